"""configs/accelerate: every launcher config loads with accelerate's own parser and says what it is for."""

from __future__ import annotations

from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {
    "single_gpu.yaml": (DistributedType.NO, 1),
    "ddp.yaml": (DistributedType.MULTI_GPU, 8),
    "cpu_gloo.yaml": (DistributedType.MULTI_GPU, 2),
    "fsdp2.yaml": (DistributedType.FSDP, 8),
    "deepspeed_zero1.yaml": (DistributedType.DEEPSPEED, 8),
    "deepspeed_zero2.yaml": (DistributedType.DEEPSPEED, 8),
    "deepspeed_zero3.yaml": (DistributedType.DEEPSPEED, 8),
    "multi_node.yaml": (DistributedType.MULTI_GPU, 32),
}


def test_the_set_of_launcher_configs():
    assert sorted(p.name for p in (ROOT / "configs" / "accelerate").glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_launcher_config_loads(name):
    path = ROOT / "configs" / "accelerate" / name
    config = load_config_from_file(str(path))
    kind, processes = EXPECTED[name]
    assert config.distributed_type == kind and config.num_processes == processes
    assert "accelerate launch --config_file configs/accelerate/" + name in path.read_text()
    if kind == DistributedType.FSDP:  # FSDP2 shards the frozen base per block, not just the LoRA
        assert config.fsdp_config["fsdp_version"] == 2
        assert "FluxTransformerBlock" in config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"]
    if kind == DistributedType.DEEPSPEED:
        assert config.deepspeed_config["zero_stage"] == int(name[-6])
    assert config.use_cpu == (name == "cpu_gloo.yaml")
