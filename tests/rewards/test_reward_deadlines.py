"""Every reward fault ends in one line within its deadline: inline, on the scoring thread, in the scoring process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from flowrl.rewards import MultiReward, RewardError, build_multi_reward, ink
from flowrl.rewards.contract import RewardTimeout
from flowrl.rewards.deadline import (
    DEFAULT_TIMEOUT_S,
    IDLE_CHECK_S,
    CallCancelled,
    DeadlineExceeded,
    call_with_deadline,
    cancel_scope,
    wait_result,
)
from flowrl.rollouts.scoring import RolloutScorer
from flowrl.rollouts.scoring_process import ScoringProcess, ScoringProcessDied

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["p"] * 8
IMAGES = torch.rand(8, 3, 8, 8, generator=torch.Generator().manual_seed(0))
FAULTS = [
    ("raise", RewardError, "reward 'judge' (batch 0) raised RuntimeError: judge crashed"),
    ("nan", RewardError, "reward 'judge' (batch 0) returned NaN at samples [0, 1, 2, 3]"),
    ("inf", RewardError, "reward 'judge' (batch 0) returned inf at samples [0, 1, 2, 3]"),
    ("shape", RewardError, "reward 'judge' (batch 0) returned shape (4, 2), expected (4,)"),
    (
        "hang",
        RewardTimeout,
        "reward 'judge' (batch 0) did not return within its deadline of 0.5 s; "
        "fix the reward if it hangs, or raise rewards.judge.timeout_s if it is just slow",
    ),
]


def judge(kind: str, timeout_s: float = 0.5, **options) -> MultiReward:
    spec = {"reward": "bench.reward_faults:faulty", "kind": kind, "timeout_s": timeout_s, **options}
    return build_multi_reward({"judge": spec})


def score(reward: MultiReward, mode: str, worker: ScoringProcess | None = None):
    """Two chunks of 4 through the RolloutScorer of ``mode`` (identity decode); returns its result."""
    with RolloutScorer(reward, torch.nn.Identity(), PROMPTS, threaded=mode == "thread", worker=worker) as scorer:
        scorer.submit(slice(0, 4), IMAGES[:4])
        scorer.submit(slice(4, 8), IMAGES[4:])
        return scorer.result(IMAGES)


def assert_one_line(err: BaseException, expected: str) -> None:
    assert "\n" not in str(err), str(err)
    assert str(err).startswith(expected), str(err)


@pytest.mark.parametrize("mode", ["inline", "thread"])
@pytest.mark.parametrize("kind, error, expected", FAULTS, ids=[f[0] for f in FAULTS])
def test_fault_ends_in_one_line_within_the_deadline(mode, kind, error, expected):
    start = time.perf_counter()
    with pytest.raises(error) as info:
        score(judge(kind), mode)
    elapsed = time.perf_counter() - start
    assert_one_line(info.value, expected)
    assert elapsed < (0.5 + 3.0 if kind == "hang" else 3.0)  # the deadline, plus a busy host's slack
    if kind == "hang":
        assert elapsed >= 0.5


def test_a_hung_reward_does_not_keep_its_thread_from_the_next_call():
    reward = judge("hang", timeout_s=0.3)
    for _ in range(2):  # the abandoned thread sleeps on; the next call gets its own deadline
        with pytest.raises(RewardTimeout):
            reward(IMAGES, PROMPTS)


def test_the_reward_thread_scores_like_the_caller():
    def grad_mode(images, prompts, **metadata):
        return torch.full((images.shape[0],), float(torch.is_grad_enabled()))

    reward = MultiReward({"g": (grad_mode, 1.0)})
    with torch.no_grad():
        assert reward(IMAGES, PROMPTS).total.eq(0).all()  # grad mode is per thread: carried over
    assert reward(IMAGES, PROMPTS).total.eq(1).all()
    out = MultiReward({"ink": (ink("bold"), 1.0, 5.0)})(IMAGES, PROMPTS)
    assert torch.equal(out.total, ink("bold")(IMAGES, PROMPTS))
    assert call_with_deadline(lambda **kw: sorted(kw), 1.0, (), {"name": 1, "fn": 2}) == ["fn", "name"]
    with pytest.raises(DeadlineExceeded):
        call_with_deadline(time.sleep, 0.05, (5,))


def test_timeout_s_is_a_common_option():
    reward = build_multi_reward({"a": {"reward": "ink", "target": "bold", "timeout_s": 7}, "b": {"reward": "ink"}})
    assert reward.timeouts == {"a": 7.0, "b": DEFAULT_TIMEOUT_S}
    remote = build_multi_reward({"r": {"reward": "remote", "url": "http://127.0.0.1:9", "timeout_s": 4}})
    assert remote.timeouts == {"r": None}  # the client bounds each attempt itself ...
    assert remote.rewards["r"][0].timeout_s == 4.0  # ... with the entry's timeout_s
    assert build_multi_reward({"r": {"reward": "remote", "url": "http://127.0.0.1:9"}}).rewards["r"][0].timeout_s == 60


@pytest.mark.parametrize("value", [0, -1, float("inf"), float("nan"), "10", True, None])
def test_bad_timeout_is_one_line_naming_the_key(value):
    with pytest.raises(ValueError) as info:
        build_multi_reward({"judge": {"reward": "ink", "timeout_s": value}})
    assert_one_line(info.value, "rewards.judge.timeout_s must be a finite number of seconds > 0")
    with pytest.raises(ValueError, match="rewards.judge.timeout_s"):
        MultiReward({"judge": (ink("bold"), 1.0, value if value is not None else 0)})


# -- train.rewards_async: process: real spawned workers ---------------------------------------------


@pytest.fixture
def worker_for():
    workers = []

    def start(reward):
        workers.append(ScoringProcess(reward, torch.nn.Identity()))
        return workers[-1]

    yield start
    for worker in workers:
        worker.close(timeout_s=2.0)


@pytest.mark.slow
@pytest.mark.parametrize("kind, error, expected", FAULTS, ids=[f[0] for f in FAULTS])
def test_fault_in_the_scoring_process(worker_for, kind, error, expected):
    reward = judge(kind, only_in_worker=True)
    worker = worker_for(reward)
    start = time.perf_counter()
    with pytest.raises(error) as info:
        score(reward, "process", worker)
    assert_one_line(info.value, expected)
    assert time.perf_counter() - start < (0.5 + 3.0 if kind == "hang" else 3.0)


CRASHES = [
    ("exit", "scoring process died (exit code 7) in reward 'judge' (batch 0); rerun with train.rewards_async=thread"),
    ("segfault", "scoring process died (signal SIGSEGV) in reward 'judge' (batch 0); its Python stack is printed"),
    (
        "stop",  # frozen so hard that its own deadline can't fire: the parent kills it
        "reward 'judge' (batch 0) did not return within its deadline of 0.5 s; fix the reward if it hangs, "
        "or raise rewards.judge.timeout_s if it is just slow; its scoring process was killed",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind, expected", CRASHES, ids=[c[0] for c in CRASHES])
def test_crash_of_the_scoring_process(worker_for, kind, expected):
    reward = judge(kind, only_in_worker=True)
    worker = worker_for(reward)
    start = time.perf_counter()
    with pytest.raises(RewardError) as info:
        score(reward, "process", worker)
    assert_one_line(info.value, expected)
    assert isinstance(info.value, RewardTimeout if kind == "stop" else ScoringProcessDied)
    assert time.perf_counter() - start < (0.5 + 2.0 + 3.0 if kind == "stop" else 3.0)
    assert not worker._proc.is_alive()


@pytest.mark.slow
def test_scoring_process_ends_when_its_trainer_dies(tmp_path):
    script = (
        "import os, sys, torch\n"
        "from flowrl.rewards import MultiReward, ink\n"
        "from flowrl.rollouts.scoring_process import ScoringProcess\n"
        "w = ScoringProcess(MultiReward({'ink': (ink('bold'), 1.0)}), torch.nn.Identity())\n"
        "print(w._proc.pid, flush=True)\n"
        "os._exit(9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 9, proc.stderr
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)  # an orphaned worker notices within POLL_S and exits


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_threads_left_by_hung_rewards_are_daemons():
    with pytest.raises(RewardTimeout):
        judge("hang", timeout_s=0.1)(IMAGES, PROMPTS)
    hung = [t for t in threading.enumerate() if t.name == "reward-judge@MainThread"]
    assert hung and all(t.daemon for t in hung)


def test_calls_that_end_in_time_share_one_worker_that_ends_with_its_caller():
    reward = MultiReward({"ink": (ink("bold"), 1.0), "thin": (ink("thin"), 1.0)})
    before = set(threading.enumerate())

    def caller() -> None:
        for _ in range(20):
            reward(IMAGES, PROMPTS)

    thread = threading.Thread(target=caller, name="scorer")
    thread.start()
    thread.join()
    left = [t for t in threading.enumerate() if t not in before]
    assert len(left) == 1 and left[0].daemon and left[0].name.endswith("@scorer"), left
    left[0].join(timeout=IDLE_CHECK_S + 10)  # it notices its caller has ended at its next idle check
    assert not left[0].is_alive()


def test_a_worker_abandoned_to_a_hung_call_is_replaced():
    started = []

    def record(images, prompts, **metadata):
        started.append(threading.current_thread())
        return torch.zeros(images.shape[0])

    quick = MultiReward({"q": (record, 1.0)})
    quick(IMAGES, PROMPTS)
    quick(IMAGES, PROMPTS)
    assert started[0] is started[1]  # calls that end in time reuse the worker
    with pytest.raises(RewardTimeout):
        judge("hang", timeout_s=0.1)(IMAGES, PROMPTS)
    quick(IMAGES, PROMPTS)
    assert started[2] is not started[1] and started[2].is_alive()
    assert started[1].is_alive()  # the abandoned worker still sleeps in the hung call


WORKERS_AT_EXIT = """
import atexit, threading, time, torch
# registered first, so it runs last of the atexit hooks: after the deadline module's, before finalization
atexit.register(lambda: print(sorted(t.name for t in threading.enumerate() if t.name.startswith("reward-"))))
from flowrl.rewards.deadline import call_with_deadline
try:
    call_with_deadline(time.sleep, 0.05, (30,), name="hung")
except Exception:  # DeadlineExceeded: its worker is abandoned to the sleep
    pass
call_with_deadline(lambda: torch.ones(3).sum(), 60.0, name="main")  # the main thread's new worker, idle now
scorer = threading.Thread(target=lambda: call_with_deadline(torch.ones(2).sum, 60.0, name="pool"), name="scorer")
scorer.start()
scorer.join()  # its worker would idle on for up to IDLE_CHECK_S
"""


def test_idle_workers_end_before_the_interpreter_finalizes():
    """A daemon thread that ran torch code and is still alive in finalization can abort the process.

    At exit the idle workers are stopped and joined; only one abandoned to a hung call is left.
    """
    out = subprocess.run([sys.executable, "-c", WORKERS_AT_EXIT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['reward-hung@MainThread']", out.stdout + out.stderr


CTRL_C_ON_ANOTHER_THREAD = """
import os, signal, sys, time, torch
from flowrl.rewards.deadline import call_with_deadline
signal.signal(signal.SIGINT, signal.default_int_handler)  # as a console Python; a background job inherits SIG_IGN
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # blocked in main and in the threads it starts
def reward():
    # The worker is the one thread that takes SIGINT, so the kernel hands it the signal. (The worker inherits
    # main's mask; without this the signal waited for a thread torch happened to start before the block, and there
    # is none with OMP_NUM_THREADS=1.)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    os.kill(os.getpid(), signal.SIGINT)  # to the process, as `kill -INT` or a supervisor sends it
    time.sleep(10)
start = time.monotonic()
try:
    call_with_deadline(reward, 60.0)
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - start:.2f} s")
"""


def test_a_ctrl_c_received_by_the_worker_thread_ends_the_wait_promptly():
    """The process-directed SIGINT lands on the worker; the caller's sliced wait still raises at once."""
    out = subprocess.run([sys.executable, "-c", CTRL_C_ON_ANOTHER_THREAD], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("interrupted after"), out.stdout + out.stderr
    assert float(out.stdout.split()[2]) < 5  # not after the reward's 10 s sleep (a single long wait's behaviour)


CTRL_C_WHILE_A_CHUNK_IS_SCORED = """
import os, signal, sys, threading, time, torch
from flowrl.rewards import MultiReward
from flowrl.rollouts.scoring import RolloutScorer
from flowrl.rollouts.scoring_process import ScoringProcess


class Slow:
    def __call__(self, images, prompts, **metadata):
        time.sleep(10)
        return torch.zeros(images.shape[0])


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a console Python
    # A thread started before main blocks SIGINT is the one that takes it (threads started later inherit the block;
    # relying on one torch starts failed with OMP_NUM_THREADS=1), so the kernel hands the SIGINT to another thread.
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    reward = MultiReward({"slow": (Slow(), 1.0)})
    mode = sys.argv[1]
    worker = ScoringProcess(reward, torch.nn.Identity()) if mode == "process" else None
    x = torch.rand(2, 3, 4, 4)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()  # as `kill -INT` or a supervisor
    start = time.monotonic()
    try:
        with RolloutScorer(reward, torch.nn.Identity(), ["p"] * 2, threaded=mode == "thread", worker=worker) as s:
            s.submit(slice(0, 2), x)
            s.result(x)
    except KeyboardInterrupt:
        if worker is not None:
            worker.close(abandon=True)
        print(f"stopped after {time.monotonic() - start:.2f} s")
"""


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_a_ctrl_c_while_a_chunk_is_scored_stops_without_waiting_for_the_reward(tmp_path, mode):
    """The caller waits for a chunk in slices, and the interrupted scorer abandons the chunk's reward call.

    Before 2026-11-27: 10.5 s with the thread (the reward's sleep), as long in the process mode.
    """
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_WHILE_A_CHUNK_IS_SCORED)
    out = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.startswith("stopped after"), out.stdout + out.stderr
    assert float(out.stdout.split()[2]) < 5  # not after the reward's 10 s sleep


def test_a_cancelled_scope_abandons_its_call_and_wait_result_returns_or_raises():
    cancel, ran = threading.Event(), threading.Event()

    def hang() -> None:
        ran.set()
        time.sleep(10)

    def cancel_soon() -> None:
        ran.wait(10)
        cancel.set()

    threading.Thread(target=cancel_soon).start()
    start = time.monotonic()
    with cancel_scope(cancel), pytest.raises(CallCancelled):
        call_with_deadline(hang, 60.0, name="hang")
    assert time.monotonic() - start < 5
    assert call_with_deadline(lambda: 3, 60.0) == 3  # outside the scope: a fresh worker, no cancel

    pool = ThreadPoolExecutor(1)
    assert wait_result(pool.submit(lambda: 7)) == 7
    with pytest.raises(TimeoutError, match="from the call"):  # the call's own TimeoutError, not the wait's
        wait_result(pool.submit(_raise, TimeoutError("from the call")))
    pool.shutdown()


def _raise(err: BaseException) -> None:
    raise err


def test_an_interrupted_wait_abandons_the_worker():
    ran = []

    def interrupting(images, prompts, **metadata):
        ran.append(threading.current_thread())
        time.sleep(0.2)  # the caller is waiting by now
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # Ctrl-C
        time.sleep(10)
        return torch.zeros(images.shape[0])

    def record(images, prompts, **metadata):
        ran.append(threading.current_thread())
        return torch.zeros(images.shape[0])

    # Python's own SIGINT handler, re-armed at the C level: a library that installed its own (sigaction) in an
    # earlier test would otherwise swallow the signal while Python still reports the default handler
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    start = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt):
            MultiReward({"i": (interrupting, 1.0)})(IMAGES, PROMPTS)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.perf_counter() - start < 8  # the wait ends with the signal, not with the call (10 s)
    MultiReward({"q": (record, 1.0)})(IMAGES, PROMPTS)
    assert ran[1] is not ran[0]  # the next call did not queue behind the interrupted one


def test_the_call_after_an_overrun_does_not_queue_behind_it() -> None:
    """A call that overran its deadline is left on its own worker: the thread's next call runs at once on a fresh
    one (it would otherwise wait behind the hung call and overrun too)."""
    release = threading.Event()
    try:
        with pytest.raises(DeadlineExceeded):
            call_with_deadline(release.wait, 0.2, (30.0,))
        assert call_with_deadline(lambda: 7, 5.0) == 7  # queued behind the hung call, it would overrun its 5 s
    finally:
        release.set()


FORKED_CHILD = """
import os
from flowrl.rewards.deadline import call_with_deadline
assert call_with_deadline(lambda: 1, 5.0) == 1  # the parent's worker exists
pid = os.fork()
if pid == 0:  # the child: exit 0 only if the call ran
    try:
        os._exit(0 if call_with_deadline(lambda: 2, 2.0) == 2 else 1)
    except BaseException:  # any failure is the child's exit code
        os._exit(2)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_its_own_worker() -> None:
    """A child forked after the parent's first call does not reuse the parent's worker (its thread does not exist
    in the child): the child's call returns at once instead of overrunning.

    The fork happens in a fresh interpreter under a timeout, not in pytest's process, whose other threads (earlier
    tests' workers) could hold a lock at the fork and hang the child.
    """
    out = subprocess.run([sys.executable, "-c", FORKED_CHILD], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "child exit 0", out.stdout + out.stderr


def test_an_idle_worker_keeps_nothing_of_the_call_it_ran_alive():
    """After a call returns, its worker idles without holding the call's result or arguments (a large reward
    output or a batch of images would otherwise live until the thread's next reward call)."""
    import gc
    import weakref

    class Big:
        pass

    arg = Big()
    ref_arg = weakref.ref(arg)
    out = call_with_deadline(lambda a: Big(), 5.0, (arg,))
    ref_out = weakref.ref(out)
    del arg, out
    for _ in range(200):  # the worker drops its job right after signalling the caller
        gc.collect()
        if ref_arg() is None and ref_out() is None:
            break
        time.sleep(0.05)
    assert ref_arg() is None and ref_out() is None


STOP_AT_EXIT = """
import threading, time
from flowrl.rewards import deadline
try:
    deadline.call_with_deadline(time.sleep, 0.05, (60,), name="hung")
except deadline.DeadlineExceeded:
    pass
deadline.call_with_deadline(lambda: 1, 5.0, name="idle")  # a new worker for the main thread, idle now
start = time.monotonic()
deadline._stop_idle_workers(timeout_s=30.0)  # what runs at exit, while the calling thread is still alive
alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("reward-") and t.is_alive())
print(f"{time.monotonic() - start:.2f}", alive)
"""


def test_the_exit_hook_ends_idle_workers_at_once_and_leaves_a_hung_one():
    """The exit hook retires the idle workers (they end at once, though their calling thread lives on) and does not
    wait for a worker that is still in a call that overran (it may never return)."""
    out = subprocess.run([sys.executable, "-c", STOP_AT_EXIT], capture_output=True, text=True, timeout=120)
    took, alive = out.stdout.split(maxsplit=1)
    assert float(took) < 15.0, out.stdout + out.stderr  # 30 s: it waited for the hung worker or a live owner
    assert alive.strip() == "['reward-hung@MainThread']", out.stdout + out.stderr
