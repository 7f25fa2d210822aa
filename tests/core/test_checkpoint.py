"""Checkpoints round-trip exactly through safetensors + JSON."""

import pytest
import torch

from flowrl.checkpoint import load_checkpoint, save_checkpoint


def _state():
    p = torch.nn.Parameter(torch.randn(3, 2))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.99))
    p.grad = torch.randn(3, 2)
    opt.step()
    gen = torch.Generator().manual_seed(5)
    torch.randn(3, generator=gen)
    return {
        "lora": {"a.lora_A.weight": torch.randn(2, 2)},
        "optimizer": opt.state_dict(),
        "generator": gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "iteration": 7,
        "samples_seen": 70,
    }, opt


def test_round_trip(tmp_path):
    state, opt = _state()
    save_checkpoint(state, tmp_path / "ck")
    back = load_checkpoint(tmp_path / "ck")
    assert back["iteration"] == 7 and back["samples_seen"] == 70
    assert torch.equal(back["lora"]["a.lora_A.weight"], state["lora"]["a.lora_A.weight"])
    assert torch.equal(back["generator"], state["generator"])
    saved = state["optimizer"]["state"][0]
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(back["optimizer"]["state"][0][key], saved[key])
    opt.load_state_dict(back["optimizer"])  # accepted by torch
    assert opt.param_groups[0]["betas"] == (0.9, 0.99)
    assert not (tmp_path / "ck.partial").exists()


def test_corrupt_and_incomplete(tmp_path):
    state, _ = _state()
    save_checkpoint(state, tmp_path / "ck")
    (tmp_path / "ck" / "optimizer.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="optimizer.safetensors is 7 bytes but manifest.json lists"):
        load_checkpoint(tmp_path / "ck")
    save_checkpoint(state, tmp_path / "ck")  # replaces the folder
    (tmp_path / "ck" / "rng.safetensors").unlink()
    with pytest.raises(ValueError, match="ck: rng.safetensors is missing; resume from an earlier checkpoint"):
        load_checkpoint(tmp_path / "ck")
    (tmp_path / "ck" / "manifest.json").unlink()
    with pytest.raises(ValueError, match="manifest.json is missing .not a finished checkpoint"):
        load_checkpoint(tmp_path / "ck")
