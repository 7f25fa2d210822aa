"""Trainer checkpoints in safetensors + JSON (no pickles).

Layout of a checkpoint folder::

    lora.safetensors        peft LoRA state
    optimizer.safetensors   optimizer tensors, keys "state.<param>.<name>"
    rng.safetensors         "generator" and "torch_rng" byte states
    trainer.json            counters, optimizer param groups, the objective's scalar state and the
                            per-prompt advantage history
    adapter-<name>.safetensors   extra LoRA adapters (e.g. DiffusionNFT's "old" and "ema")
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

FILES = ("lora.safetensors", "optimizer.safetensors", "rng.safetensors", "trainer.json")


def _flatten_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors, scalars = {}, {}
    for pid, entry in state["state"].items():
        for name, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"state.{pid}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = value
    for key, value in meta["scalars"].items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def _atomic_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def save_checkpoint(state: dict[str, Any], directory: str | Path) -> Path:
    """Write a trainer state dict; files are written under a temp name then renamed.

    Args:
        state: output of ``Trainer.state_dict()``.
        directory: target folder (created).

    Returns:
        The folder path.
    """
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state["lora"].items()}, str(tmp / "lora.safetensors"))
    for name, weights in state.get("adapters", {}).items():
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / f"adapter-{name}.safetensors"))
    opt_tensors, opt_meta = _flatten_optimizer(state["optimizer"])
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    save_file({"generator": state["generator"], "torch_rng": state["torch_rng"]}, str(tmp / "rng.safetensors"))
    meta = {
        "iteration": state["iteration"],
        "samples_seen": state["samples_seen"],
        "nfe": state.get("nfe", 0),
        "optimizer": opt_meta,
    }
    meta["objective"] = state.get("objective", {})  # JSON scalars of the objective (e.g. SAGE-GRPO's adaptive beta)
    meta["advantage"] = state.get("advantage", {})  # per-prompt reward history (advantage.method: per_prompt)
    _atomic_json(tmp / "trainer.json", meta)
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


def load_checkpoint(directory: str | Path) -> dict[str, Any]:
    """Read a folder written by :func:`save_checkpoint`.

    Raises:
        ValueError: a missing or corrupt file (named, with the fix).
    """
    directory = Path(directory)
    missing = [name for name in FILES if not (directory / name).is_file()]
    if missing:
        raise ValueError(
            f"checkpoint {directory} is incomplete (missing {', '.join(missing)}); resume from another checkpoint"
        )
    try:
        lora = load_file(str(directory / "lora.safetensors"))
        opt = load_file(str(directory / "optimizer.safetensors"))
        rng = load_file(str(directory / "rng.safetensors"))
        meta = json.loads((directory / "trainer.json").read_text())
        adapters = {
            p.stem.removeprefix("adapter-"): load_file(str(p)) for p in sorted(directory.glob("adapter-*.safetensors"))
        }
    except (SafetensorError, OSError, json.JSONDecodeError, ValueError) as err:
        raise ValueError(f"checkpoint {directory} is corrupt ({err}); resume from another checkpoint") from None
    return {
        "lora": lora,
        "adapters": adapters,
        "optimizer": _unflatten_optimizer(opt, meta["optimizer"]),
        "generator": rng["generator"],
        "torch_rng": rng["torch_rng"],
        "iteration": meta["iteration"],
        "samples_seen": meta["samples_seen"],
        "nfe": meta.get("nfe", 0),
        "objective": meta.get("objective", {}),
        "advantage": meta.get("advantage", {}),
    }
