"""Group geometry over processes, and the accelerate launch that silently starts one process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_launch import FREE_PORT

from flowrl.distributed import check_rank_device, derive_geometry, silent_single_process, single_process_message


@pytest.mark.parametrize("placement", ["contiguous", "spread"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_partition_the_global_batch(placement, world):
    ranks = [derive_geometry(4, 4, 3, world, r, placement) for r in range(world)]
    owned = torch.cat([g.indices() for g in ranks])
    assert sorted(owned.tolist()) == list(range(16))  # every sample once, on exactly one rank
    assert all(len(g.indices()) == g.local_samples == 16 // world for g in ranks)


def test_contiguous_keeps_groups_whole_and_spread_splits_them():
    contiguous = derive_geometry(4, 3, 3, 2, 1, "contiguous")
    assert contiguous.indices().tolist() == [6, 7, 8, 9, 10, 11]  # groups 2 and 3
    spread = derive_geometry(2, 4, 2, 2, 1, "spread")
    assert spread.indices().tolist() == [2, 3, 6, 7]  # the second half of each group
    assert not contiguous.needs_reward_gather("group") and contiguous.needs_reward_gather("global")
    assert spread.needs_reward_gather("group") and not derive_geometry(4, 3, 3, 1, 0).needs_reward_gather("global")
    assert spread.local_chunks == 2 and derive_geometry(4, 3, 4, 2, 0).local_chunks == 2


def test_impossible_combinations_name_the_numbers():
    with pytest.raises(
        ValueError, match=r"prompts.per_iteration=5 .* over 2 processes; use a multiple of 2 \(e.g. 4 or 6\)"
    ):
        derive_geometry(5, 4, 4, 2, 0)
    with pytest.raises(ValueError, match=r"prompts.group_size=6 .* over 4 processes .* \(e.g. 4 or 8\)"):
        derive_geometry(4, 6, 4, 4, 0, "spread")
    with pytest.raises(ValueError, match=r"\(e.g. 4 or 6\) or train.placement=spread$"):  # spread splits 4 over 2
        derive_geometry(5, 4, 4, 2, 0)
    with pytest.raises(ValueError, match=r"\(e.g. 18 or 21\)$"):  # spread would not split 8 over 3 either
        derive_geometry(20, 8, 4, 3, 0)
    with pytest.raises(ValueError, match=r"\(e.g. 6 or 9\)$"):  # nor contiguous 20 over 3
        derive_geometry(20, 8, 4, 3, 0, "spread")
    with pytest.raises(ValueError, match="placement must be one of contiguous, spread"):
        derive_geometry(4, 4, 4, 2, 0, "round_robin")
    with pytest.raises(ValueError, match="rank 2 is not in a launch of 2"):
        derive_geometry(4, 4, 4, 2, 2)


def test_silent_single_process_is_detected_from_the_launcher_argv():
    cpu = {"ACCELERATE_USE_CPU": "True"}
    assert silent_single_process(cpu, ["accelerate", "launch", "--cpu", "--num_processes", "2", "x.py"]) == 2
    assert silent_single_process(cpu, ["accelerate", "launch", "--cpu", "--num-processes=4", "x.py"]) == 4
    assert silent_single_process(cpu, ["accelerate", "launch", "--cpu", "--num_processes", "1"]) == 0
    assert silent_single_process(cpu, ["accelerate", "launch", "--num_processes"]) == 0
    assert silent_single_process({**cpu, "WORLD_SIZE": "2"}, ["--num_processes", "2"]) == 0  # really 2
    assert silent_single_process({}, ["--num_processes", "2"]) == 0
    no_gpu = {"ACCELERATE_USE_CPU": "False"}  # --num_processes 2 without --multi_gpu on a machine without GPUs
    assert silent_single_process(no_gpu, ["accelerate", "launch", "--num_processes", "2", "-m", "flowrl"]) == 2
    assert "--multi_gpu --num_processes 2" in single_process_message(2)


def test_silent_single_process_under_the_real_launcher(tmp_path: Path):
    script = tmp_path / "probe.py"
    script.write_text("from flowrl.distributed import silent_single_process\nprint('asked', silent_single_process())\n")
    accelerate = Path(sys.executable).with_name("accelerate")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [
            str(accelerate),
            "launch",
            *FREE_PORT,
            "--cpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split().count("asked") == 1 and "asked 2" in out.stdout  # one process, 2 asked for
    if not torch.cuda.is_available():  # without --multi_gpu and without GPUs accelerate starts one process too
        plain = [str(accelerate), "launch", *FREE_PORT, "--num_processes", "2", "--num_machines", "1"]
        out = subprocess.run(
            [*plain, "--mixed_precision", "no", "--dynamo_backend", "no", str(script)],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split().count("asked") == 1 and "asked 2" in out.stdout


def test_sharding_launches_that_are_not_wired_are_refused():
    from accelerate.utils import DistributedType

    from flowrl.distributed import check_plugin

    with pytest.raises(ValueError, match="DeepSpeed ZeRO stage 0 is not wired .* zero_stage: 1, 2 or 3"):
        check_plugin(str(DistributedType.DEEPSPEED), zero_stage=0)
    for stage in (1, 2, 3):  # ZeRO-1/2/3: flowrl/zero.py
        check_plugin(str(DistributedType.DEEPSPEED), zero_stage=stage)
    with pytest.raises(ValueError, match="FSDP version 1 is not wired .* fsdp_version: 2"):
        check_plugin(str(DistributedType.FSDP), 1)
    check_plugin(str(DistributedType.FSDP), 2)  # FSDP2: flowrl/sharding.py
    for kind in (DistributedType.MULTI_GPU, DistributedType.MULTI_CPU, DistributedType.NO):
        check_plugin(str(kind))


def test_processes_that_did_not_join_are_refused():
    from flowrl.distributed import check_joined

    check_joined(2, 2, "DistributedType.MULTI_CPU")
    with pytest.raises(ValueError, match="started 2 processes but accelerate joined 1 .*type NO.*train.sharding=fsdp2"):
        check_joined(2, 1, "DistributedType.NO")
    with pytest.raises(ValueError, match=r"^the launcher started .*accelerate needs ACCELERATE_USE_CPU=true"):
        check_joined(2, 1, "DistributedType.NO")  # e.g. torchrun: not necessarily accelerate's launcher


@pytest.mark.slow
def test_fsdp_launch_without_gpus_is_refused_on_every_rank(tmp_path: Path):
    """The shipped FSDP2 config on a machine without GPUs: accelerate runs each process alone; flowrl says so."""
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs: accelerate really shards there")
    config = tmp_path / "fsdp2.yaml"
    text = (Path(__file__).parents[2] / "configs" / "accelerate" / "fsdp2.yaml").read_text()
    config.write_text(text.replace("num_processes: 8", "num_processes: 2"))
    script = tmp_path / "probe.py"
    script.write_text("from flowrl.distributed import join_launch\njoin_launch()\nprint('joined')\n")
    accelerate = Path(sys.executable).with_name("accelerate")
    out = subprocess.run(
        [str(accelerate), "launch", *FREE_PORT, "--config_file", str(config), str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**{k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}, "HF_HUB_OFFLINE": "1"},
    )  # the premise: no ACCELERATE_USE_CPU (with it accelerate joins the CPU processes)
    assert out.returncode != 0 and "joined" not in out.stdout
    assert out.stderr.count("started 2 processes but accelerate joined 1") == 2, out.stderr[-3000:]


@pytest.mark.parametrize(
    "device,processes,visible,message",
    [
        ("cuda:0", 2, 8, "model.device='cuda:0' puts all 2 processes on one GPU; use model.device=cuda"),
        ("cuda", 4, 2, "4 processes of a CUDA model need one GPU each but this machine shows 2; use --processes 2"),
    ],
)
def test_a_launch_that_would_share_or_lack_gpus_is_refused(device, processes, visible, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_rank_device(device, processes, visible)


def test_devices_a_launch_can_use_pass():
    check_rank_device("cuda", 2, 2)
    check_rank_device("cuda", 2)  # after the launch started (accelerate placed the ranks)
    check_rank_device("cuda:1", 1, 2)  # one process: any GPU
    check_rank_device("cpu", 4, 0)


def test_a_batch_below_one_multiple_suggests_the_multiple_itself() -> None:
    """1 prompt over 2 processes: the example is "e.g. 2", not "0 or 2"."""
    with pytest.raises(ValueError, match=r"use a multiple of 2 \(e.g. 2\)"):
        derive_geometry(1, 4, 4, 2, 0)


def test_rollout_splits_check_tree_placement_and_the_spread_run_of_each_group() -> None:
    """Trees and tree leaves need contiguous placement; the chunk must divide the rows a rank holds in a row (G / W of a
    group under spread), for tree leaves too but not for trees."""
    from flowrl.distributed import check_rollout_split

    spread = derive_geometry(2, 4, 2, 2, 0, "spread")
    for kind in ("tree", "tree_leaves"):
        with pytest.raises(ValueError, match="set train.placement=contiguous"):
            check_rollout_split(spread, kind)
    check_rollout_split(spread, "sde")  # 2 samples of each group per rank, chunk 2
    with pytest.raises(ValueError, match=r"must divide the 2 samples each rank holds in a row .* sampler.chunk_size=2"):
        check_rollout_split(derive_geometry(2, 4, 4, 2, 0, "spread"), "sde")
    check_rollout_split(derive_geometry(2, 4, 4, 2, 0, "contiguous"), "solver")  # a rank holds one group of 4
    odd_chunk = derive_geometry(2, 4, 3, 2, 0, "contiguous")
    check_rollout_split(odd_chunk, "tree")  # a tree's micro-batches are frontier chunks, not rows
    with pytest.raises(ValueError, match="sampler.chunk_size=3 must divide the 4 samples"):
        check_rollout_split(odd_chunk, "tree_leaves")
