"""Registry of the Gaussian SDE steps that rollouts and GRPO-style objectives can use.

Every step shares one signature, documented once at :data:`SDEStepFn`, so a rollout and the
training-time log-prob recomputation pick the same step by name, and the stored log-prob is
always the density the sample was drawn from. ``level`` is each step's own noise knob (Flow-SDE
``a``, Dance/SAGE ``eta``, CPS noise level); 0 is the Euler ODE step for all. Each step is a
:class:`~flowrl.samplers.sde_finish.GaussianSDE` over its own moments (mean and std).
"""

from __future__ import annotations

from .cps import cps_step
from .dance_sde import dance_sde_step
from .flow_sde import flow_sde_step
from .sage_sde import sage_sde_step
from .types import SDEStepFn

SDE_STEPS: dict[str, SDEStepFn] = {
    "flow": flow_sde_step,  # Flow-GRPO (Liu et al., 2025)
    "dance": dance_sde_step,  # DanceGRPO's constant-eta SDE (Xue et al., 2025)
    "cps": cps_step,  # coefficients-preserving sampling (Wang & Yu, 2025)
    "sage": sage_sde_step,  # SAGE-GRPO's manifold-aware SDE (Zheng et al., 2026)
}


def get_sde_step(name: str) -> SDEStepFn:
    """The SDE step registered as ``name``.

    Raises:
        ValueError: for an unknown name (the message lists the known ones).
    """
    try:
        return SDE_STEPS[name]
    except KeyError:
        raise ValueError(f"unknown SDE {name!r}; set sampler.sde to one of {', '.join(SDE_STEPS)}") from None
