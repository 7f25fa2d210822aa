"""True classifier-free guidance as an adapter wrapper, shared by rollouts and training.

:class:`GuidedAdapter` wraps any adapter whose ``guidance`` is ``"cfg"`` (SD3, Wan). Its
``velocity`` runs the unconditional (negative-prompt) and conditional branches in ONE batched
transformer call on ``[x; x]`` with ``[uncond; cond]`` conditioning ("CFG batching") and returns

    v = v_u + w (v_c - v_u)

The negative prompt's conditioning travels inside the :data:`~flowrl.models.adapter.Cond` dict
under ``"uncond."``-prefixed keys, so ``select_cond`` chunking, the stored rollout batch, every
objective's ``loss`` and the KL reference pass (LoRA switched off) all see the same guided
velocity without code changes: sampling and training use the same guidance, dtype, batch
geometry and sigmas, and the Flow-GRPO ratio is exactly 1 before the first update.

References:
    Ho & Salimans, "Classifier-Free Diffusion Guidance", 2022.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

import torch
from torch import Tensor

from ..models.adapter import GUIDANCE_KINDS, Cond, ModelAdapter, repeat_cond
from .wrapper import AdapterWrapper

UNCOND = "uncond."


def split_cond(cond: Cond) -> tuple[Cond, Cond]:
    """Split a conditioning dict into (conditional, unconditional) parts (prefix removed)."""
    pos = {k: v for k, v in cond.items() if not k.startswith(UNCOND)}
    neg = {k[len(UNCOND) :]: v for k, v in cond.items() if k.startswith(UNCOND)}
    return pos, neg


def with_uncond(cond: Cond, negative: Cond) -> Cond:
    """Attach negative-prompt conditioning (same keys, same batch size) under ``"uncond."`` keys.

    Raises:
        ValueError: the two dicts have different keys, batch sizes or per-sample shapes.
    """
    if set(cond) != set(negative):
        raise ValueError(f"negative conditioning keys {sorted(negative)} differ from the prompt's {sorted(cond)}")
    sizes = {v.shape[0] for v in (*cond.values(), *negative.values())}
    if len(sizes) != 1:
        raise ValueError(
            f"negative and prompt conditioning have different batch sizes {sorted(sizes)}; "
            "encode one negative per prompt"
        )
    for key, value in cond.items():
        if negative[key].shape[1:] != value.shape[1:]:
            raise ValueError(
                f"negative conditioning '{key}' has per-sample shape {tuple(negative[key].shape[1:])} "
                f"but the prompt's is {tuple(value.shape[1:])}; "
                "pad both to one fixed length (max_sequence_length) so [uncond; cond] batch together"
            )
    return {**cond, **{UNCOND + k: v for k, v in negative.items()}}


def encode_with_negative(encode: Callable[[list[str]], Cond], prompts: Sequence[str], negative: str | None) -> Cond:
    """Encode prompts and, when ``negative`` is not None, the negative prompt once (repeated to B).

    Args:
        encode: ``adapter.encode_prompt`` or ``PromptCache.encode`` (the cache path stores the
            negative prompt like any other prompt, so it is encoded once per run).
        prompts: B prompts.
        negative: the negative prompt ("" = empty prompt, as diffusers does), or None for no CFG.

    Returns:
        Conditioning for B samples, with ``"uncond."`` keys when ``negative`` is given.
    """
    cond = encode(list(prompts))
    if negative is None:
        return cond
    return with_uncond(cond, repeat_cond(encode([negative]), len(prompts)))


class GuidedAdapter(AdapterWrapper):
    """A model adapter with true CFG folded into ``velocity`` (and ``encode_prompt``).

    Args:
        model: an adapter with ``guidance == "cfg"``.
        scale: guidance weight w (1.0 means no guidance; :func:`apply_guidance` does not wrap then).
        negative_prompt: the unconditional prompt ("" by default, as in diffusers).

    Attributes:
        evaluations_per_sample: 2 (each sample runs the conditional and unconditional branch);
            :class:`~flowrl.policy.counting.CountingAdapter` counts NFE with it.

    Raises:
        ValueError: the adapter's ``guidance`` is not ``"cfg"``.
    """

    evaluations_per_sample = 2

    def __init__(self, model: ModelAdapter, scale: float, negative_prompt: str = ""):
        if model.guidance != "cfg":
            raise ValueError(f"{type(model).__name__} has guidance={model.guidance!r}; true CFG needs guidance='cfg'")
        super().__init__(model)
        self.scale = float(scale)
        self.negative_prompt = negative_prompt

    @property
    def model_id(self) -> str:
        """Identity for the prompt cache's fingerprint: the wrapped model plus the negative prompt.

        A :class:`~flowrl.prompts.cache.PromptCache` over a guided adapter stores each prompt with
        its ``"uncond."`` tensors, so a cache folder is never reused for another negative prompt.
        """
        digest = hashlib.sha256(self.negative_prompt.encode("utf-8")).hexdigest()[:16]
        return f"{self._model.model_id}|negative:{digest}"

    def encode_prompt(self, prompts: Sequence[str]) -> Cond:
        """Prompt conditioning plus the negative prompt's under ``"uncond."`` keys (B each).

        The B prompts go through the wrapped adapter's ``encode_prompt`` in one batched call and
        the negative prompt in one more (encoded once, repeated to B).
        """
        return encode_with_negative(self._model.encode_prompt, prompts, self.negative_prompt)

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """Guided velocity ``v_u + w (v_c - v_u)`` from one batched call on (2B, ...), at least fp32.

        Args:
            x: (B, ...) latents.
            sigma: (B,) noise levels.
            cond: conditioning with ``"uncond."`` keys (from :meth:`encode_prompt` or
                :func:`encode_with_negative`).

        Raises:
            ValueError: the conditioning carries no negative prompt.
        """
        pos, neg = split_cond(cond)
        if not neg:
            raise ValueError(
                "guided velocity needs negative-prompt conditioning ('uncond.' keys); "
                "encode with GuidedAdapter.encode_prompt"
            )
        both = {k: torch.cat([neg[k], pos[k]]) for k in pos}
        v = self._model.velocity(torch.cat([x, x]), torch.cat([sigma, sigma]), both)
        v_u, v_c = v.to(torch.promote_types(v.dtype, torch.float32)).chunk(2)  # half -> fp32; fp64 stays
        return self._model.combine_cfg(v_u, v_c, self.scale)  # the model's own rule (Qwen-Image: norm rescale)


def apply_guidance(model: ModelAdapter, scale: float, negative_prompt: str = "") -> ModelAdapter:
    """Wrap ``model`` for true CFG when it uses it and ``scale != 1``; otherwise return it unchanged.

    ``scale == 1`` is the "no-CFG" mode of the fast recipes: one conditional pass, bit-identical to
    an unwrapped adapter. Distilled guidance (FLUX.1-dev) lives inside the adapter
    (``model.distilled_guidance``), so its ``sampler.guidance_scale`` must stay 1.

    Raises:
        ValueError: ``scale != 1`` for an adapter without true CFG, or an unknown guidance kind.
    """
    kind = model.guidance
    if kind not in GUIDANCE_KINDS:
        raise ValueError(f"{type(model).__name__}.guidance must be one of {GUIDANCE_KINDS}; got {kind!r}")
    if scale == 1.0:
        return model
    if kind == "distilled":
        raise ValueError(
            f"sampler.guidance_scale={scale} asks for true CFG but {type(model).__name__} uses distilled guidance; "
            "set model.distilled_guidance instead and keep sampler.guidance_scale=1.0"
        )
    if kind == "none":
        raise ValueError(
            f"sampler.guidance_scale={scale} but {type(model).__name__} has no guidance; set sampler.guidance_scale=1.0"
        )
    return GuidedAdapter(model, scale, negative_prompt)
