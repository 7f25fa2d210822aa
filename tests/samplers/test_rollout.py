"""Identity tests for flowrl.samplers.rollout (trajectories are stored in fp32 by design)."""

from __future__ import annotations

import pytest
import torch
from sde_inputs import SHAPES

from flowrl.samplers import Trajectory, euler_step, flow_sde_step, make_sigmas, rollout, sde_noise_levels

torch.set_num_threads(1)


def _velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A non-trivial field that depends on x and sigma, returned in x's dtype."""
    s = sigma.reshape(-1, *([1] * (x.ndim - 1)))
    return 0.4 * x * (1 + s) - torch.sin(3 * x) * s + 0.1


def _init(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _noises(shape: tuple[int, ...], num_steps: int, seed: int = 1) -> torch.Tensor:
    return torch.randn((shape[0], num_steps) + shape[1:], generator=torch.Generator().manual_seed(seed))


def _manual(
    x_init: torch.Tensor, sigmas: torch.Tensor, levels: torch.Tensor, noises: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    x, lat, lps = x_init.float(), [x_init.float()], []
    batch = x.shape[0]
    for i in range(sigmas.shape[0] - 1):
        s = sigmas[i].float().expand(batch)
        s_next = sigmas[i + 1].float().expand(batch)
        step = flow_sde_step(x, _velocity(x, s), s, s_next, float(levels[i]), noise=noises[:, i])
        x = step.sample
        lat.append(x)
        lps.append(step.log_prob)
    return torch.stack(lat, dim=1), torch.stack(lps, dim=1)


@pytest.mark.parametrize("rank", [3, 4, 5])
def test_trajectory_shapes(rank: int) -> None:
    shape, num_steps = SHAPES[rank], 5
    sigmas = make_sigmas("shift", num_steps, shift=3.0)
    levels = sde_noise_levels(num_steps, 0.7)
    traj = rollout(_velocity, _init(shape), sigmas, levels, generator=torch.Generator().manual_seed(0))
    assert isinstance(traj, Trajectory)
    assert traj.latents.shape == (shape[0], num_steps + 1) + shape[1:]
    assert traj.log_probs.shape == (shape[0], num_steps)
    assert traj.latents.dtype == torch.float32 and traj.log_probs.dtype == torch.float32
    assert torch.equal(traj.sigmas, sigmas) and torch.equal(traj.noise_levels, levels)
    assert torch.equal(traj.latents[:, 0], _init(shape))
    assert bool(torch.isfinite(traj.latents).all()) and bool(torch.isfinite(traj.log_probs).all())
    assert bool((traj.log_probs[:, -1] == 0).all()) and bool((traj.log_probs[:, :-1] != 0).all())


def test_velocity_fn_sees_batch_sigmas() -> None:
    seen: list[torch.Tensor] = []

    def fn(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        seen.append(sigma.clone())
        return _velocity(x, sigma)

    sigmas = make_sigmas("linear", 4)
    rollout(fn, _init(SHAPES[4]), sigmas, sde_noise_levels(4, 0.5), generator=torch.Generator().manual_seed(0))
    assert len(seen) == 4
    for i, s in enumerate(seen):
        assert s.shape == (2,)
        torch.testing.assert_close(s, sigmas[i].float().expand(2), rtol=0, atol=0)


@pytest.mark.parametrize("rank", [4, 5])
def test_zero_noise_equals_euler_loop(rank: int) -> None:
    shape, num_steps = SHAPES[rank], 7
    sigmas = make_sigmas("dynamic_shift", num_steps, image_seq_len=1024)
    traj = rollout(_velocity, _init(shape), sigmas, torch.zeros(num_steps, dtype=torch.float64))
    x = _init(shape)
    for i in range(num_steps):
        s, s_next = sigmas[i].float().expand(2), sigmas[i + 1].float().expand(2)
        x = euler_step(x, _velocity(x, s), s, s_next)
        assert torch.equal(traj.latents[:, i + 1], x)
    assert torch.equal(traj.log_probs, torch.zeros(2, num_steps))


def test_zero_noise_straight_line_field_lands_on_data() -> None:
    x0 = _init(SHAPES[5], seed=3).double()
    eps = _init(SHAPES[5], seed=4)

    def straight(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return (x.double() - x0) / sigma.double().reshape(-1, 1, 1, 1, 1)

    sigmas = make_sigmas("shift", 9, shift=3.0)
    traj = rollout(straight, eps, sigmas, torch.zeros(9, dtype=torch.float64))
    torch.testing.assert_close(traj.latents[:, -1], x0.float(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("rank", [4, 5])
def test_explicit_noises_replay_and_match_manual_steps(rank: int) -> None:
    shape, num_steps = SHAPES[rank], 6
    sigmas = make_sigmas("shift", num_steps, shift=3.0)
    levels = sde_noise_levels(num_steps, 0.7, sde_steps=[1, 2, 4])
    noises = _noises(shape, num_steps)
    a = rollout(_velocity, _init(shape), sigmas, levels, noises=noises, generator=torch.Generator().manual_seed(0))
    b = rollout(_velocity, _init(shape), sigmas, levels, noises=noises, generator=torch.Generator().manual_seed(99))
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    lat, lps = _manual(_init(shape), sigmas, levels, noises)
    assert torch.equal(a.latents, lat) and torch.equal(a.log_probs, lps)
    assert bool((a.log_probs[:, [0, 3, 5]] == 0).all()) and bool((a.log_probs[:, [1, 2, 4]] != 0).all())


@pytest.mark.parametrize("rank", [3, 4, 5])
@pytest.mark.parametrize("use_noises", [True, False])
def test_recomputed_log_probs_equal_stored(rank: int, use_noises: bool) -> None:
    """GRPO's ratio exp(log p_new - log p_old) must be exactly 1 when the policy did not change."""
    shape, num_steps = SHAPES[rank], 6
    sigmas = make_sigmas("shift", num_steps, shift=3.0)
    levels = sde_noise_levels(num_steps, 0.9)
    noises = _noises(shape, num_steps) if use_noises else None
    traj = rollout(_velocity, _init(shape), sigmas, levels, noises=noises, generator=torch.Generator().manual_seed(5))
    for i in range(num_steps):
        x = traj.latents[:, i]
        s, s_next = sigmas[i].float().expand(2), sigmas[i + 1].float().expand(2)
        again = flow_sde_step(x, _velocity(x, s), s, s_next, float(levels[i]), prev_sample=traj.latents[:, i + 1])
        assert torch.equal(again.log_prob, traj.log_probs[:, i])
    # A changed velocity changes the recomputed log-prob (the check can fail).
    x = traj.latents[:, 2]
    s, s_next = sigmas[2].float().expand(2), sigmas[3].float().expand(2)
    shifted = flow_sde_step(x, _velocity(x, s) + 0.05, s, s_next, float(levels[2]), prev_sample=traj.latents[:, 3])
    assert not torch.equal(shifted.log_prob, traj.log_probs[:, 2])


def test_generator_rollouts_are_reproducible() -> None:
    sigmas, levels = make_sigmas("linear", 4), sde_noise_levels(4, 0.7)
    a = rollout(_velocity, _init(SHAPES[4]), sigmas, levels, generator=torch.Generator().manual_seed(1))
    b = rollout(_velocity, _init(SHAPES[4]), sigmas, levels, generator=torch.Generator().manual_seed(1))
    c = rollout(_velocity, _init(SHAPES[4]), sigmas, levels, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    assert not torch.equal(a.latents, c.latents)


def test_noise_levels_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match=r"noise_levels") as info:
        rollout(_velocity, _init(SHAPES[4]), make_sigmas("linear", 4), torch.zeros(3, dtype=torch.float64))
    assert "\n" not in str(info.value)


def test_sde_noise_levels_default_is_all_but_last() -> None:
    levels = sde_noise_levels(5, 0.7)
    assert levels.dtype == torch.float64 and levels.shape == (5,)
    assert torch.equal(levels, torch.tensor([0.7, 0.7, 0.7, 0.7, 0.0], dtype=torch.float64))
    assert torch.equal(sde_noise_levels(1, 0.7), torch.tensor([0.7], dtype=torch.float64))


def test_sde_noise_levels_custom_windows() -> None:
    assert torch.equal(
        sde_noise_levels(6, 0.5, sde_steps=[2, 3]), torch.tensor([0, 0, 0.5, 0.5, 0, 0], dtype=torch.float64)
    )
    assert torch.equal(sde_noise_levels(4, 1.0, sde_steps=range(4)), torch.ones(4, dtype=torch.float64))
    assert torch.equal(sde_noise_levels(4, 1.0, sde_steps=[]), torch.zeros(4, dtype=torch.float64))
    assert torch.equal(sde_noise_levels(3, 0.3, sde_steps=(0,)), torch.tensor([0.3, 0, 0], dtype=torch.float64))


@pytest.mark.parametrize("bad", [-1, 4, 10])
def test_sde_noise_levels_out_of_range(bad: int) -> None:
    with pytest.raises(ValueError, match=str(bad)) as info:
        sde_noise_levels(4, 0.7, sde_steps=[0, bad])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("sde", ["flow", "dance", "cps", "sage"])
def test_rollout_stores_the_density_of_the_named_sde(sde):
    """Each stored log-prob is the named step's density of the stored transition (float64)."""
    from flowrl.samplers import SDE_STEPS

    torch.manual_seed(0)
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    sigmas = make_sigmas("linear", 5).double()
    levels = sde_noise_levels(5, 0.5)
    traj = rollout(lambda z, s: _velocity(z, s), x, sigmas, levels, generator=torch.Generator().manual_seed(1), sde=sde)
    assert traj.sde == sde
    for i in range(5):
        again = SDE_STEPS[sde](
            traj.latents[:, i].double(),
            _velocity(traj.latents[:, i].double(), sigmas[i]),
            sigmas[i],
            sigmas[i + 1],
            float(levels[i]),
            prev_sample=traj.latents[:, i + 1].double(),
        )
        torch.testing.assert_close(again.log_prob.float(), traj.log_probs[:, i], rtol=1e-4, atol=1e-4)


def test_unknown_sde_names_the_choices():
    from flowrl.samplers import get_sde_step

    with pytest.raises(ValueError, match="sampler.sde"):
        get_sde_step("langevin")


def test_the_flow_step_uses_the_step_registered_for_the_latents_device_only(monkeypatch):
    """``flow_step`` looks the accelerated step up by x's device type: one registered for another device is not used.

    A step registered for "meta" runs for meta latents; CPU latents still get :func:`flow_sde_step` bit for bit.
    """
    from flowrl.samplers import get_sde_step
    from flowrl.samplers.sde_steps import ACCELERATED_STEPS

    calls = []

    def accelerated(x, *args, **kwargs):
        calls.append(x.device.type)
        return "accelerated"

    monkeypatch.setitem(ACCELERATED_STEPS, ("flow", "meta"), accelerated)
    x, v, z = _init((2, 3, 4)), _init((2, 3, 4), seed=1), _init((2, 3, 4), seed=2)
    got = get_sde_step("flow")(x, v, 0.7, 0.6, 0.7, noise=z)
    assert calls == [] and all(torch.equal(a, b) for a, b in zip(got, flow_sde_step(x, v, 0.7, 0.6, 0.7, noise=z)))
    assert get_sde_step("flow")(x.to("meta"), v.to("meta"), 0.7, 0.6, 0.7) == "accelerated"
    assert calls == ["meta"]
