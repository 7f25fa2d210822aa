"""Both experts of a two-expert Wan2.2 model as one module, so one LoRA adapter spans them.

flowrl's LoRA helpers (``flowrl.policy.lora``: ``add_lora``, ``adapters_disabled``, ``use_adapter``,
``add_frozen_copy``, ``lora_state_dict``) act on one module. :class:`WanExperts` holds the
high-noise expert (``transformer``) under ``high.`` and the low-noise expert (``transformer_2``)
under ``low.`` and gets diffusers' peft methods from ``PeftAdapterMixin``, so ``add_adapter``
injects the same LoRA config into both experts and every adapter switch applies to both. The
experts themselves are still called directly (``WanAdapter.velocity`` picks one by sigma).
"""

from __future__ import annotations

import torch
from diffusers.loaders.peft import PeftAdapterMixin
from torch import Tensor, nn

PREFIXES = {"high": "high.", "low": "low."}


class WanExperts(nn.Module, PeftAdapterMixin):
    """Container of the two Wan2.2 experts for joint LoRA training.

    Args:
        high: the high-noise expert (``WanPipeline.transformer``).
        low: the low-noise expert (``WanPipeline.transformer_2``).
    """

    _supports_gradient_checkpointing = True

    def __init__(self, high: nn.Module, low: nn.Module):
        super().__init__()
        self.high = high
        self.low = low

    @property
    def config(self):
        """The high-noise expert's config (both experts share the architecture)."""
        return self.high.config

    @property
    def dtype(self) -> torch.dtype:
        """The high-noise expert's parameter dtype."""
        return self.high.dtype

    @property
    def device(self) -> torch.device:
        """The high-noise expert's device."""
        return self.high.device

    def enable_gradient_checkpointing(self) -> None:
        """Activation checkpointing in both experts."""
        self.high.enable_gradient_checkpointing()
        self.low.enable_gradient_checkpointing()

    def set_attention_backend(self, backend: str) -> None:
        """Select diffusers' attention backend in both experts."""
        self.high.set_attention_backend(backend)
        self.low.set_attention_backend(backend)

    def forward(self, *args, **kwargs):
        """Not callable: always raises, since each expert is called directly.

        Raises:
            TypeError: always; call ``WanAdapter.velocity``, which picks the expert by sigma.
        """
        raise TypeError("WanExperts is a container; call WanAdapter.velocity, which picks the expert by sigma")


def split_expert_state(state: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """Split a LoRA state dict of :class:`WanExperts` into per-expert dicts (prefix removed).

    Raises:
        ValueError: a key that belongs to neither expert.
    """
    parts: dict[str, dict[str, Tensor]] = {"high": {}, "low": {}}
    for key, value in state.items():
        for name, prefix in PREFIXES.items():
            if key.startswith(prefix):
                parts[name][key[len(prefix) :]] = value
                break
        else:
            raise ValueError(f"LoRA key {key!r} belongs to neither Wan expert ('high.' or 'low.' prefix expected)")
    return parts
