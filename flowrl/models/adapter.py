"""The model-adapter contract every model family implements (SD3, FLUX, Wan, the embedded model).

A trainer, sampler or reward never touches a diffusers pipeline directly: it calls these
methods, so every algorithm runs on every model.

Conditioning for true classifier-free guidance rides in the same :data:`Cond` dict: the negative
prompt's tensors are stored under keys prefixed ``"uncond."`` (see :mod:`flowrl.policy.guidance`), so
:func:`select_cond` / :func:`repeat_cond` slice them with everything else and no objective needs
to know whether guidance is on.
"""

from __future__ import annotations

import functools
import gc
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor, nn

from ..samplers.cfg import cfg

Cond = dict[str, Tensor]
"""Prompt conditioning: a dict of batch-first tensors, e.g. SD3's
``{"encoder_hidden_states": (B, L, D), "pooled_projections": (B, P)}``; with true CFG also
``"uncond.encoder_hidden_states"`` etc. for the negative prompt."""

GUIDANCE_KINDS = ("cfg", "distilled", "none")


@runtime_checkable
class ModelAdapter(Protocol):
    """What flowrl needs from a text-to-image (or text-to-video) flow model: the whole contract.

    Every member below is used by library code on a bare adapter or on the policy stack
    (``CountingAdapter(MemoryAdapter(GuidedAdapter(adapter)))``, :mod:`flowrl.policy`), whose
    wrappers define each member explicitly. The built-in adapters inherit honest defaults for the
    optional ones from :class:`AdapterBase`.

    Attributes:
        transformer: the denoiser module LoRA is attached to (for a two-expert model such as
            Wan2.2-A14B: the trained expert, or ``WanExperts`` holding both).
        lora_target_modules: default LoRA target module names for this family.
        dtype: the dtype the model weights run in (log-probs and SDE means stay fp32 regardless).
        device: where the denoiser runs (inputs are moved there; the RNG stays on the CPU).
        default_resolution: (height, width) used when a config does not say.
        guidance: how the model is guided. ``"cfg"``: true classifier-free guidance, an
            unconditional (negative-prompt) pass combined with :meth:`combine_cfg`; the policy
            wraps the adapter in :class:`flowrl.policy.guidance.GuidedAdapter` when
            ``sampler.guidance_scale != 1`` (SD3, Wan, Qwen-Image). ``"distilled"``: the guidance
            scale is an input of the network (FLUX.1-dev's guidance embedding), handled inside the
            adapter's ``velocity``; flowrl never adds an unconditional pass. ``"none"``: no guidance.
        model_id: name of the model (folder or hub id) in messages and the prompt cache's fingerprint.
        pipe: the diffusers pipeline the parts come from (text encoders, VAE, LoRA loading).
        max_sequence_length: text tokens per prompt the encoders produce.
        default_num_frames: frames per video when ``model.num_frames`` is null; None for image
            models (this is what :func:`is_video` tests).
        evaluations_per_sample: network evaluations one ``velocity`` call costs per sample (1; 2
            under true CFG), counted by :class:`flowrl.policy.counting.CountingAdapter`.
    """

    transformer: nn.Module
    lora_target_modules: tuple[str, ...]
    dtype: torch.dtype
    default_resolution: tuple[int, int]
    guidance: str
    model_id: str
    pipe: Any
    max_sequence_length: int
    default_num_frames: int | None
    evaluations_per_sample: int

    @property
    def device(self) -> torch.device:
        """Where the denoiser runs."""

    def encode_prompt(self, prompts: Sequence[str]) -> Cond:
        """Encode B prompts in one batched call to conditioning tensors (no gradient).

        A negative prompt is encoded by the same method (it is just another prompt).
        """

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """Predict ``v = eps - x0`` for latents x (B, C, H, W) or video latents (B, C, F, H, W).

        ``sigma`` is (B,) in [0, 1]; the adapter converts it to its model's timestep convention.
        """

    def decode(self, latents: Tensor) -> Tensor:
        """Decode latents to float32 in [0, 1]: images (B, 3, H, W) or videos (B, F, 3, H, W)."""

    def decoder(self) -> Callable[[Tensor], Tensor]:
        """``decode`` as a picklable callable holding only the VAE.

        E.g. ``functools.partial(decode_scaled, vae)``; ``train.rewards_async: process`` sends it to
        the scoring process.
        """

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """Latent shape (without batch) for an output resolution.

        (C, H_lat, W_lat) for images, (C, F_lat, H_lat, W_lat) for videos (``frames`` None =
        ``default_num_frames``; image adapters reject a frame count).
        """

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor | None:
        """The (num_steps + 1,) float64 sigma grid the model's own pipeline uses at this resolution.

        Used by ``sampler.schedule: model``; None when the model has no schedule of its own.
        """

    def combine_cfg(self, v_uncond: Tensor, v_cond: Tensor, scale: float) -> Tensor:
        """Combine the unconditional and conditional velocities (B, ...) of true CFG.

        Plain :func:`flowrl.samplers.cfg` by default; Qwen-Image rescales norms.
        """

    def save_lora(self, directory: str | Path, lora_state: dict[str, Tensor]) -> Path:
        """Write a LoRA state dict in the layout the family's diffusers pipeline reads; returns the main file.

        The state dict is ``flowrl.policy.lora.lora_state_dict(transformer)``; the pipeline reads the
        written files with ``pipe.load_lora_weights``.
        """

    def load_lora(self, path: str | Path) -> None:
        """Load a LoRA written by :meth:`save_lora` into the pipeline's denoiser(s).

        ``path`` is the folder :meth:`save_lora` wrote, or a ``.safetensors`` file.
        """

    def free_text_encoders(self) -> int:
        """Drop the text encoders from the pipeline (once every prompt is cached).

        Returns:
            The number of parameters released.
        """


def module_device(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter: where a module flowrl places whole runs.

    diffusers' ``ModelMixin.device`` also walks every submodule for group-offloading hooks (about
    1 ms on the embedded denoiser, a dozen times per iteration); flowrl never installs those hooks,
    it moves whole modules (:mod:`flowrl.policy.memory`), so the first parameter says it.
    """
    return next(module.parameters()).device


def text_encoders(pipe: Any) -> dict[str, nn.Module]:
    """The pipeline's text encoders by component name (``text_encoder``, ``text_encoder_2``, ...)."""
    return {k: v for k, v in pipe.components.items() if k.startswith("text_encoder") and isinstance(v, nn.Module)}


class AdapterBase:
    """Defaults shared by the built-in pipeline adapters (SD3, FLUX, Qwen-Image, Wan).

    ``__init__`` takes the parts every pipeline has (``pipe``, ``transformer``, ``vae``, ``dtype``)
    and the two names (Wan sets them itself: its ``transformer`` may hold both experts); a subclass
    also sets ``default_resolution``, ``lora_target_modules``, ``guidance`` and ``decode_latents``,
    and defines ``encode_prompt``, ``velocity``, ``latent_shape`` and ``save_lora``. ``decode`` and
    ``decoder`` run ``decode_latents``. The class attributes and methods here are the defaults of
    the optional members of :class:`ModelAdapter`: an image model, one evaluation per sample, plain
    CFG, no sigma grid of its own, LoRA loaded by ``pipe.load_lora_weights``.

    Args:
        pipe: the loaded diffusers pipeline.
        max_sequence_length: text tokens per prompt the encoders produce.
        model_id: name used in the prompt cache's fingerprint and messages.
    """

    pipe: Any
    transformer: nn.Module
    vae: Any
    decode_latents: Callable[[Any, Tensor], Tensor]
    """``decode_latents(vae, latents)``: the family's module-level decode function (a staticmethod),
    e.g. :func:`~flowrl.models.sd3.decode_scaled`; module-level so that :meth:`decoder` pickles."""
    default_num_frames: int | None = None
    evaluations_per_sample: int = 1
    combine_cfg = staticmethod(cfg)

    def __init__(self, pipe: Any, *, max_sequence_length: int, model_id: str):
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.vae = pipe.vae
        self.model_id = model_id
        self.max_sequence_length = max_sequence_length
        self.dtype = self.transformer.dtype

    @property
    def device(self) -> torch.device:
        """Where the denoiser runs."""
        return module_device(self.transformer)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Latents -> float32 images (B, 3, H, W) or videos (B, F, 3, H, W) in [0, 1], by ``decode_latents``."""
        return self.decode_latents(self.vae, latents)

    def decoder(self) -> Callable[[Tensor], Tensor]:
        """``decode`` as a picklable callable holding only the VAE (for a scoring process)."""
        return functools.partial(self.decode_latents, self.vae)

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor | None:
        """None: no sigma grid of its own (FLUX and Qwen-Image override this)."""
        return None

    def load_lora(self, path: str | Path) -> None:
        """``pipe.load_lora_weights(path)``: a folder holding ``pytorch_lora_weights.safetensors`` or the file."""
        self.pipe.load_lora_weights(str(path))

    def free_text_encoders(self) -> int:
        """Set every text encoder of the pipeline to None and release its memory.

        Returns:
            The number of encoder parameters released.
        """
        released = 0
        for name, encoder in text_encoders(self.pipe).items():
            released += sum(p.numel() for p in encoder.parameters())
            setattr(self.pipe, name, None)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return released

    def _image_only(self, frames: int | None) -> None:
        """Reject a frame count in an image adapter's ``latent_shape``."""
        if frames is not None:
            raise ValueError(f"{type(self).__name__} is an image model; got frames={frames} (remove model.num_frames)")


def lora_metadata(transformer: nn.Module) -> dict[str, Any]:
    """The trained adapter's peft config (rank, alpha, targets) as JSON-ready safetensors metadata.

    Sets become sorted lists. Saved with the weights, it lets diffusers restore the same ``alpha / r`` scale.
    """
    config = transformer.peft_config["default"].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def save_transformer_lora(
    pipeline_class: Any, directory: str | Path, transformer: nn.Module, lora_state: dict[str, Tensor]
) -> Path:
    """Write a denoiser LoRA with ``pipeline_class.save_lora_weights``, its peft config in the metadata.

    Args:
        pipeline_class: the diffusers pipeline class whose ``load_lora_weights(directory)`` reads it back.
        directory: the output folder.
        transformer: the denoiser the LoRA was trained on (for its peft config).
        lora_state: ``flowrl.policy.lora.lora_state_dict(transformer)``.

    Returns:
        The written ``pytorch_lora_weights.safetensors``.
    """
    pipeline_class.save_lora_weights(
        str(directory), transformer_lora_layers=lora_state, transformer_lora_adapter_metadata=lora_metadata(transformer)
    )
    return Path(directory) / "pytorch_lora_weights.safetensors"


def is_video(model: ModelAdapter) -> bool:
    """Whether an adapter produces videos (its ``default_num_frames`` is set)."""
    return model.default_num_frames is not None


def output_resolution(resolution: int | Sequence[int] | None, model: ModelAdapter) -> tuple[int, int]:
    """(height, width) from ``model.resolution``: an int (square), [height, width], or None (model default).

    Raises:
        ValueError: anything else (one line naming the key and the allowed forms).
    """
    if resolution is None:
        return tuple(model.default_resolution)
    if isinstance(resolution, int) and not isinstance(resolution, bool) and resolution > 0:
        return (resolution, resolution)
    if (
        isinstance(resolution, (list, tuple))
        and len(resolution) == 2
        and all(isinstance(r, int) and r > 0 for r in resolution)
    ):
        return (int(resolution[0]), int(resolution[1]))
    raise ValueError(f"model.resolution must be a positive int (square) or [height, width]; got {resolution!r}")


def model_latent_shape(model: ModelAdapter, resolution: tuple[int, int], frames: int | None = None) -> tuple[int, ...]:
    """Latent shape for a resolution and (video models only) a frame count.

    Args:
        model: the adapter.
        resolution: (height, width).
        frames: ``model.num_frames``; None = the video model's default (ignored by image models).

    Raises:
        ValueError: a frame count given for an image model.
    """
    if is_video(model):
        return tuple(model.latent_shape(*resolution, frames=frames))
    if frames is not None:
        raise ValueError(
            f"model.num_frames={frames} is set but {type(model).__name__} is an image model; remove model.num_frames"
        )
    return tuple(model.latent_shape(*resolution))


def freeze_modules(*modules: nn.Module | None) -> None:
    """Put the frozen parts of a pipeline (denoiser, VAE, text encoders) in eval mode without gradients.

    ``None`` entries (absent optional encoders) are skipped. LoRA adds trainable parameters afterwards.
    """
    for module in modules:
        if module is not None:
            module.requires_grad_(False)
            module.eval()


def select_cond(cond: Cond, index: Tensor | slice) -> Cond:
    """Index every tensor of a conditioning dict along the batch dimension."""
    return {key: value[index] for key, value in cond.items()}


def repeat_cond(cond: Cond, repeats: int) -> Cond:
    """Repeat each row ``repeats`` times consecutively: (B, ...) -> (B * repeats, ...)."""
    return {key: value.repeat_interleave(repeats, dim=0) for key, value in cond.items()}
