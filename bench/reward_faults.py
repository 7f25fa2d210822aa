"""Every reward fault in every scoring mode ends in one line, within its deadline.

Usage: ``python -m bench.reward_faults [--deadline 3] [--only FAULT ...] [--modes MODE ...]``

Each fault x mode runs in a fresh process (a crash must not take the bench down), scores two
chunks of 4 random 16x16 images through the real path, and the table shows the one line it ended
with, the seconds from the first scoring call to that line, and the deadline that applied:

- ``inline`` / ``thread`` / ``process``: a :class:`~flowrl.rollouts.scoring.RolloutScorer` in that
  ``train.rewards_async`` mode (identity decode), the reward built from a config entry with
  ``timeout_s``. In ``process`` mode the fault happens in the worker only (``only_in_worker``): the
  trainer scores the jobs the worker has not started itself, and a crash there is the ``train`` case;
- ``remote``: the reward behind a real ``flowrl serve-reward`` process, scored by the remote client
  (``timeout_s`` per attempt, ``retries: 1``), plus two faults of the server itself: ``down`` (nothing
  listens) and ``trickle`` (a server that sends its reply one byte every 0.5 s);
- ``train``: the real ``flowrl train`` command (supervised), for crashes that kill the training process
  itself; its seconds include starting the run (loading the model), not only the reward call.

The faulty reward (``faulty(kind)``) is also what the tests use.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

FAULTS = ("raise", "nan", "inf", "shape", "hang", "exit", "segfault")
MODES = ("inline", "thread", "process", "remote", "train")
ROOT = Path(__file__).resolve().parents[1]


class Faulty:
    """A reward that fails one way: raise, nan, inf, shape, hang, exit (``os._exit(7)``), segfault, stop.

    ``stop`` freezes its own process with SIGSTOP (a reward stuck so hard that not even its own
    deadline thread runs). With ``only_in_worker`` the fault happens only in a spawned worker
    process; elsewhere it scores like the mean pixel (picklable). ``marker``: a file created just
    before the fault (tests wait for it).
    """

    def __init__(self, kind: str, only_in_worker: bool = False, marker: str | None = None) -> None:
        self.kind, self.only_in_worker, self.marker = kind, only_in_worker, marker

    def __call__(self, images: torch.Tensor, prompts: list[str], **metadata: object) -> torch.Tensor:
        scores = images.mean(dim=tuple(range(1, images.ndim))).float()
        if self.only_in_worker and multiprocessing.parent_process() is None:
            return scores
        if self.marker:
            Path(self.marker).touch()
        return self._fail(scores)

    def _fail(self, scores: torch.Tensor) -> torch.Tensor:
        if self.kind == "raise":
            raise RuntimeError("judge crashed\nsecond line")
        if self.kind == "nan":
            return torch.full_like(scores, float("nan"))
        if self.kind == "inf":
            return scores.fill_(float("inf"))
        if self.kind == "shape":
            return scores[:, None].repeat(1, 2)
        if self.kind == "hang":
            time.sleep(3600)
        if self.kind == "exit":
            os._exit(7)
        if self.kind == "segfault":
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        if self.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        return scores


def faulty(kind: str = "raise", only_in_worker: bool = False, marker: str | None = None) -> Faulty:
    """A reward that fails the way ``kind`` says (see :class:`Faulty`)."""
    return Faulty(kind, only_in_worker, marker)


faulty.offline = True  # type: ignore[attr-defined]


# -- one case, in a child process ---------------------------------------------------------------


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def score_in_mode(reward_spec: dict, mode: str) -> str:
    """Score two chunks through a RolloutScorer in ``mode``; the error's one line (or "ok")."""
    from flowrl.rewards import build_multi_reward
    from flowrl.rollouts.scoring import RolloutScorer
    from flowrl.rollouts.scoring_process import ScoringProcess

    reward = build_multi_reward(reward_spec)
    images = torch.rand(8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    worker = ScoringProcess(reward, torch.nn.Identity()) if mode == "process" else None
    print(json.dumps({"start": time.time()}), flush=True)  # a crash ends the process: the parent times it
    try:
        with RolloutScorer(reward, torch.nn.Identity(), ["p"] * 8, threaded=mode == "thread", worker=worker) as s:
            s.submit(slice(0, 4), images[:4])
            s.submit(slice(4, 8), images[4:])
            s.result(images)
        line = "ok"
    except Exception as err:  # noqa: BLE001 - the bench reports whatever ended the call
        line = _one_line(err)
    finally:
        print(json.dumps({"end": time.time()}), flush=True)
        if worker is not None:
            worker.close(timeout_s=2.0)
    return line


def _child(fault: str, mode: str, deadline: float, url: str | None) -> None:
    if url:
        spec = {"judge": {"reward": "remote", "url": url, "timeout_s": deadline, "retries": 1, "backoff_s": 0.1}}
    else:
        options = {"kind": fault, "only_in_worker": mode == "process", "timeout_s": deadline}
        spec = {"judge": {"reward": "bench.reward_faults:faulty", **options}}
    print(json.dumps({"line": score_in_mode(spec, mode)}), flush=True)


# -- the parent: run every case, print the table ---------------------------------------------------


def _run(cmd: list[str], env: dict | None = None, timeout: float = 300) -> tuple[int, str, str, float]:
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})}
    )
    return proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - start


def _case(fault: str, mode: str, deadline: float, url: str | None = None) -> tuple[str, float | None]:
    args = [sys.executable, "-m", "bench.reward_faults", "--child", fault, mode, str(deadline)] + (
        ["--url", url] if url else []
    )
    code, out, err, _ = _run(args)
    ended = time.time()
    rows = {key: value for line in out.splitlines() if line.startswith("{") for key, value in json.loads(line).items()}
    seconds = rows.get("end", ended) - rows["start"] if "start" in rows else None
    line = rows.get("line")
    if line is None:
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        line = f"(the process died: {how}, no message of its own; `flowrl train` runs it supervised)"
    return line, seconds


def _serve(fault: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowrl", "serve-reward", "bench.reward_faults:faulty", f"kind={fault}"]
        + ["--port", "0", "--idle-exit", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return proc, proc.stdout.readline().split(" at ")[1].split(" ")[0]


def trickle_server(interval_s: float = 0.5) -> str:
    """A server that reads a request, then sends a valid reply one byte every ``interval_s`` (forever)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=_trickle, args=(conn, interval_s), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}"


def _trickle(conn: socket.socket, interval_s: float) -> None:
    conn.recv(1 << 20)
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100000
    try:
        for byte in reply:
            conn.sendall(bytes([byte]))
            time.sleep(interval_s)
    except OSError:
        conn.close()


def _remote_case(fault: str, deadline: float) -> tuple[str, float | None, str]:
    budget = f"{deadline:g} s x 2 attempts"
    if fault == "down":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return (*_case(fault, "inline", deadline, url), budget)
    if fault == "trickle":
        return (*_case(fault, "inline", deadline, trickle_server()), budget)
    server, url = _serve(fault)
    try:
        return (*_case(fault, "inline", deadline, url), budget)
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            server.wait(timeout=60)


def _train_case(fault: str, deadline: float, tiny: Path) -> tuple[str, float | None]:
    cfg = tiny / f"{fault}.yaml"
    cfg.write_text(
        f"model: {{path: {tiny / 'model'}}}\nrewards:\n  judge: {{reward: 'bench.reward_faults:faulty', "
        f"kind: {fault}, timeout_s: {deadline}}}\noutput: {{dir: {tiny / ('run-' + fault)}}}\n"
    )
    fast = ["prompts.per_iteration=2", "prompts.group_size=2", "sampler.num_steps=2", "train.iterations=1"]
    code, _, err, seconds = _run(
        [sys.executable, "-m", "flowrl", "train", str(cfg), *fast, "--overwrite"], env={"PYTHONPATH": str(ROOT)}
    )
    lines = [line for line in err.splitlines() if line.startswith("flowrl: error:")]
    return (lines[-1] if lines else f"(exit code {code}, no line)"), seconds


def _tiny_model(folder: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import tiny_sd3_pipeline

    folder.mkdir(parents=True, exist_ok=True)
    tiny_sd3_pipeline().save_pretrained(str(folder / "model"))
    return folder


def _table(rows: list[tuple[str, str, str, float | None, str]]) -> None:
    print(f"{'fault':<9} {'mode':<8} {'seconds':>7}  {'deadline':<18} outcome (the one line)")
    for fault, mode, line, seconds, deadline in rows:
        shown = "-" if seconds is None else f"{seconds:.2f}"
        print(f"{fault:<9} {mode:<8} {shown:>7}  {deadline:<18} {line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deadline", type=float, default=3.0, help="timeout_s of every reward (seconds)")
    parser.add_argument("--only", nargs="*", default=None, help="faults to run (default: all)")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    parser.add_argument("--child", nargs=3, metavar=("FAULT", "MODE", "DEADLINE"), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child[0], args.child[1], float(args.child[2]), args.url)
        return 0
    import tempfile

    faults = args.only or list(FAULTS)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            for fault in faults + (["down", "trickle"] if mode == "remote" and not args.only else []):
                rows.append(_row(fault, mode, args.deadline, Path(tmp)))
                print(f"  done: {fault} / {mode}", file=sys.stderr, flush=True)
    _table(rows)
    return 0


def _row(fault: str, mode: str, deadline: float, tiny: Path) -> tuple[str, str, str, float | None, str]:
    if mode == "remote":
        line, seconds, budget = _remote_case(fault, deadline)
        return fault, mode, line, seconds, budget
    if mode == "train":
        if not (tiny / "model").is_dir():
            _tiny_model(tiny)
        line, seconds = _train_case(fault, deadline, tiny)
        return fault, mode, line, seconds, f"{deadline:g} s"
    line, seconds = _case(fault, mode, deadline)
    return fault, mode, line, seconds, f"{deadline:g} s"


if __name__ == "__main__":
    sys.exit(main())
