"""One quantisation per activation: sibling Linears that read the same tensor share its quantised form.

In every DiT block several Linears read one activation: attention's ``to_q`` / ``to_k`` / ``to_v``
(and ``add_q_proj`` / ``add_k_proj`` / ``add_v_proj`` on the text stream), and in FLUX's
single-stream blocks ``proj_mlp`` beside them. An explore copy that quantises its activations
(FP8 on ``torch._scaled_mm``, emulated NVFP4 / FP8 W4A4) would quantise that activation once per
Linear, the same computation on the same bytes: an SD3.5-M dual-attention block runs 18 activation
quantisations where 12 distinct inputs exist (the AdaLN modulation Linears counted), a FLUX single-stream
block 6 where 3 exist; over a forward, SD3.5-M 385 where 263 exist, FLUX.1 494 where 304 do (counted on
models of their block structure, docs/kernels.md). A
:class:`SharedInput` remembers the last input it quantised and hands the same result to the next
layer that reads the same, unmodified tensor. It needs no change to the attention processors
(diffusers' fused-QKV processor skips SD3.5's q/k norms and second attention) and leaves every
GEMM's shape and every output bit as it was.

Identity is checked, not assumed: the same Python tensor object (a weak reference, so a freed
tensor never matches a new one at the same address), the same version counter (an in-place
write in between recomputes), and the same key (the format and scaling). Under ``torch.compile``
it steps aside: the traced graph holds each quantisation as a node, and guarding on tensor
identity would break the graph. Inference-mode tensors carry no version counter, so they are
never shared.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor


class SharedInput:
    """A one-entry memo of ``compute(x)`` keyed on the tensor ``x`` itself (object, version) and a key.

    Attributes:
        hits: calls answered from the memo.
        misses: calls that computed (the memo then holds their result).
    """

    def __init__(self) -> None:
        self._source: weakref.ref[Tensor] | None = None
        self._version = -1
        self._key: Hashable = None
        self._value: Any = None
        self.hits = 0
        self.misses = 0

    def get(self, x: Tensor, key: Hashable, compute: Callable[[Tensor], Any]) -> Any:
        """``compute(x)``, or the value it returned for this very tensor, unmodified, under ``key``.

        Args:
            x: the layer input, any shape.
            key: what else the result depends on (format, scaling); the memo holds one entry.
            compute: a pure function of ``x`` (and of what ``key`` names).

        Returns:
            What ``compute(x)`` returns.
        """
        if torch.compiler.is_compiling() or x.is_inference():
            return compute(x)
        if self._matches(x, key):
            self.hits += 1
            return self._value
        value = compute(x)
        self._source, self._version, self._key, self._value = weakref.ref(x), x._version, key, value
        self.misses += 1
        return value

    def __getstate__(self) -> dict[str, int]:
        """Pickle the counters only: a weak reference does not pickle, and a memo outlives no process."""
        return {"hits": self.hits, "misses": self.misses}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__()
        self.hits, self.misses = state["hits"], state["misses"]

    def clear(self) -> None:
        """Drop the held result (one quantised activation; an explore copy clears it when its forward returns)."""
        self._source, self._version, self._key, self._value = None, -1, None, None

    @property
    def held(self) -> Any:
        """The result the memo holds now (None after :meth:`clear`)."""
        return self._value

    def _matches(self, x: Tensor, key: Hashable) -> bool:
        source = None if self._source is None else self._source()
        return source is x and x._version == self._version and key == self._key
