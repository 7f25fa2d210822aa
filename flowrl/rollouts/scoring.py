"""Decode and score a rollout chunk by chunk: inline, on a worker thread or in a worker process.

The trainer's rollout runs in chunks of ``sampler.chunk_size``. After each chunk it hands the
chunk's clean latents to a :class:`RolloutScorer`, which decodes them and scores the images with
every reward (``train.rewards_async``):

- ``false``: inline, after each chunk;
- ``true`` / ``thread``: on one worker thread, so chunk k is decoded and scored while chunk
  k + 1 is being sampled (torch kernels and HTTP waits release the GIL; Python does not);
- ``process``: in a spawned worker process (:mod:`flowrl.rollouts.scoring_process`), which overlaps even
  when both sides are bound by Python and op dispatch, as on the embedded model on a CPU.

All modes run :func:`~flowrl.rollouts.scoring_process.score_chunk` on the same chunks in the same order;
only the thread or process differs. The rollout's RNG is untouched by decoding and scoring, so a run with
``rewards_async: true`` is bit-identical to one without (tested). The whole-batch checks (a
reward that is NaN for every sample) run once all chunks are in, as for a single call.

Error messages name the reward and the batch index ``iteration * chunks_per_iteration + chunk``.
In every mode each reward call runs under its deadline ``rewards.<name>.timeout_s``
(:class:`~flowrl.rewards.MultiReward`); a call that overruns it ends the batch with one line.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from ..rewards import MultiReward, RewardOutput
from ..rewards.deadline import cancel_scope, wait_result
from .scoring_process import ScoringProcess, score_chunk

Decode = Callable[[Tensor], Tensor]


def _rows(value: Any, rows: slice, total: int) -> Any:
    """The rows of one per-sample metadata entry (lists, tuples, tensors of length B)."""
    if isinstance(value, (list, tuple, Tensor)) and len(value) == total:
        return value[rows]
    return value


def _jobs_per_batch(total: int, chunk_size: int, score_chunk_size: int | None) -> int:
    """How many scoring jobs a batch of ``total`` makes: each rollout chunk cut into ``score_chunk_size`` rows."""
    step = score_chunk_size or chunk_size
    return sum(math.ceil(min(chunk_size, total - start) / step) for start in range(0, total, chunk_size))


def batch_index(
    iteration: int, chunk: int, batch_size: int, chunk_size: int, score_chunk_size: int | None = None
) -> int:
    """Run-wide index of a scoring job: ``iteration * jobs_per_iteration + chunk``.

    A job is a rollout chunk (``sampler.chunk_size``) or, with ``train.score_chunk_size``, one
    piece of it.
    """
    return iteration * _jobs_per_batch(batch_size, chunk_size, score_chunk_size) + chunk


class RolloutScorer:
    """Decode + score rollout chunks as they arrive; gather images and rewards at the end.

    Each chunk the rollout reports is cut into jobs of ``score_chunk_size`` rows (the same cut
    in every mode, so results are bit-identical). When the rollout is done, :meth:`result` does
    not just wait: it takes the jobs the worker has not started yet, last first, and scores them
    itself, so the end of the batch is scored on two cores.

    Args:
        reward: the weighted rewards: every chunk is scored per component
            (``MultiReward.score_parts``) and the batch combined at the end (``MultiReward.combine``).
        decode: latents (b, ...) -> images (b, 3, H, W) or clips (b, F, 3, H, W) in [0, 1].
        prompts: the B prompts of the batch.
        metadata: per-sample metadata lists of length B.
        threaded: score on a worker thread while the caller keeps sampling.
        first_index: batch index of the first job (for error messages).
        worker: score in this worker process instead (``train.rewards_async: process``); it is
            owned by the caller and outlives the scorer.
        score_chunk_size: rows per decode + score call; None = each reported chunk whole.
    """

    def __init__(
        self,
        reward: MultiReward,
        decode: Decode,
        prompts: Sequence[str],
        metadata: dict[str, Any] | None = None,
        *,
        threaded: bool = False,
        first_index: int = 0,
        worker: ScoringProcess | None = None,
        score_chunk_size: int | None = None,
    ) -> None:
        if score_chunk_size is not None and score_chunk_size < 1:
            raise ValueError(f"score_chunk_size must be >= 1 or None; got {score_chunk_size}")
        self.reward, self.decode = reward, decode
        self.prompts, self.metadata = list(prompts), dict(metadata or {})
        self.first_index = first_index
        self.score_chunk_size = score_chunk_size
        self.worker = worker
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowrl-scoring") if threaded else None
        self._cancel = threading.Event()  # set by close(abandon=True): the worker thread gives up its reward call
        self._jobs: list[tuple[slice, Future | tuple[Tensor, dict[str, Tensor]]]] = []
        self._inputs: list[Tensor] = []  # each job's latents, for the jobs the caller takes back

    def _chunk_args(self, rows: slice) -> tuple[list[str], dict[str, Any]]:
        return self.prompts[rows], {k: _rows(v, rows, len(self.prompts)) for k, v in self.metadata.items()}

    def _score(self, rows: slice, latents: Tensor, index: int) -> tuple[Tensor, dict[str, Tensor]]:
        return score_chunk(self.reward, self.decode, latents, *self._chunk_args(rows), index)

    def _score_on_thread(self, rows: slice, latents: Tensor, index: int) -> tuple[Tensor, dict[str, Tensor]]:
        with cancel_scope(self._cancel):
            return self._score(rows, latents, index)

    def _raise_failures(self) -> None:
        for _, job in self._jobs:
            if isinstance(job, Future) and job.done() and not job.cancelled() and job.exception() is not None:
                raise job.exception()  # type: ignore[misc]

    def submit(self, rows: slice, latents: Tensor) -> None:
        """Decode and score the chunk ``latents`` (b, ...) holding rows ``rows`` of the batch."""
        self._raise_failures()  # stop sampling as soon as an earlier chunk failed
        step = self.score_chunk_size or latents.shape[0]
        for offset in range(0, latents.shape[0], step):
            part = slice(rows.start + offset, min(rows.start + offset + step, rows.start + latents.shape[0]))
            self._submit_job(part, latents[offset : offset + step])

    def _submit_job(self, rows: slice, latents: Tensor) -> None:
        index = self.first_index + len(self._jobs)
        self._inputs.append(latents)
        if self.worker is not None:
            self._jobs.append((rows, self.worker.submit(latents, *self._chunk_args(rows), index)))
        elif self._pool is None:
            self._jobs.append((rows, self._score(rows, latents, index)))
        else:
            self._jobs.append((rows, self._pool.submit(self._score_on_thread, rows, latents, index)))

    def _take_back(self, job: Any) -> bool:
        """Withdraw a job the worker has not started (thread: cancel; process: unsent)."""
        if not isinstance(job, Future):
            return False
        if self.worker is not None:
            return self.worker.withdraw(job)
        return job.cancel()

    def _share_the_tail(self) -> None:
        """Score, last first, every job the worker has not started, while it finishes the rest."""
        for i in reversed(range(len(self._jobs))):
            rows, job = self._jobs[i]
            if self._take_back(job):
                self._jobs[i] = (rows, self._inline(rows, self._inputs[i], self.first_index + i))

    def _inline(self, rows: slice, latents: Tensor, index: int) -> Future:
        """Score one job here; a failure is kept in the Future so the earliest batch's error is raised first."""
        future: Future = Future()
        try:
            future.set_result(self._score(rows, latents, index))
        except Exception as exc:  # noqa: BLE001 - re-raised by result() in batch order
            future.set_exception(exc)
        return future

    def result(self, samples: Tensor) -> tuple[Tensor, RewardOutput]:
        """Wait for every chunk; return images (B, ...) and the batch's :class:`RewardOutput`.

        Args:
            samples: (B, ...) all clean latents; scored in one piece if no chunk was submitted
                (a rollout that does not report chunks).
        """
        if not self._jobs:
            self.submit(slice(0, samples.shape[0]), samples)
        self._raise_failures()
        self._share_the_tail()
        done = [(rows, wait_result(job) if isinstance(job, Future) else job) for rows, job in self._jobs]
        covered = [(rows.start, rows.stop) for rows, _ in done]
        expected_start = 0
        for start, stop in covered:
            if start != expected_start:
                raise ValueError(
                    f"rollout chunks {covered} do not cover the batch of {samples.shape[0]} in order; report this bug"
                )
            expected_start = min(stop, samples.shape[0])
        images = torch.cat([out[0] for _, out in done])
        parts = [out[1] for _, out in done]
        components = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
        last = self.first_index + len(done) - 1
        where = self.first_index if last == self.first_index else f"{self.first_index}-{last}"
        return images, self.reward.combine(components, batch_index=where)

    def close(self, abandon: bool = False) -> None:
        """Stop the worker thread; pending chunks are cancelled.

        Args:
            abandon: give up the chunk being scored too (the batch failed or was interrupted): its
                reward call is abandoned within ``WAIT_SLICE_S`` and the thread ends without waiting
                for it. Otherwise the running chunk finishes first. In ``process`` mode the worker
                process is the trainer's and is closed by it.
        """
        if self._pool is not None:
            if abandon:
                self._cancel.set()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "RolloutScorer":
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(abandon=kind is not None)
