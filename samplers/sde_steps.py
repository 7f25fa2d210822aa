"""Registry of the Gaussian SDE steps that rollouts and GRPO-style objectives can use.

Every step shares one signature, documented once at :data:`SDEStepFn`, so a rollout and the
training-time log-prob recomputation pick the same step by name, and the stored log-prob is
always the density the sample was drawn from. ``level`` is each step's own noise knob (Flow-SDE
``a``, Dance/SAGE ``eta``, CPS noise level); 0 is the Euler ODE step for all. Each step is a
:class:`~flowrl.samplers.sde_finish.GaussianSDE` over its own moments (mean and std).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .cps import cps_step
from .dance_sde import dance_sde_step
from .flow_sde import flow_sde_step
from .sage_sde import sage_sde_step
from .types import SDEStep, SDEStepFn

ACCELERATED_STEPS: dict[tuple[str, str], SDEStepFn] = {}
"""(step name, device type) -> an implementation of that step with the same contract and equations,
faster on that device. ``flowrl.kernels`` registers its fused Flow-SDE kernel as ("flow", "cuda") when
it is imported (the rollout and objective modules import it); samplers never import kernels."""


def register_accelerated_step(name: str, device_type: str, step: SDEStepFn) -> None:
    """Use ``step`` for the registry's step ``name`` on latents of ``device_type`` (e.g. "cuda").

    Raises:
        ValueError: ``name`` is not a registered step.
    """
    get_sde_step(name)
    ACCELERATED_STEPS[(name, device_type)] = step


def flow_step(x: Tensor, *args: Any, **kwargs: Any) -> SDEStep:
    """The registry's Flow-SDE step: the accelerated step registered for x's device, else :func:`flow_sde_step`.

    On a GPU the step's ~23 elementwise launches (and as many more in its backward) cost as much as a
    small model's matmuls; ``flowrl.kernels`` registers its fused Triton kernel for CUDA latents
    (:func:`flowrl.kernels.flow_sde.fused_flow_sde_step`: one launch, a four-pass backward, equal to the
    reference within fp32 rounding). Rollouts and the objectives' recomputation both come here, so on a
    GPU both use the kernel and a stored log-prob is still recomputed bit for bit (the first-update ratio
    stays 1). Elsewhere (the CPU, or nothing registered) this *is* :func:`flow_sde_step`, bit for bit.
    Arguments and result: :data:`~flowrl.samplers.types.SDEStepFn`.
    """
    return ACCELERATED_STEPS.get(("flow", x.device.type), flow_sde_step)(x, *args, **kwargs)


SDE_STEPS: dict[str, SDEStepFn] = {
    "flow": flow_step,  # Flow-GRPO (Liu et al., 2025); fused on CUDA
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


def _step_std(step_fn: SDEStepFn, sigma: Tensor, sigma_next: Tensor, level: float) -> float:
    """The transition std of one SDE step from ``sigma`` to ``sigma_next`` (scalars), in fp64 on the CPU.

    0 where the step is deterministic although its level is not, e.g. CPS's step to sigma 0
    (``sigma_next sin(level pi / 2)``): such a step has no density to train on.
    """
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.float64)
    sigma, sigma_next = sigma.detach().cpu().double().reshape(1), sigma_next.detach().cpu().double().reshape(1)
    return float(step_fn(zero, zero, sigma, sigma_next, level, noise=zero).std)


def has_density(sde: str, sigmas: Tensor, levels: Tensor) -> Tensor:
    """(T,) bool: the steps of a grid whose transitions have a density to train on.

    A step with noise level 0 is the Euler ODE step; a step whose std is 0 at a level above 0 (CPS's
    step to sigma 0) is deterministic too. Neither has a log-prob gradient or a KL, so the objectives'
    plans leave both out.

    Args:
        sde: the step's name in :data:`SDE_STEPS`.
        sigmas: (T + 1,) grid.
        levels: (T,) noise levels.
    """
    step_fn = get_sde_step(sde)
    return torch.tensor(
        [
            float(levels[t]) > 0 and _step_std(step_fn, sigmas[t], sigmas[t + 1], float(levels[t])) > 0
            for t in range(len(levels))
        ],
        dtype=torch.bool,
    )
