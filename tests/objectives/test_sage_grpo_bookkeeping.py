"""SAGE-GRPO's per-update bookkeeping without a model: the KL_eff mean, beta, anchor refreshes, rank sums, resume.

``test_sage_grpo.py`` runs these through the tiny model; here each counter and each reset is pinned on its
own, with ``soft_update`` recorded instead of run.
"""

import pytest
import torch

import flowrl.objectives.sage_grpo as sage_mod
from flowrl.objectives.sage_grpo import ANCHOR, ROLLOUT, SageGRPO

MODEL = type("Model", (), {"transformer": None})()


@pytest.fixture
def updates(monkeypatch):
    """The (adapter, keep) of every soft update the objective asks for."""
    calls = []
    monkeypatch.setattr(sage_mod, "soft_update", lambda transformer, name, keep: calls.append((name, keep)))
    return calls


def test_after_update_adapts_beta_to_the_mean_kl_of_the_step_and_resets_it(updates):
    """beta follows ``KL_eff = sum / count`` of the step's micro-batches; the sums start afresh after it."""
    sage = SageGRPO(kl_init=1.0, kl_min=0.1, kl_max=10.0, kl_target=1.0, kl_rate=0.5, anchor_every=0)
    sage._kl_sum, sage._kl_count = 3.3, 3  # mean 1.1: beta * (1 + 0.1)
    stats = sage.after_update(MODEL)
    assert stats["kl_eff"] == pytest.approx(1.1) and sage.beta == pytest.approx(1.1)
    assert (sage._kl_sum, sage._kl_count) == (0.0, 0)
    sage.after_update(MODEL)  # an empty step: KL_eff 0, beta down by the rate
    assert sage.beta == pytest.approx(0.55) and updates == []


def test_anchor_refreshes_every_k_updates_and_is_current_right_after(updates):
    """Every K-th update hard-copies theta into the anchor; until the next update the anchor is theta itself."""
    sage = SageGRPO(anchor_every=3)
    assert sage._anchor_adapter() == "current"  # the anchor starts as a copy of theta
    for n in range(1, 7):
        sage.after_update(MODEL)
        assert sage._anchor_adapter() == ("current" if n % 3 == 0 else ANCHOR)
    assert updates == [(ANCHOR, 0.0), (ANCHOR, 0.0)] and sage.refreshes == 2 and sage.updates == 6
    assert SageGRPO(anchor_every=0)._anchor_adapter() is None  # K = 0: the base model


def test_the_rollout_adapter_is_kept_only_when_theta_moves_within_an_iteration(updates):
    """Needed with several updates per iteration and a step KL or GRPO-Guard; snapshotted after each iteration."""
    assert SageGRPO(updates_per_iteration=2).uses_rollout_adapter
    assert SageGRPO(updates_per_iteration=2, step_kl_weight=0.0, ratio_norm=True).uses_rollout_adapter
    assert not SageGRPO(updates_per_iteration=2, step_kl_weight=0.0).uses_rollout_adapter
    assert not SageGRPO(updates_per_iteration=1).uses_rollout_adapter
    sage = SageGRPO(updates_per_iteration=2, anchor_every=0)
    sage.after_update(MODEL)
    sage.after_update(MODEL)
    assert sage.iteration_updates == 2
    assert sage.after_iteration(MODEL, 1) == {"updates": 2.0}
    assert sage.iteration_updates == 0 and updates == [(ROLLOUT, 0.0)]


def test_sync_step_sums_over_ranks_and_counts_the_global_micro_batches():
    """Several ranks: the step's KL_eff sum is the ranks' total and the count the step's micro-batches overall."""
    sage = SageGRPO(kl_init=1e-6, anchor_every=0)
    sage._kl_sum, sage._kl_count = 0.5, 2
    sage.sync_step(lambda t: t * 4, microbatches=8)
    assert sage._kl_sum == 2.0 and sage._kl_count == 8


def test_state_round_trips_every_counter():
    """beta and the four counters survive a resume (``iteration_updates`` mid-iteration too)."""
    sage = SageGRPO()
    sage.beta, sage.updates, sage.refreshes, sage.since_refresh, sage.iteration_updates = 3e-6, 7, 2, 1, 1
    other = SageGRPO()
    other.load_state_dict(sage.state_dict())
    assert (
        other.state_dict()
        == sage.state_dict()
        == {
            "beta": 3e-6,
            "updates": 7,
            "refreshes": 2,
            "since_refresh": 1,
            "iteration_updates": 1,
        }
    )


def test_kl_bounds_are_checked():
    """``0 <= kl_min <= kl_init <= kl_max``, ``kl_init = 0`` only with ``kl_max = 0``, and the rate below 1."""
    for bad in ({"kl_min": 2e-7}, {"kl_max": 5e-8}, {"kl_init": 0.0, "kl_min": 0.0}):
        with pytest.raises(ValueError):
            SageGRPO(**bad)
    for key, value in (("kl_rate", 1.0), ("kl_target", 0.0), ("clip_range", 0.0), ("anchor_weight", -1.0)):
        with pytest.raises(ValueError, match=f"objective.{key}"):
            SageGRPO(**{key: value})
    assert SageGRPO(kl_init=0.0, kl_min=0.0, kl_max=0.0).beta == 0.0
    assert torch.isfinite(torch.tensor(SageGRPO(kl_rate=0.0).kl_rate))


def test_equaliser_scales_skip_zero_and_non_finite_sensitivities():
    """``median / g`` over the finite, positive g only (lower median); a zero or NaN g gets the scale 1."""
    from flowrl.objectives.sage_grpo import equaliser_scales

    g = torch.tensor([0.0, 1.0, 2.0, 4.0, float("nan")], dtype=torch.float64)
    assert equaliser_scales(g).tolist() == [1.0, 2.0, 1.0, 0.5, 1.0]
    assert equaliser_scales(torch.tensor([0.0, float("nan")])).tolist() == [1.0, 1.0]


def test_flat_edges_weigh_the_kept_rows_of_the_chunk():
    """A flat chunk's edge weights are ``keep * mb.weight / kept`` (unkept rows weigh 0), on j -> j + 1."""
    from types import SimpleNamespace

    from flowrl.objectives.base import Microbatch, RolloutBatch
    from flowrl.objectives.sage_grpo import flat_edges

    latents = torch.arange(4 * 3 * 2, dtype=torch.float32).reshape(4, 3, 2)
    traj = SimpleNamespace(latents=latents, log_probs=torch.zeros(4, 2), sigmas=None, noise_levels=None, sde="sde")
    keep = torch.tensor([True, False, True, True])
    batch = RolloutBatch(["p"] * 4, torch.zeros(4), {}, latents[:, -1], traj, None, None, torch.ones(4),
                         torch.arange(4.0), keep, 4)  # fmt: skip
    edges = flat_edges(batch, Microbatch(torch.tensor([0, 1, 2]), 1, weight=0.8))
    torch.testing.assert_close(edges.weights, torch.tensor([0.4, 0.0, 0.4]), rtol=0, atol=0)
    assert torch.equal(edges.x, latents[:3, 1]) and torch.equal(edges.x_next, latents[:3, 2])
    assert edges.advantages.tolist() == [0.0, 1.0, 2.0] and edges.noise_scale == 1.0
