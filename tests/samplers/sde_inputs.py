"""Float64 inputs shared by the sampler identity tests: latent shapes of ranks 3-5 and (x, v) draws."""

from __future__ import annotations

from collections.abc import Callable

import torch

F64 = torch.float64
# rank -> (B, ...): token sequences (B, N, D), images (B, C, H, W), videos (B, C, F, H, W)
SHAPES = {3: (2, 6, 5), 4: (2, 3, 4, 4), 5: (2, 3, 2, 4, 4)}


def xv(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 latent and velocity of ``shape``, drawn from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=F64), torch.randn(shape, generator=g, dtype=F64)


def gaussian_velocity(m: float, c: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The exact velocity field for data x0 ~ N(m, c^2): ``v(x, sigma) = E[eps - x0 | x_sigma = x]``.

    With ``x = (1 - s) x0 + s eps``, x is Gaussian with mean ``(1 - s) m`` and variance
    ``(1 - s)^2 c^2 + s^2``, and ``E[eps - x0 | x] = -m + (s - (1 - s) c^2) (x - (1 - s) m) / var``.
    Sampling with it must end at N(m, c^2) whenever a sampler preserves the marginals.

    Returns:
        ``velocity(x (B, ...), sigma (scalar or (B,))) -> (B, ...)`` in x's dtype.
    """

    def velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        s = torch.as_tensor(sigma).reshape(-1, *([1] * (x.ndim - 1))).to(x.dtype)
        var = (1 - s) ** 2 * c**2 + s**2
        return -m + (s - (1 - s) * c**2) * (x - (1 - s) * m) / var

    return velocity
