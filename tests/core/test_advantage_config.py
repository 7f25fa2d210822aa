"""The ``advantage`` config section and :class:`AdvantageEstimator`, the trainer's advantage entry point.

The group methods must be exactly :func:`compute_advantages` (the estimator only dispatches);
``per_prompt`` must be exactly DDPO's :class:`StatTracker` on the weighted reward, plus the clip.
"""

from __future__ import annotations

import json
import math
import typing

import pytest
import torch

from flowrl.advantages import ADVANTAGE_METHODS, AdvantageEstimator, AdvantageStats, StatTracker
from flowrl.advantages.group import compute_advantages, weighted_sum
from flowrl.config import AdvantageConfig, ConfigError, load_config

NAN = math.nan


def batch() -> tuple[dict[str, torch.Tensor], dict[str, float], torch.Tensor, list[str]]:
    """Two rewards (with NaNs), 3 groups of 3, one constant group; prompts match the groups."""
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(9, generator=gen, dtype=torch.float64)
    b = torch.rand(9, generator=gen, dtype=torch.float64)
    a[6:] = 0.5
    b[6:] = NAN
    a[1], b[1] = NAN, NAN
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    prompts = [f"prompt {int(g)}" for g in group_ids]
    return {"a": a, "b": b}, {"a": 1.0, "b": 0.5}, group_ids, prompts


# -- config -----------------------------------------------------------------------------------------


def test_config_defaults_and_per_prompt_keys():
    cfg = load_config(None)
    assert (cfg.advantage.method, cfg.advantage.buffer_size, cfg.advantage.min_count) == ("sum", 16, 16)
    cfg = load_config(None, ["advantage.method=per_prompt", "advantage.buffer_size=32", "advantage.min_count=8"])
    assert (cfg.advantage.method, cfg.advantage.buffer_size, cfg.advantage.min_count) == ("per_prompt", 32, 8)


def test_config_methods_match_the_estimator():
    hints = typing.get_type_hints(AdvantageConfig)
    assert typing.get_args(hints["method"]) == ADVANTAGE_METHODS


@pytest.mark.parametrize(
    "override, fragment",
    [
        (["advantage.method=ddpo"], "'advantage.method' must be one of 'sum', 'gdpo', 'median', 'per_prompt'"),
        (["advantage.buffer_size=0"], "'advantage.buffer_size' must be >= 1; got 0"),
        (["advantage.min_count=0"], "'advantage.min_count' must be >= 1; got 0"),
        (["advantage.buffer_size=1.5"], "'advantage.buffer_size' must be int; got 1.5"),
        (["advantage.min_count=17"], "'advantage.min_count' must be <= 'advantage.buffer_size' (16); got 17"),
        (["advantage.buffer_size=4"], "'advantage.min_count' must be <= 'advantage.buffer_size' (4); got 16"),
    ],
)
def test_config_rejects_bad_advantage_keys(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    message = str(err.value)
    assert fragment in message and "command line" in message and "\n" not in message


def test_config_cross_check_sees_all_layers(tmp_path):
    # min_count in one file, the larger buffer in the next: only the merged section is checked
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("advantage:\n  min_count: 32\n")
    second.write_text("advantage:\n  buffer_size: 64\n")
    cfg = load_config([first, second])
    assert (cfg.advantage.min_count, cfg.advantage.buffer_size) == (32, 64)
    with pytest.raises(ConfigError, match=r"a\.yaml: 'advantage.min_count' must be <="):
        load_config(first)


def test_from_config():
    cfg = load_config(None, ["advantage.method=per_prompt", "advantage.buffer_size=8", "advantage.min_count=2"])
    estimator = AdvantageEstimator.from_config(cfg.advantage)
    assert (estimator.method, estimator.std, estimator.eps, estimator.clip) == ("per_prompt", "global", 1e-4, 5.0)
    assert (estimator.tracker.buffer_size, estimator.tracker.min_count, estimator.tracker.eps) == (8, 2, 1e-4)
    assert AdvantageEstimator.from_config(load_config(None).advantage).tracker is None


# -- estimator --------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["sum", "gdpo", "median"])
@pytest.mark.parametrize("std", ["global", "group", "none"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_group_methods_are_exactly_compute_advantages(method, std, clip):
    components, weights, group_ids, prompts = batch()
    estimator = AdvantageEstimator(method, std=std, eps=1e-3, clip=clip)
    adv, keep, stats = estimator(components, weights, group_ids, prompts)
    expected = compute_advantages(components, weights, group_ids, method=method, std=std, eps=1e-3, clip=clip)
    ref_adv, ref_keep, ref_stats = expected
    assert torch.equal(adv, ref_adv) and adv.dtype == torch.float32
    assert torch.equal(keep, ref_keep)
    assert stats == ref_stats
    assert estimator.state_dict() == {}


def test_per_prompt_is_the_stat_tracker_on_the_weighted_sum():
    components, weights, group_ids, prompts = batch()
    estimator = AdvantageEstimator("per_prompt", eps=1e-6, clip=None, buffer_size=4, min_count=3)
    twin = StatTracker(buffer_size=4, min_count=3, eps=1e-6)
    for step in range(3):  # step 0: batch stats; steps 1, 2: each prompt's own history
        scaled = {k: v * (step + 1) for k, v in components.items()}
        adv, keep, stats = estimator(scaled, weights, group_ids, prompts)
        total = weighted_sum(scaled, weights)
        assert torch.equal(adv, twin.update(prompts, total))
        assert keep.tolist() == (~torch.isnan(total)).tolist()
        assert isinstance(stats, AdvantageStats)
        counts = (stats.num_groups, stats.zero_std_groups, stats.num_samples, stats.kept, stats.not_applicable)
        assert counts == (3, 0, 9, 8, 1)
        assert stats.std == float(total[~torch.isnan(total)].std(unbiased=False))
    assert estimator.tracker.history == twin.history


def test_per_prompt_by_hand():
    estimator = AdvantageEstimator("per_prompt", eps=1.0, clip=None, buffer_size=2, min_count=1)
    rewards, groups = {"r": torch.tensor([1.0, 3.0, 10.0])}, torch.tensor([0, 0, 1])
    adv, keep, _ = estimator(rewards, {"r": 2.0}, groups, ["a", "a", "b"])
    # weighted (2, 6, 20); a's history (2, 6): mean 4, std 2 -> -+2 / (2 + 1); b's (20,): std 0 -> 0, still kept
    torch.testing.assert_close(adv, torch.tensor([-2 / 3, 2 / 3, 0.0]))
    assert keep.tolist() == [True, True, True]
    adv, _, _ = estimator({"r": torch.tensor([9.0])}, {"r": 1.0}, torch.tensor([0]), ["a"])
    # a keeps its last 2 rewards, (6, 9): mean 7.5, std 1.5 -> 1.5 / 2.5
    torch.testing.assert_close(adv, torch.tensor([0.6]))


def test_per_prompt_clip_counts():
    estimator = AdvantageEstimator("per_prompt", eps=0.0, clip=0.5, buffer_size=4, min_count=1)
    adv, keep, stats = estimator({"r": torch.tensor([0.0, 4.0])}, {"r": 1.0}, torch.tensor([0, 0]), ["a", "a"])
    assert adv.tolist() == [-0.5, 0.5] and keep.all() and stats.clipped == 2  # raw (-1, 1)


def test_estimator_rejects_bad_arguments():
    with pytest.raises(ValueError, match="advantage.method must be one of"):
        AdvantageEstimator("ddpo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="advantage.std"):
        AdvantageEstimator("sum", std="batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="advantage.clip"):
        AdvantageEstimator("sum", clip=0.0)
    with pytest.raises(ValueError, match="advantage.eps"):
        AdvantageEstimator("sum", eps=-1e-4)
    with pytest.raises(ValueError, match="min_count <= buffer_size"):
        AdvantageEstimator("per_prompt", buffer_size=2, min_count=3)
    components, weights, group_ids, prompts = batch()
    for method in ADVANTAGE_METHODS:
        with pytest.raises(ValueError, match="one prompt per sample"):
            AdvantageEstimator(method)(components, weights, group_ids, prompts[:-1])


# -- state ------------------------------------------------------------------------------------------


def test_state_round_trips_through_json():
    components, weights, group_ids, prompts = batch()
    estimator = AdvantageEstimator("per_prompt", buffer_size=4, min_count=2)
    estimator(components, weights, group_ids, prompts)
    state = json.loads(json.dumps(estimator.state_dict()))
    assert state == {"method": "per_prompt", "history": estimator.tracker.history}
    twin = AdvantageEstimator("per_prompt", buffer_size=4, min_count=2)
    twin.load_state_dict(state)
    assert twin.tracker.history == estimator.tracker.history
    adv, keep, stats = estimator(components, weights, group_ids, prompts)
    twin_adv, twin_keep, twin_stats = twin(components, weights, group_ids, prompts)
    assert torch.equal(adv, twin_adv) and torch.equal(keep, twin_keep) and stats == twin_stats
    twin.load_state_dict({})  # a fresh start
    assert twin.tracker.history == {}


def test_state_keeps_the_configured_settings():
    saved = {"method": "per_prompt", "history": {"a": [1.0, 2.0, 3.0, 4.0]}}
    smaller = AdvantageEstimator("per_prompt", buffer_size=2, min_count=1)
    smaller.load_state_dict(saved)
    assert smaller.tracker.history == {"a": [3.0, 4.0]}  # newest rewards kept
    assert (smaller.tracker.buffer_size, smaller.tracker.min_count) == (2, 1)


def test_state_errors():
    saved = {"method": "per_prompt", "history": {"a": [1.0]}}
    stateless = AdvantageEstimator("sum")
    stateless.load_state_dict({})
    with pytest.raises(ValueError, match="advantage.method is 'sum'") as err:
        stateless.load_state_dict(saved)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="advantage state must be"):
        AdvantageEstimator("per_prompt").load_state_dict({"history": [1.0]})
