"""Pure sampler functions: state in, state out, no step counters.

Convention: ``sigma`` in [0, 1] with 1 = noise, ``x = (1 - sigma) x0 + sigma eps`` and
``v = eps - x0``.
"""

from .broadcast import batch_view, compute_dtype, expand_like, standard_normal
from .cfg import cfg
from .cps import cps_log_prob_reference, cps_step
from .dance_sde import dance_sde_step
from .euler import euler_step
from .flow_sde import flow_sde_diffusion, flow_sde_mean, flow_sde_step
from .gaussian import gaussian_log_prob
from .ode_solve import DPMState, dpmpp_2m_step, heun_step, log_snr, ode_solve
from .rollout import rollout, sde_noise_levels
from .sage_sde import sage_sde_step, sage_sde_variance
from .schedules import dynamic_shift_mu, dynamic_shift_sigmas, linear_sigmas, make_sigmas, shift_sigmas
from .sde_steps import SDE_STEPS, SDEStepFn, get_sde_step
from .types import SDEStep, Trajectory, VelocityFn
from .window_solve import sde_window_solve
from .windows import progressive_window_start, random_window_start, window_noise_levels

__all__ = [
    "DPMState",
    "dpmpp_2m_step",
    "heun_step",
    "log_snr",
    "ode_solve",
    "SDEStep",
    "SDEStepFn",
    "SDE_STEPS",
    "Trajectory",
    "VelocityFn",
    "batch_view",
    "cfg",
    "compute_dtype",
    "expand_like",
    "standard_normal",
    "cps_log_prob_reference",
    "cps_step",
    "dance_sde_step",
    "dynamic_shift_mu",
    "dynamic_shift_sigmas",
    "euler_step",
    "flow_sde_diffusion",
    "flow_sde_mean",
    "flow_sde_step",
    "gaussian_log_prob",
    "get_sde_step",
    "linear_sigmas",
    "make_sigmas",
    "progressive_window_start",
    "random_window_start",
    "rollout",
    "sage_sde_step",
    "sage_sde_variance",
    "sde_noise_levels",
    "sde_window_solve",
    "shift_sigmas",
    "window_noise_levels",
]
