"""2x2 latent patch packing shared by the FLUX.1 and Qwen-Image transformers.

Both transformers take image latents as a token sequence: every 2x2 patch of a (C, h, w) latent
becomes one token of 4C features, in row-major patch order, plus integer position ids for RoPE.
flowrl keeps latents unpacked, (B, C, h, w), everywhere outside the adapter, so samplers, rewards
and the VAE see ordinary image latents; the adapter packs on the way in and unpacks on the way out.

References:
    Black Forest Labs, "FLUX.1" (2024); Wu et al., "Qwen-Image Technical Report", 2025.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .adapter import AdapterBase
from .pipeline_schedule import pipeline_sigmas


def pack_latents(latents: Tensor) -> Tensor:
    """(B, C, h, w) -> (B, (h/2)(w/2), 4C) tokens, channel-major inside each 2x2 patch.

    Raises:
        ValueError: if h or w is odd.
    """
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"latent height and width must be even to form 2x2 patches; got {h}x{w}")
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: Tensor, height: int, width: int) -> Tensor:
    """Inverse of :func:`pack_latents`: (B, (h/2)(w/2), 4C) -> (B, C, h, w) for latent size h x w."""
    b, n, d = tokens.shape
    if n != (height // 2) * (width // 2) or d % 4:
        raise ValueError(f"cannot unpack {tuple(tokens.shape)} tokens to a {height}x{width} latent")
    x = tokens.view(b, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, height, width)


def latent_image_ids(
    height: int, width: int, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Tensor:
    """FLUX RoPE ids of the packed image tokens: (h/2 * w/2, 3) rows ``(0, row, col)``.

    Args:
        height: the unpacked latent height h (even).
        width: the unpacked latent width w (even).
        device: device of the returned ids.
        dtype: dtype of the returned ids.
    """
    rows, cols = height // 2, width // 2
    ids = torch.zeros(rows, cols, 3)
    ids[..., 1] = torch.arange(rows)[:, None]
    ids[..., 2] = torch.arange(cols)[None, :]
    return ids.reshape(rows * cols, 3).to(device=device, dtype=dtype)


def packed_latent_shape(
    family: str, in_channels: int, vae_factor: int, height: int, width: int
) -> tuple[int, int, int]:
    """Unpacked latent shape (C, H / f, W / f) of a 2x2-packed model (FLUX, Qwen-Image).

    Args:
        family: model name for the error message.
        in_channels: the transformer's input channels (4 x the latent channels, 2x2 packed).
        vae_factor: the VAE's spatial downsampling factor f.
        height: output height; a multiple of 2f.
        width: output width; a multiple of 2f.

    Raises:
        ValueError: for a resolution that does not pack into whole 2x2 patches.
    """
    if height % (2 * vae_factor) or width % (2 * vae_factor):
        raise ValueError(f"{family} resolution must be a multiple of {2 * vae_factor}; got {height}x{width}")
    return (in_channels // 4, height // vae_factor, width // vae_factor)


class PackedImageAdapter(AdapterBase):
    """Defaults shared by the 2x2-packed image adapters (FLUX, Qwen-Image): latent shape and sigma grid.

    A subclass sets ``family``, the model name in error messages, besides what :class:`AdapterBase`
    asks for (minus ``latent_shape``).
    """

    family: str

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """(C, H / f, W / f) with f the VAE factor; H and W must be multiples of 2f (2x2 packing); no ``frames``."""
        self._image_only(frames)
        return packed_latent_shape(
            self.family, self.transformer.config.in_channels, self.pipe.vae_scale_factor, height, width
        )

    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        """The (num_steps + 1,) float64 sigma grid the model's pipeline uses at this resolution.

        :func:`~flowrl.models.pipeline_schedule.pipeline_sigmas` of the scheduler config: a dynamic
        shift with mu from the packed image sequence length (FLUX.1-dev, Qwen-Image, which also
        stretches the grid to a terminal sigma) or the config's static shift (FLUX.1-schnell).
        """
        _, h, w = self.latent_shape(height, width)
        return pipeline_sigmas(self.pipe.scheduler.config, num_steps, (h // 2) * (w // 2))
