"""DeepSpeed ZeRO-1/2/3 (``train.sharding: zero1 | zero2 | zero3``): the engine owns the LoRA's update.

Under ZeRO-1 each rank keeps the whole denoiser and the whole gradients (all-reduced) but only
``1/W`` of the trainable LoRA's fp32 master weights and AdamW moments. Under ZeRO-2 each rank keeps
the whole denoiser but only ``1/W`` of the LoRA's fp32 master weights, AdamW moments and reduced
gradients; under ZeRO-3 every parameter is partitioned too, the frozen base and the objective's
frozen adapters included (what a 12B FLUX needs). The trainer's backward, global clip and AdamW
step go through the :class:`ZeroEngine`:

- every micro-batch's loss goes through ``engine.backward`` (``managed_gradient_accumulation``
  off: flowrl's plan decides how many micro-batches make a step; each backward reduce-scatters
  its gradients, a collective, so ranks pad with placeholders as under FSDP2);
- ``engine.step`` clips to ``optim.max_grad_norm`` over the global gradient and runs the torch
  AdamW (the client optimizer, ``zero_allow_untested_optimizer``) on each rank's flat partition;
- a step whose gradient norm or new weights are bad is undone from a snapshot of the partitions
  and moments, as :class:`flowrl.guards.StepSnapshot` does on one process.

DeepSpeed averages gradients over the ranks; flowrl's losses are already divided by the global
number of micro-batches and summed, so each loss is multiplied by ``W`` first (exact for powers
of two). Checkpoints hold the one-process files: full LoRA tensors and a torch AdamW state dict
of full moments (:meth:`ZeroEngine.optimizer_state`); resume cuts them back into the partitions.

On CPU processes (gloo) flowrl calls ``deepspeed.initialize`` itself; on an accelerate DeepSpeed
launch with GPUs the engine comes from ``accelerator.prepare`` with the plugin's config (stage,
offload) and flowrl's micro-batch, clipping and accumulation settings.

References:
    Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
    SC 2020; DeepSpeed (``deepspeed.initialize``, ``deepspeed.utils.safe_get_full_optimizer_state``).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from .distributed import Collective, agree_fault, skip_inference_comm_build
from .guards import tensor_fault, weight_fault

ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
"""``train.sharding`` values run by DeepSpeed, and their ZeRO stage."""

MOMENTS = ("exp_avg", "exp_avg_sq")


def require_deepspeed() -> Any:
    """``import deepspeed``, or one line naming the install.

    Raises:
        ValueError: deepspeed is not installed.
    """
    try:
        import deepspeed
    except ImportError:
        raise ValueError(
            "train.sharding=zero1/zero2/zero3 needs DeepSpeed; pip install 'flowrl[deepspeed]' "
            "(or set train.sharding=fsdp2)"
        ) from None
    return deepspeed


def zero_config(stage: int, max_grad_norm: float, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config of a flowrl run: ``base`` (a launcher's, or empty) with flowrl's own settings.

    Args:
        stage: ZeRO stage, 1, 2 or 3.
        max_grad_norm: ``optim.max_grad_norm`` (DeepSpeed's ``gradient_clipping``).
        base: the accelerate plugin's config (offload settings kept), or None.

    Returns:
        A new config dict (``base`` is not modified).

    Raises:
        ValueError: the launcher config turns on DeepSpeed's fp16 / bf16 engine (not wired).
    """
    cfg = dict(base or {})
    for half in ("fp16", "bf16"):
        if cfg.get(half, {}).get("enabled") in (True, "true", "auto"):
            raise ValueError(
                f"train.sharding=zero{stage} keeps the LoRA and its AdamW in fp32 and does not wire DeepSpeed's {half} "
                "engine; set mixed_precision: 'no' in the launcher config (memory.autocast=bf16 for bf16 compute)"
            )
    zero = {**cfg.get("zero_optimization", {}), "stage": stage}
    if stage == 3:  # partition every parameter, the small LoRA matrices too (gathered with their module)
        zero["stage3_param_persistence_threshold"] = 0
        # DeepSpeed's own linear replaces torch.nn.functional.linear in the whole process (text encoders and
        # rewards too) and rounds differently (measured); off unless the launcher config turns it on
        zero.setdefault("memory_efficient_linear", False)
    cfg.update(
        zero_optimization=zero,
        train_micro_batch_size_per_gpu=1,  # flowrl feeds its own micro-batches; DeepSpeed never sees a dataloader
        gradient_accumulation_steps=1,
        managed_gradient_accumulation=False,  # every engine.step() is the boundary: the plan decides
        gradient_clipping=max_grad_norm,
        zero_allow_untested_optimizer=True,  # the client optimizer is torch's AdamW
        steps_per_print=2**62,
    )
    cfg.setdefault("fp16", {"enabled": False})
    cfg.setdefault("bf16", {"enabled": False})
    return cfg


def is_partitioned(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are ZeRO-3 partitions (a forward then gathers them: a collective)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def gathered(params: Sequence[nn.Parameter], modify: bool = False) -> contextlib.AbstractContextManager[Any]:
    """ZeRO-3 partitions gathered into full parameters for the block (collective); a no-op otherwise.

    Args:
        params: parameters, some or all of them ZeRO-3 partitions.
        modify: write the (identical on every rank) values back into the partitions on exit.
    """
    parts = [p for p in params if hasattr(p, "ds_id")]
    if not parts:
        return contextlib.nullcontext()
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    return GatheredParameters(parts, modifier_rank=0 if modify else None)


@contextlib.contextmanager
def adapters_gathered(transformer: nn.Module, modify: bool = False) -> Iterator[None]:
    """Every LoRA parameter of ``transformer`` (all adapters) whole for the block: soft updates, loads, saves."""
    params = [p for n, p in transformer.named_parameters() if "lora_" in n]
    with gathered(params, modify):
        yield


class ZeroEngine:
    """The DeepSpeed engine of a run: backward, clipped AdamW step, full-tensor optimizer state.

    Args:
        engine: the ``DeepSpeedEngine`` wrapping the denoiser.
        params: the trainable LoRA parameters (the trainer's order: the optimizer state's indices).
        collective: the launch.
    """

    def __init__(self, engine: Any, params: Sequence[nn.Parameter], collective: Collective) -> None:
        self.engine, self.params, self.collective = engine, list(params), collective
        self.stage = int(engine.zero_optimization_stage())
        self.inner: torch.optim.Optimizer = engine.optimizer.optimizer  # torch AdamW over the flat partitions

    @classmethod
    def start(
        cls, transformer: nn.Module, optimizer: torch.optim.Optimizer, stage: int, max_grad_norm: float,
        collective: Collective,
    ) -> ZeroEngine:  # fmt: skip
        """Hand ``transformer`` and its AdamW to DeepSpeed (``deepspeed.initialize``, or ``accelerator.prepare``).

        Args:
            transformer: the denoiser with every adapter the objective attached.
            optimizer: torch AdamW over the trainable LoRA parameters.
            stage: ZeRO stage, 1, 2 or 3.
            max_grad_norm: ``optim.max_grad_norm``.
            collective: the launch (several processes).
        """
        deepspeed = require_deepspeed()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        plugin = collective.deepspeed_plugin
        if plugin is not None:  # accelerate's DeepSpeed launch (GPUs; not run yet: no GPU in this work)
            config = zero_config(stage, max_grad_norm, plugin.deepspeed_config)
            plugin.deepspeed_config.clear()  # in place: the plugin's HfDeepSpeedConfig holds the same dict
            plugin.deepspeed_config.update(config)
            engine, _ = collective.accelerator.prepare(transformer, optimizer)
        else:  # CPU processes on gloo: the process group accelerate already set up
            skip_inference_comm_build()
            engine, *_ = deepspeed.initialize(
                model=transformer, optimizer=optimizer, config=zero_config(stage, max_grad_norm),
                dist_init_required=False,
            )  # fmt: skip
        zero = cls(engine, params, collective)
        local, full = zero.local_numel(transformer)
        print(
            f"flowrl: zero{stage}: rank {collective.rank} of {collective.world_size} holds {local} of {full} denoiser "
            f"parameters ({100 * local / full:.1f} %) and 1/{collective.world_size} of the LoRA's AdamW state",
            file=sys.stderr,
        )
        return zero

    @staticmethod
    def local_numel(module: nn.Module) -> tuple[int, int]:
        """(parameter elements this rank holds, elements of the full parameters) of ``module``."""
        params = list(module.parameters())
        local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
        return local, sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params)

    def backward(self, loss: Tensor) -> None:
        """Backward one micro-batch's loss (already divided by the step's global micro-batch count).

        DeepSpeed averages the reduced gradients over the ranks; flowrl sums them, hence ``x W``.
        flowrl calls the denoiser itself, not through ``engine.forward``, which is where DeepSpeed
        counts a finished micro-batch; without that count ZeRO-3 overwrites the gradient partitions
        with each backward instead of adding to them (measured), so it is counted here.
        """
        self.engine.backward(loss * self.collective.world_size)
        self.engine.optimizer.clear_backward_seen_flag()

    def discard(self) -> None:
        """Drop the gradients accumulated for a step that will not be taken (collective: every rank calls it).

        ZeRO-1/2 keep the reduced gradients outside ``.grad`` until their step consumes them, so
        clearing ``.grad`` would leave them to be added to the next step's. DeepSpeed's own step
        consumes them here, and is undone exactly (:meth:`_snapshot`): nothing it wrote stays.
        """
        self.ensure_state()
        restore = self._snapshot()
        self.engine.step()
        restore()
        self.engine.optimizer.zero_grad(set_to_none=True)

    def step(self, max_lora_weight: float) -> tuple[Tensor, str | None]:
        """Clip to ``optim.max_grad_norm`` and step; undo it when the gradient norm or the new weights are bad.

        Returns:
            (the global gradient norm before clipping, the fault or None), the same on every rank.
        """
        self.ensure_state()
        restore = self._snapshot()
        self.engine.step()
        grad_norm = torch.tensor(float(self.engine.get_global_grad_norm()))
        fault = tensor_fault("the gradient norm", grad_norm) or weight_fault(self._local_weights(), max_lora_weight)
        fault = agree_fault(self.collective, fault)  # ZeRO-3: each rank checked its partition
        if fault is not None:
            restore()
        return grad_norm, fault

    def _snapshot(self) -> Callable[[], None]:
        """Copies of what a step changes (master partitions, moments, this rank's LoRA weights); returns the undo.

        The undo writes in place: DeepSpeed's per-parameter views into the flat moments stay valid
        (``optimizer.load_state_dict``, what :class:`flowrl.guards.StepSnapshot` uses, would replace them).
        """
        masters = self._masters()
        live = masters + self._local_weights()
        live += [v for flat in masters for v in self.inner.state[flat].values() if isinstance(v, Tensor)]
        saved = [t.detach().clone() for t in live]

        @torch.no_grad()
        def restore() -> None:
            for t, s in zip(live, saved):
                t.copy_(s)

        return restore

    def _masters(self) -> list[Tensor]:
        """The flat fp32 master partitions the inner AdamW updates (ZeRO-3 lists them in its groups only in a step)."""
        opt = self.engine.optimizer
        return list(opt.fp32_partitioned_groups_flat if self.stage == 3 else opt.single_partition_of_fp32_groups)

    def _local_weights(self) -> list[Tensor]:
        return [p.ds_tensor if hasattr(p, "ds_tensor") else p for p in self.params]

    def ensure_state(self) -> None:
        """Create the AdamW state of the flat partitions the way torch does on its first step (zeros, step 0).

        DeepSpeed links each parameter to its slice of the moments only once they exist; a run
        that resumes before its first step needs them to load the checkpoint's moments.
        """
        created = False
        for flat in self._masters():
            if not self.inner.state[flat]:
                self.inner.state[flat] = {
                    "step": torch.tensor(0.0),
                    **{k: torch.zeros_like(flat, memory_format=torch.preserve_format) for k in MOMENTS},
                }
                created = True
        if created and self.stage in (1, 2):
            self.engine.optimizer._lazy_init_hp_params_optimizer_state()

    def optimizer_state(self) -> dict[str, Any]:
        """The torch AdamW state dict a one-process run writes: full moments per LoRA parameter (collective)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        self.ensure_state()
        group = self.inner.param_groups[0]
        step = self.inner.state[self._masters()[0]]["step"]
        state = {}
        for i, p in enumerate(self.params):
            moments = {k: safe_get_full_optimizer_state(p, k).detach().cpu().clone() for k in MOMENTS}
            state[i] = {"step": step.detach().cpu().clone(), **moments}
        hyper = {k: v for k, v in group.items() if k != "params"}
        return {"state": state, "param_groups": [{**hyper, "params": list(range(len(self.params)))}]}

    @torch.no_grad()
    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Load a one-process AdamW state dict: moments and step into the partitions, masters from the LoRA.

        Call after the LoRA weights are loaded into the module (:func:`flowrl.sharding.load_lora_shards`).

        Raises:
            ValueError: the state is for another number of LoRA parameters (a checkpoint from another config).
        """
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        entries = state["state"]
        if len(entries) not in (0, len(self.params)):
            raise ValueError(
                f"optimizer state holds {len(entries)} parameters and this run trains {len(self.params)}; use the "
                "same lora.rank/targets as the run that wrote the checkpoint"
            )
        self.ensure_state()
        with gathered(self.params):
            weights = [p.detach().clone() for p in self.params]
        for i, (p, weight) in enumerate(zip(self.params, weights)):
            safe_set_full_fp32_param(p, weight)
            for key in MOMENTS:
                if i in entries:
                    safe_set_full_optimizer_state(p, entries[i][key].to(weight), key)
        steps = [float(entries[i]["step"]) for i in entries]
        for group, saved in zip(self.inner.param_groups, state["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for flat in self._masters():
            self.inner.state[flat]["step"] = torch.tensor(steps[0] if steps else 0.0)
