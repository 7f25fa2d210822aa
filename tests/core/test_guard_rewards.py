"""Reward-hacking guards: the tracker's trip rule, the config section, and planted degradations."""

import json
import math
import re

import pytest
import torch

from flowrl.config import ConfigError, load_config
from flowrl.evaluation import mean_ci
from flowrl.evaluation.guard_rewards import GuardSpec, GuardTracker, parse_guards
from flowrl.evaluation.heldout import HeldOutEvaluation, as_uint8, heldout_inputs
from flowrl.prompts.batch import collate
from flowrl.prompts.files import Prompt
from flowrl.rewards import build_multi_reward


def test_trips_only_when_guard_falls_past_tolerance_while_reward_rises():
    tracker = GuardTracker([GuardSpec("g", tolerance=0.1)])
    assert tracker.update(0, {"g": 0.9}, reward=0.2) == ([], True)
    assert tracker.update(10, {"g": 0.85}, reward=0.3) == ([], True)  # within tolerance
    trips, healthy = tracker.update(20, {"g": 0.79}, reward=0.1)  # fell, but the reward fell too: not hacking
    assert trips == [] and not healthy
    trips, healthy = tracker.update(30, {"g": 0.7}, reward=0.5)
    assert [(t.name, t.best, t.best_iteration, t.value, t.iteration) for t in trips] == [("g", 0.9, 0, 0.7, 30)]
    assert "guard 'g' fell from its best 0.9 (iteration 0) to 0.7 at iteration 30" in trips[0].message()
    assert tracker.update(40, {"g": 0.6}, reward=0.6)[0] == []  # still tripped: warned once
    assert tracker.update(50, {"g": 0.88}, reward=0.6) == ([], True)  # recovered
    assert len(tracker.update(60, {"g": 0.5}, reward=0.7)[0]) == 1  # trips again
    assert tracker.kept_iteration == 50 and len(tracker.trips) == 2


def test_a_fallen_guard_warns_once_until_it_recovers_and_is_counted_while_fallen():
    """The trained reward dipping while the guard stays fallen is not a recovery."""
    tracker = GuardTracker([GuardSpec("g", tolerance=0.05)])
    seen = []
    for iteration, value, reward in [(0, 1.0, 1.0), (1, 0.8, 1.2), (2, 0.8, 0.9), (3, 0.8, 1.3), (4, 0.99, 1.3)]:
        trips, _ = tracker.update(iteration, {"g": value}, reward)
        seen.append((len(trips), tracker.metrics()["guard/tripped"]))
    assert seen == [(0, 0.0), (1, 1.0), (0, 1.0), (0, 1.0), (0, 0.0)] and len(tracker.trips) == 1


def test_relative_tolerance_and_nan_skipped():
    spec = GuardSpec("d", tolerance=0.2, relative=True)
    assert spec.allowed_fall(0.5) == pytest.approx(0.1)
    tracker = GuardTracker([spec])
    tracker.update(0, {"d": 0.5}, reward=0.0)
    assert tracker.update(1, {"d": 0.41}, reward=1.0) == ([], True)
    assert tracker.update(2, {"d": math.nan}, reward=1.0) == ([], True)  # not measured: no verdict
    assert len(tracker.update(3, {"d": 0.39}, reward=1.0)[0]) == 1


def test_state_round_trip():
    tracker = GuardTracker([GuardSpec("g", 0.05, on_trip="stop")])
    tracker.update(0, {"g": 1.0}, 0.0)
    tracker.update(5, {"g": 0.5}, 1.0)
    again = GuardTracker([GuardSpec("g", 0.05, on_trip="stop")])
    again.load_state_dict(tracker.state_dict())
    assert again.state_dict() == tracker.state_dict() and again.tripped == {"g"}
    assert again.update(6, {"g": 0.4}, 2.0)[0] == []  # already tripped before the resume: no second warning


def test_trip_rule_boundaries():
    """A fall of exactly the tolerance is within it; a reward equal to the reward at the best is not rising; a tie
    with the best keeps the first best (its iteration and reward); a non-finite value (inf too) is not measured.
    """
    tracker = GuardTracker([GuardSpec("g", tolerance=0.25)])
    tracker.update(0, {"g": 1.0}, reward=0.5)
    assert tracker.update(1, {"g": 1.0}, reward=2.0) == ([], True)  # a tie: the best stays iteration 0's
    assert tracker.update(2, {"g": 0.75}, reward=3.0) == ([], True)  # fell by exactly the tolerance
    assert tracker.update(3, {"g": 0.5}, reward=0.5) == ([], False)  # fell, the reward did not rise past 0.5
    assert tracker.update(4, {"g": math.inf}, reward=0.5) == ([], True)  # not measured: no verdict
    assert tracker.update(5, {"g": -math.inf}, reward=0.5) == ([], True)
    trips, healthy = tracker.update(6, {"g": 0.5}, reward=1.0)  # risen past iteration 0's 0.5, not past 2.0
    assert [(t.best, t.best_iteration) for t in trips] == [(1.0, 0)] and not healthy
    assert tracker.summary()["best"] == {"g": {"value": 1.0, "iteration": 0}}


def test_one_fallen_guard_makes_the_evaluation_unhealthy_and_is_counted_without_a_trip():
    """``healthy`` needs every guard within tolerance (the first fallen one is not forgotten by a later healthy
    one); ``guard/tripped`` counts guards fallen now, tripped or not (here the reward fell, so no trip).
    """
    tracker = GuardTracker([GuardSpec("a", tolerance=0.1), GuardSpec("b", tolerance=0.1)])
    tracker.update(0, {"a": 1.0, "b": 1.0}, reward=1.0)
    assert tracker.update(1, {"a": 0.5, "b": 1.0}, reward=0.5) == ([], False)
    assert tracker.metrics() == {"guard/a_best": 1.0, "guard/b_best": 1.0, "guard/tripped": 1.0}
    assert tracker.kept_iteration == 0


def test_state_keeps_the_reward_at_the_best_and_reads_older_checkpoints():
    """The reward at each guard's best survives a resume (a later fall trips only past it); a checkpoint from
    before ``fallen`` was stored counts its tripped guards as fallen.
    """
    tracker = GuardTracker([GuardSpec("g", 0.05)])
    tracker.update(0, {"g": 1.0}, reward=1.0)
    again = GuardTracker([GuardSpec("g", 0.05)])
    again.load_state_dict(json.loads(json.dumps(tracker.state_dict())))
    assert again.update(1, {"g": 0.5}, reward=0.5) == ([], False)  # the reward fell below 1.0: no trip
    old = {"best": {"g": [1.0, 0, 1.0]}, "tripped": ["g"], "trips": [], "kept_iteration": 0}
    older = GuardTracker([GuardSpec("g", 0.05)])
    older.load_state_dict(old)
    assert older.fallen == {"g"} and older.metrics()["guard/tripped"] == 1.0


def test_parse_guards_splits_guard_keys_from_reward_options():
    specs = parse_guards(
        {"digit_correctness": {"tolerance": 0.05, "on_trip": "stop"}, "diversity": {"tolerance": 0.2, "relative": True}}
    )
    assert specs[0] == GuardSpec("digit_correctness", 0.05, False, "stop", {})
    assert specs[1].is_monitor and specs[1].relative
    assert parse_guards({"bright": {"reward": "ink", "target": "bold"}})[0].options == {
        "reward": "ink",
        "target": "bold",
    }


def test_guard_spec_defaults_and_relative_tolerance_of_a_negative_best():
    """An entry with no guard keys warns (never stops) at tolerance 0.05; a relative tolerance is a share of |best|,
    so a guard whose best is negative still has a positive allowed fall.
    """
    assert parse_guards({"g": None})[0] == GuardSpec("g", 0.05, False, "warn", {})
    assert GuardSpec("g", 0.1, relative=True).allowed_fall(-2.0) == pytest.approx(0.2)
    tracker = GuardTracker([GuardSpec("g", 0.1, relative=True)])
    tracker.update(0, {"g": -2.0}, reward=0.0)
    assert tracker.update(1, {"g": -2.15}, reward=1.0) == ([], True)  # fell 0.15 <= 0.1 * |-2|
    assert len(tracker.update(2, {"g": -2.25}, reward=1.0)[0]) == 1


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"tolerance": True}, "'guards.g.tolerance' must be a finite number >= 0; got True"),
        ({"tolerance": float("nan")}, "'guards.g.tolerance' must be a finite number >= 0; got nan"),
        ({"tolerance": float("inf")}, "'guards.g.tolerance' must be a finite number >= 0; got inf"),
        ({"relative": "yes"}, "'guards.g.relative' must be true or false; got 'yes'"),
    ],
)
def test_parse_guards_refuses_a_bad_tolerance_or_relative(entry, message):
    """A bool, NaN or infinite tolerance (a guard that could never trip) and a non-bool ``relative`` are refused."""
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        parse_guards({"g": entry})


def test_a_guard_is_the_trained_reward_only_with_the_same_options():
    """Guard and trained reward are compared by reward factory and options: other options make another scorer (a
    guard may watch the other style of the trained ``ink``), while ``timeout_s`` or ``weight`` alone do not.
    """
    rewards = {"ink": {"target": "thin", "weight": 1.0}}
    assert parse_guards({"bright": {"reward": "ink", "target": "bold"}}, rewards)[0].options == {
        "reward": "ink",
        "target": "bold",
    }
    with pytest.raises(ValueError, match="'guards.same' scores what the trained reward rewards.ink scores"):
        parse_guards({"same": {"reward": "ink", "target": "thin", "timeout_s": 30}}, rewards)
    with pytest.raises(ValueError, match="'guards.same' scores what the trained reward rewards.ink scores"):
        parse_guards({"same": {"reward": "ink", "target": "thin"}}, {"ink": {"target": "thin", "timeout_s": 5}})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("guards.ink.tolerance=0.1", "'guards.ink' is also a trained reward"),
        ("guards.legible.reward=digit_correctness", "'guards.legible' scores what the trained reward rewards.digit"),
        ("guards.g.tolerance=-1", "'guards.g.tolerance' must be >= 0"),
        ("guards.g.on_trip=halt", "'guards.g.on_trip' must be one of 'warn', 'stop'"),
        ("guards.g.weight=1", "'guards.g.weight' has no meaning"),
        ("guards.diversity.target=bold", "'guards.diversity' is a monitor"),
        ("output.image_every=3", "'output.image_every' (3) must be a multiple of 'train.eval_every' (10)"),
    ],
)
def test_config_refuses_bad_guards(override, message):
    with pytest.raises(ConfigError, match="^default config \\+ command line: ") as err:
        load_config(None, ["rewards.ink.target=prompt", override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_diversity_guard_needs_two_seeds():
    with pytest.raises(ConfigError, match="guards.diversity needs 'train.eval_seeds' >= 2"):
        load_config(None, ["guards.diversity.tolerance=0.2", "train.eval_seeds=1"])


# -- planted degradations on the held-out evaluation (real rewards, images made to degrade) ---------------


PROMPTS = [Prompt("a bold 3", {}), Prompt("a thin 7", {})]


def _digits_like(seed: int, n: int) -> torch.Tensor:
    """(n, 3, 8, 8) sparse bright strokes on black, different per seed."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(n, 1, 8, 8, generator=gen) > 0.6).float()
    return mask.expand(n, 3, 8, 8) * 0.9


def _evaluation(guards):
    trained = build_multi_reward({"ink": {"target": "thin"}})
    specs = parse_guards(guards)
    scored = {s.name: s.options for s in specs if not s.is_monitor}
    guard_reward = build_multi_reward(scored) if scored else None
    return HeldOutEvaluation(PROMPTS, 3, 1000, trained, specs, guard_reward, collate=collate)


def _sampler(transform):
    def sample(prompts, seeds):
        return transform(torch.cat([_digits_like(s, 1) for s in seeds]))

    return sample


def test_healthy_run_does_not_trip_and_reads_no_drift():
    ev = _evaluation({"bright": {"reward": "ink", "target": "bold", "tolerance": 0.02}, "diversity": {}})
    same = _sampler(lambda x: x)
    for it in range(3):
        result = ev.run(same, same, it)
        assert result.trips == [] and result.healthy
    assert result.metrics["eval/drift"] == 0.0 and result.metrics["eval/diversity_ratio"] == pytest.approx(1.0)
    assert result.metrics["guard/bright"] == result.metrics["guard/bright_best"]
    assert ev.tracker.kept_iteration == 2


def test_black_images_trip_the_brightness_guard():
    ev = _evaluation({"bright": {"reward": "ink", "target": "bold", "tolerance": 0.02, "on_trip": "stop"}})
    base = _sampler(lambda x: x)
    assert ev.run(base, base, 0).trips == []
    fading = ev.run(_sampler(lambda x: x * 0.3), base, 10)  # the "thin" reward rises by dimming the strokes
    assert fading.metrics["eval/reward_mean"] > ev.tracker.best["bright"].reward
    assert [t.name for t in fading.trips] == ["bright"] and fading.trips[0].on_trip == "stop"
    assert fading.metrics["eval/drift"] > 0.1 and not fading.healthy
    assert ev.tracker.kept_iteration == 0  # the base evaluation is the last one every guard vouched for


def test_collapsed_samples_trip_the_diversity_guard():
    ev = _evaluation({"diversity": {"tolerance": 0.5, "relative": True}})
    base = _sampler(lambda x: x)
    ev.run(base, base, 0)

    def collapsed(prompts, seeds):  # every seed gives the same, slightly dimmer image (reward up)
        return _digits_like(0, 1).expand(len(seeds), -1, -1, -1) * 0.8

    result = ev.run(collapsed, base, 5)
    assert result.metrics["eval/diversity"] == 0.0 and [t.name for t in result.trips] == ["diversity"]


def test_heldout_inputs_and_quantisation():
    """Each prompt gets the seeds ``seed_base + j`` (the same for every prompt), grouped prompt-major; samples are
    clamped to [0, 1] and rounded (not truncated) to 8 bits, as a PNG holds them.
    """
    rows, seeds, groups = heldout_inputs(["a", "b"], 3, 100)
    assert rows == ["a", "a", "a", "b", "b", "b"] and seeds == [100, 101, 102, 100, 101, 102]
    assert groups.tolist() == [0, 0, 0, 1, 1, 1]
    assert as_uint8(torch.tensor([-0.5, 0.0, 0.999, 1.0, 2.0])).tolist() == [0, 0, 255, 255, 255]


def test_heldout_run_reads_nan_means_samples_the_base_once_and_builds_only_reward_guards():
    """Components and guards that do not apply to a prompt (NaN) are nan-means over the rest; eval/reward_ci95 is
    the interval's half width; the base model is sampled at the first evaluation only; ``from_config`` scores the
    reward guards (weight 1) and leaves the monitors to the evaluation.
    """
    prompts = [Prompt("a bold 3", {}), Prompt("a 5", {})]  # the second has no style: ink_band/stroke_width NaN
    specs = parse_guards({"stroke": {"reward": "stroke_width"}})
    trained = build_multi_reward({"ink_band": {}})
    ev = HeldOutEvaluation(
        prompts, 2, 0, trained, specs, build_multi_reward({"stroke": {"reward": "stroke_width"}}), collate=collate
    )
    calls = []

    def base(prompts, seeds):
        calls.append(len(seeds))
        return _sampler(lambda x: x)(prompts, seeds)

    for it in range(3):
        result = ev.run(_sampler(lambda x: x), base, it)
    assert calls == [4]
    scored = trained(result.images, ev.batch.texts, **ev.batch.metadata)
    assert math.isfinite(result.metrics["eval/ink_band"]) and math.isfinite(result.metrics["guard/stroke"])
    assert result.metrics["eval/ink_band"] == pytest.approx(float(scored.components["ink_band"][:2].mean()))
    assert result.metrics["eval/reward_ci95"] == pytest.approx(mean_ci(scored.total).half_width)
    cfg = load_config(None, ["guards.diversity.tolerance=0.2", "guards.bright.reward=ink", "train.eval_seeds=2"])
    built = HeldOutEvaluation.from_config(cfg, PROMPTS, trained, 0, collate)
    assert built.guard_reward.weights == {"bright": 1.0} and built.has_guards
