"""Sharded training (``train.sharding=fsdp2``) with two real gloo processes against one process.

The denoiser's frozen base and its LoRA are split over the ranks with PyTorch's ``fully_shard``
(flowrl/sharding.py); every rank calls the sharded model in lockstep. The same global batch must
give the same LoRA as one unsharded process (within fp32 tolerance; measured bit-identical), each
rank must hold about half of the parameters, and checkpoints must hold full tensors that resume
into the shards exactly.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fault_on_one_rank import EVAL_ERROR
from test_launch import (
    OBJECTIVES,
    ROOT,
    STRADDLING,
    TINY,
    assert_same_lora,
    env,
    lora,
    metrics,
    one_process_run,
    train_faulty,
    train_one,
    train_two,
)

from flowrl.checkpoint import load_checkpoint
from flowrl.distributed import Collective
from flowrl.sharding import Lockstep, collective_calls

FSDP2 = ["train.sharding=fsdp2"]
SHARD_LINE = re.compile(
    r"fsdp2: rank (\d) of 2 holds (\d+) of (\d+) denoiser parameters .* trainable LoRA (\d+) of (\d+)"
)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(OBJECTIVES))
def test_sharded_two_processes_train_the_same_lora_as_one(case, tmp_path, tmp_path_factory):
    args = [*OBJECTIVES[case], *TINY]
    one, two = one_process_run(args, tmp_path_factory), train_two([*args, *FSDP2], tmp_path / "two")
    assert two.returncode == 0, two.stderr[-3000:]
    assert_same_lora(one, tmp_path / "two")
    assert_same_metrics(one, tmp_path / "two", two.stdout)
    # both ranks own as many chunks: neither pads its rollout calls (one per global chunk before)
    assert [r["rollout/placeholder_calls"] for r in metrics(tmp_path / "two") if r["step"]] == [0.0, 0.0]


def assert_same_metrics(one: Path, two: Path, two_stdout: str) -> None:
    """The 2-process run logged what one process did: rewards, model evaluations and eval figures, once."""
    m1, m2 = metrics(one), metrics(two)
    assert [r["step"] for r in m2] == [0, 1, 2]
    for r1, r2 in zip(m1, m2):  # placeholder rows are not counted as model evaluations
        for key in ("reward_mean", "eval/reward_mean"):
            assert (key in r1) == (key in r2) and r2.get(key) == pytest.approx(r1.get(key), abs=1e-5)
        assert r2.get("nfe") == r1.get("nfe")
    assert two_stdout.count("done: 2 iterations") == 1


MORE = {  # (arguments, tolerance)
    # a tree frontier chunk on both ranks: each evaluates its part (another batch geometry; measured 5e-6)
    "straddling_tree": (STRADDLING, 1e-4),
    # bf16 frozen base beside the fp32 LoRA in one FSDP group, autocast, per-block recomputation (measured identical)
    "bf16_checkpointing": (
        [
            *OBJECTIVES["flow_grpo"],
            "model.dtype=bfloat16",
            "memory.autocast=bf16",
            "memory.gradient_checkpointing=true",
        ],
        1e-5,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(MORE))
def test_sharded_geometries_and_memory_settings_match_one_process(case, tmp_path):
    extra, tol = MORE[case]
    args = [*extra, *TINY]
    one, two = train_one(args, tmp_path / "one"), train_two([*args, *FSDP2], tmp_path / "two")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr + two.stderr)[-3000:]
    assert_same_lora(tmp_path / "one", tmp_path / "two", tol=tol)
    if case == "straddling_tree":  # frontiers of 2, 4, 8 nodes in chunks of 3, tree 0 on rank 0, tree 1 on rank 1:
        # rank 0's rows meet 1 + 1 + 2 calls, rank 1's 1 + 2 + 2, so rank 0 pads one (it padded 2 of 6 per chunk)
        assert [r["rollout/placeholder_calls"] for r in metrics(tmp_path / "two") if r["step"]] == [1.0, 1.0]


def assert_diffusers_loads_lora(folder: Path) -> None:
    """diffusers' ``load_lora_weights`` reads a sharded run's gathered LoRA, and it changes the velocity."""
    from flowrl.models import load_adapter

    model = load_adapter("flowrl-digits", dtype="float32", device="cpu")
    x = torch.randn(2, *model.latent_shape(8, 8), generator=torch.Generator().manual_seed(0))
    sigma, cond = torch.full((2,), 0.7), model.encode_prompt(["a bold 3", "a thin 7"])
    with torch.no_grad():
        base = model.velocity(x, sigma, cond)
        model.pipe.load_lora_weights(str(folder))
        trained = model.velocity(x, sigma, cond)
    assert float((trained - base).abs().max()) > 1e-6


@pytest.mark.slow
def test_each_rank_holds_half_the_denoiser_and_the_lora_loads_with_diffusers(tmp_path):
    args = [*OBJECTIVES["flow_grpo"], *TINY]
    two = train_two([*args, *FSDP2], tmp_path / "two")
    assert two.returncode == 0, two.stderr[-3000:]
    shards = {int(m[1]): tuple(map(int, m.groups()[1:])) for m in SHARD_LINE.finditer(two.stderr)}
    assert sorted(shards) == [0, 1], two.stderr[-3000:]
    (l0, full, lo0, lora_full), (l1, full1, lo1, _) = shards[0], shards[1]
    assert full == full1 and l0 + l1 == full and abs(l0 - full / 2) <= 0.01 * full  # ~1/W of base + LoRA
    assert lo0 + lo1 == lora_full and abs(lo0 - lora_full / 2) <= 0.05 * lora_full

    assert_diffusers_loads_lora(tmp_path / "two" / "lora")


@pytest.mark.slow
def test_sharded_checkpoints_hold_full_tensors_and_resume_exactly(tmp_path, tmp_path_factory):
    assert_checkpoints_as_one_process_and_exact_resume(tmp_path, FSDP2, tmp_path_factory)


def assert_checkpoints_as_one_process_and_exact_resume(
    tmp_path: Path, sharded: list[str], temp: pytest.TempPathFactory
) -> None:
    """A sharded 2-process run's checkpoint holds one process's tensors, and resuming it is bitwise exact.

    Args:
        tmp_path: the test's folder.
        sharded: the overrides that shard the run (``train.sharding=...``).
        temp: the session's temporary folders (the one-process run is shared, :func:`one_process_run`).
    """
    args = [*OBJECTIVES["diffusion_nft"], *TINY, "train.save_every=1", "output.keep_checkpoints=5"]
    full = train_two([*args, *sharded], tmp_path / "full")
    assert full.returncode == 0, full.stderr[-3000:]
    one = one_process_run([*args, "train.iterations=1"], temp)  # the same step on one process
    sharded_ckpt = load_checkpoint(tmp_path / "full" / "checkpoints" / "iter-000001")
    plain = load_checkpoint(one / "checkpoints" / "iter-000001")
    for key in ("lora", "adapters", "optimizer"):  # the one-process layout: full tensors, same shapes and values
        flat_s, flat_p = _tensors(sharded_ckpt[key]), _tensors(plain[key])
        assert flat_s.keys() == flat_p.keys()
        assert all(flat_s[k].shape == flat_p[k].shape for k in flat_s)
        # measured 3.5e-9 under ZeRO-2/3 (docs/scale-out.md)
        assert max(float((flat_s[k].float() - flat_p[k].float()).abs().max()) for k in flat_s) <= 1e-6
    # the full run's first checkpoint resumed in another folder (--resume CKPT output.dir=B) ends as the full run
    cut = tmp_path / "cut"
    resumed = train_two([*args, *sharded, "--resume", str(tmp_path / "full" / "checkpoints" / "iter-000001")], cut)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (cut / "checkpoints" / "iter-000002").is_dir() and not (cut / "checkpoints" / "iter-000001").exists()
    wa, wb = lora(tmp_path / "full"), lora(cut)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # bitwise, as an unsharded resume


def _tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state, keyed by its path."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else []
    return {k: v for key, value in items for k, v in _tensors(value, f"{prefix}/{key}").items()}


def test_sharding_one_process_is_refused_in_one_line(tmp_path):
    cmd = [sys.executable, "-m", "flowrl", "train", *OBJECTIVES["flow_grpo"], *TINY, *FSDP2, f"output.dir={tmp_path}/r"]
    result = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.startswith("flowrl: error:")]
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-3000:]
    assert "train.sharding=fsdp2 shards over the processes of a launch" in lines[0]
    assert "--multi_gpu --num_processes 2" in lines[0] and "train.sharding=none" in lines[0]


@pytest.mark.slow
def test_an_unsupported_combination_is_refused_on_every_rank(tmp_path):
    args = [*OBJECTIVES["diffusion_nft"], *TINY, *FSDP2, "solrl.mode=regenerate"]
    result = train_two(args, tmp_path / "run")
    assert result.returncode != 0
    lines = {line for line in result.stderr.splitlines() if line.startswith("flowrl: error:")}
    assert len(lines) == 1, result.stderr[-3000:]  # both ranks print the same line
    line = lines.pop()
    assert "does not support solrl.mode=regenerate" in line and "set solrl.mode=off or train.sharding=none" in line
    assert not (tmp_path / "run").exists()


def test_the_sharding_key_is_checked():
    from flowrl.config import ConfigError, load_config

    assert load_config(None, ["train.sharding=fsdp2"]).train.sharding == "fsdp2"
    with pytest.raises(ConfigError, match="train.sharding"):
        load_config(None, ["train.sharding=fsdp1"])


def test_sharded_launch_command_is_the_documented_one():
    doc = (Path(__file__).parents[2] / "docs" / "scale-out.md").read_text()
    assert "--config_file configs/accelerate/cpu_gloo.yaml -m flowrl train CONFIG train.sharding=fsdp2" in doc


def test_block_classes_keep_the_models_own(tiny_sd3):
    from flowrl.sharding import block_classes

    transformer = tiny_sd3.transformer
    names = ["JointTransformerBlock", "FluxTransformerBlock", "WanTransformerBlock"]  # configs/accelerate/fsdp2.yaml
    assert [c.__name__ for c in block_classes(transformer, names)] == ["JointTransformerBlock"]
    assert [c.__name__ for c in block_classes(transformer)] == ["JointTransformerBlock"]  # its _no_split_modules
    with pytest.raises(ValueError, match="has none of the block classes .* fsdp_transformer_layer_cls_to_wrap"):
        block_classes(transformer, ["FluxTransformerBlock"])


def test_accelerate_wrap_list_is_narrowed_per_model_and_restored(tiny_sd3, monkeypatch):
    """Found on an H100 (2026-11-27): after SD3.5-M, FLUX.1 in the same process saw only JointTransformerBlock."""
    import accelerate.utils.fsdp_utils as fsdp_utils
    from accelerate import FullyShardedDataParallelPlugin
    from conftest import tiny_flux_transformer

    from flowrl.sharding import shard_transformer

    launch = "JointTransformerBlock,FluxTransformerBlock,FluxSingleTransformerBlock,WanTransformerBlock".split(",")
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=list(launch)
    )
    seen = []
    # accelerate's fsdp2_prepare_model needs an FSDP launch on GPUs; here it records what it would wrap
    monkeypatch.setattr(
        fsdp_utils, "fsdp2_prepare_model", lambda acc, model: seen.append(plugin.transformer_cls_names_to_wrap)
    )

    class FsdpLaunch:  # the two things shard_transformer reads of an accelerate FSDP launch
        fsdp_plugin, accelerator, rank, world_size = plugin, None, 0, 1

    flux = tiny_flux_transformer()
    for transformer in (tiny_sd3.transformer, flux):
        shard_transformer(transformer, FsdpLaunch())
        assert plugin.transformer_cls_names_to_wrap == launch
    assert seen == [["JointTransformerBlock"], ["FluxSingleTransformerBlock", "FluxTransformerBlock"]]


def test_ranks_pair_their_micro_batches_and_pad_with_one_row_placeholders():
    from flowrl.distributed import derive_geometry
    from flowrl.objectives.base import Microbatch, RolloutBatch
    from flowrl.sharding import rank_microbatches

    b = 8  # 2 prompts x 4 samples, chunks of 2: rank 0 owns rows 0-3, rank 1 rows 4-7 (contiguous)
    x = torch.zeros(b, 2, 3, 3)
    keep = torch.ones(b, dtype=torch.bool)
    batch = RolloutBatch([f"p{i // 4}" for i in range(b)], torch.arange(b) // 4, {}, x, None, None, x, x[:, 0, 0, 0],
                         x[:, 0, 0, 0], keep, 2)  # fmt: skip
    noise = torch.randn(2, 2, 3, 3)
    group = [Microbatch(torch.tensor([0, 1]), 0, noise), Microbatch(torch.tensor([2, 3]), 1, noise),
             Microbatch(torch.tensor([6, 7]), 0, noise)]  # fmt: skip
    ranks = [derive_geometry(2, 4, 2, 2, r) for r in range(2)]
    zero = rank_microbatches(group, batch, ranks[0].owned_mask(), ranks[0])
    one = rank_microbatches(group, batch, ranks[1].owned_mask(), ranks[1])
    assert [(i, mb.index.tolist(), real) for i, mb, real in zero] == [(0, [0, 1], True), (1, [2, 3], True)]
    assert [(mb.index.tolist(), real) for _, mb, real in one] == [([6, 7], True), ([0], False)]  # padded to 2 calls
    assert one[1][1].noise.shape[0] == 1 and one[1][1].step == 0
    assert rank_microbatches(group, batch, ranks[1].owned_mask()) == one[:1]  # unsharded: own parts only
    assert rank_microbatches(group, batch, None) == [(i, mb, True) for i, mb in enumerate(group)]  # one process


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["fsdp2", "zero2"])
def test_a_one_process_checkpoint_resumes_sharded(sharding, tmp_path):
    """Start on one process, continue on two sharded ones: the run the uninterrupted one-process run gives."""
    args = [*OBJECTIVES["diffusion_nft"], *TINY, "train.save_every=1"]
    full = train_one(args, tmp_path / "full")
    cut = tmp_path / "cut"
    first = train_one([*args, "train.iterations=1"], cut)
    assert full.returncode == 0 and first.returncode == 0, (full.stderr + first.stderr)[-3000:]
    checkpoint = cut / "checkpoints" / "iter-000001"
    resumed = train_two([*args, f"train.sharding={sharding}", "--resume", str(checkpoint)], cut)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in metrics(cut)] == [0, 1, 2]
    assert_same_lora(tmp_path / "full", cut)  # gradient sums in another order: fp32 tolerance


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["fsdp2", "zero3"])
def test_an_error_on_rank_zero_in_lockstep_ends_the_launch_at_once(sharding, tmp_path):
    """Rank 0's evaluation raises while the other rank waits in its lockstep calls: the launch ends with the error."""
    t0 = time.monotonic()
    run = train_faulty(tmp_path / "run", 2, "eval_error", "train.eval_every=1", f"train.sharding={sharding}")
    wall = time.monotonic() - t0
    assert run.returncode != 0 and EVAL_ERROR in run.stderr, run.stderr[-3000:]
    assert "finished" not in run.stdout
    assert wall < 300, f"{wall:.0f} s: the ranks waited for the process group's timeout"  # the launch took ~30 s


class ScriptedLaunch(Collective):
    """A one-process Collective whose broadcasts are recorded (rank 0) or replayed from ``script`` (other ranks)."""

    def __init__(self, rank: int = 0, script: tuple = (), world_size: int = 2) -> None:
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self.sent: list[object] = []
        self.script = list(script)

    def broadcast_object(self, value: object) -> object:
        if self.rank == 0:
            self.sent.append(value)
            return value
        return self.script.pop(0)


def test_lockstep_announces_listed_calls_only_and_the_other_ranks_replay_them() -> None:
    """Rank 0 broadcasts (name, args, kwargs) of listed calls only, then None to release; another rank makes
    each announced call with its arguments until it receives None."""
    made: list[tuple] = []
    calls = {"sample": lambda *a, **k: made.append(("sample", a, k)), "state": lambda: made.append(("state", (), {}))}
    main = ScriptedLaunch(rank=0)
    lockstep = Lockstep(main, calls)
    lockstep.announce("grid", 1)  # not a call of this launch: the other ranks never hear of it
    lockstep.announce("sample", 3, seed=7)
    lockstep.meet()
    assert main.sent == [("sample", (3,), {"seed": 7}), None] and made == []
    other = ScriptedLaunch(rank=1, script=(("sample", (3,), {"seed": 7}), ("state", (), {}), None, ("state", (), {})))
    Lockstep(other, calls).announce("sample", 9)  # a no-op off rank 0
    Lockstep(other, calls).meet()
    assert made == [("sample", (3,), {"seed": 7}), ("state", (), {})] and other.script == [("state", (), {})]


def test_only_the_state_gather_is_collective_under_zero_one_and_two() -> None:
    """ZeRO-1/2 keep the model whole: only "state" is announced; FSDP2 and ZeRO-3 announce every call."""
    calls = {"sample": print, "state": len, "grid": sum}
    assert collective_calls("zero1", calls) == {"state": len} == collective_calls("zero2", calls)
    assert collective_calls("fsdp2", calls) == calls == collective_calls("zero3", calls)


class LaunchedAs(ScriptedLaunch):
    """A two-process launch whose launcher chose the sharding (an FSDP plugin, or a DeepSpeed stage)."""

    def __init__(self, fsdp: bool = False, stage: int | None = None) -> None:
        super().__init__()
        self._fsdp, self._stage = fsdp, stage

    @property
    def fsdp_plugin(self) -> object:
        return object() if self._fsdp else None

    @property
    def deepspeed_stage(self) -> int | None:
        return self._stage


def test_the_launch_s_sharding_wins_over_the_config_s() -> None:
    """An FSDP launch shards fsdp2 and a DeepSpeed launch zero<stage>, whatever train.sharding says."""
    from flowrl.config import load_config
    from flowrl.sharding import run_sharding

    cfg = load_config(None, [])
    assert cfg.train.sharding == "none" and run_sharding(cfg, LaunchedAs()) == "none"
    assert run_sharding(cfg, LaunchedAs(fsdp=True)) == "fsdp2"
    pytest.importorskip("deepspeed")
    assert run_sharding(cfg, LaunchedAs(stage=2)) == "zero2"
    assert run_sharding(load_config(None, ["train.sharding=fsdp2"]), LaunchedAs(stage=3)) == "zero3"


def test_placeholder_backward_leaves_a_zero_gradient_and_no_trace() -> None:
    """A placeholder's loss is backwarded times zero (grad exactly 0) and the objective's attributes and the
    model's nfe are put back as they were."""
    from flowrl.sharding import placeholder_backward

    weight = torch.nn.Parameter(torch.tensor([1.0, -2.0]))

    class Model:
        nfe = 5

    class Objective:
        def __init__(self) -> None:
            self.kl_sum = 0.25

        def loss(self, model: Model, batch: object, mb: object) -> tuple[torch.Tensor, dict]:
            model.nfe += 2
            self.kl_sum += 1.0
            self.extra = True
            return (weight * 3.0).sum(), {}

    objective, model = Objective(), Model()
    placeholder_backward(objective, model, None, None)
    assert torch.equal(weight.grad, torch.zeros(2))
    assert vars(objective) == {"kl_sum": 0.25} and model.nfe == 5


def test_full_tensors_keep_the_container_types() -> None:
    """Tuples stay tuples, lists lists, dicts dicts; plain tensors and other values pass through as they are."""
    from flowrl.sharding import full_tensors

    t = torch.ones(2)
    out = full_tensors({"a": (t, [t, 3]), "b": "x"})
    assert type(out["a"]) is tuple and type(out["a"][1]) is list and out["a"][0] is t and out["b"] == "x"


def test_an_empty_step_has_no_micro_batches_even_when_sharded() -> None:
    """A group with no micro-batches runs nothing and pads nothing (no placeholder from a missing first one)."""
    from flowrl.distributed import derive_geometry
    from flowrl.sharding import rank_microbatches

    geometry = derive_geometry(2, 4, 2, 2, 1)
    assert rank_microbatches([], None, geometry.owned_mask(), geometry) == []


def test_a_tree_placeholder_uses_the_first_parent_with_a_trained_edge() -> None:
    """At a step of a tree, the placeholder row is the first parent node with a trained child edge (else row 0)."""
    from flowrl.objectives.base import RolloutBatch
    from flowrl.samplers.tree import TreeRollout
    from flowrl.sharding import held_row
    from flowrl.tree.rollouts import TreeBatch

    x = torch.zeros(8, 2, 2, 2)
    batch = RolloutBatch(["a"] * 8, torch.zeros(8), {}, x, None, None, x, x[:, 0, 0, 0], x[:, 0, 0, 0],
                         torch.ones(8, dtype=torch.bool), 2)  # fmt: skip
    assert held_row(batch, 1).tolist() == [0]  # no tree: the first row
    factors = torch.tensor([2, 2])  # 2 trees: 4 nodes at depth 1, 8 edges at step 1
    rollout = TreeRollout([], [], factors, torch.ones(2, dtype=torch.float64), torch.ones(3), torch.ones(2), "flow", 2)
    edges = torch.tensor([False, False, False, False, False, True, True, True])  # parents 2 and 3 have trained edges
    tree = TreeBatch(rollout, [], [torch.ones(4, dtype=torch.bool), edges], [], None, 2)
    assert held_row(batch._replace(tree=tree), 1).tolist() == [2]
    assert held_row(
        batch._replace(tree=tree._replace(train=[edges[:4], torch.zeros(8, dtype=torch.bool)])), 1
    ).tolist() == [0]
