"""DeepSpeed ZeRO-1/2/3 (``train.sharding=zero1|zero2|zero3``) with two real gloo processes against one process.

The DeepSpeed engine owns the LoRA's gradients, clipping and AdamW step (flowrl/zero.py): ZeRO-2
partitions the LoRA's fp32 masters, moments and reduced gradients, ZeRO-3 every parameter of the
denoiser as well. The same global batch must give the same LoRA as one plain process (within fp32
tolerance), checkpoints must hold the one-process tensors, and a resumed run must equal the
uninterrupted one. Skipped only when deepspeed is not installed (``pip install 'flowrl[deepspeed]'``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_launch import (
    ACCELERATE,
    FREE_PORT,
    OBJECTIVES,
    ROOT,
    TINY,
    assert_same_lora,
    env,
    lora,
    one_process_run,
    train_two,
)
from test_sharding import (
    assert_checkpoints_as_one_process_and_exact_resume,
    assert_diffusers_loads_lora,
    assert_same_metrics,
)

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'flowrl[deepspeed]')")

STAGES = ("zero1", "zero2", "zero3")
# worst LoRA weight |one process - 2 ranks| (as for DDP and FSDP2), and the bound on 99.9 % of them. Measured
# (docs/scale-out.md): worst 3.7e-6 (ZeRO-2) and 4.0e-6 (ZeRO-3), 99.9 % within 3.7e-7 (both)
WORST, BULK = 1e-5, 1e-6
HOLDS = re.compile(r"(zero[123]): rank (\d) of 2 holds (\d+) of (\d+) denoiser parameters")


def assert_partitioned_as_the_stage_says(stage: str, stderr: str) -> None:
    """Each rank's printed share: the whole denoiser under ZeRO-1/2, half of every parameter under ZeRO-3."""
    holds = {int(m[2]): (int(m[3]), int(m[4])) for m in HOLDS.finditer(stderr) if m[1] == stage}
    assert sorted(holds) == [0, 1], stderr[-3000:]
    (l0, full), (l1, _) = holds[0], holds[1]
    if stage != "zero3":  # the whole denoiser on every rank (only the LoRA's optimizer state is partitioned)
        assert l0 == l1 == full
    else:  # every parameter partitioned, the frozen base and the objective's frozen adapters included
        assert l0 + l1 == full and abs(l0 - full / 2) <= 0.01 * full


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(OBJECTIVES))
def test_zero_two_processes_train_the_same_lora_as_one(case, tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))  # what DeepSpeed JIT-builds lands here
    args = [*OBJECTIVES[case], *TINY]
    one = one_process_run(args, tmp_path_factory)
    for stage in STAGES:
        two = train_two([*args, f"train.sharding={stage}"], tmp_path / stage)
        assert two.returncode == 0, two.stderr[-3000:]
        assert_same_lora(one, tmp_path / stage, tol=WORST)
        wa, wb = lora(one), lora(tmp_path / stage)
        gaps = torch.cat([(wa[k] - wb[k]).abs().flatten() for k in wa])
        assert float(gaps.quantile(0.999)) <= BULK, f"{stage}: over 0.1 % of the LoRA weights differ by > {BULK:g}"
        assert_same_metrics(one, tmp_path / stage, two.stdout)
        assert_partitioned_as_the_stage_says(stage, two.stderr)
    assert_diffusers_loads_lora(tmp_path / "zero3" / "lora")
    built = sorted(p.name for p in (tmp_path / "extensions").rglob("*") if p.is_file())
    assert built == [], f"DeepSpeed compiled {built} for a ZeRO run (flowrl.distributed.skip_inference_comm_build)"


@pytest.mark.slow
@pytest.mark.parametrize("stage", (1, 2, 3))
def test_a_bad_step_is_undone_exactly(stage):
    """A weight-check fault and a non-finite gradient: weights, masters and moments restored (zero_step_check.py)."""
    cmd = [ACCELERATE, "launch", *FREE_PORT, "--config_file", str(ROOT / "configs/accelerate/cpu_gloo.yaml")]
    cmd += [str(Path(__file__).with_name("zero_step_check.py")), str(stage)]
    result = subprocess.run(
        cmd, cwd=ROOT, env=env(ACCELERATE_USE_CPU="true"), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"zero{stage}: bad steps undone" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_zero_checkpoints_hold_full_tensors_and_resume_exactly(stage, tmp_path, tmp_path_factory):
    assert_checkpoints_as_one_process_and_exact_resume(tmp_path, [f"train.sharding={stage}"], tmp_path_factory)


@pytest.mark.slow
def test_a_deepspeed_launcher_config_on_cpu_trains_with_its_stage(tmp_path, tmp_path_factory):
    """accelerate 1.15 turns a DeepSpeed config with ACCELERATE_USE_CPU=true into plain CPU processes; flowrl shards."""
    launch = ("--config_file", str(ROOT / "configs/accelerate/deepspeed_zero3.yaml"), "--num_processes", "2")
    args = [*OBJECTIVES["flow_grpo"], *TINY]
    two = train_two(args, tmp_path / "two", *launch)
    assert two.returncode == 0, two.stderr[-3000:]
    assert {m[1] for m in HOLDS.finditer(two.stderr)} == {"zero3"}  # the launcher's stage, not train.sharding
    assert_same_lora(one_process_run(args, tmp_path_factory), tmp_path / "two")


def without_use_cpu() -> dict[str, str]:
    """The launch environment without ACCELERATE_USE_CPU (whatever the caller's shell sets)."""
    return {k: v for k, v in env().items() if k != "ACCELERATE_USE_CPU"}


@pytest.mark.slow
def test_a_deepspeed_launch_without_gpus_or_use_cpu_is_refused_on_every_rank(tmp_path):
    """Without ACCELERATE_USE_CPU accelerate 1.15 gives each CPU process a DeepSpeed type of its own (1 process).

    accelerate starts DeepSpeed's backend there, so without flowrl's mark each rank would first JIT-compile
    DeepSpeed's inference all-reduce (86 s here) only to be refused.
    """
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs: accelerate joins the DeepSpeed processes there")
    script = tmp_path / "probe.py"
    script.write_text("from flowrl.distributed import join_launch\njoin_launch()\nprint('joined')\n")
    launch = [ACCELERATE, "launch", *FREE_PORT, "--config_file", str(ROOT / "configs/accelerate/deepspeed_zero2.yaml")]
    out = subprocess.run(
        [*launch, "--num_processes", "2", str(script)],
        env={**without_use_cpu(), "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0 and "joined" not in out.stdout
    assert out.stderr.count("started 2 processes but accelerate joined 1 (distributed type DEEPSPEED") == 2
    assert not (tmp_path / "extensions").exists(), "DeepSpeed compiled an extension before the refusal"


@pytest.mark.slow
def test_an_unsupported_combination_is_refused_on_every_rank(tmp_path):
    result = train_two([*OBJECTIVES["diffusion_nft"], *TINY, "train.sharding=zero2", "solrl.mode=regenerate"], tmp_path)
    lines = {line for line in result.stderr.splitlines() if line.startswith("flowrl: error:")}
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-3000:]  # both ranks print the same line
    assert "train.sharding=zero2 does not support solrl.mode=regenerate" in lines.pop()


@pytest.mark.parametrize("stage", STAGES)
def test_zero_on_one_process_is_refused_in_one_line(stage, tmp_path):
    cmd = [sys.executable, "-m", "flowrl", "train", *OBJECTIVES["flow_grpo"], *TINY, f"train.sharding={stage}"]
    result = subprocess.run(
        [*cmd, f"output.dir={tmp_path}/r"], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300
    )
    lines = [line for line in result.stderr.splitlines() if line.startswith("flowrl: error:")]
    assert result.returncode != 0 and len(lines) == 1, result.stderr[-3000:]
    assert f"train.sharding={stage} shards over the processes of a launch" in lines[0]


def test_the_deepspeed_config_is_flowrls():
    from flowrl.config import load_config
    from flowrl.zero import zero_config

    assert load_config(None, ["train.sharding=zero3"]).train.sharding == "zero3"
    launcher = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "gradient_clipping": 9.0}
    cfg = zero_config(3, 1.0, launcher)
    assert cfg["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},  # the launcher's offload is kept
        "stage3_param_persistence_threshold": 0,  # the small LoRA matrices are partitioned too
        "memory_efficient_linear": False,  # torch.nn.functional.linear stays torch's
    }
    assert cfg["gradient_clipping"] == 1.0 and cfg["managed_gradient_accumulation"] is False  # flowrl's plan steps
    assert cfg["train_micro_batch_size_per_gpu"] == 1 and cfg["zero_allow_untested_optimizer"]
    assert launcher["gradient_clipping"] == 9.0  # not modified in place
    with pytest.raises(ValueError, match="does not wire DeepSpeed's bf16 engine; set mixed_precision: 'no'"):
        zero_config(2, 1.0, {"bf16": {"enabled": True}})


def test_launch_commands_are_documented():
    doc = (Path(__file__).parents[2] / "docs" / "scale-out.md").read_text()
    assert "--config_file configs/accelerate/cpu_gloo.yaml -m flowrl train CONFIG train.sharding=zero2" in doc
    assert "accelerate launch --config_file configs/accelerate/deepspeed_zero3.yaml -m flowrl train CONFIG" in doc
    assert str(Path(ACCELERATE).name) == "accelerate"


def test_the_launcher_s_own_zero_settings_are_kept_and_not_modified() -> None:
    """A launcher's memory_efficient_linear is kept, its zero_optimization dict untouched, and fp16 "auto" refused."""
    from flowrl.zero import zero_config

    launcher = {"zero_optimization": {"stage": 2, "memory_efficient_linear": True}}
    cfg = zero_config(3, 1.0, launcher)
    assert cfg["zero_optimization"]["memory_efficient_linear"] is True and cfg["zero_optimization"]["stage"] == 3
    assert launcher == {"zero_optimization": {"stage": 2, "memory_efficient_linear": True}}
    assert zero_config(2, 1.0, launcher)["zero_optimization"] == {"stage": 2, "memory_efficient_linear": True}
    assert cfg["fp16"] == {"enabled": False} and cfg["bf16"] == {"enabled": False}
    for enabled in (True, "true", "auto"):
        with pytest.raises(ValueError, match="does not wire DeepSpeed's fp16 engine"):
            zero_config(1, 1.0, {"fp16": {"enabled": enabled}})


def test_a_module_is_partitioned_when_any_parameter_is_a_zero3_partition() -> None:
    """ZeRO-3 tags its partitions with ds_id; one tagged parameter makes a forward a collective."""
    from flowrl.zero import gathered, is_partitioned

    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert not is_partitioned(module)
    with gathered(list(module.parameters())):  # nothing partitioned: a no-op
        pass
    module[0].weight.ds_id = 0
    assert is_partitioned(module)


def test_deepspeed_skips_its_shared_memory_all_reduce_build_when_flowrl_marks_it(monkeypatch) -> None:
    """The op flowrl marks is the CPU shared-memory comm builder's, and the mark is what DeepSpeed's backend reads.

    Without the mark, ``build_shm_op`` JIT-compiles the extension (33 s of a first 51 s ZeRO-2 run here); the
    two-process test above checks that no ZeRO run builds anything.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    from flowrl.distributed import skip_inference_comm_build

    if get_accelerator().device_name() != "cpu":
        pytest.skip("DeepSpeed's accelerator here is not the CPU one")
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    assert builder is not None and builder.NAME == "deepspeed_shm_comm"
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, builder.NAME, True)  # restored after the test
    skip_inference_comm_build()
    assert deepspeed.ops.__compatible_ops__[builder.NAME] is False
    assert build_shm_op() is None
