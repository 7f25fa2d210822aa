"""Real multi-process training: `accelerate launch` with 2 gloo processes against one process.

Each case trains the embedded flowrl-digits model for 2 iterations on a tiny global batch, once as
a plain process and once under ``ACCELERATE_USE_CPU=true accelerate launch --multi_gpu
--num_processes 2`` (gloo), and compares the final LoRA: the same global batch must give the same
weights within fp32 tolerance (gradient sums in another order).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
# accelerate picks a free rendezvous port: launches of two suites (or two pytest-xdist workers) on one host
# never meet on its default 29500
FREE_PORT = ("--main_process_port", "0")
TINY = [
    "sampler.num_steps=3",
    "train.iterations=2",
    "train.eval_every=2",
    "train.eval_seeds=1",
    "output.grid_seeds=1",
    "train.progress=false",
]
TREE = ["sampler.tree.split_steps=[0,1]", "objective.updates_per_iteration=2"]
OBJECTIVES = {  # sampler.chunk_size divides every rank's rows (and tree frontiers): one-process batch geometry
    "flow_grpo": [
        "prompts.per_iteration=2",
        "prompts.group_size=3",
        "sampler.chunk_size=3",
        "objective.kl_beta=0.01",
        "objective.updates_per_iteration=2",
    ],
    "branch_grpo": [
        "configs/branch/digits.yaml",
        "prompts.per_iteration=4",
        "prompts.group_size=4",
        "sampler.chunk_size=2",
        *TREE,
    ],
    "sage_grpo": [
        "configs/sage/digits.yaml",
        "prompts.per_iteration=2",
        "prompts.group_size=3",
        "sampler.chunk_size=3",
        "objective.anchor_every=1",
        "objective.updates_per_iteration=2",
    ],
    "diffusion_nft": [
        "configs/nft/digits.yaml",
        "prompts.per_iteration=2",
        "prompts.group_size=3",
        "sampler.chunk_size=3",
    ],
    "awm": [  # tree leaves (sampler.solver: tree) for a solver objective
        "configs/awm/digits_fast.yaml",
        "prompts.per_iteration=4",
        "prompts.group_size=4",
        "sampler.chunk_size=2",
        "sampler.solver=tree",
        *TREE,
    ],
    "flow_grpo_spread": [  # every group split over the ranks; rewards all-gathered before advantages
        "prompts.per_iteration=2",
        "prompts.group_size=4",
        "sampler.chunk_size=2",
        "train.placement=spread",
    ],
}
STRADDLING = [  # 2 trees, frontier chunks of 3 nodes span both ranks: each rank runs its part of a micro-batch
    "configs/branch/digits.yaml",
    "prompts.per_iteration=2",
    "prompts.group_size=4",
    "sampler.chunk_size=3",
    *TREE,
]


def env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "LOCAL_RANK", "RANK", "MASTER_ADDR")}
    return {**out, "HF_HUB_OFFLINE": "1", "FLOWRL_NO_SUPERVISOR": "1", **extra}


def train_one(args: list[str], out: Path) -> subprocess.CompletedProcess:
    """``python -m flowrl train`` in one process."""
    cmd = [sys.executable, "-m", "flowrl", "train", *args, f"output.dir={out}"]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)


_ONE_PROCESS_RUNS: dict[tuple[str, ...], Path] = {}


def one_process_run(args: list[str], temp: pytest.TempPathFactory) -> Path:
    """The folder of a finished one-process run of ``args`` (:func:`train_one`), trained once per session.

    The DDP, FSDP2 and ZeRO equivalence tests (here, test_sharding.py, test_deepspeed.py) compare their launches
    with the same one-process runs; each is trained on its first request and shared. Callers only read it.
    """
    key = tuple(args)
    if key not in _ONE_PROCESS_RUNS:
        out = temp.mktemp("one") / "run"
        result = train_one(args, out)
        assert result.returncode == 0, result.stderr[-3000:]
        _ONE_PROCESS_RUNS[key] = out
    return _ONE_PROCESS_RUNS[key]


def train_two(args: list[str], out: Path, *launch: str) -> subprocess.CompletedProcess:
    """``accelerate launch`` with 2 CPU processes (gloo) of ``flowrl train``."""
    launch = launch or ("--config_file", str(ROOT / "configs/accelerate/cpu_gloo.yaml"))
    cmd = [ACCELERATE, "launch", *FREE_PORT, *launch, "-m", "flowrl", "train", *args, f"output.dir={out}"]
    return subprocess.run(
        cmd, cwd=ROOT, env=env(ACCELERATE_USE_CPU="true"), capture_output=True, text=True, timeout=600
    )


def lora(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "lora" / "pytorch_lora_weights.safetensors"))


def assert_same_lora(a: Path, b: Path, tol: float = 1e-5) -> None:
    wa, wb = lora(a), lora(b)
    assert wa.keys() == wb.keys()
    assert any(bool(v.abs().max() > 0) for v in wa.values())  # the LoRA B matrices moved off zero
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst <= tol, f"LoRA differs by {worst:g}"


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(OBJECTIVES))
def test_two_processes_train_the_same_lora_as_one(case, tmp_path, tmp_path_factory):
    args = [*OBJECTIVES[case], *TINY]
    one, two = one_process_run(args, tmp_path_factory), train_two(args, tmp_path / "two")
    assert two.returncode == 0, two.stderr[-3000:]
    assert_same_lora(one, tmp_path / "two")
    m1, m2 = metrics(one), metrics(tmp_path / "two")
    assert [r["step"] for r in m2] == [0, 1, 2]  # rank 0 alone logs: one row per step
    for r1, r2 in zip(m1[1:], m2[1:]):  # global rewards and sample counts, as on one process
        assert r2["reward_mean"] == pytest.approx(r1["reward_mean"], abs=1e-5)
        assert r2["nfe"] == r1["nfe"]
        assert r2["rollout/held_mb"] == pytest.approx(0.5 * r1["rollout/held_mb"], rel=1e-6)  # a rank's half
        assert r2["train/plan_mb"] == pytest.approx(0.5 * r1["train/plan_mb"], rel=1e-6)  # its rows' noise (NFT, AWM)
    assert two.stdout.count("done: 2 iterations") == 1  # rank 0 reports once


@pytest.mark.slow
def test_two_processes_run_solrl_as_one(tmp_path):
    """Sol-RL (regenerate): each rank explores its prompts' seeds, every rank selects the same, stage 2 is split."""
    args = ["configs/solrl/digits.yaml", "prompts.per_iteration=2", "prompts.group_size=2", "sampler.chunk_size=2",
            "solrl.candidates=4", "solrl.explore_steps=2", *TINY]  # fmt: skip
    one, two = train_one(args, tmp_path / "one"), train_two(args, tmp_path / "two")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr + two.stderr)[-3000:]
    assert_same_lora(tmp_path / "one", tmp_path / "two")  # measured: bitwise (2026-11-24)
    m1, m2 = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for r1, r2 in zip(m1[1:], m2[1:]):  # the same selected seeds, rewards and model evaluations
        for key in ("reward_mean", "nfe", "solrl/explore_reward_mean", "solrl/selected_explore_reward_mean"):
            assert r2[key] == pytest.approx(r1[key], abs=1e-6), key


@pytest.mark.slow
def test_tree_micro_batches_split_between_ranks(tmp_path):
    """A frontier chunk on two ranks: each evaluates its rows (another batch geometry: fp32 noise through Adam)."""
    args = [*STRADDLING, *TINY]
    one, two = train_one(args, tmp_path / "one"), train_two(args, tmp_path / "two")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr + two.stderr)[-3000:]
    assert_same_lora(tmp_path / "one", tmp_path / "two", tol=1e-4)  # measured 2e-5; a lost part moves ~lr = 1e-3


@pytest.mark.slow
def test_rank_zero_writes_one_run_folder_and_resume_continues_exactly(tmp_path):
    args = [*OBJECTIVES["flow_grpo"], *TINY, "train.save_every=1", "output.keep_checkpoints=5"]
    full = train_two(args, tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    run = tmp_path / "full"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter-000001", "iter-000002"]
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert (run / "summary.json").is_file() and (run / "grid_before_after.png").is_file()
    cut = tmp_path / "cut"
    first = train_two([*args, "train.iterations=1"], cut)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = train_two(
        [*args, "--resume", str(cut / "checkpoints" / "iter-000001")],
        cut,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    wa, wb = lora(run), lora(cut)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # bitwise, as a one-process resume
    assert [r["step"] for r in metrics(cut)] == [0, 1, 2]


def user_command(out: Path, *args: str, supervised: bool = True) -> tuple[list[str], dict[str, str]]:
    """``flowrl train --processes 2 ARGS`` as a user runs it, flowrl starting the launch itself.

    Supervised (the console script's default) the launching process becomes accelerate's launcher;
    with ``FLOWRL_NO_SUPERVISOR=1`` it runs the launcher as a child and waits.
    """
    cmd = [sys.executable, "-m", "flowrl", "train", "--processes", "2", *args, f"output.dir={out}"]
    return cmd, env() if not supervised else {k: v for k, v in env().items() if k != "FLOWRL_NO_SUPERVISOR"}


@pytest.mark.slow
def test_processes_flag_trains_as_the_manual_accelerate_launch(tmp_path):
    args = [*OBJECTIVES["diffusion_nft"], *TINY]
    cmd, user_env = user_command(tmp_path / "own", *args)
    own = subprocess.run(cmd, cwd=ROOT, env=user_env, capture_output=True, text=True, timeout=600)
    manual = train_two(args, tmp_path / "manual")
    assert own.returncode == 0 and manual.returncode == 0, (own.stderr + manual.stderr)[-3000:]
    assert own.stdout.count("flowrl: training on 2 CPU processes (gloo)") == 1
    assert own.stdout.count("done: 2 iterations") == 1  # rank 0 reports once
    wa, wb = lora(tmp_path / "own"), lora(tmp_path / "manual")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # the same launch: bitwise
    assert [r["step"] for r in metrics(tmp_path / "own")] == [0, 1, 2]


def processes_running(marker: str) -> list[str]:
    """Command lines of this machine's processes that mention ``marker``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            line = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and marker in line:
            found.append(line)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("supervised", [True, False])
def test_sigterm_stops_the_whole_launch_and_leaves_no_process(supervised, tmp_path):
    out = tmp_path / "long"
    args = [*OBJECTIVES["flow_grpo"], *TINY, "train.iterations=10000", "train.eval_every=10000"]
    cmd, user_env = user_command(out, *args, supervised=supervised)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=user_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics_file = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics_file.is_file() and len(metrics_file.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    assert len(processes_running(str(out))) == 4  # supervisor or launching process, accelerate's launcher, 2 ranks
    proc.send_signal(signal.SIGTERM)  # to the top process only: forwarded down the chain
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "flowrl: the launch was stopped by a signal" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]  # not torchrun's SignalException out of the launcher
    assert "closing signal" not in err, err[-3000:]  # nor torch elastic's warning per rank before flowrl's line
    deadline = time.monotonic() + 30  # the ranks' exit is asynchronous to the launcher's
    while processes_running(str(out)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_running(str(out)) == []


@pytest.mark.slow
def test_a_launch_that_fails_after_it_started_ends_with_one_line(tmp_path):
    """A reward that cannot be built fails in the ranks (nothing before the launch builds rewards)."""
    (tmp_path / "faulty_reward.py").write_text(
        "def make(**kwargs):\n    raise ValueError('faulty_reward is broken on purpose')\n"
    )
    cmd, user_env = user_command(tmp_path / "run", *TINY, 'rewards={"faulty_reward:make": {"weight": 1.0}}')
    result = subprocess.run(
        cmd, cwd=ROOT, env={**user_env, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("flowrl: error:")]
    own = "flowrl: error: reward 'faulty_reward:make' could not be built with options {}: "
    own += "ValueError: faulty_reward is broken on purpose"
    exited = {r: f"flowrl: error: rank {r} exited with code 2; its own error line is above" for r in (0, 1)}
    stopped = {  # torch elastic SIGTERMs a rank still building its rewards once the other has failed: a race
        r: f"flowrl: error: rank {r} was stopped by the launcher (SIGTERM) after rank {1 - r} failed" for r in (0, 1)
    }
    last_own = max(i for i, line in enumerate(lines) if line == own)
    launcher = lines[last_own + 1 : -1]  # each rank's own line first (rank 0's, unless stopped), then the launcher's
    assert set(lines[: last_own + 1]) == {own}, lines
    assert len(launcher) == 2 and all(line in (exited[r], stopped[r]) for r, line in enumerate(launcher)), lines
    assert any(line in exited.values() for line in launcher), lines  # the rank that failed first is named
    assert lines[-1].startswith("flowrl: error: the launch ended with code 1; the failing process's error is above")


@pytest.mark.slow
def test_a_failure_on_one_rank_ends_the_launch_with_its_line_and_one_line_of_the_other(tmp_path):
    """Rank 1's reward raises mid-training; rank 0, waiting in the reward gather, says why it stopped in one line."""
    (tmp_path / "rank_one_reward.py").write_text(
        "import os\n"
        "def make(**kwargs):\n"
        "    calls = []\n"
        "    def reward(images, prompts, **metadata):\n"
        "        calls.append(1)\n"
        "        if os.environ['RANK'] == '1' and len(calls) == 3:\n"
        "            raise ValueError('rank_one_reward is broken on purpose')\n"
        "        return images.float().flatten(1).mean(1)\n"
        "    return reward\n"
    )
    args = [*OBJECTIVES["flow_grpo"], *TINY, "train.iterations=4", 'rewards={"rank_one_reward:make": {"weight": 1.0}}']
    cmd = [ACCELERATE, "launch", *FREE_PORT, "--config_file", str(ROOT / "configs/accelerate/cpu_gloo.yaml")]
    cmd += ["-m", "flowrl", "train", *args, f"output.dir={tmp_path / 'run'}"]
    launch_env = env(ACCELERATE_USE_CPU="true", PYTHONPATH=str(tmp_path))
    result = subprocess.run(cmd, cwd=ROOT, env=launch_env, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.startswith("flowrl: error:")]
    broken = "raised ValueError: rank_one_reward is broken on purpose"
    lost = "flowrl: error: rank 0 stopped because another process of the launch ended during a collective; "
    assert broken in lines[0] and all(line.startswith(lost) for line in lines[1:]), result.stderr[-3000:]
    # rank 0 says its line unless the launcher's SIGTERM reaches it before gloo reports the lost peer
    assert "Connection closed by peer" not in result.stderr and "Connection reset by peer" not in result.stderr


def test_cpu_flag_that_starts_one_process_is_refused(tmp_path):
    launch = ("--cpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no")
    result = train_two([*OBJECTIVES["flow_grpo"], *TINY], tmp_path / "run", *launch, "--dynamo_backend", "no")
    assert result.returncode == 1 and "returned non-zero exit status 2" in result.stderr  # accelerate: flowrl's 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("flowrl: error:")]
    assert len(lines) == 1 and "started ONE process" in lines[0] and "--multi_gpu --num_processes 2" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_impossible_split_names_the_numbers(tmp_path):
    result = train_two(["prompts.per_iteration=3", "prompts.group_size=2", *TINY], tmp_path / "run")
    assert result.returncode != 0
    lines = {line for line in result.stderr.splitlines() if line.startswith("flowrl: error:")}
    assert len(lines) == 1, result.stderr[-3000:]  # both ranks print the same line
    assert "prompts.per_iteration=3" in lines.pop()
    chunks = train_two(
        ["prompts.per_iteration=2", "prompts.group_size=3", "sampler.chunk_size=2", *TINY], tmp_path / "c"
    )
    assert "sampler.chunk_size=2 must divide the 3 samples each rank holds" in chunks.stderr


FAULT = Path(__file__).with_name("fault_on_one_rank.py")


def train_faulty(out: Path, processes: int, fault: str, *extra: str) -> subprocess.CompletedProcess:
    """fault_on_one_rank.py (``fault`` on rank 0) alone or on 2 gloo processes, the flow_grpo case."""
    args = [str(FAULT), str(out), "0", fault, *OBJECTIVES["flow_grpo"], *TINY, *extra]
    cmd = [sys.executable, *args]
    if processes == 2:
        cmd = [ACCELERATE, "launch", *FREE_PORT, "--config_file", str(ROOT / "configs/accelerate/cpu_gloo.yaml"), *args]
    return subprocess.run(
        cmd, cwd=ROOT, env=env(ACCELERATE_USE_CPU="true"), capture_output=True, text=True, timeout=400
    )


@pytest.fixture(scope="module")
def poisoned_alone(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("poisoned") / "one"
    result = train_faulty(out, 1, "nan_loss")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_the_time_budget_does_not_count_rank_zeros_start_on_the_other_ranks(tmp_path):
    """Rank 0's start evaluation takes 12 s; a 6 s budget must still train more than one iteration on 2 ranks."""
    budget = ["train.iterations=1000", "train.eval_every=1000", "train.time_budget_s=6"]
    two = train_faulty(tmp_path / "two", 2, "slow_start", *budget)
    assert two.returncode == 0, two.stderr[-3000:]
    assert len(metrics(tmp_path / "two")) > 2, "the ranks stopped after one iteration"  # step 0 and 1 only: stopped


@pytest.mark.slow
def test_the_collective_timeout_is_the_config_s(tmp_path):
    """Rank 0 starts 12 s late: with train.collective_timeout_s=4 rank 1's wait ends the launch (default: it waits)."""
    two = train_faulty(tmp_path / "two", 2, "slow_start", "train.iterations=1", "train.collective_timeout_s=4")
    assert two.returncode != 0 and "timed out" in two.stderr.lower(), two.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "fsdp2", "zero1", "zero2", "zero3"])
def test_a_non_finite_loss_on_one_rank_skips_that_update_on_every_rank(sharding, poisoned_alone, tmp_path):
    """Sharded backwards are collective: the faulty rank keeps pairing them, then every rank drops the step."""
    sharded = [] if sharding == "none" else [f"train.sharding={sharding}"]
    two = train_faulty(tmp_path / "two", 2, "nan_loss", *sharded)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("finished") == 2
    skipped = [row.get("train/skipped_updates") for row in metrics(tmp_path / "two")]
    assert skipped == [None, 0.0, 1.0] == [row.get("train/skipped_updates") for row in metrics(poisoned_alone)]
    assert_same_lora(poisoned_alone, tmp_path / "two")  # the same update dropped, the next one the same
