"""Pure sampler functions: state in, state out, no step counters.

Convention: ``sigma`` in [0, 1] with 1 = noise, ``x = (1 - sigma) x0 + sigma eps`` and
``v = eps - x0``.
"""

from .cfg import cfg
from .euler import euler_step
from .flow_sde import SDEStep, flow_sde_diffusion, flow_sde_mean, flow_sde_step
from .gaussian import gaussian_log_prob
from .ode_solve import DPMState, dpmpp_2m_step, heun_step, log_snr, ode_solve
from .rollout import Trajectory, VelocityFn, rollout, sde_noise_levels
from .schedules import dynamic_shift_mu, dynamic_shift_sigmas, linear_sigmas, make_sigmas, shift_sigmas

__all__ = [
    "DPMState",
    "dpmpp_2m_step",
    "heun_step",
    "log_snr",
    "ode_solve",
    "SDEStep",
    "Trajectory",
    "VelocityFn",
    "cfg",
    "dynamic_shift_mu",
    "dynamic_shift_sigmas",
    "euler_step",
    "flow_sde_diffusion",
    "flow_sde_mean",
    "flow_sde_step",
    "gaussian_log_prob",
    "linear_sigmas",
    "make_sigmas",
    "rollout",
    "sde_noise_levels",
    "shift_sigmas",
]
