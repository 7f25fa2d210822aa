"""Async scoring (train.rewards_async): chunk k is scored while chunk k + 1 samples, bit-identically."""

import threading
import time

import pytest
import torch
from conftest import tiny_sd3_pipeline

from flowrl.config import load_config
from flowrl.models.sd3 import SD3Adapter
from flowrl.policy import build_policy
from flowrl.prompts.sets import load_prompts
from flowrl.rewards import MultiReward, RewardError, ink
from flowrl.rollouts.scoring import RolloutScorer, batch_index
from flowrl.trainer import Trainer

FAST = [
    "prompts.per_iteration=4",
    "prompts.group_size=3",
    "sampler.num_steps=3",
    "sampler.chunk_size=5",
    "train.eval_seeds=1",
    "objective.kl_beta=0.01",
    "optim.lr=0.01",
]


class SlowInk:
    """The ink reward, slowed down so that scoring and sampling really interleave; logs its thread."""

    allows_nan = True

    def __init__(self, events, delay=0.02):
        self.events, self.delay, self.ink = events, delay, ink("prompt")
        self.started = threading.Event()

    def __call__(self, images, prompts, **metadata):
        caller = threading.current_thread().name.split("@")[-1]  # a reward runs on "reward-<name>@<caller>"
        self.events.append(("score-start", caller, time.perf_counter()))
        self.started.set()
        time.sleep(self.delay)
        out = self.ink(images, prompts, **metadata)
        self.events.append(("score-end", caller, time.perf_counter()))
        return out


def trainer(async_, *extra, reward=None, events=None):
    cfg = load_config(None, FAST + [f"train.rewards_async={str(async_).lower()}", *extra])
    events = [] if events is None else events
    reward = reward or MultiReward({"ink": (SlowInk(events), 1.0), "ink_bold": (ink("bold"), 0.5)})
    prompts = load_prompts("digits-styles")
    model = SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8))
    return Trainer(cfg, build_policy(cfg, model=model, trainable=True), reward, prompts, prompts[:2])


def assert_same_iteration(sync, other):
    """Collect and update once on both trainers; everything must match bit for bit."""
    a, info_a = sync.collect()
    b, info_b = other.collect()
    assert torch.equal(a.rewards, b.rewards) and torch.equal(a.advantages, b.advantages)
    assert torch.equal(a.keep, b.keep) and torch.equal(a.images, b.images) and torch.equal(a.samples, b.samples)
    if a.trajectory is not None:
        assert torch.equal(a.trajectory.latents, b.trajectory.latents)
        assert torch.equal(a.trajectory.log_probs, b.trajectory.log_probs)
    for key in info_a:
        assert torch.equal(info_a[key].nan_to_num(), info_b[key].nan_to_num()), key
    assert sync.update(a) == other.update(b)
    sync.iteration += 1
    other.iteration += 1


def assert_same_weights(sync, other):
    assert torch.equal(sync.generator.get_state(), other.generator.get_state())
    for (n, p), (_, q) in zip(sync.model.transformer.named_parameters(), other.model.transformer.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("objective", ["flow_grpo", "diffusion_nft"])
def test_async_scoring_is_bit_identical(objective):
    sync, threaded = trainer(False, f"objective.name={objective}"), trainer(True, f"objective.name={objective}")
    for _ in range(2):  # second iteration: after an update computed from the first iteration's rewards
        assert_same_iteration(sync, threaded)
    assert_same_weights(sync, threaded)


def test_chunks_are_scored_on_a_worker_while_sampling():
    events = []
    t = trainer(True, "prompts.per_iteration=6", events=events)  # 18 samples: chunks of 5, 5, 5, 3
    slow = t.reward.rewards["ink"][0]
    slow.delay = 0.3
    velocity = t.model.velocity
    calls = []

    def logged_velocity(x, sigma, cond):
        calls.append(1)
        if len(calls) == 4:  # first step of chunk 1 (3 steps per chunk): chunk 0 is with the worker
            # wait until the worker is scoring chunk 0, so a slow decode on a loaded host can't
            # make the main thread finish sampling first (that would hang in sync mode: never set)
            assert slow.started.wait(timeout=60)
        events.append(("velocity", threading.current_thread().name, time.perf_counter()))
        return velocity(x, sigma, cond)

    t.model.velocity = logged_velocity
    t.collect()
    scores = [e for e in events if e[0].startswith("score")]
    worker = [e for e in scores if e[1].startswith("flowrl-scoring")]
    assert len(scores) == 8 and scores[0][1].startswith("flowrl-scoring")  # the trainer may score the tail itself
    first_start, first_end = worker[0][2], worker[1][2]
    overlapped = [e for e in events if e[0] == "velocity" and first_start < e[2] < first_end]
    assert overlapped and all(name == threading.current_thread().name for _, name, _ in overlapped)
    assert not [th for th in threading.enumerate() if th.name.startswith("flowrl-scoring")]  # worker stopped


@pytest.mark.parametrize("async_", [False, True])
def test_failing_reward_names_reward_and_batch(async_):
    def broken(images, prompts, **metadata):
        raise RuntimeError("judge crashed\ntraceback noise")

    t = trainer(async_, reward=MultiReward({"judge": (broken, 1.0)}))
    t.iteration = 2  # 12 samples in chunks of 5, 5, 2: this iteration's first batch index is 2 * 3
    with pytest.raises(RewardError) as info:
        t.collect()
    assert str(info.value) == "reward 'judge' (batch 6) raised RuntimeError: judge crashed"
    assert batch_index(2, 1, 12, 5) == 7
    assert not [th for th in threading.enumerate() if th.name.startswith("flowrl-scoring")]


@pytest.mark.parametrize("async_", [False, True])
def test_all_nan_is_checked_on_the_whole_batch(async_):
    def first_rows_only(images, prompts, **metadata):
        keep = torch.tensor(["bold" in p for p in prompts])
        return torch.where(keep, images.mean(dim=(1, 2, 3)), torch.tensor(float("nan"))).float()

    first_rows_only.allows_nan = True
    scorer = RolloutScorer(
        MultiReward({"partial": (first_rows_only, 1.0)}),
        lambda z: z,
        ["a bold 1"] * 5 + ["x"] * 5,
        threaded=async_,
        first_index=4,
    )
    with scorer:
        scorer.submit(slice(0, 5), torch.rand(5, 3, 2, 2))
        scorer.submit(slice(5, 10), torch.rand(5, 3, 2, 2))  # all NaN in this chunk: fine, the batch is not
        images, out = scorer.result(torch.zeros(10, 3, 2, 2))
    assert images.shape == (10, 3, 2, 2) and out.components["partial"][5:].isnan().all()
    scorer = RolloutScorer(
        MultiReward({"partial": (first_rows_only, 1.0)}), lambda z: z, ["x"] * 10, threaded=async_, first_index=4
    )
    with scorer, pytest.raises(RewardError, match=r"reward 'partial' \(batch 4-5\) returned NaN for every sample"):
        scorer.submit(slice(0, 5), torch.rand(5, 3, 2, 2))
        scorer.submit(slice(5, 10), torch.rand(5, 3, 2, 2))
        scorer.result(torch.zeros(10, 3, 2, 2))


def test_rollout_without_chunk_reports_is_scored_whole():
    scorer = RolloutScorer(MultiReward({"ink": (ink("bold"), 1.0)}), lambda z: z, ["p"] * 3, threaded=True)
    x = torch.rand(3, 3, 4, 4)
    with scorer:
        images, out = scorer.result(x)
    assert torch.equal(images, x) and torch.equal(out.total, x.mean(dim=(1, 2, 3)))


def test_only_per_sample_metadata_is_cut_to_each_job() -> None:
    """A metadata entry of length B is cut to each job's rows; any other value reaches every job whole."""
    seen: list[dict] = []

    def record(images: torch.Tensor, prompts: list[str], **metadata: object) -> torch.Tensor:
        seen.append(metadata)
        return images.mean(dim=(1, 2, 3))

    metadata = {"digit": [0, 1, 2, 3], "pair": ["a", "b"], "scale": 2.0}
    scorer = RolloutScorer(MultiReward({"r": (record, 1.0)}), lambda z: z, ["p"] * 4, metadata, score_chunk_size=2)
    x = torch.rand(4, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    with scorer:
        scorer.submit(slice(0, 4), x)
        _, out = scorer.result(x)
    assert seen == [
        {"digit": [0, 1], "pair": ["a", "b"], "scale": 2.0},
        {"digit": [2, 3], "pair": ["a", "b"], "scale": 2.0},
    ]
    assert torch.equal(out.total, x.mean(dim=(1, 2, 3)))


def test_a_score_chunk_size_below_one_is_refused() -> None:
    """score_chunk_size=0 would cut no jobs: refused at construction."""
    with pytest.raises(ValueError, match="score_chunk_size must be >= 1 or None; got 0"):
        RolloutScorer(MultiReward({"ink": (ink("bold"), 1.0)}), lambda z: z, ["p"] * 2, score_chunk_size=0)


@pytest.mark.parametrize("reported", [[(2, 4), (0, 2)], [(0, 2), (3, 4)]])
def test_chunks_that_do_not_tile_the_batch_in_order_are_a_bug(reported: list[tuple[int, int]]) -> None:
    """Rewards are concatenated in job order, so chunks out of order or with a gap are refused, not misassigned."""
    scorer = RolloutScorer(MultiReward({"ink": (ink("bold"), 1.0)}), lambda z: z, ["p"] * 4)
    x = torch.rand(4, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    with scorer:
        for start, stop in reported:
            scorer.submit(slice(start, stop), x[start:stop])
        with pytest.raises(ValueError, match="do not cover the batch of 4 in order"):
            scorer.result(x)


def test_a_job_taken_back_from_the_worker_keeps_its_batch_index() -> None:
    """The tail the caller scores itself names its own batch index in errors, as the worker would have."""
    gate = threading.Event()

    def judge(images: torch.Tensor, prompts: list[str], **metadata: object) -> torch.Tensor:
        if prompts[0] == "first":
            gate.wait(timeout=30)  # hold the worker on job 0 until the caller has taken the others back
        gate.set()
        if prompts[0] == "bad":
            raise RuntimeError("judge crashed")
        return images.mean(dim=(1, 2, 3))

    reward = MultiReward({"judge": (judge, 1.0)})
    scorer = RolloutScorer(reward, lambda z: z, ["first", "ok", "bad"], threaded=True, first_index=10)
    x = torch.rand(3, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RewardError) as info:
        with scorer:
            for i in range(3):
                scorer.submit(slice(i, i + 1), x[i : i + 1])
            scorer.result(x)
    assert str(info.value) == "reward 'judge' (batch 12) raised RuntimeError: judge crashed"
