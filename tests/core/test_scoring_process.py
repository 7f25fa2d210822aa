"""train.rewards_async=process: chunks decoded and scored in a spawned worker, bit-identically, without hangs."""

import multiprocessing
import os
import re
import threading
import time

import pytest
import torch
from conftest import tiny_sd3_pipeline
from test_async_scoring import FAST, assert_same_iteration, assert_same_weights  # 12 samples in chunks of 5, 5, 2

from flowrl.config import ConfigError, load_config
from flowrl.models.sd3 import SD3Adapter
from flowrl.policy import build_policy
from flowrl.policy.memory import MemoryAdapter
from flowrl.prompts.sets import load_prompts
from flowrl.rewards import MultiReward, RewardError, ink
from flowrl.rollouts.scoring import RolloutScorer, batch_index
from flowrl.rollouts.scoring_process import ScoringProcess
from flowrl.trainer import Trainer


class TimedInk:
    """The ink reward, slowed down; appends (pid:caller thread, start, end) wall times to a file (picklable).

    A reward runs on its own thread (its deadline's), named "reward-<name>@<caller's thread>": the
    log names the caller, i.e. who scored the chunk.
    """

    allows_nan = True

    def __init__(self, log_path, delay=0.0):
        self.log_path, self.delay, self.ink = str(log_path), delay, ink("prompt")

    def __call__(self, images, prompts, **metadata):
        start = time.time()
        time.sleep(self.delay)
        out = self.ink(images, prompts, **metadata)
        with open(self.log_path, "a") as f:
            f.write(f"{os.getpid()}:{threading.current_thread().name.split('@')[-1]} {start} {time.time()}\n")
        return out


class Broken:
    def __call__(self, images, prompts, **metadata):
        raise RuntimeError("judge crashed\ntraceback noise")


class Exits:
    """Kills the scoring process it runs in (in the trainer's own process it scores like ink)."""

    def __call__(self, images, prompts, **metadata):
        if multiprocessing.parent_process() is not None:
            os._exit(3)
        return ink("prompt")(images, prompts, **metadata)


def trainer(mode, reward, *extra):
    cfg = load_config(None, FAST + [f"train.rewards_async={mode}", *extra])
    prompts = load_prompts("digits-styles")
    model = SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8))
    return Trainer(cfg, build_policy(cfg, model=model, trainable=True), reward, prompts, prompts[:2])


def inks(log_path, delay=0.0):
    return MultiReward({"ink": (TimedInk(log_path, delay), 1.0), "ink_bold": (ink("bold"), 0.5)})


@pytest.mark.parametrize("pieces", ["null", "2"])
def test_process_scoring_is_bit_identical_to_inline(tmp_path, pieces):
    extra = f"train.score_chunk_size={pieces}"
    inline, proc = (
        trainer("false", inks(tmp_path / "a.log"), extra),
        trainer("process", inks(tmp_path / "b.log"), extra),
    )
    try:
        for _ in range(2):  # the second iteration follows an update made from the first one's rewards
            assert_same_iteration(inline, proc)
        pids = [line.split(":")[0] for line in (tmp_path / "b.log").read_text().splitlines()]
        assert len(pids) == 2 * (
            3 if pieces == "null" else 7
        )  # 12 samples: chunks 5, 5, 2 -> pieces 2, 2, 1, 2, 2, 1, 2
        assert batch_index(1, 0, 12, 5, None if pieces == "null" else 2) == len(pids) // 2
        assert set(pids) - {str(os.getpid())}  # scored in another process (the trainer may take a share of the tail)
        assert proc._scoring_process is not None and proc._scoring_process._proc.is_alive()  # one worker for the run
    finally:
        proc.close()
    assert_same_weights(inline, proc)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_trainer_scores_the_tail_beside_the_worker(tmp_path, mode):
    log = tmp_path / "score.log"
    t = trainer(
        mode, inks(log, delay=0.4), "sampler.chunk_size=6", "train.score_chunk_size=3"
    )  # 12 samples: 4 jobs of 3
    try:
        if mode == "process":
            t.scoring_process()
        t.collect()
    finally:
        t.close()
    rows = [line.split() for line in log.read_text().splitlines()]
    assert len(rows) == 4
    me = f"{os.getpid()}:{threading.current_thread().name}"
    mine, theirs = [r for r in rows if r[0] == me], [r for r in rows if r[0] != me]
    assert mine and theirs  # the trainer scored the last job(s) itself, the worker the others
    assert any(
        float(a[1]) < float(b[2]) and float(b[1]) < float(a[2]) for a in mine for b in theirs
    )  # at the same time


def wait_for(path, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout:g} s")
        time.sleep(0.005)


class HandshakeInk:
    """Ink that, once started, waits until the trainer has evaluated the model (a marker file) before it ends.

    Its span then holds a model evaluation exactly when scoring and sampling run at the same time, whatever
    the machine's load: a trainer blocked by scoring never writes the marker and the span holds none.
    """

    allows_nan = True

    def __init__(self, folder):
        self.folder, self.ink = str(folder), ink("prompt")

    def __call__(self, images, prompts, **metadata):
        start = time.time()
        open(os.path.join(self.folder, "started"), "w").close()
        wait_for(os.path.join(self.folder, "sampled"))
        out = self.ink(images, prompts, **metadata)
        with open(os.path.join(self.folder, "score.log"), "a") as f:
            f.write(f"{os.getpid()} {start} {time.time()}\n")
        return out


def test_chunks_are_scored_in_the_worker_while_sampling(tmp_path):
    t = trainer("process", MultiReward({"ink": (HandshakeInk(tmp_path), 1.0)}), "prompts.per_iteration=6")
    velocity, calls, submitted = t.model.velocity, [], []
    worker = t.scoring_process()  # started before sampling: start-up is once per run
    submit = worker.submit

    def logged_submit(*args):
        submitted.append(True)
        return submit(*args)

    def logged_velocity(x, sigma, cond):
        if submitted:  # a chunk is with the worker: sample on only once it is being scored
            wait_for(tmp_path / "started")
        calls.append(time.time())
        out = velocity(x, sigma, cond)
        if (tmp_path / "started").exists():
            (tmp_path / "sampled").touch()
        return out

    worker.submit, t.model.velocity = logged_submit, logged_velocity
    try:
        t.collect()  # chunks 5, 5, 5, 3
    finally:
        t.close()
    spans = [line.split() for line in (tmp_path / "score.log").read_text().splitlines()]
    assert len(spans) == 4
    in_worker = [(float(a), float(b)) for pid, a, b in spans if pid != str(os.getpid())]
    overlapped = [c for c in calls if any(start <= c <= end for start, end in in_worker)]
    assert overlapped  # the trainer evaluated the model while the worker was scoring a chunk


class CudnnFlag:
    """Scores 1 where torch would let SDPA pick its cuDNN kernel in this process, 0 where it is off (picklable)."""

    def __call__(self, images, prompts, **metadata):
        return torch.full((images.shape[0],), float(torch.backends.cuda.cudnn_sdp_enabled()))


def test_the_worker_scores_under_the_training_attention_kernels():
    """Inline scoring runs inside Trainer.collect's trainable_attention; the worker process must too (same bits)."""
    reward = MultiReward({"flag": (CudnnFlag(), 1.0)})
    worker = ScoringProcess(reward, torch.nn.Identity())
    try:
        scorer = RolloutScorer(reward, torch.nn.Identity(), ["p"] * 3, worker=worker)
        x = torch.rand(3, 3, 4, 4)
        with scorer:
            scorer.submit(slice(0, 3), x)
            _, out = scorer.result(x)
    finally:
        worker.close()
    assert torch.backends.cuda.cudnn_sdp_enabled() and out.total.tolist() == [0.0, 0.0, 0.0]


def test_failing_reward_in_the_worker_names_reward_and_batch():
    t = trainer("process", MultiReward({"judge": (Broken(), 1.0)}))
    t.iteration = 2  # 12 samples in chunks of 5, 5, 2: this iteration's first batch index is 6
    try:
        with pytest.raises(RewardError) as info:
            t.collect()
        assert str(info.value) == "reward 'judge' (batch 6) raised RuntimeError: judge crashed"
    finally:
        t.close()


@pytest.mark.parametrize("name", ["quitter", "quitter " + "\u00e9\U0001f600" * 200])  # a name longer than any buffer
def test_dead_worker_fails_fast_with_one_line(name):
    t = trainer("process", MultiReward({name: (Exits(), 1.0)}))
    start = time.perf_counter()
    try:
        with pytest.raises(
            RewardError,
            match=rf"^scoring process died \(exit code 3\) in reward {re.escape(repr(name))} \(batch 0\); "
            r"rerun with train.rewards_async=thread",
        ):
            t.collect()
    finally:
        t.close()
    assert time.perf_counter() - start < 60


def test_unpicklable_reward_is_named_before_starting():
    lock_holder = lambda images, prompts, **metadata: images.mean(dim=(1, 2, 3))  # noqa: E731 - a lambda can't be pickled
    with pytest.raises(
        ValueError,
        match=r"^train.rewards_async=process: reward 'judge' can't be sent to a scoring process .*"
        r"use train.rewards_async=thread",
    ):
        ScoringProcess(MultiReward({"judge": (lock_holder, 1.0)}), lambda z: z)


def test_bound_decode_of_an_adapter_is_not_needed():
    model = SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8))
    z = torch.randn(2, *model.latent_shape(8, 8))
    assert torch.equal(model.decoder()(z), model.decode(z))
    with pytest.raises(ValueError, match="memory.offload_vae=true and train.rewards_async=process can't be combined"):
        MemoryAdapter(model, offload_vae=True).decoder()


def test_rollout_scorer_with_a_worker_gathers_chunks(tmp_path):
    reward = MultiReward({"ink": (ink("bold"), 1.0)})
    worker = ScoringProcess(reward, torch.nn.Identity())
    try:
        scorer = RolloutScorer(reward, torch.nn.Identity(), ["p"] * 7, worker=worker)
        x = torch.rand(7, 3, 4, 4)
        with scorer:
            scorer.submit(slice(0, 4), x[:4])
            scorer.submit(slice(4, 7), x[4:])
            images, out = scorer.result(x)
        assert torch.equal(images, x) and torch.equal(out.total, x.mean(dim=(1, 2, 3)))
    finally:
        worker.close()
    # the receiver (which unpickles tensors) has ended: no daemon thread that ran torch code outlives close()
    assert not any(t.name == "flowrl-scoring-receiver" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(RewardError, match="^scoring process is not running .*rerun with train.rewards_async=thread"):
        worker.submit(x, ["p"], {}, 0)  # a RewardError: the CLI prints it as one line


def test_config_modes():
    assert load_config(None, ["train.rewards_async=process"]).train.rewards_async == "process"
    assert load_config(None, ["train.rewards_async=true"]).train.rewards_async is True
    with pytest.raises(ConfigError, match="rewards_async"):
        load_config(None, ["train.rewards_async=processes"])


class HoldsALock(Exception):
    """An exception that can't be pickled (it carries a lock), as some libraries' errors do."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def decode_fails(z: torch.Tensor) -> torch.Tensor:
    """A picklable decoder that raises an unpicklable exception in the worker."""
    raise HoldsALock("decoder ran out of memory")


def test_an_unpicklable_error_in_the_worker_comes_back_as_its_text() -> None:
    """An error the worker can't send back is replaced by a RuntimeError with its text, never lost (no hang)."""
    worker = ScoringProcess(MultiReward({"ink": (ink("bold"), 1.0)}), decode_fails)
    try:
        future = worker.submit(torch.rand(2, 3, 4, 4), ["p", "q"], {}, 0)
        with pytest.raises(RuntimeError, match="^HoldsALock: decoder ran out of memory$"):
            future.result(timeout=120)  # a hang guard only: the reply comes within a second
    finally:
        worker.close()
