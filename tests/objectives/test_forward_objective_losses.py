"""DiffusionNFT and AWM ``loss`` / ``plan`` / ``after_iteration`` against float64 references of their formulas.

The sibling ``test_forward_objectives.py`` checks the pure helpers; these run the objectives' own methods on a
stub model (a fixed affine velocity), with the frozen velocities placed in the objective's store, so the whole
micro-batch loss (keep mask, advantage clip, KL penalties, plan weight) is pinned number for number.
"""

import pytest
import torch

from flowrl.objectives.awm import AWM
from flowrl.objectives.base import Microbatch, RolloutBatch
from flowrl.objectives.diffusion_nft import DiffusionNFT

F64 = torch.float64


class _Stub:
    """A model whose velocity is ``0.7 x - 0.3 sigma + 0.1`` (no transformer, no adapters)."""

    def velocity(self, x, sigma, cond):
        return 0.7 * x - 0.3 * sigma.view(-1, *([1] * (x.ndim - 1))) + 0.1


def _batch(b=4, steps=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(b, 2, 3, 3, generator=g)
    sigmas = torch.linspace(1, 0, steps + 1)
    adv = torch.tensor([3.0, -0.5, 1.5, -7.0])[:b]  # two beyond a clip of 2
    keep = torch.tensor([True, True, False, True])[:b]
    return RolloutBatch([f"p{i}" for i in range(b)], torch.zeros(b), {}, x0, None, sigmas, x0, adv, adv, keep, b)


def _frozen(obj, mb, adapter, v):
    obj.frozen.store[(adapter, id(mb))] = v.float()


def _point(batch, mb):
    x0 = batch.samples[mb.index].double()
    t = batch.sigmas[mb.step].double()
    x_t = (1 - t) * x0 + t * mb.noise.double()
    return x0, t, x_t


def _kept_mean(per_row, keep):
    keep = keep.double()
    return (per_row * keep).sum() / keep.sum()


def test_nft_loss_matches_its_formula_in_float64():
    """``c (r L+ + (1 - r) L-) / beta`` over kept rows + ``kl_beta`` kept-row KL to the base model, times weight."""
    batch = _batch()
    g = torch.Generator().manual_seed(1)
    mb = Microbatch(torch.arange(4), 2, torch.randn(4, 2, 3, 3, generator=g), weight=0.6)
    nft = DiffusionNFT(beta=0.7, kl_beta=0.3, adv_clip=2.0)
    x0, t, x_t = _point(batch, mb)
    v_old = torch.randn(4, 2, 3, 3, generator=g, dtype=F64)
    v_ref = torch.randn(4, 2, 3, 3, generator=g, dtype=F64)
    _frozen(nft, mb, "old", v_old)
    _frozen(nft, mb, None, v_ref)
    loss, stats = nft.loss(_Stub(), batch, mb)

    v = _Stub().velocity(x_t.float(), t.float().expand(4), {}).double()
    v_old, v_ref = v_old.float().double(), v_ref.float().double()
    r = (batch.advantages.double().clamp(-2, 2) / 4 + 0.5).clamp(0, 1)

    def adaptive(v_mix):
        d = (x_t - t * v_mix) - x0
        return (d**2).mean((1, 2, 3)) / d.abs().mean((1, 2, 3))

    pos, neg = 0.7 * v + 0.3 * v_old, 1.7 * v_old - 0.7 * v
    policy = _kept_mean(2.0 * (r * adaptive(pos) + (1 - r) * adaptive(neg)) / 0.7, batch.keep)
    kl = _kept_mean(((v - v_ref) ** 2).mean((1, 2, 3)), batch.keep)
    expected = (policy + 0.3 * kl) * 0.6
    torch.testing.assert_close(loss.double(), expected, rtol=2e-6, atol=0)
    torch.testing.assert_close(torch.tensor(stats["kl"], dtype=F64), kl, rtol=2e-6, atol=0)
    assert loss.dtype == torch.float32


def test_awm_loss_matches_its_formula_in_float64():
    """``-A lp`` over kept rows (A clipped, / c; lp the sigma-weighted power transform) + penalties, times weight."""
    batch = _batch()
    g = torch.Generator().manual_seed(2)
    mb = Microbatch(torch.arange(4), 3, torch.randn(4, 2, 3, 3, generator=g), weight=1.5)
    awm = AWM(power=0.25, kl_beta=0.2, ema_beta=0.4, adv_clip=2.0)
    x0, t, x_t = _point(batch, mb)
    v_ref = torch.randn(4, 2, 3, 3, generator=g, dtype=F64)
    v_ema = torch.randn(4, 2, 3, 3, generator=g, dtype=F64)
    _frozen(awm, mb, None, v_ref)
    _frozen(awm, mb, "ema", v_ema)
    loss, stats = awm.loss(_Stub(), batch, mb)

    v = _Stub().velocity(x_t.float(), t.float().expand(4), {}).double()
    v_ref, v_ema = v_ref.float().double(), v_ema.float().double()
    mse = ((v - (mb.noise.double() - x0)) ** 2).mean((1, 2, 3))
    lp = -(t / 0.25) * ((mse + 1e-10) ** 0.25 - 1e-10**0.25)
    adv = batch.advantages.double().clamp(-2, 2) / 2
    policy = _kept_mean(-adv * lp, batch.keep)
    kl = _kept_mean(((v - v_ref) ** 2).mean((1, 2, 3)), batch.keep)
    ema_kl = _kept_mean(((v - v_ema) ** 2).mean((1, 2, 3)), batch.keep)
    expected = (policy + 0.2 * kl + 0.4 * ema_kl) * 1.5
    torch.testing.assert_close(loss.double(), expected, rtol=2e-6, atol=0)
    torch.testing.assert_close(torch.tensor(stats["ema_kl"], dtype=F64), ema_kl, rtol=2e-6, atol=0)
    torch.testing.assert_close(torch.tensor(stats["kl"], dtype=F64), kl, rtol=2e-6, atol=0)


def test_nft_plan_draws_distinct_nonzero_sigmas_per_chunk_in_shuffled_order():
    """Each chunk trains at ``int(T * train_fraction)`` distinct steps in [0, T) (never sigma 0), shuffled."""
    batch = _batch(steps=10)._replace(chunk_size=1)
    plan = DiffusionNFT(train_fraction=0.5).plan(batch, torch.Generator().manual_seed(0))
    (group,) = plan
    per_chunk = {}
    for mb in group:
        per_chunk.setdefault(int(mb.index[0]), []).append(mb.step)
    assert sorted(per_chunk) == [0, 1, 3]  # row 2 is not kept
    for steps in per_chunk.values():
        assert len(steps) == len(set(steps)) == 5 and all(0 <= s < 10 for s in steps)
    chunks = [int(mb.index[0]) for mb in group]
    assert chunks != sorted(chunks)  # the micro-batches are shuffled, not chunk by chunk
    seen = set()
    for seed in range(20):  # over seeds the last trainable step (index T - 1) is drawn, the sigma-0 end never
        for mb in DiffusionNFT(train_fraction=0.5).plan(batch, torch.Generator().manual_seed(seed))[0]:
            seen.add(mb.step)
    assert max(seen) == 9


def test_after_iteration_soft_updates_with_the_scheduled_decays(monkeypatch):
    """NFT: old ``keep = min(rate * it, max)``, EMA ``min((1 + n) / (10 + n), max)`` with n = it - 1; AWM's EMA."""
    import flowrl.objectives.awm as awm_mod
    import flowrl.objectives.diffusion_nft as nft_mod

    calls = []
    record = lambda transformer, name, keep: calls.append((name, keep))  # noqa: E731
    monkeypatch.setattr(nft_mod, "soft_update", record)
    monkeypatch.setattr(awm_mod, "soft_update", record)
    model = type("M", (), {"transformer": None})()
    nft = DiffusionNFT(old_decay_rate=0.01, old_decay_max=0.5, ema_decay_max=0.9)
    assert nft.after_iteration(model, 1) == {"old_decay": 0.01, "ema_decay": 0.1}
    assert nft.after_iteration(model, 11) == {"old_decay": pytest.approx(0.11), "ema_decay": pytest.approx(11 / 20)}
    assert nft.after_iteration(model, 200)["ema_decay"] == 0.9 and nft.old_decay(200) == 0.5
    assert calls[:2] == [("old", 0.01), ("ema", 0.1)]
    calls.clear()
    awm = AWM(ema_decay_rate=0.01, ema_decay_max=0.3)
    assert awm.after_iteration(model, 10) == {"ema_decay": pytest.approx(0.1)}
    assert awm.after_iteration(model, 100) == {"ema_decay": 0.3}
    assert calls == [("ema", pytest.approx(0.1)), ("ema", 0.3)]


def test_adaptive_x0_loss_stops_the_gradient_of_its_scale_and_floors_it_at_1e_5():
    """``mean d^2 / sg(mean |d|)``: the gradient is ``2 d / (D sg)`` (the scale is a constant), floor 1e-5."""
    from flowrl.objectives.diffusion_nft import adaptive_x0_loss

    g = torch.Generator().manual_seed(4)
    x0 = torch.randn(3, 2, 2, 2, generator=g, dtype=F64)
    pred = (x0 + torch.randn(3, 2, 2, 2, generator=g, dtype=F64)).requires_grad_(True)
    adaptive_x0_loss(pred, x0).sum().backward()
    d = (pred - x0).detach()
    scale = d.abs().mean((1, 2, 3)).view(-1, 1, 1, 1)
    torch.testing.assert_close(pred.grad, 2 * d / (8 * scale), rtol=1e-12, atol=0)
    tiny = x0 + 1e-7  # mean |d| = 1e-7, below the floor
    torch.testing.assert_close(adaptive_x0_loss(tiny, x0), torch.full((3,), 1e-14 / 1e-5, dtype=F64), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "cls, key, value",
    [
        (DiffusionNFT, "beta", 0.0),
        (DiffusionNFT, "kl_beta", -1e-9),
        (DiffusionNFT, "adv_clip", 0.0),
        (DiffusionNFT, "train_fraction", 0.0),
        (DiffusionNFT, "train_fraction", 1.01),
        (DiffusionNFT, "updates_per_iteration", 0),
        (DiffusionNFT, "old_decay_rate", -0.1),
        (DiffusionNFT, "old_decay_max", -0.1),
        (DiffusionNFT, "old_decay_max", 1.01),
        (DiffusionNFT, "ema_decay_max", 1.01),
        (AWM, "power", 0.0),
        (AWM, "kl_beta", -1e-9),
        (AWM, "ema_beta", -1e-9),
        (AWM, "adv_clip", 0.0),
        (AWM, "num_timesteps", 0),
        (AWM, "num_timesteps", 1001),
        (AWM, "timestep_fraction", 0.0),
        (AWM, "timestep_fraction", 1.01),
        (AWM, "ema_decay_rate", -0.1),
        (AWM, "ema_decay_max", -0.1),
        (AWM, "ema_decay_max", 1.01),
        (AWM, "updates_per_iteration", 0),
    ],
)
def test_out_of_range_settings_are_refused_naming_the_key(cls, key, value):
    """Every range check of DiffusionNFT and AWM refuses the value just past its bound (beta = 0 would divide by 0)."""
    with pytest.raises(ValueError, match=f"objective.{key}"):
        cls(**{key: value})


def test_the_range_edges_are_accepted():
    """The closed ends of the ranges construct: fractions and decays of exactly 1 (or 0), 1000 AWM timesteps."""
    DiffusionNFT(kl_beta=0, train_fraction=1.0, old_decay_rate=0, old_decay_max=1.0, ema_decay_max=0.0)
    DiffusionNFT(old_decay_max=0.0, ema_decay_max=1.0)
    AWM(power=None, kl_beta=0, ema_beta=0, num_timesteps=1000, timestep_fraction=1.0, ema_decay_rate=0)
    AWM(num_timesteps=1, ema_decay_max=1.0)
    AWM(ema_decay_max=0.0)


def test_nft_trains_at_least_one_sigma_per_chunk_on_a_short_grid():
    """``max(1, int(T * train_fraction))``: one rollout step (0.99 * 1 rounds to 0) still trains each chunk once."""
    assert DiffusionNFT().noise_per_row(1) == 1 and DiffusionNFT(train_fraction=0.3).noise_per_row(3) == 1
    assert DiffusionNFT().noise_per_row(10) == 9
    plan = DiffusionNFT().plan(_batch(steps=1), torch.Generator().manual_seed(0))
    assert [(mb.index.tolist(), mb.step) for mb in plan[0]] == [([0, 1, 2, 3], 0)]


def test_awm_strata_cover_exactly_the_usable_steps():
    """Steps run over ``[skip_first, min(T - 1, int(T * fraction))]``: one per stratum, sorted, never sigma 0."""
    from flowrl.objectives.awm import stratified_steps

    gen = torch.Generator().manual_seed(0)
    assert stratified_steps(10, 9, 1.0, gen) == list(range(1, 10))  # one stratum per usable step: all of them
    assert stratified_steps(10, 10, 1.0, gen, skip_first=False) == list(range(10))
    assert stratified_steps(20, 10, 0.5, gen) == list(range(1, 11))  # int(20 * 0.5) = 10 is the last
    for seed in range(20):  # more strata than steps: distinct, sorted, within [1, T - 1]
        steps = stratified_steps(4, 6, 1.0, torch.Generator().manual_seed(seed))
        assert steps == sorted(set(steps)) and set(steps) <= {1, 2, 3}
        steps = stratified_steps(12, 3, 1.0, torch.Generator().manual_seed(seed))
        assert len(steps) == 3 and steps[0] <= 4 and 8 <= steps[-1] <= 11
    with pytest.raises(ValueError, match="sampler.num_steps >= 2"):
        stratified_steps(1, 1, 1.0, gen)
    assert stratified_steps(1, 1, 1.0, gen, skip_first=False) == [0]


def test_awm_noise_per_row_counts_the_usable_steps():
    """``min(num_timesteps, hi - lo + 1)``: a short grid trains (and draws noise for) fewer sigmas."""
    assert AWM().noise_per_row(3) == 2  # steps 1..2
    assert AWM(skip_first=False).noise_per_row(3) == 3
    assert AWM().noise_per_row(14) == 6 and AWM(timestep_fraction=0.5).noise_per_row(8) == 4


def test_awm_plan_follows_skip_first():
    """``skip_first=False`` (the reference's "discrete") lets the plan train at step 0; True never does."""
    batch = _batch(steps=10)
    steps = lambda awm: sorted({mb.step for mb in awm.plan(batch, torch.Generator().manual_seed(0))[0]})  # noqa: E731
    assert steps(AWM(skip_first=False, num_timesteps=10, timestep_fraction=1.0)) == list(range(10))
    assert steps(AWM(skip_first=True, num_timesteps=10, timestep_fraction=1.0)) == list(range(1, 10))


def test_awm_one_step_plan_weighs_chunks_by_their_kept_rows():
    """One optimizer step: ``weight = n_mb * kept / total_kept``, so the step's loss is the mean over its kept rows."""
    batch = _batch(steps=10)._replace(chunk_size=2)  # chunks {0, 1} (2 kept) and {2, 3} (1 kept)
    (group,) = AWM().plan(batch, torch.Generator().manual_seed(0))
    assert len(group) == 12
    for mb in group:
        assert mb.weight == pytest.approx(12 * int(batch.keep[mb.index].sum()) / 18)
