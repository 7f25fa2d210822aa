"""One way to build a policy: the adapter stack, its LoRA and the output geometry, for training and sampling alike.

The stack is always ``CountingAdapter(MemoryAdapter(GuidedAdapter(adapter)))``, with the
:class:`~flowrl.policy.guidance.GuidedAdapter` layer only under true CFG
(``sampler.guidance_scale != 1``). ``flowrl train`` and ``flowrl sample`` build it here, so a
sampled grid uses exactly the guidance, memory settings and sigma grid training used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor, nn

from ..models import load_adapter
from ..models.adapter import ModelAdapter, model_latent_shape, output_resolution
from ..models.pipeline_schedule import run_sigmas
from .counting import CountingAdapter
from .guidance import apply_guidance
from .lora import add_lora, check_lora_targets, load_saved_lora
from .memory import apply_memory_settings, check_trainable_precision
from .wrapper import AdapterWrapper

if TYPE_CHECKING:
    from ..config import Config


@dataclass
class Policy:
    """The sampling/training policy: the adapter stack, its LoRA parameters, the output geometry.

    Attributes:
        model: ``CountingAdapter(MemoryAdapter(GuidedAdapter(adapter)))``; the ``GuidedAdapter``
            layer only when true CFG is on.
        params: the trainable LoRA parameters (fp32; ``[]`` when not trainable).
        resolution: (height, width) of the outputs (``model.resolution``, else the model's default).
        latent_shape: latent shape without batch, (C, h, w) or (C, F, h, w) for videos.
        schedule: ``sampler.schedule``, the kind of sigma grid :meth:`sigmas` builds.
        shift: ``sampler.shift`` (for the "shift" schedule).
    """

    model: CountingAdapter
    params: list[nn.Parameter]
    resolution: tuple[int, int]
    latent_shape: tuple[int, ...]
    schedule: str
    shift: float

    def sigmas(self, num_steps: int) -> Tensor:
        """The run's (num_steps + 1,) float64 sigma grid, from 1 down to 0.

        Raises:
            ValueError: ``sampler.schedule: model`` for a model without a grid of its own.
        """
        return run_sigmas(
            self.model, self.schedule, num_steps, shift=self.shift, resolution=self.resolution, latent=self.latent_shape
        )


def build_policy(
    cfg: Config,
    *,
    model: ModelAdapter | None = None,
    lora: str | Path | None = None,
    trainable: bool = False,
    counter: type[CountingAdapter] = CountingAdapter,
) -> Policy:
    """Load (or take) a model adapter and wrap it into the policy ``cfg`` describes.

    Order: load -> saved LoRA (``lora``) -> true CFG (``sampler.guidance_scale``,
    ``prompts.negative``) -> memory settings (``memory``: attention backend, gradient
    checkpointing, VAE tiling, offload, autocast) -> ``counter`` -> trainable LoRA on
    ``model.transformer`` (``lora.rank``, ``lora.alpha``, ``lora.targets``). The trainable LoRA
    comes last, as it always has: its Gaussian init draws from torch's global RNG.

    Args:
        cfg: a validated run config.
        model: a bare adapter; None loads ``model.path`` with ``model.dtype``, ``model.device``
            and ``model.distilled_guidance``.
        lora: a trained LoRA to load into the pipeline: a run folder, its ``lora/`` folder or a
            ``pytorch_lora_weights.safetensors`` file.
        trainable: attach a fresh trainable LoRA (training); ``Policy.params`` holds its parameters.
        counter: the NFE-counting class wrapping the stack (a :class:`CountingAdapter` subclass).

    Returns:
        The :class:`Policy`.

    Raises:
        FileNotFoundError: no LoRA at ``lora``, or the model's weights are missing.
        TypeError: ``model`` is already wrapped (pass the bare adapter).
        ValueError: ``lora`` together with ``trainable``, training in fp16 (``model.dtype``, ``memory.autocast``),
            or a setting the model cannot honour (guidance kind, memory settings, resolution; one line with the fix).
    """
    if isinstance(model, AdapterWrapper):
        raise TypeError(
            f"build_policy takes a bare model adapter; got a {type(model).__name__} (it wraps the adapter itself)"
        )
    if lora is not None and trainable:
        raise ValueError(
            "build_policy: a saved LoRA (lora=...) and a fresh trainable LoRA (trainable=True) can't be combined"
        )
    if trainable:
        dtype = cfg.model.dtype if model is None else str(model.dtype).removeprefix("torch.")
        check_trainable_precision(dtype, cfg.memory.autocast)
    if model is None:
        m = cfg.model
        model = load_adapter(m.path, dtype=m.dtype, device=m.device, distilled_guidance=m.distilled_guidance)
    if lora is not None:
        load_saved_lora(model, lora)
    guided = apply_guidance(model, cfg.sampler.guidance_scale, cfg.prompts.negative)  # unchanged when the scale is 1
    stack = counter(apply_memory_settings(guided, cfg.memory))
    resolution = output_resolution(cfg.model.resolution, stack)
    latent = model_latent_shape(stack, resolution, cfg.model.num_frames)
    params = _trainable_lora(stack, cfg) if trainable else []
    return Policy(stack, params, resolution, latent, cfg.sampler.schedule, cfg.sampler.shift)


def _trainable_lora(model: ModelAdapter, cfg: Config) -> list[nn.Parameter]:
    """Attach the configured LoRA to ``model.transformer``; its parameters (fp32, requires_grad).

    Raises:
        ValueError: a ``lora.targets`` entry that names no module of the denoiser.
    """
    if cfg.lora.targets:
        check_lora_targets(model.transformer, cfg.lora.targets)
    targets = cfg.lora.targets or list(model.lora_target_modules)
    return add_lora(model.transformer, rank=cfg.lora.rank, alpha=cfg.lora.alpha, targets=targets)
