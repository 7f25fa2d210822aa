"""The policy: a model adapter with LoRA, guidance, memory settings and evaluation counting.

:func:`build_policy` builds the whole stack from a config; the layers live in
:mod:`~flowrl.policy.guidance`, :mod:`~flowrl.policy.memory`, :mod:`~flowrl.policy.counting`
(all :class:`~flowrl.policy.wrapper.AdapterWrapper` subclasses) and :mod:`~flowrl.policy.lora`.
"""

from .build import Policy, build_policy

__all__ = ["Policy", "build_policy"]
