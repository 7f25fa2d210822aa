"""Branching tree rollouts (BranchGRPO): shared prefixes, the frontier of every depth batched.

A tree starts from one root latent at ``sigmas[0]``. At step ``t`` every node of the frontier
(depth ``t``) is evaluated by the model once; at a split step each node draws ``factor``
children with independent noises, elsewhere one child. With ``n_t`` nodes at depth ``t``
(``n_0 = 1``, ``n_{t+1} = n_t * f_t``, ``f_t = 1`` off the splits) a tree costs

    NFE   = sum_{t=0}^{T-1} n_t            (model evaluations: one per node and step)
    edges = sum_{t=0}^{T-1} n_{t+1}        (stored transitions, each trained once)
    leaves = n_T = prod_splits f.

Nodes are stored tree-major and children next to each other, so for ``N`` trees the frontier
at depth ``t`` is a (N * n_t, ...) tensor, node ``j`` belongs to tree ``j // n_t`` and the
child ``c`` of step ``t`` has parent ``c // f_t``.

At a split step the child noise can be scaled (BranchGRPO's script uses 4x): the child is
``mean + scale * std * z`` and its stored log-prob is the density of THAT Gaussian,
``N(mean, (scale * std)^2)`` (the public code stores the unscaled density). Training recomputes
it with :func:`branch_step` and the same scale.

References:
    Li et al., "BranchGRPO: Stable and Efficient GRPO with Structured Branching in Diffusion
    Models", arXiv 2509.06040, 2025.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from .broadcast import standard_normal
from .gaussian import Reduction, gaussian_log_prob
from .sde_steps import SDEStepFn, get_sde_step, has_density
from .types import SDEStep

TreeVelocityFn = Callable[[Tensor, Tensor, Tensor], Tensor]
"""``velocity_fn(x (M, ...), sigma (M,), tree (M,) long) -> v (M, ...)``; ``tree`` says which
tree (prompt) each row belongs to, so the caller can pick its conditioning."""


class TreeRollout(NamedTuple):
    """A batch of ``num_trees`` sampled trees of identical shape.

    Attributes:
        nodes: T + 1 tensors; ``nodes[d]`` (N * n_d, ...) fp32 latents at depth d
            (``nodes[0]`` the roots, ``nodes[T]`` the leaves).
        log_probs: T tensors; ``log_probs[t]`` (N * n_{t+1},) fp32 log-density of the edge
            parent -> child drawn at step t (the density actually sampled from).
        factors: (T,) long, children per node at each step (1 off the splits).
        noise_scales: (T,) float64, the std multiplier used at each step (1 off the splits).
        sigmas: (T + 1,) float64 grid.
        noise_levels: (T,) float64 SDE noise level per step (0 = ODE step).
        sde: name of the SDE step in :data:`flowrl.samplers.SDE_STEPS`.
        num_trees: N.
    """

    nodes: list[Tensor]
    log_probs: list[Tensor]
    factors: Tensor
    noise_scales: Tensor
    sigmas: Tensor
    noise_levels: Tensor
    sde: str
    num_trees: int

    @property
    def leaves(self) -> Tensor:
        """(N * L, ...) final latents, tree-major."""
        return self.nodes[-1]

    def width(self, depth: int) -> int:
        """``n_d``: nodes per tree at ``depth`` (from the split factors, so it holds without ``nodes``)."""
        return int(self.factors[:depth].prod())

    def parents(self, step: int) -> Tensor:
        """(N * n_{t+1},) index into ``nodes[t]`` of each child drawn at ``step``."""
        f = int(self.factors[step])
        return torch.arange(self.num_trees * self.width(step + 1)) // f

    def trees(self, depth: int) -> Tensor:
        """(N * n_d,) tree index of each node at ``depth``."""
        width = self.width(depth)
        return torch.arange(self.num_trees * width) // width


def select_trees(rows: Tensor, trees: Tensor) -> Tensor:
    """The rows of the trees ``trees`` ((N,) bool) of a tree-major (N * n, ...) tensor: (N' * n, ...)."""
    return rows[trees.repeat_interleave(rows.shape[0] // trees.shape[0]).to(rows.device)]


def split_factors(num_steps: int, split_steps: Sequence[int], factors: Sequence[int]) -> Tensor:
    """Children per node at each step: (T,) long, ``factors[k]`` at ``split_steps[k]``, else 1.

    Args:
        num_steps: T.
        split_steps: strictly increasing step indices in [0, T).
        factors: one factor for every split, or a single factor for all of them (>= 1).

    Raises:
        ValueError: unsorted/duplicate/out-of-range splits, or a factor count or value that does
            not fit (the message names the setting).
    """
    steps = list(split_steps)
    if any(not 0 <= s < num_steps for s in steps) or steps != sorted(set(steps)):
        raise ValueError(f"sampler.tree.split_steps must be increasing step indices in 0..{num_steps - 1}; got {steps}")
    facs = list(factors) * len(steps) if len(factors) == 1 else list(factors)
    if len(facs) != len(steps):
        raise ValueError(f"sampler.tree.factors needs 1 or {len(steps)} values (one per split); got {list(factors)}")
    if any(int(f) != f or f < 1 for f in facs):
        raise ValueError(f"sampler.tree.factors must be integers >= 1; got {list(factors)}")
    out = torch.ones(num_steps, dtype=torch.long)
    for s, f in zip(steps, facs):
        out[s] = int(f)
    return out


def tree_widths(factors: Tensor) -> list[int]:
    """Nodes per tree at each depth: ``[n_0 = 1, n_1, ..., n_T]``."""
    widths = [1]
    for f in factors.tolist():
        widths.append(widths[-1] * int(f))
    return widths


def tree_nfe(factors: Tensor) -> int:
    """Model evaluations of one tree, ``sum_{t<T} n_t``."""
    return sum(tree_widths(factors)[:-1])


def tree_edges(factors: Tensor) -> int:
    """Transitions (edges) of one tree, ``sum_{t<T} n_{t+1}``."""
    return sum(tree_widths(factors)[1:])


def branch_step(
    step_fn: SDEStepFn,
    x: Tensor,
    v: Tensor,
    sigma: Tensor,
    sigma_next: Tensor,
    level: float,
    noise_scale: float = 1.0,
    *,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    prev_sample: Tensor | None = None,
    reduce: Reduction = "mean",
) -> SDEStep:
    """One SDE step whose noise std is multiplied by ``noise_scale``, with the matching density.

    ``x`` and ``v`` are already one row per child (a parent's rows repeated). With scale 1 this
    is exactly ``step_fn``. Otherwise the child is ``mean + scale * std * z`` and the log-prob is
    that of ``N(mean, (scale * std)^2)``.

    Args:
        step_fn: an SDE step of :data:`flowrl.samplers.SDE_STEPS`.
        x: (B, ...) latents.
        v: (B, ...) velocities.
        sigma: (B,) noise level at the step's start.
        sigma_next: (B,) noise level at the step's end.
        level: the step's noise knob (0 = ODE).
        noise_scale: std multiplier (> 0).
        noise: optional standard normal (B, ...) z.
        generator: RNG for z when ``noise`` is None.
        prev_sample: stored child to score instead of drawing one.
        reduce: "mean" or "sum" over elements for the log-prob.

    Returns:
        SDEStep(sample, mean, std = scale * base std, log_prob (B,)).
    """
    if noise_scale == 1.0:
        return step_fn(
            x, v, sigma, sigma_next, level, noise=noise, generator=generator, prev_sample=prev_sample, reduce=reduce
        )
    if prev_sample is None and noise is None:
        noise = standard_normal(x, generator)
    scaled = None if noise is None else noise * noise_scale
    base = step_fn(x, v, sigma, sigma_next, level, noise=scaled, prev_sample=prev_sample, reduce=reduce)
    std = base.std * noise_scale
    return SDEStep(base.sample, base.mean, std, gaussian_log_prob(base.sample, base.mean, std, reduce))


def tree_rollout(
    velocity_fn: TreeVelocityFn,
    roots: Tensor,
    sigmas: Tensor,
    noise_levels: Tensor,
    factors: Tensor,
    *,
    split_noise_scale: float = 1.0,
    sde: str = "flow",
    generator: torch.Generator | None = None,
    noises: Sequence[Tensor] | None = None,
    store: Tensor | None = None,
) -> TreeRollout:
    """Grow ``N`` trees from their roots; the model runs once per node and step.

    Args:
        velocity_fn: model velocity, called once per step on the whole frontier (the caller
            chunks it).
        roots: (N, ...) initial noise at sigmas[0], one per tree.
        sigmas: (T + 1,) decreasing grid.
        noise_levels: (T,) SDE noise level per step; a split step must have a level > 0. A step
            with level 0 is an Euler ODE step; its edges get log-prob 0 (no density: never trained).
        factors: (T,) children per node at each step (see :func:`split_factors`).
        split_noise_scale: std multiplier at steps with factor > 1.
        sde: the step's name in :data:`flowrl.samplers.SDE_STEPS`.
        generator: RNG for the noises when ``noises`` is None.
        noises: optional T standard normals, ``noises[t]`` (N * n_{t+1}, ...), for exact replay.
        store: (N,) bool, the trees whose nodes and edge log-probs are kept (one rank's of several);
            None = every tree. The frontier of every tree is still grown, so the draws are the same.

    Returns:
        :class:`TreeRollout` of the stored trees.
    """
    num_steps = sigmas.shape[0] - 1
    if noise_levels.shape != (num_steps,) or factors.shape != (num_steps,):
        raise ValueError(
            f"noise_levels and factors must have shape ({num_steps},); "
            f"got {tuple(noise_levels.shape)}, {tuple(factors.shape)}"
        )
    if bool(((factors > 1) & (noise_levels <= 0)).any()):
        raise ValueError(
            "a split step has noise level 0, so its children would be identical; give split steps SDE noise"
        )
    if split_noise_scale <= 0:
        raise ValueError(f"sampler.tree.split_noise_scale must be > 0; got {split_noise_scale}")
    step_fn = get_sde_step(sde)
    no_density = torch.nonzero((factors.cpu() > 1) & ~has_density(sde, sigmas, noise_levels)).flatten().tolist()
    if no_density:  # the level is above 0 (checked above) but the step's std is not, e.g. CPS's step to sigma 0
        t = no_density[0]
        raise ValueError(
            f"the split at step {t} has transition std 0 under sampler.sde={sde} (sigma {float(sigmas[t]):.4g} "
            f"-> {float(sigmas[t + 1]):.4g}), so its children would be identical; move the split to an earlier step"
        )
    scales = torch.where(factors > 1, split_noise_scale, 1.0).double()
    x = roots.float()
    num_trees = x.shape[0]

    def kept(v: Tensor) -> Tensor:  # the rows of the stored trees
        return v if store is None else select_trees(v, store)

    nodes, log_probs = [kept(x)], []
    for t in range(num_steps):
        trees = torch.arange(x.shape[0]) // (x.shape[0] // num_trees)
        v = velocity_fn(x, sigmas[t].float().expand(x.shape[0]), trees)
        f = int(factors[t])
        xc, vc = (x, v) if f == 1 else (x.repeat_interleave(f, 0), v.repeat_interleave(f, 0))
        sigma, sigma_next = sigmas[t].float().expand(xc.shape[0]), sigmas[t + 1].float().expand(xc.shape[0])
        noise = None if noises is None else noises[t]
        step = branch_step(
            step_fn,
            xc,
            vc,
            sigma,
            sigma_next,
            float(noise_levels[t]),
            float(scales[t]),
            noise=noise,
            generator=generator,
        )
        x = step.sample.float()
        nodes.append(kept(x))
        log_prob = step.log_prob.float() if float(noise_levels[t]) > 0 else torch.zeros_like(step.log_prob).float()
        log_probs.append(kept(log_prob))
    stored = num_trees if store is None else int(store.sum())
    return TreeRollout(nodes, log_probs, factors, scales, sigmas, noise_levels, sde, stored)
