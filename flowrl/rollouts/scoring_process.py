"""A spawned worker process that decodes and scores rollout chunks (``train.rewards_async: process``).

A scoring *thread* shares the GIL with sampling: on a small model, where most of the time is
Python and op dispatch rather than long kernels, the two threads take turns and nothing overlaps
(measured in docs/benchmarks.md: CPU seconds = wall seconds). A process has its own interpreter,
so decoding and scoring run on another core while the trainer samples the next chunk.

The worker is started once per training run (importing torch costs seconds) and kept for every
iteration. It receives the decoder and the reward by pickling, with tensors moved to shared memory
(``torch.multiprocessing``), so no weights are copied. It runs the same :func:`score_chunk` as the
inline and threaded modes, with the same number of torch threads, so results are bit-identical.

Faults never hang the trainer: a reward that raises comes back as the same exception; a reward that
misses its deadline (``rewards.<name>.timeout_s``) is stopped by the worker itself, or, if the worker
cannot even do that (a reward stuck in native code that holds the GIL), the worker is killed
``BACKSTOP_GRACE_S`` after the deadline; a worker that dies (an exit, a segfault, the OOM killer) fails
every pending chunk within ``POLL_S`` with one line naming the signal or exit code and the reward
that was running (the worker reports each reward as it starts it, and enables ``faulthandler`` so a
crash also leaves its Python stack on stderr); a reward or decoder that can't be pickled is named
before anything starts.
"""

from __future__ import annotations

import faulthandler
import json
import pickle
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Sequence

import torch
import torch.multiprocessing as mp
from torch import Tensor

from ..policy.memory import trainable_attention
from ..rewards import MultiReward, RewardError
from ..rewards.contract import RewardTimeout, timeout_message
from ..supervisor import signal_name

Decode = Callable[[Tensor], Tensor]
POLL_S = 0.2  # how often a waiting side checks that the other one is still alive
BACKSTOP_GRACE_S = 2.0  # past a reward's deadline, how long the worker has to report it before it is killed
_FIX = "rerun with train.rewards_async=thread or false to see the reward's own error"


class ScoringProcessDied(RewardError):
    """The scoring process ended while it held chunks (exit code or signal named in the message)."""


def _how_it_ended(exitcode: int | None) -> str:
    """``"signal SIGSEGV"`` or ``"exit code 3"`` for a process's exit code."""
    if exitcode is not None and exitcode < 0:
        return f"signal {signal_name(-exitcode)}"
    return f"exit code {exitcode}"


def score_chunk(
    reward: MultiReward,
    decode: Decode,
    latents: Tensor,
    prompts: Sequence[str],
    metadata: dict[str, Any],
    index: int,
    on_start: Callable[[str], None] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decode one chunk and score it with every reward component (no gradient), each under its deadline.

    Args:
        reward: the weighted rewards; each component scores the chunk (``MultiReward.score_parts``).
        decode: latents (b, ...) -> images (b, 3, H, W) or clips (b, F, 3, H, W) in [0, 1].
        latents: (b, ...) clean latents of the chunk.
        prompts: the chunk's b prompts.
        metadata: the chunk's rows of every per-sample metadata entry.
        index: run-wide batch index, named in error messages.
        on_start: called with each reward's name as it starts (see ``MultiReward.score_parts``).

    Returns:
        images (b, ...) and the per-component rewards {name: (b,)}.
    """
    with torch.no_grad():  # grad mode is per thread: set it in every worker
        images = decode(latents)
        return images, reward.score_parts(images, list(prompts), metadata, batch_index=index, on_start=on_start)


def _portable(exc: BaseException) -> BaseException:
    """The exception itself if it survives pickling, else a RuntimeError with its text."""
    try:
        pickle.loads(ForkingPickler.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any unpicklable exception is replaced, never lost
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _set_running(running: Any, index: int | None = None, position: int = 0) -> None:
    """Write the reward the worker is calling now into shared memory (visible at once, even if it then crashes).

    The reward is written as its position in ``MultiReward.rewards`` (a name can be longer than the buffer).
    """
    running.value = json.dumps([index, position, time.monotonic()]).encode() if index is not None else b""


def _get_running(running: Any, names: Sequence[str]) -> tuple[int, str, float] | None:
    """(batch index, reward name, start time) of the reward the worker is calling now, or None."""
    raw = running.value
    if not raw:
        return None
    index, position, started = json.loads(raw)
    return index, names[position], started


def _starts(running: Any, index: int, at: dict[str, int]) -> Callable[[str], None]:
    """The ``on_start`` of one chunk: write each reward the worker calls into ``running`` (:func:`_set_running`)."""
    return lambda name: _set_running(running, index, at[name])


def _worker_main(reward: MultiReward, decode: Decode, threads: int, jobs: Any, results: Any, running: Any) -> None:
    """Worker loop: ``(key, latents, prompts, metadata, index)`` in, ``(key, ok, payload)`` out; None stops.

    The reward being called is kept in ``running`` (shared memory, see :func:`_set_running`).
    """
    faulthandler.enable()  # a segfault in a reward leaves its Python stack on stderr
    at = {name: i for i, name in enumerate(reward.rewards)}
    torch.set_num_threads(threads)
    results.put((None, True, "ready"))
    parent = mp.parent_process()
    # the attention kernels inline scoring runs under (Trainer.collect), so every mode scores the same bits on a
    # GPU too; the flags are process-wide, and this process only scores
    with trainable_attention():
        while True:
            try:
                job = jobs.get(timeout=POLL_S)
            except queue.Empty:
                if parent is not None and not parent.is_alive():  # the trainer died: never outlive it
                    results.cancel_join_thread()
                    return
                continue
            if job is None:
                return
            key, latents, prompts, metadata, index = job
            try:
                out = score_chunk(reward, decode, latents, prompts, metadata, index, _starts(running, index, at))
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to the trainer
                _set_running(running)
                results.put((key, False, _portable(exc)))
            else:
                _set_running(running)
                results.put((key, True, out))


def _unpicklable_part(reward: MultiReward, decode: Decode) -> str | None:
    """Name what can't be sent to a worker process (a reward component or the decoder), with why."""
    named = [(f"reward {name!r}", fn) for name, (fn, _) in reward.rewards.items()]  # a MultiReward has >= 1
    for what, obj in [*named, ("the model's decoder", decode)]:
        try:
            ForkingPickler.dumps(obj)
        except Exception as exc:  # noqa: BLE001 - reported to the user in one line
            return f"{what} can't be sent to a scoring process ({type(exc).__name__}: {exc})"
    return None


class ScoringProcess:
    """One spawned worker that decodes + scores chunks; :meth:`submit` returns a Future.

    Args:
        reward: the trainer's reward (a :class:`~flowrl.rewards.MultiReward`); must be picklable.
        decode: a picklable decoder (``adapter.decoder()``), not a bound method of the adapter.
        threads: torch threads in the worker; the trainer's own count keeps results bit-identical.
        start_timeout_s: how long to wait for the worker to import torch and load the reward.

    Raises:
        ValueError: the reward or decoder can't be pickled (the message names which and the fix).
        RuntimeError: the worker died or did not start in time.
    """

    def __init__(
        self, reward: MultiReward, decode: Decode, *, threads: int | None = None, start_timeout_s: float = 300.0
    ) -> None:
        ctx = mp.get_context("spawn")
        self._jobs, self._results = ctx.Queue(), ctx.Queue()
        self._pending: dict[int, Future] = {}
        self._backlog: deque[tuple[int, tuple]] = deque()  # jobs not sent yet: the caller may withdraw them
        self._busy = False  # one job at a time in the worker, so the rest can still be withdrawn
        self._lock = threading.Lock()
        self._next_key = 0
        self._closed = False
        self._timeouts = dict(reward.timeouts)
        self._names = list(reward.rewards)
        self._running = ctx.Array("c", 512)  # the reward the worker is calling now (_set_running)
        self._receiver: threading.Thread | None = None  # started once the worker is ready
        self._proc = ctx.Process(
            target=_worker_main,
            name="flowrl-scoring",
            daemon=True,
            args=(reward, decode, threads or torch.get_num_threads(), self._jobs, self._results, self._running),
        )
        try:
            self._proc.start()  # spawn pickles the arguments here, before any child exists
        except Exception:
            problem = _unpicklable_part(reward, decode)  # only on failure: name the part that can't travel
            if problem is None:
                raise
            raise ValueError(
                f"train.rewards_async=process: {problem}; use train.rewards_async=thread, "
                "or serve that reward with `flowrl serve-reward` and use it as remote:"
            ) from None
        self._wait_ready(start_timeout_s)
        self._receiver = threading.Thread(target=self._receive, name="flowrl-scoring-receiver", daemon=True)
        self._receiver.start()

    def _wait_ready(self, timeout_s: float) -> None:
        waited = 0.0
        while waited < timeout_s:
            try:
                self._results.get(timeout=POLL_S)
                return
            except queue.Empty:
                waited += POLL_S
                if not self._proc.is_alive():
                    self._closed = True
                    raise ScoringProcessDied(
                        f"scoring process died ({_how_it_ended(self._proc.exitcode)}) while starting "
                        "(it could not load the reward); run with train.rewards_async=false to see the error"
                    )
        self.close()
        raise ScoringProcessDied(
            f"scoring process did not start within {timeout_s:.0f} s; use train.rewards_async=thread"
        )

    def _receive(self) -> None:
        """Resolve futures as results arrive; fail them all if the worker dies or a reward overruns its deadline.

        Nothing ends this thread with a future unresolved: an unexpected error fails every pending one.
        """
        try:
            self._receive_until_done()
        except BaseException as exc:  # noqa: BLE001 - a silent end here would leave the trainer waiting forever
            self._fail_pending(
                ScoringProcessDied(f"scoring results could not be received ({type(exc).__name__}: {exc})")
            )
            raise

    def _receive_until_done(self) -> None:
        while True:
            try:
                key, ok, payload = self._results.get(timeout=POLL_S)
            except queue.Empty:
                if self._closed or self._check_worker():
                    return
                continue
            except (EOFError, OSError):
                return
            with self._lock:
                future = self._pending.pop(key, None)
                self._busy = False
                self._send_next()
            if future is not None:
                future.set_result(payload) if ok else future.set_exception(payload)

    def _where(self) -> str:
        """``" in reward 'x' (batch 6)"`` for the reward the worker is running, or ``""``."""
        running = _get_running(self._running, self._names)
        if running is None:
            return ""
        index, name, _ = running
        return f" in reward {name!r} (batch {index})"

    def _check_worker(self) -> bool:
        """Fail every pending chunk if the worker died or overran a deadline; True when it did."""
        if not self._proc.is_alive():
            code = self._proc.exitcode
            hint = "its Python stack is printed above; fix the reward" if code is not None and code < 0 else _FIX
            self._fail_pending(
                ScoringProcessDied(f"scoring process died ({_how_it_ended(code)}){self._where()}; {hint}")
            )
            return True
        running = _get_running(self._running, self._names)
        if running is None:
            return False
        index, name, started = running
        timeout = self._timeouts.get(name)
        if timeout is None or time.monotonic() - started < timeout + BACKSTOP_GRACE_S:
            return False
        self._proc.kill()  # the reward holds the worker so hard that it could not report its own deadline
        self._proc.join(5.0)
        self._fail_pending(RewardTimeout(timeout_message(name, timeout, index) + "; its scoring process was killed"))
        return True

    def _fail_pending(self, exc: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            self._backlog.clear()
        for future in pending.values():
            future.set_exception(exc)

    def _send_next(self) -> None:
        """Hand the oldest waiting job to the worker if it is idle (call with the lock held)."""
        if not self._busy and self._backlog and not self._closed:
            key, job = self._backlog.popleft()
            self._busy = True
            self._jobs.put((key, *job))

    def withdraw(self, future: Future) -> bool:
        """Take back a job the worker has not received; True if it was withdrawn (score it yourself)."""
        with self._lock:
            for i, (key, _) in enumerate(self._backlog):
                if self._pending.get(key) is future:
                    del self._backlog[i]
                    del self._pending[key]
                    return True
        return False

    def submit(self, latents: Tensor, prompts: Sequence[str], metadata: dict[str, Any], index: int) -> Future:
        """Queue one chunk; the Future resolves to ``score_chunk``'s (images, parts)."""
        if self._closed or not self._proc.is_alive():
            raise ScoringProcessDied(
                f"scoring process is not running ({_how_it_ended(self._proc.exitcode)}); "
                "rerun with train.rewards_async=thread or false"
            )
        future: Future = Future()
        # a private copy of the latents, moved to shared memory when sent
        job = (latents.detach().clone(), list(prompts), metadata, index)
        with self._lock:
            key, self._next_key = self._next_key, self._next_key + 1
            self._pending[key] = future
            self._backlog.append((key, job))
            self._send_next()
        return future

    def close(self, timeout_s: float = 10.0, abandon: bool = False) -> None:
        """Stop the worker (it finishes the chunk at hand); kill it if it does not stop in time.

        Args:
            timeout_s: how long to wait for the worker to finish the chunk at hand and exit.
            abandon: kill the worker at once (the run failed or was interrupted: its chunks are not wanted).
        """
        if self._closed:
            return
        self._closed = True
        if self._proc.is_alive():
            if not abandon:
                self._jobs.put(None)
                self._proc.join(timeout_s)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout_s)
        self._fail_pending(RuntimeError("scoring process was closed before this chunk was scored"))
        self._join_receiver(timeout_s)

    def _join_receiver(self, timeout_s: float) -> None:
        """Wait for the receiver thread to notice the close (within :data:`POLL_S`).

        It unpickles tensors (torch code), so it must not be alive when the interpreter finalizes:
        a daemon thread's forced unwind through torch's C++ frames aborts the process.
        """
        receiver = self._receiver
        if receiver is not None and receiver is not threading.current_thread():
            receiver.join(timeout_s)

    def __del__(self) -> None:
        try:
            self.close(timeout_s=1.0)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
