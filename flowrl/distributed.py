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

import atexit
import importlib.util
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, NoReturn, Sequence

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

    def owned_mask(self) -> Tensor:
        """(B,) bool: True on the rows of the global batch this rank owns."""
        return self.owners() == self.rank

    def owners(self) -> Tensor:
        """(B,) int64: the rank that owns each row of the global batch."""
        owners = torch.empty(self.global_samples, dtype=torch.long)
        for rank in range(self.world_size):
            owners[self.indices(rank)] = rank
        return owners

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
        other = "" if group_size % world_size else " or train.placement=spread"
        raise ValueError(
            f"prompts.per_iteration={prompts} does not split into whole groups over {world_size} processes; "
            f"use a multiple of {world_size} (e.g. {_multiples(prompts, world_size)}){other}"
        )
    if placement == "spread" and group_size % world_size:
        other = "" if prompts % world_size else " or train.placement=contiguous"
        raise ValueError(
            f"prompts.group_size={group_size} does not split over {world_size} processes with spread placement; "
            f"use a multiple of {world_size} (e.g. {_multiples(group_size, world_size)}){other}"
        )
    return Geometry(world_size, rank, placement, prompts, group_size, chunk_size)  # type: ignore[arg-type]


def check_rollout_split(geometry: Geometry, rollout_kind: str) -> None:
    """Check that a rollout kind can be split over the ranks as ``geometry`` says.

    Trees (kinds ``tree`` and ``tree_leaves``) are whole prompt groups, so they need contiguous
    placement. Flat micro-batches (every kind but ``tree``, whose micro-batches are tree frontier
    chunks) must each lie on one rank, so the rollout and the update see the batch geometry of a
    one-process run: ``sampler.chunk_size`` must divide the samples a rank holds in a row.

    Raises:
        ValueError: an impossible combination, naming the numbers to change.
    """
    g = geometry
    if g.world_size == 1:
        return
    if rollout_kind in ("tree", "tree_leaves") and g.placement != "contiguous":
        raise ValueError(
            f"tree rollouts keep each prompt's tree on one rank; set train.placement=contiguous (got {g.placement})"
        )
    if rollout_kind == "tree":
        return
    run = g.local_samples if g.placement == "contiguous" else g.group_size // g.world_size
    if run % g.chunk_size:
        fits = max(d for d in range(1, g.chunk_size + 1) if run % d == 0)
        raise ValueError(
            f"sampler.chunk_size={g.chunk_size} must divide the {run} samples each rank holds in a row "
            f"(prompts.per_iteration={g.prompts} x prompts.group_size={g.group_size} over {g.world_size} processes, "
            f"{g.placement} placement); use sampler.chunk_size={fits} or change the batch"
        )


def batch_geometry(cfg: Any, collective: Collective, rollout_kind: str) -> Geometry:
    """The rows of the global batch this process owns (``train.placement``), checked against the rollout kind.

    Args:
        cfg: the run's :class:`~flowrl.config.Config` (prompts, sampler chunk, placement).
        collective: this process's place in the launch.
        rollout_kind: a key of :data:`flowrl.rollouts.collect.ROLLOUTS`.

    Raises:
        ValueError: the batch does not split over the processes (the message names the numbers).
    """
    p, c = cfg.prompts, collective
    geometry = derive_geometry(
        p.per_iteration, p.group_size, cfg.sampler.chunk_size, c.world_size, c.rank, cfg.train.placement
    )
    check_rollout_split(geometry, rollout_kind)
    return geometry


def _multiples(value: int, of: int) -> str:
    """The multiples of ``of`` around ``value``: ``"4 or 6"`` (just the upper one below ``of``)."""
    down = value // of * of
    return f"{down} or {down + of}" if down else str(of)


def silent_single_process(environ: dict[str, str] | None = None, parent_cmdline: list[str] | None = None) -> int:
    """Processes asked for by ``accelerate launch --num_processes N`` when only one was started.

    accelerate runs ``--cpu --num_processes N``, and ``--num_processes N`` without ``--multi_gpu`` on a
    machine without GPUs, as ONE plain process: its simple launcher sets ``ACCELERATE_USE_CPU`` (to
    ``True`` or ``False``) but not ``WORLD_SIZE``. The number asked for is read from the launcher's
    command line (the parent process).

    Args:
        environ: the environment (default: ``os.environ``).
        parent_cmdline: the launcher's argv (default: read from ``/proc/<ppid>/cmdline``).

    Returns:
        N when N > 1 processes were asked for and one was started; 0 otherwise.
    """
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env or "ACCELERATE_USE_CPU" not in env:  # a launch of several, or not accelerate's launcher
        return 0
    argv = _parent_cmdline() if parent_cmdline is None else parent_cmdline
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if name not in ("--num_processes", "--num-processes"):
            continue
        value = value or (argv[i + 1] if i + 1 < len(argv) else "")
        if value.isascii() and value.isdigit() and int(value) > 1:
            return int(value)
    return 0


def single_process_message(asked: int) -> str:
    """The one line for :func:`silent_single_process`: what happened and the command that works."""
    return (
        f"`accelerate launch --num_processes {asked}` started ONE process (accelerate does so with --cpu, and without "
        f"--multi_gpu on a machine without GPUs); for {asked} CPU processes use "
        f"`ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes {asked} -m flowrl train ...`"
    )


def _parent_cmdline() -> list[str]:
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:  # not Linux, or the parent is gone
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


class Collective:
    """This process's place in the launch and the few collectives training needs.

    On one process every collective is the identity. On several it wraps an
    ``accelerate.Accelerator`` (its process group: gloo on CPU, NCCL on GPUs) and uses accelerate's
    operations (``gather``, ``reduce``, ``gather_object``, ``wait_for_everyone``).

    Args:
        accelerator: the run's ``Accelerator``; None for one process.
    """

    def __init__(self, accelerator: Any = None) -> None:
        self.accelerator = accelerator
        self.rank = 0 if accelerator is None else int(accelerator.process_index)
        self.world_size = 1 if accelerator is None else int(accelerator.num_processes)

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that logs, evaluates and writes the run folder."""
        return self.rank == 0

    def gather(self, local: Tensor) -> Tensor:
        """Every rank's ``local`` (b, ...) concatenated in rank order: (W * b, ...), on ``local``'s device."""
        if self.accelerator is None:
            return local
        return self.accelerator.gather(local.contiguous().to(self.accelerator.device)).to(local.device)

    def sum(self, value: Tensor) -> Tensor:
        """The sum over ranks of ``value`` (same shape on every rank), on ``value``'s device."""
        if self.accelerator is None:
            return value
        return self.accelerator.reduce(value.to(self.accelerator.device), reduction="sum").to(value.device)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is True on any rank."""
        return bool(self.sum(torch.tensor([float(flag)])).item() > 0)

    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's picklable ``value``, in rank order."""
        if self.accelerator is None:
            return [value]
        from accelerate.utils import gather_object

        return gather_object([value])

    def broadcast_object(self, value: Any) -> Any:
        """Rank 0's picklable ``value``, on every rank (what the other ranks pass is ignored)."""
        if self.accelerator is None:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value])[0]

    @property
    def fsdp_plugin(self) -> Any:
        """The accelerate FSDP plugin of an FSDP launch (GPUs); None otherwise (CPU gloo: flowrl shards itself)."""
        if self.accelerator is None or "FSDP" not in str(self.accelerator.distributed_type):
            return None
        return self.accelerator.state.fsdp_plugin

    @property
    def deepspeed_plugin(self) -> Any:
        """The accelerate DeepSpeed plugin of a DeepSpeed launch (GPUs); None otherwise."""
        if self.accelerator is None or "DEEPSPEED" not in str(self.accelerator.distributed_type):
            return None
        return self.accelerator.state.deepspeed_plugin

    @property
    def deepspeed_stage(self) -> int | None:
        """The ZeRO stage of an accelerate DeepSpeed launch, None for any other launch.

        On GPUs it is the plugin's. On CPU (``ACCELERATE_USE_CPU=true``) accelerate 1.15 turns a
        DeepSpeed launcher config into plain ``MULTI_CPU`` processes and drops the plugin; the
        launcher's stage is then read from ``ACCELERATE_DEEPSPEED_ZERO_STAGE``.
        """
        if self.accelerator is None:
            return None
        plugin = self.deepspeed_plugin
        if plugin is not None:
            return int(plugin.zero_stage)
        env = os.environ
        if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("true", "1", "yes"):
            return int(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2") or 2)
        return None

    @property
    def device_type(self) -> str:
        """The device type of this rank's process group (``cpu`` for gloo, ``cuda`` for NCCL)."""
        return "cpu" if self.accelerator is None else self.accelerator.device.type

    def barrier(self) -> None:
        """Wait until every rank gets here."""
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()

    def close(self) -> None:
        """Leave the process group (several processes; no-op on one)."""
        if self.accelerator is not None:
            self.accelerator.end_training()


def launch_world_size(environ: dict[str, str] | None = None) -> int:
    """Processes in this launch (``WORLD_SIZE``, 1 when not launched by a distributed launcher)."""
    env = os.environ if environ is None else environ
    return int(env.get("WORLD_SIZE", "1") or 1)


def local_world_size(environ: dict[str, str] | None = None) -> int:
    """Processes of this launch on this machine (``LOCAL_WORLD_SIZE``, 1 when not launched)."""
    env = os.environ if environ is None else environ
    return max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1))


def exit_launched_process(code: int) -> NoReturn:
    """End a process of a multi-process launch: exit handlers run, interpreter finalization does not.

    torch's gloo backend runs worker threads for a process group as long as anything holds the group
    (an FSDP2 device mesh, a DTensor, DeepSpeed's group registry), past ``destroy_process_group``.
    A worker that frees its last collective's tensors after the main thread has begun finalizing the
    interpreter needs the GIL, and CPython ends a thread that asks for it then in a way C++ cannot
    unwind: ``terminate called without an active exception`` and SIGABRT, after every output was
    written (4 of 40 two-rank launches under load in a minimal reproduction; a CI failure of the
    FSDP2 test). So a launched process runs its ``atexit`` handlers (logging, multiprocessing
    children) while the interpreter is whole, flushes its streams and leaves with ``os._exit``.

    Args:
        code: the process's exit status.
    """
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken stream: nothing more can be said on it
                pass
        os._exit(code)


LOST_PEER = ("Connection closed by peer", "Connection reset by peer")
"""What gloo says when a collective's peer process ended (crashed, failed, killed) while this rank waited on it."""

TIMED_OUT = ("Timed out waiting",)
"""What gloo says when a collective waited longer than the process group's timeout (``train.collective_timeout_s``)."""


def lost_peer_message(err: BaseException, environ: dict[str, str] | None = None) -> str | None:
    """The one line for a collective that failed because another process ended or did not come in time, or None.

    When one rank fails (its own ``flowrl: error:`` line) or is killed, the ranks waiting for it in a
    collective get gloo's ``RuntimeError: ... Connection closed by peer``; its traceback would bury
    the failing rank's line, so the waiting ranks say in one line what happened instead.

    Args:
        err: the exception that ended this process.
        environ: the environment (default: ``os.environ``), for this process's ``RANK``.
    """
    if not isinstance(err, RuntimeError):
        return None
    rank = (os.environ if environ is None else environ).get("RANK", "?")
    if any(text in str(err) for text in TIMED_OUT):
        return (
            f"flowrl: error: rank {rank} waited longer than train.collective_timeout_s for another process of the "
            "launch; raise it if rank 0's evaluation or checkpoint takes that long, else that process's error says why"
        )
    if not any(text in str(err) for text in LOST_PEER):
        return None
    return (
        f"flowrl: error: rank {rank} stopped because another process of the launch ended during a collective; "
        "that process's error line (or the launcher's exitcode line, for a killed one) says why"
    )


def skip_inference_comm_build() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce on CPU, which flowrl's training never calls.

    DeepSpeed's torch backend JIT-builds the ``deepspeed_shm_comm`` extension when it starts
    (``deepspeed.comm.torch.build_shm_op``, once per ``TORCH_EXTENSIONS_DIR``), but only its
    inference all-reduce (tensor-parallel inference layers) uses it; ZeRO's collectives go through
    the gloo process group. The build cost a first two-process ZeRO-2 run 33 s of its 51 s here
    (docs/scale-out.md). Marking the op incompatible is the check ``build_shm_op`` itself reads.
    Called before DeepSpeed starts: by :meth:`flowrl.zero.ZeroEngine.start` on CPU processes and by
    :func:`join_launch` on a DeepSpeed launch. A no-op where DeepSpeed's accelerator is not the CPU
    (its GPU backends have no such build).
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def join_launch(timeout_s: float | None = None) -> Collective:
    """The :class:`Collective` of this launch: an ``accelerate.Accelerator`` when ``WORLD_SIZE`` > 1.

    Args:
        timeout_s: how long a collective waits for the other ranks (``train.collective_timeout_s``);
            None: torch's default (10 min for NCCL, 30 min for gloo).
    """
    if launch_world_size() == 1:
        return Collective()
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true" and importlib.util.find_spec("deepspeed"):
        skip_inference_comm_build()  # accelerate starts DeepSpeed's backend on a DeepSpeed launch without use_cpu
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    handlers = [] if timeout_s is None else [InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))]
    accelerator = Accelerator(kwargs_handlers=handlers)
    plugin = accelerator.state.fsdp_plugin if "FSDP" in str(accelerator.distributed_type) else None
    collective = Collective(accelerator)
    fsdp_version = None if plugin is None else int(plugin.fsdp_version)
    check_plugin(str(accelerator.distributed_type), fsdp_version, collective.deepspeed_stage)
    check_joined(launch_world_size(), accelerator.num_processes, str(accelerator.distributed_type))
    return collective


def check_rank_device(device: str, processes: int, visible: int | None = None) -> None:
    """Refuse a CUDA model that several processes would put on one GPU, or on GPUs that are not there.

    With several processes ``model.device: cuda`` gives rank r the GPU ``cuda:LOCAL_RANK``; an
    explicit ``cuda:N`` would put every rank on GPU N.

    Args:
        device: ``model.device`` as given.
        processes: processes of the launch.
        visible: CUDA devices this machine shows (None: not checked, e.g. once the launch started).

    Raises:
        ValueError: one line naming the setting and the fix.
    """
    if processes <= 1 or not device.startswith("cuda"):
        return
    if device != "cuda":
        raise ValueError(
            f"model.device={device!r} puts all {processes} processes on one GPU; use model.device=cuda "
            "(each process then takes the GPU of its local rank)"
        )
    if visible is not None and visible < processes:
        raise ValueError(
            f"{processes} processes of a CUDA model need one GPU each but this machine shows {visible}; "
            f"use --processes {max(visible, 1)} (or --processes auto)"
        )


def check_joined(launched: int, joined: int, distributed_type: str) -> None:
    """Refuse a launch whose processes did not join one process group.

    accelerate 1.15 turns an FSDP or DeepSpeed launch on a machine without GPUs, and any launch there
    without ``ACCELERATE_USE_CPU=true`` (e.g. ``torchrun --nproc_per_node 2``), into
    ``DistributedType.NO`` in every process: each would train alone and write the same run folder.

    Args:
        launched: processes the launcher started (``WORLD_SIZE``).
        joined: processes in accelerate's group (``Accelerator.num_processes``).
        distributed_type: accelerate's ``DistributedType`` of the launch.

    Raises:
        ValueError: ``joined != launched``.
    """
    if joined != launched:
        kind = distributed_type.rsplit(".", 1)[-1]
        raise ValueError(
            f"the launcher started {launched} processes but accelerate joined {joined} (distributed type {kind}; "
            "without GPUs accelerate needs ACCELERATE_USE_CPU=true, and its FSDP and DeepSpeed need GPUs); "
            "on CPU launch with ACCELERATE_USE_CPU=true accelerate launch "
            f"--multi_gpu --num_processes {launched} (configs/accelerate/cpu_gloo.yaml), adding train.sharding=fsdp2 "
            "(or zero1 / zero2 / zero3) to shard the model"
        )


ZERO_LAUNCH_STAGES = (1, 2, 3)
"""ZeRO stages of a DeepSpeed launch flowrl wires (``train.sharding`` zero1 / zero2 / zero3, :mod:`flowrl.zero`)."""


def check_plugin(distributed_type: str, fsdp_version: int | None = None, zero_stage: int | None = None) -> None:
    """Refuse a sharding launch flowrl does not wire, instead of silently not sharding.

    An FSDP launch with ``fsdp_version: 2`` is wired (:mod:`flowrl.sharding`), and a DeepSpeed
    launch with ZeRO stage 1, 2 or 3 (:mod:`flowrl.zero`); FSDP1 and ZeRO stage 0 are not.

    Args:
        distributed_type: accelerate's ``DistributedType`` of the launch (e.g. ``"MULTI_GPU"``).
        fsdp_version: the FSDP plugin's version on an FSDP launch.
        zero_stage: the ZeRO stage of a DeepSpeed launch (:attr:`Collective.deepspeed_stage`).

    Raises:
        ValueError: an FSDP1 launch, or a DeepSpeed launch with ZeRO stage 0.
    """
    kind = distributed_type.rsplit(".", 1)[-1].upper()
    if kind == "FSDP" and fsdp_version != 2:
        raise ValueError(
            f"accelerate launch with FSDP version {fsdp_version} is not wired into flowrl; set fsdp_version: 2 in the "
            "launcher config (configs/accelerate/fsdp2.yaml)"
        )
    if zero_stage is not None and zero_stage not in ZERO_LAUNCH_STAGES:
        raise ValueError(
            f"accelerate launch with DeepSpeed ZeRO stage {zero_stage} is not wired into flowrl; set zero_stage: 1, 2 "
            "or 3 in the launcher config (configs/accelerate/deepspeed_zero1.yaml, _zero2.yaml or _zero3.yaml)"
        )


def gather_rows(collective: Collective, geometry: Geometry, local: Tensor) -> Tensor:
    """Every rank's owned rows (b, ...) put back in global order: (B, ...), the same on every rank."""
    parts = collective.gather(local)
    if geometry.placement == "contiguous" or geometry.world_size == 1:
        return parts
    order = torch.cat([geometry.indices(r) for r in range(geometry.world_size)]).to(parts.device)
    out = torch.empty_like(parts)
    out[order] = parts
    return out


def sum_gradients(params: Sequence[Tensor], collective: Collective) -> None:
    """Replace every parameter's gradient by its sum over the ranks (one flat all-reduce).

    A gradient that is None on every rank stays None (AdamW then skips the parameter, as on one
    process); one that is None on some ranks counts as zeros there.
    """
    if collective.world_size == 1 or not params:
        return
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    has = torch.tensor([float(p.grad is not None) for p in params], device=grads[0].device)
    flat = collective.sum(torch.cat([has.double(), *(g.reshape(-1).double() for g in grads)]))
    offset = len(params)
    for i, p in enumerate(params):
        n = p.numel()
        p.grad = None if flat[i] == 0 else flat[offset : offset + n].reshape(p.shape).to(grads[i].dtype)
        offset += n


def agree_fault(collective: Collective, fault: str | None) -> str | None:
    """The first rank's update fault, on every rank: a bad loss on any rank skips the step on all of them."""
    if collective.world_size == 1:
        return fault
    faults = [f for f in collective.gather_objects(fault) if f is not None]
    return faults[0] if faults else None


def merge_totals(
    collective: Collective, totals: dict[str, float], first: tuple[int, float] | None
) -> tuple[dict[str, float], tuple[int, float] | None]:
    """Sum the ranks' per-micro-batch statistics; keep the (plan position, value) that comes first in the plan."""
    if collective.world_size == 1:
        return totals, first
    merged: dict[str, float] = {}
    firsts = []
    for part, part_first in collective.gather_objects((totals, first)):
        for k, v in part.items():
            merged[k] = merged.get(k, 0.0) + v
        firsts += [tuple(part_first)] if part_first is not None else []
    return merged, min(firsts) if firsts else None
