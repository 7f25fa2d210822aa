"""`flowrl serve-reward` as a user runs it: a real subprocess on 127.0.0.1, stopped by the test."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from flowrl.rewards import build_multi_reward, ink
from flowrl.rewards.remote import RemoteReward


def spawn(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "flowrl", "serve-reward", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def first_line(proc: subprocess.Popen, timeout: float = 60) -> str:
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        proc.kill()
        pytest.fail(f"serve-reward printed nothing in {timeout} s")


@pytest.fixture
def server_process():
    procs = []

    def start(*args, env=None):
        if "--idle-exit" not in args:
            args = (*args, "--idle-exit", "60")  # even if this test process dies, the server ends on its own
        proc = spawn(*args, env=env)
        procs.append(proc)
        line = first_line(proc)
        assert line.startswith("serving reward"), line + proc.stderr.read() if proc.poll() is not None else line
        return proc, line.split(" at ")[1].split(" ")[0]

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the server's own Ctrl-C path
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def test_serve_reward_scores_like_in_process(server_process):
    proc, url = server_process("ink", "target=bold", "--port", "0")
    assert url.startswith("http://127.0.0.1:")
    x = torch.rand(5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    prompts = ["a bold handwritten 1"] * 5
    reward = build_multi_reward({f"remote:{url}": {"batch_size": 2, "timeout_s": 30}})
    out = reward(x, prompts)
    assert torch.equal(out.total, ink("bold")(x, prompts))
    assert RemoteReward(url).info()["batches_scored"] == 3
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 0


def test_serve_reward_token_from_env(server_process):
    _, url = server_process("ink", "target=thin", "--port", "0", env={"FLOWRL_REWARD_TOKEN": "abc"})
    x = torch.rand(2, 3, 8, 8)
    assert torch.equal(RemoteReward(url, token="abc")(x, ["a", "b"]), 1 - x.mean(dim=(1, 2, 3)))
    with pytest.raises(Exception, match="HTTP 401"):
        RemoteReward(url, token="nope")(x, ["a", "b"])


def test_serve_reward_stops_itself_when_idle(server_process):
    proc, url = server_process("ink", "--port", "0", "--idle-exit", "1.5")
    x = torch.rand(2, 3, 8, 8)
    assert RemoteReward(url)(x, ["a", "b"]).shape == (2,)
    assert proc.wait(timeout=30) == 0  # no request for 1.5 s: it stops on its own
    assert "no request for 1.5 s; stopped" in proc.stdout.read()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (
            ["ink", "--host", "0.0.0.0", "--port", "0"],
            "binding the reward server to 0.0.0.0 exposes it to the network; pass --token",
        ),
        (["no_such_reward", "--port", "0"], "unknown reward 'no_such_reward'"),
        (["ink", "target=huge", "--port", "0"], "reward 'ink' could not be built"),
        (["ink", "--port", "99999"], "cannot serve on 127.0.0.1:99999 (bind(): port must be 0-65535.)"),
    ],
)
def test_serve_reward_one_line_errors(args, fragment):
    result = subprocess.run(
        [sys.executable, "-m", "flowrl", "serve-reward", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "FLOWRL_REWARD_TOKEN": ""},
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("flowrl: error:")]
    assert len(lines) == 1 and fragment in lines[0], result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_reward_stops_cleanly_under_concurrent_load(server_process, sig):
    proc, url = server_process("ink", "target=bold", "--port", "0")
    stop, served, failed = threading.Event(), [], []

    def load():
        client, x = RemoteReward(url, retries=0, timeout_s=30), torch.rand(16, 3, 64, 64)
        while not stop.is_set():
            try:
                served.append(client(x, ["a"] * 16).shape)
            except Exception as err:  # noqa: BLE001 - after the signal: refused, reset or 503
                failed.append(str(err))

    clients = [threading.Thread(target=load) for _ in range(8)]
    for client in clients:
        client.start()
    try:
        while len(served) < 16:  # requests are in flight on every handler thread
            time.sleep(0.01)
        start = time.perf_counter()
        proc.send_signal(sig)
        stop.set()  # each client ends after its request in flight (a tight loop of refused connections would
        # only starve the server's own exit on a small host)
        code = proc.wait(timeout=60)
        seconds = time.perf_counter() - start
    finally:
        stop.set()
        for client in clients:
            client.join()  # never leave a thread in torch code when this process exits
    stderr = proc.stderr.read()
    assert code == 0 and "terminate called" not in stderr, stderr[-2000:]
    # stop() itself takes milliseconds (it waits only for the batch being scored); the rest is the interpreter's
    # own exit (module teardown after importing torch): about 1 s, several on a busy 2-core host
    assert seconds < 30, seconds
    assert all("\n" not in message for message in failed)


def test_serve_reward_applies_max_request_pixels(server_process) -> None:
    """``--max-request-pixels 100`` reaches the server: two 8x8 images (128 pixels) are refused with HTTP 413."""
    _, url = server_process("ink", "target=thin", "--port", "0", "--max-request-pixels", "100")
    x = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(Exception, match="HTTP 413"):
        RemoteReward(url)(x, ["a", "b"])
    assert torch.equal(RemoteReward(url)(x[:1], ["a"]), 1 - x[:1].mean(dim=(1, 2, 3)))  # 64 pixels pass
