"""Counting network evaluations (NFE): the outermost layer of the policy stack."""

from __future__ import annotations

from torch import Tensor

from ..models.adapter import Cond, ModelAdapter
from .wrapper import AdapterWrapper


class CountingAdapter(AdapterWrapper):
    """Wraps a model adapter and counts network evaluations per sample (NFE).

    A guided adapter (true CFG) declares ``evaluations_per_sample = 2`` and is counted twice per
    sample. Every other member is delegated unchanged.

    Args:
        model: the adapter (or wrapper) underneath.

    Attributes:
        nfe: evaluations counted so far (callers may reset or restore it).
    """

    def __init__(self, model: ModelAdapter):
        super().__init__(model)
        self.nfe = 0

    def velocity(self, x: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        """Count ``B * evaluations_per_sample`` evaluations, then call the wrapped model."""
        self.nfe += x.shape[0] * int(self._model.evaluations_per_sample)
        return self._model.velocity(x, sigma, cond)
