"""Per-call deadlines for rewards: a call that does not return in time is abandoned with one line.

A Python thread cannot be killed, so :func:`call_with_deadline` runs the call on a daemon worker
thread and waits for it at most ``timeout_s`` seconds. When the deadline passes the caller gets
:class:`DeadlineExceeded` at once; the abandoned worker keeps running until the call returns on its
own, then exits, and, being a daemon, never keeps the interpreter alive. The caller's grad mode and
CUDA device (both per-thread in torch) are carried over, so a reward scores exactly as it would inline.

Each calling thread keeps one worker for its calls that end in time (a fresh thread per call cost
0.3-0.6 ms of each reward call on the embedded model's CPU rollouts: thread start-up and torch's
per-thread state); the worker exits within :data:`IDLE_CHECK_S` of its caller's end, so at most one
idle worker per live calling thread exists. At interpreter exit every idle worker is told to stop
and joined (:func:`_stop_idle_workers`, an ``atexit`` hook): a daemon thread that has run torch code
must not outlive Python's finalization, where its forced unwind through torch's C++ frames aborts
the process ("terminate called without an active exception", pytorch/pytorch#38228).

A thread that scores for someone else (the rollout scorer's worker thread) can run its calls in a
:func:`cancel_scope`: setting the scope's event ends the call's wait within :data:`WAIT_SLICE_S` with
:class:`CallCancelled`, the call itself is abandoned like one that overran, and the thread is free
at once (a Ctrl-C must not wait for a slow or hung reward). :func:`wait_result` waits for a
``Future`` in the same slices.

Every entry of a config's ``rewards:`` section takes ``timeout_s`` (default :data:`DEFAULT_TIMEOUT_S`).
"""

from __future__ import annotations

import atexit
import math
import os
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

DEFAULT_TIMEOUT_S = 600.0  # a reward call that takes longer than 10 minutes is treated as hung
IDLE_CHECK_S = 1.0  # how often an idle worker checks that its calling thread is still alive
WAIT_SLICE_S = 0.1  # the caller waits in slices this long, so a Ctrl-C another thread received is handled promptly
EXIT_JOIN_S = 2.0  # at exit, how long to wait for the idle workers to end (they end at once; bounded under load)


class DeadlineExceeded(Exception):
    """A call did not return within its deadline (``args[0]`` is the deadline in seconds)."""


class CallCancelled(Exception):
    """The calling thread's :func:`cancel_scope` was cancelled while it waited for a call."""


def check_timeout(name: str, value: object) -> float:
    """A reward's ``timeout_s`` as float; ValueError unless it is a finite number > 0 (bools rejected).

    Args:
        name: the reward's name in the config, for the message.
        value: the configured value.

    Returns:
        ``value`` as a float.

    Raises:
        ValueError: ``value`` is not a finite number > 0.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"rewards.{name}.timeout_s must be a finite number of seconds > 0; got {value!r}; "
            f"set e.g. rewards.{name}.timeout_s={DEFAULT_TIMEOUT_S:g}"
        )
    return float(value)


def _thread_state() -> Callable[[], None]:
    """A function that gives the calling thread this thread's torch grad mode and CUDA device."""
    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def apply() -> None:
        torch.set_grad_enabled(grad)
        if device is not None:
            torch.cuda.set_device(device)

    return apply


def call_with_deadline(
    fn: Callable[..., Any],
    timeout_s: float,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    name: str = "reward",
) -> Any:
    """``fn(*args, **kwargs)``, or :class:`DeadlineExceeded` once ``timeout_s`` seconds have passed.

    Args:
        fn: the callable (a reward).
        timeout_s: seconds to wait for it.
        args: positional arguments of ``fn``.
        kwargs: keyword arguments of ``fn``.
        name: the reward's name; the call's thread is named ``"reward-<name>@<caller's thread>"``
            (visible in stack dumps).

    Returns:
        What ``fn`` returned; what it raised is raised here.

    Raises:
        DeadlineExceeded: ``fn`` did not return in time (it keeps running on its daemon thread).
    """
    box: dict[str, Any] = {}
    apply_state = _thread_state()
    done = threading.Event()

    def run() -> None:
        try:
            apply_state()
            box["out"] = fn(*args, **(kwargs or {}))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which re-raises it
            box["err"] = exc
        finally:
            done.set()

    worker, cancel = _worker(), _WORKERS.cancel
    try:
        worker.run(run, name)
        finished = _wait(done, timeout_s, cancel)
    except BaseException:  # e.g. Ctrl-C while waiting: the next call must not queue behind this one
        _abandon(worker)
        raise
    if not finished:
        _abandon(worker)
        if cancel is not None and cancel.is_set():
            raise CallCancelled(name)
        raise DeadlineExceeded(timeout_s)
    if "err" in box:
        raise box["err"]
    return box["out"]


def _wait(done: threading.Event, timeout_s: float, cancel: threading.Event | None = None) -> bool:
    """``done.wait(timeout_s)`` in slices of :data:`WAIT_SLICE_S`; True once ``done`` is set.

    A SIGINT / SIGTERM sent to the process may be received by any thread (here often the worker
    running the reward); CPython runs the Python handler only in the main thread, between bytecodes,
    so one long wait would hold a Ctrl-C until the reward returned or the deadline passed. Between
    slices the handler runs and its KeyboardInterrupt ends the wait. False at the deadline, or
    as soon as ``cancel`` is set.
    """
    end = time.monotonic() + timeout_s
    while not done.wait(min(WAIT_SLICE_S, max(end - time.monotonic(), 0.0))):
        if time.monotonic() >= end or (cancel is not None and cancel.is_set()):
            return done.is_set()
    return True


def wait_result(future: Future) -> Any:
    """``future.result()``, waited for in slices of :data:`WAIT_SLICE_S` (a Ctrl-C ends it within one).

    Raises:
        What the future's call raised; ``CancelledError`` for a cancelled future.
    """
    while True:
        try:
            future.exception(timeout=WAIT_SLICE_S)  # returns (not raises) the call's exception once done
        except FutureTimeout:
            continue
        return future.result()


@contextmanager
def cancel_scope(cancel: threading.Event) -> Iterator[None]:
    """Within the block, a call of this thread waiting in :func:`call_with_deadline` ends once ``cancel`` is set.

    Args:
        cancel: set by another thread to give up this thread's calls; they raise :class:`CallCancelled`
            within :data:`WAIT_SLICE_S` and are abandoned (they keep running on their daemon worker).
    """
    previous, _WORKERS.cancel = _WORKERS.cancel, cancel
    try:
        yield
    finally:
        _WORKERS.cancel = previous


class _Worker:
    """A daemon thread that runs one calling thread's reward calls, one at a time.

    Args:
        owner: the calling thread; the worker exits within :data:`IDLE_CHECK_S` once it has ended.
    """

    def __init__(self, owner: threading.Thread) -> None:
        self.owner, self.pid = owner, os.getpid()
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.busy = False  # running a job (an abandoned call may never return: not joined at exit)
        self.thread = threading.Thread(target=self._loop, name=self._name("idle"), daemon=True)
        with _LIVE_LOCK:
            _LIVE.add(self)
        self.thread.start()

    def _name(self, reward: str) -> str:
        return f"reward-{reward}@{self.owner.name}"

    def run(self, job: Callable[[], None], reward: str) -> None:
        """Run ``job`` on the worker; its thread is named after ``reward`` while it runs (stack dumps)."""
        self.thread.name = self._name(reward)
        self.jobs.put(job)

    def retire(self) -> None:
        """Let the worker exit once its current job returns (a call that overran its deadline)."""
        self.jobs.put(None)

    def _loop(self) -> None:
        try:
            while True:
                try:
                    job = self.jobs.get(timeout=IDLE_CHECK_S)
                except queue.Empty:
                    if not self.owner.is_alive():
                        return
                    continue
                if job is None:
                    return
                self.busy = True
                job()
                self.busy = False
                del job  # the call's arguments and result are not kept alive by an idle worker
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(self)


_LIVE: set[_Worker] = set()  # every started worker of this process that has not ended
_LIVE_LOCK = threading.Lock()


@atexit.register
def _stop_idle_workers(timeout_s: float = EXIT_JOIN_S) -> None:
    """Stop and join this process's idle workers (run at interpreter exit, before finalization).

    A worker still running a call that overran its deadline is left alone: it may never return.
    """
    with _LIVE_LOCK:
        idle = [w for w in _LIVE if w.pid == os.getpid() and not w.busy]
    for worker in idle:
        worker.retire()
    end = time.monotonic() + timeout_s
    for worker in idle:
        worker.thread.join(max(end - time.monotonic(), 0.0))


class _Workers(threading.local):
    """Each calling thread's worker (None until its first call, and after one overran) and cancel event."""

    worker: _Worker | None = None
    cancel: threading.Event | None = None


_WORKERS = _Workers()


def _abandon(worker: _Worker) -> None:
    """Leave ``worker`` to the call it is running (it exits when that returns); the next call gets a new one."""
    _WORKERS.worker = None
    worker.retire()


def _worker() -> _Worker:
    """The calling thread's worker, started on first use (and anew in a forked child, where it does not run)."""
    worker = _WORKERS.worker
    if worker is None or worker.pid != os.getpid():
        worker = _WORKERS.worker = _Worker(threading.current_thread())
    return worker
