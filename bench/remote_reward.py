"""Per-batch overhead of the remote reward server against in-process scoring.

Usage: ``python -m bench.remote_reward [--repeats 20]``.

Serves each reward twice on 127.0.0.1 (free ports): ``flowrl serve-reward`` in a subprocess
(the real deployment) and a :class:`~flowrl.rewards.server.RewardServer` on a thread of this
process (no process wake-ups: isolates encoding + HTTP cost from the host's scheduler). Then
times, alternating within one process, the same batch scored in-process and through each server
(safetensors float32 or uint8, and PNG wire formats). Cases: the embedded task's reward batch (40 images 8x8,
digit correctness) and SD3-sized images (8 images 512x512, ink, whose own cost is tiny, so the
time is almost all transport and encoding). Prints median milliseconds per batch, the overhead
(remote minus in-process) and the request size.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import time

import torch


def serve_reward_process(name: str, *options: str) -> tuple[subprocess.Popen, str]:
    """Start ``flowrl serve-reward NAME OPTIONS`` on a free port; the process and the URL it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowrl", "serve-reward", name, *options, "--port", "0", "--idle-exit", "300"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    line = proc.stdout.readline()
    if not line.startswith("serving reward"):
        proc.kill()
        raise RuntimeError(f"serve-reward did not start: {line!r}")
    return proc, line.split(" at ")[1].split(" ")[0]


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def main(argv: list[str] | None = None) -> None:
    from flowrl.rewards import build_reward
    from flowrl.rewards.server import RewardServer
    from flowrl.rewards.wire import encode_batch, encode_batch_png

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    cases = [
        ("digit_correctness", (), torch.rand(40, 3, 8, 8, generator=gen), "40 x 8x8, digit_correctness"),
        ("ink", ("target=bold",), torch.rand(8, 3, 512, 512, generator=gen), "8 x 512x512, ink"),
    ]
    print(
        f"# {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        "server in a subprocess on 127.0.0.1, "
        f"{args.repeats} repeats, load average {os.getloadavg()[0]:.1f} at start"
    )
    print("| batch | path | request KB | median ms | min ms | overhead ms (median) |")
    print("|---|---|---|---|---|---|")
    for name, options, images, label in cases:
        prompts = [f"a bold handwritten {i % 10}" for i in range(images.shape[0])]
        local = build_reward(name, **dict(o.split("=") for o in options))
        proc, url = serve_reward_process(name, *options)
        thread_server = RewardServer(local, name, port=0).start()
        st_size, png_size = len(encode_batch(images, prompts)), len(encode_batch_png(images, prompts))
        try:
            paths = {"in-process": (lambda: local(images, prompts), 0)}
            for where, address in (("thread server", thread_server.url), ("subprocess server", url)):
                paths[f"{where}, safetensors"] = (
                    lambda a=address: build_reward("remote", url=a)(images, prompts),
                    st_size,
                )
                paths[f"{where}, safetensors uint8"] = (
                    lambda a=address: build_reward("remote", url=a, wire_dtype="uint8")(images, prompts),
                    len(encode_batch(images, prompts, dtype="uint8")),
                )
                paths[f"{where}, PNG (JSON)"] = (
                    lambda a=address: build_reward("remote", url=a, format="png")(images, prompts),
                    png_size,
                )
            times: dict[str, list[float]] = {p: [] for p in paths}
            for fn, _ in paths.values():
                fn()
            for _ in range(args.repeats):
                for path, (fn, _) in paths.items():
                    t0 = time.perf_counter()
                    fn()
                    times[path].append((time.perf_counter() - t0) * 1000)
        finally:
            _stop(proc)
            thread_server.stop()
        base = statistics.median(times["in-process"])
        for path, (_, size) in paths.items():
            med = statistics.median(times[path])
            kb = f"{size / 1000:.1f}" if size else "-"
            over = f"{med - base:.1f}" if path != "in-process" else "-"
            print(f"| {label} | {path} | {kb} | {med:.1f} | {min(times[path]):.1f} | {over} |")
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
