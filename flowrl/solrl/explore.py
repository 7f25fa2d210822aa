"""Sampling with the explore copy through the policy's own adapter stack.

The explore copy (:func:`flowrl.policy.precision.build_explore`) is a bare transformer module.
:func:`explore_transformer` puts it in the place of the policy's transformer for a while, so
the same adapter code (conditioning, timestep convention, guidance, autocast, evaluation
counting) drives it; the trained transformer is put back on exit, also on an error.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from torch import nn

from ..policy.wrapper import AdapterWrapper


def base_adapter(model: Any) -> Any:
    """The model adapter under every :class:`~flowrl.policy.wrapper.AdapterWrapper` of a policy stack."""
    while isinstance(model, AdapterWrapper):
        model = model.wrapped
    return model


@contextmanager
def explore_transformer(model: Any, module: nn.Module) -> Iterator[None]:
    """Run ``model`` (a policy stack or a bare adapter) through ``module`` instead of its transformer.

    Args:
        model: the policy's adapter stack.
        module: the explore copy (``ExploreModel.module``).
    """
    adapter = base_adapter(model)
    original = adapter.transformer
    adapter.transformer = module
    try:
        yield
    finally:
        adapter.transformer = original
