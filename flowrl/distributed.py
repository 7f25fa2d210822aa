"""Group geometry across processes, and what a launcher really started.

A training iteration samples ``P = prompts.per_iteration`` prompts with ``G = prompts.group_size``
samples each: a global batch of ``B = P * G`` samples in group-major order (sample ``i`` belongs
to group ``i // G``). With ``W`` processes each rank handles ``B / W`` of them:

- ``contiguous`` placement: rank ``r`` holds whole groups ``[r P/W, (r+1) P/W)``; group
  statistics need no communication (a batch-wide std still needs the rewards of every rank).
- ``spread`` placement: every group is split across the ranks, rank ``r`` holding samples
  ``[r G/W, (r+1) G/W)`` of each group; rewards are all-gathered before advantages.

Noise and prompt groups are drawn for the whole global batch from the run's one generator, the
same on every rank, and each rank takes its rows. So rank ``r``'s seeds are a pure function of
``train.seed``, the iteration and its indices, and the samples do not depend on ``W``: a run on
two processes sees the same samples as a run on one.

References:
    Flow-GRPO (Liu et al., 2025) trains with groups spread over GPUs and gathers rewards;
    verl-omni (2026) places groups contiguously per data-parallel rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

Placement = Literal["contiguous", "spread"]
PLACEMENTS: tuple[str, ...] = ("contiguous", "spread")


@dataclass(frozen=True)
class Geometry:
    """Which samples of the global batch a rank owns.

    Attributes:
        world_size: number of processes ``W``.
        rank: this process's rank.
        placement: ``contiguous`` or ``spread``.
        prompts: prompts per iteration ``P`` (global).
        group_size: samples per prompt ``G``.
        chunk_size: rows per sampling chunk (``sampler.chunk_size``).
    """

    world_size: int
    rank: int
    placement: Placement
    prompts: int
    group_size: int
    chunk_size: int

    @property
    def global_samples(self) -> int:
        """``B = P * G``."""
        return self.prompts * self.group_size

    @property
    def local_samples(self) -> int:
        """``B / W``: the samples this rank rolls out, scores and trains on."""
        return self.global_samples // self.world_size

    @property
    def local_chunks(self) -> int:
        """Sampling chunks per rank (the last one may be short)."""
        return -(-self.local_samples // self.chunk_size)

    def indices(self, rank: int | None = None) -> Tensor:
        """Global sample indices (int64, ascending) owned by ``rank`` (default: this rank): (B / W,)."""
        r = self.rank if rank is None else rank
        if self.placement == "contiguous":
            per = self.local_samples
            return torch.arange(r * per, (r + 1) * per)
        share = self.group_size // self.world_size
        within = torch.arange(r * share, (r + 1) * share)
        return (torch.arange(self.prompts)[:, None] * self.group_size + within[None, :]).flatten()

    def needs_reward_gather(self, std: str) -> bool:
        """Whether advantages need the other ranks' rewards (``advantage.std``: global | group | none)."""
        return self.world_size > 1 and (self.placement == "spread" or std == "global")


def derive_geometry(
    prompts: int, group_size: int, chunk_size: int, world_size: int, rank: int, placement: str = "contiguous"
) -> Geometry:
    """Check that the global settings split over ``world_size`` processes and return the geometry.

    Args:
        prompts: ``prompts.per_iteration`` (global).
        group_size: ``prompts.group_size``.
        chunk_size: ``sampler.chunk_size``.
        world_size: processes in the launch.
        rank: this process's rank, ``0 <= rank < world_size``.
        placement: ``contiguous`` or ``spread``.

    Returns:
        The :class:`Geometry`.

    Raises:
        ValueError: an impossible combination, naming the numbers to change.
    """
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}; got {placement!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a launch of {world_size} processes")
    if placement == "contiguous" and prompts % world_size:
        raise ValueError(
            f"prompts.per_iteration={prompts} does not split into whole groups over {world_size} processes; "
            f"use a multiple of {world_size} (e.g. {_multiples(prompts, world_size)}) or placement spread"
        )
    if placement == "spread" and group_size % world_size:
        raise ValueError(
            f"prompts.group_size={group_size} does not split over {world_size} processes with spread placement; "
            f"use a multiple of {world_size} (e.g. {_multiples(group_size, world_size)}) or placement contiguous"
        )
    return Geometry(world_size, rank, placement, prompts, group_size, chunk_size)  # type: ignore[arg-type]


def _multiples(value: int, of: int) -> str:
    """The multiples of ``of`` around ``value``: ``"4 or 6"`` (just the upper one below ``of``)."""
    down = value // of * of
    return f"{down} or {down + of}" if down else str(of)


def silent_single_process(environ: dict[str, str] | None = None, parent_cmdline: list[str] | None = None) -> int:
    """Processes asked for by ``accelerate launch --cpu --num_processes N`` when only one was started.

    accelerate runs ``--cpu --num_processes N`` (without ``--multi_gpu``) as ONE plain process:
    ``ACCELERATE_USE_CPU`` is set but not ``WORLD_SIZE``. The number asked for is read from the
    launcher's command line (the parent process).

    Args:
        environ: the environment (default: ``os.environ``).
        parent_cmdline: the launcher's argv (default: read from ``/proc/<ppid>/cmdline``).

    Returns:
        N when N > 1 processes were asked for and one was started; 0 otherwise.
    """
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env or env.get("ACCELERATE_USE_CPU", "").lower() not in ("true", "1", "yes"):
        return 0
    argv = _parent_cmdline() if parent_cmdline is None else parent_cmdline
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if name not in ("--num_processes", "--num-processes"):
            continue
        value = value or (argv[i + 1] if i + 1 < len(argv) else "")
        if value.isdigit() and int(value) > 1:
            return int(value)
    return 0


def single_process_message(asked: int) -> str:
    """The one line for :func:`silent_single_process`: what happened and the command that works."""
    return (
        f"`accelerate launch --cpu --num_processes {asked}` started ONE process (accelerate ignores "
        f"--num_processes with --cpu); for {asked} CPU processes use "
        f"`ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes {asked} -m flowrl train ...`"
    )


def _parent_cmdline() -> list[str]:
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:  # not Linux, or the parent is gone
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]
