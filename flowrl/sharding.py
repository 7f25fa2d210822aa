"""Sharded training (FSDP2): the denoiser's frozen base and its LoRA split over the ranks.

Under ``train.sharding: fsdp2`` every transformer block (the model's ``_no_split_modules``, or the
accelerate FSDP plugin's wrap classes) and then the whole transformer go through PyTorch's
``fully_shard``: each rank keeps ``1/W`` of every parameter, the frozen base as well as the LoRA
adapters (``default`` and the objectives' frozen copies), as DTensors. A forward gathers a block's
full weights just before it runs and frees them after; a backward reduce-scatters the LoRA
gradients, summed over the ranks (divide factor 1), so AdamW updates each rank's shard of the
one-process gradient.

Those gathers are collectives: every rank must call the model the same number of times, in the
same order (lockstep). The data-parallel path of :mod:`flowrl.distributed` calls the model only on
chunks a rank owns, so under sharding

- in a rollout each rank calls the model on the chunks it owns rows of, then makes one-row
  placeholder calls, outputs dropped, up to the busiest rank's count
  (:class:`flowrl.rollouts.owned.OwnedRows`);
- in an optimizer step, each rank runs its own micro-batches side by side with the other ranks'
  and pads with placeholder losses on one row, scaled by zero, up to the most any rank runs
  (:func:`rank_microbatches`): a placeholder's gradient is exactly zero;
- rank 0's evaluation, image grids and checkpoint gathers run on every rank at once
  (:class:`Lockstep`: rank 0 announces each call, the other ranks make the same one).

Checkpoints and the final LoRA hold full tensors (the one-process files); resume cuts them back into
each rank's shard.

DeepSpeed ZeRO-1/2/3 (``train.sharding: zero1 | zero2 | zero3``, :mod:`flowrl.zero`) uses the same lockstep
pieces: ZeRO-3 partitions every parameter, so its forwards are collectives like FSDP2's
(:func:`is_sharded`); under ZeRO-1/2 the model is whole on every rank and only the update's backwards
and the optimizer-state gathers are collectives (:func:`collective_calls`).

References:
    Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB 2023;
    PyTorch ``torch.distributed.fsdp.fully_shard`` (FSDP2, per-parameter DTensor sharding).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from .distributed import Collective, Geometry
from .objectives.planning import owned_microbatch, trained_parents
from .policy.lora import adapter_parameters, load_lora_state, lora_mismatch, lora_state_dict
from .zero import ZERO_STAGES, adapters_gathered, is_partitioned, require_deepspeed


def run_sharding(cfg: Any, collective: Collective) -> str:
    """The run's sharding: ``train.sharding``, or what the launch implies (FSDP: ``fsdp2``, DeepSpeed: ``zero<stage>``).

    Raises:
        ValueError: a combination sharding does not support yet, or DeepSpeed missing, in one line naming the fix.
    """
    stage = collective.deepspeed_stage
    launched = "fsdp2" if collective.fsdp_plugin is not None else None if stage is None else f"zero{stage}"
    sharding = launched or cfg.train.sharding
    if sharding == "none":
        return sharding
    if collective.world_size == 1:
        raise ValueError(
            f"train.sharding={sharding} shards over the processes of a launch and this is one process; launch several, "
            "e.g. ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 -m flowrl train ... "
            f"train.sharding={sharding} (or set train.sharding=none)"
        )
    if cfg.solrl.mode != "off":
        raise ValueError(
            f"train.sharding={sharding} does not support solrl.mode={cfg.solrl.mode} yet (its explore copy merges the "
            "full LoRA into an unsharded transformer); set solrl.mode=off or train.sharding=none"
        )
    if cfg.memory.compile != "none":
        raise ValueError(
            f"train.sharding={sharding} does not support memory.compile={cfg.memory.compile} yet (the denoiser is "
            "compiled before it is sharded); set memory.compile=none or train.sharding=none"
        )
    if sharding in ZERO_STAGES:
        require_deepspeed()
    return sharding


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are sharded, so that a forward is a collective (FSDP2 or ZeRO-3)."""
    return is_fsdp(module) or is_partitioned(module)


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` went through ``fully_shard`` (its parameters are DTensor shards)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def block_classes(transformer: nn.Module, names: Iterable[str] | None = None) -> list[type[nn.Module]]:
    """The block classes to shard one by one: ``names`` found in the model, else its ``_no_split_modules``.

    Raises:
        ValueError: the model has none of the classes (nothing to shard per block).
    """
    wanted = set(names or getattr(transformer, "_no_split_modules", None) or ())
    found = {type(m) for m in transformer.modules() if type(m).__name__ in wanted}
    if not found:
        raise ValueError(
            f"train.sharding=fsdp2: {type(transformer).__name__} has none of the block classes {sorted(wanted)} to "
            "shard; list its block class in fsdp_transformer_layer_cls_to_wrap (configs/accelerate/fsdp2.yaml)"
        )
    return sorted(found, key=lambda c: c.__name__)


def shard_transformer(transformer: nn.Module, collective: Collective) -> list[nn.Parameter]:
    """``fully_shard`` every block of ``transformer``, then the transformer itself, over the launch's ranks.

    On an accelerate FSDP launch (GPUs) accelerate's own ``fsdp2_prepare_model`` shards, with the
    plugin's wrap classes and settings; otherwise (e.g. CPU processes on gloo) the same per-block
    ``fully_shard`` runs on a one-dimensional device mesh of all ranks. Gradients are reduce-scattered
    as sums (divide factor 1), the sum the data-parallel path all-reduces.

    Args:
        transformer: the denoiser with its LoRA adapters attached (every adapter the objective adds:
            they are sharded with it).
        collective: the launch (several processes).

    Returns:
        The trainable parameters after sharding (new DTensor parameters; the optimizer takes these).
    """
    from torch.distributed.fsdp import fully_shard

    plugin = collective.fsdp_plugin
    if plugin is not None:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        # the shipped launcher config lists every family's block class; accelerate refuses names the model lacks.
        # Narrowed for this call only: the plugin is the launch's, and a later model of another family sharded in
        # the same process (bench.fsdp2_memory: SD3.5-M, then FLUX.1) needs the whole list again.
        names = plugin.transformer_cls_names_to_wrap
        plugin.transformer_cls_names_to_wrap = [c.__name__ for c in block_classes(transformer, names)]
        try:
            fsdp2_prepare_model(collective.accelerator, transformer)
        finally:
            plugin.transformer_cls_names_to_wrap = names
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(collective.device_type, (collective.world_size,))
        classes = tuple(block_classes(transformer))
        for module in [m for m in transformer.modules() if isinstance(m, classes)]:
            fully_shard(module, mesh=mesh)
        fully_shard(transformer, mesh=mesh)
    for module in transformer.modules():  # each sharded block reduces its own gradients: a plain SUM (gloo too)
        if is_fsdp(module):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    params = [p for p in transformer.parameters() if p.requires_grad]
    (local, full), lora = local_numel(transformer), local_numel(params)
    print(
        f"flowrl: fsdp2: rank {collective.rank} of {collective.world_size} holds {local} of {full} denoiser parameters "
        f"({100 * local / full:.1f} %); trainable LoRA {lora[0]} of {lora[1]}",
        file=sys.stderr,
    )
    return params


def local_numel(params: nn.Module | Sequence[Tensor]) -> tuple[int, int]:
    """(parameter elements held by this rank, elements of the full parameters) of a module or a parameter list."""
    params = list(params.parameters()) if isinstance(params, nn.Module) else list(params)
    return sum(t.numel() for t in local_tensors(params)), sum(p.numel() for p in params)


def local_tensors(params: Sequence[Tensor]) -> list[Tensor]:
    """Each parameter's local shard (the parameter itself when it is not sharded)."""
    return [p.to_local() if isinstance(p, DTensor) else p for p in params]


def full_tensors(value: Any) -> Any:
    """``value`` (a tensor, or dicts / lists of them) with every DTensor gathered into a full tensor (collective)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: full_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(full_tensors(v) for v in value)
    return value


def shard_like(full: Tensor, param: DTensor) -> DTensor:
    """This rank's shard of ``full`` (a whole tensor of ``param``'s shape), placed like ``param`` (no communication)."""
    full = full.to(device=param.device, dtype=param.dtype)
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)


def lora_weights(transformer: nn.Module, adapter: str = "default") -> dict[str, Tensor]:
    """One adapter's full weights as a peft state dict on the CPU (every rank must call it when sharded)."""
    if not is_fsdp(transformer):
        with adapters_gathered(transformer):  # ZeRO-3 partitions gathered (collective); a no-op otherwise
            return lora_state_dict(transformer, adapter)
    from peft.utils import get_peft_model_state_dict

    weights = get_peft_model_state_dict(transformer, adapter_name=adapter)
    return {k: full_tensors(v.detach()).cpu().clone() for k, v in weights.items()}


@torch.no_grad()
def load_lora_shards(transformer: nn.Module, state: dict[str, Tensor], adapter: str = "default") -> None:
    """Cut full LoRA weights (:func:`lora_weights`) into this rank's shards of ``adapter`` (FSDP2, ZeRO-2/3).

    Raises:
        ValueError: the keys do not match the adapter's (a checkpoint from another config).
    """
    if not is_fsdp(transformer):  # ZeRO: gathered whole, loaded, written back into the partitions (collective)
        with adapters_gathered(transformer, modify=True):
            load_lora_state(transformer, state, adapter)
        return
    params = adapter_parameters(transformer, adapter)
    if params.keys() != state.keys():
        raise lora_mismatch(len(params.keys() - state.keys()), len(state.keys() - params.keys()))
    for key, param in params.items():
        param.to_local().copy_(shard_like(state[key], param).to_local())


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict`` of full tensors: cut every per-parameter state tensor into the parameter's shard."""
    for param, state in optimizer.state.items():
        if not isinstance(param, DTensor):
            continue
        for key, value in state.items():
            if isinstance(value, Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
                state[key] = shard_like(value, param)


def rank_microbatches(
    group: Sequence[Any], batch: Any, owned: Tensor | None, geometry: Geometry | None = None
) -> list[tuple[int, Any, bool]]:
    """The micro-batches of one optimizer step this rank runs: ``(position in group, micro-batch, real)``.

    These are the parts of the planned micro-batches on this rank's rows
    (:func:`~flowrl.objectives.planning.owned_microbatch`; all of them on one process), in plan
    order. With ``geometry`` (a sharded model) they are followed by one-row placeholders
    (``real`` False; the trainer scales their loss by zero) up to the most micro-batches any rank
    runs in the step, so every rank makes as many forwards and backwards, each rank's real ones
    side by side with the others'.

    Args:
        group: the step's micro-batches (``objective.plan``).
        batch: the iteration's :class:`~flowrl.objectives.base.RolloutBatch`.
        owned: (B,) bool, this rank's rows; None = one process.
        geometry: the launch's geometry when the model is sharded (every rank's rows); None otherwise.
    """
    mine = [(i, m, True) for i, mb in enumerate(group) if (m := owned_microbatch(mb, batch, owned)) is not None]
    if geometry is None or not group:
        return mine
    masks = [replace(geometry, rank=r).owned_mask() for r in range(geometry.world_size)]
    calls = max(sum(owned_microbatch(mb, batch, mask) is not None for mb in group) for mask in masks)
    first = group[0]
    # zero noise of one row: the rank may hold none of ``first``'s rows, and the loss is scaled by zero
    noise = None if first.noise is None else first.noise.new_zeros((1, *first.noise.shape[1:]))
    index = first.index[:1] if batch.rows is None else held_row(batch, first.step)
    placeholder = first._replace(index=index, noise=noise)
    return mine + [(0, placeholder, False)] * (calls - len(mine))


def held_row(batch: Any, step: int) -> Tensor:
    """(1,) a row of a rank's own batch for a placeholder micro-batch at ``step``.

    Its first row; for a tree, its first parent node at ``step`` with a trained edge (else its first).
    """
    first = torch.zeros(1, dtype=torch.long)
    if batch.tree is None:
        return first
    trained = trained_parents(batch.tree, step).nonzero().squeeze(1)
    return trained[:1] if len(trained) else first


def placeholder_backward(
    objective: Any, model: Any, batch: Any, mb: Any, backward: Callable[[Tensor], None] = Tensor.backward
) -> None:
    """Run a placeholder micro-batch's loss and backward it scaled by zero, leaving no other trace.

    The backward takes part in the sharded model's reduce-scatter with an exactly zero gradient.
    The objective's attributes (e.g. SAGE-GRPO's summed KL of the step) and the model's ``nfe``
    are put back as they were, so placeholders change no statistic.

    Args:
        objective: the run's objective (``loss(model, batch, mb) -> (loss, stats)``).
        model: the policy's model (with ``nfe``).
        batch: the iteration's batch.
        mb: the placeholder micro-batch (:func:`rank_microbatches`, ``real`` False).
        backward: how a loss is backwarded (DeepSpeed: the engine's, :meth:`flowrl.zero.ZeroEngine.backward`).
    """
    saved, nfe = dict(vars(objective)), model.nfe
    loss, _ = objective.loss(model, batch, mb)
    backward(loss * 0.0)
    vars(objective).clear()
    vars(objective).update(saved)
    model.nfe = nfe


COLLECTIVE_CALLS = {"zero1": ("state",), "zero2": ("state",)}
"""Under ZeRO-1/2 only gathering the optimizer state is collective (the model is whole on every rank)."""


def collective_calls(sharding: str, calls: dict[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """The calls of :class:`Lockstep` that are collectives under ``sharding`` (all of them, but for ZeRO-1/2)."""
    names = COLLECTIVE_CALLS.get(sharding, tuple(calls))
    return {k: v for k, v in calls.items() if k in names}


class Lockstep:
    """Rank 0's model calls outside training (evaluation, grids, checkpoint gathers), made on every rank.

    Rank 0 runs the recipe (evaluates, logs, writes); before each call of a sharded model it
    :meth:`announce` s the call, and the other ranks, waiting in :meth:`meet`, make the same call
    with the same arguments (its result dropped). :meth:`meet` on rank 0 lets them go back to
    training. Every rank calls :meth:`meet` at the same points of the loop.

    Args:
        collective: the launch.
        calls: the calls that may be announced, by name (e.g. ``"sample"``: ``Trainer.sample``).
    """

    def __init__(self, collective: Collective, calls: dict[str, Callable[..., Any]]) -> None:
        self.collective, self.calls = collective, calls

    def announce(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Rank 0: tell the other ranks to make call ``name`` now (no-op on the other ranks and for unlisted calls)."""
        if self.collective.is_main and name in self.calls:
            self.collective.broadcast_object((name, args, kwargs))

    def meet(self) -> None:
        """Rank 0: release the other ranks; the others: make rank 0's announced calls until released."""
        if self.collective.is_main:
            self.collective.broadcast_object(None)
            return
        while (call := self.collective.broadcast_object(None)) is not None:
            name, args, kwargs = call
            self.calls[name](*args, **kwargs)
