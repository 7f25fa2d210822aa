"""Trainer checkpoints in safetensors + JSON (no pickles), verified against a checksummed manifest.

Layout of a checkpoint folder::

    lora.safetensors        peft LoRA state (float32, the dtype training keeps)
    optimizer.safetensors   optimizer tensors, keys "state.<param>.<name>"
    rng.safetensors         "generator" and "torch_rng" byte states
    trainer.json            counters, optimizer param groups, the objective's scalar state, the
                            per-prompt advantage history, the update guard's counters, the
                            reward-hacking guards' best values and trips, and the resolved run config
    adapter-<name>.safetensors   extra LoRA adapters (e.g. DiffusionNFT's "old" and "ema")
    manifest.json           written last: format version, and per file its size and sha256

:func:`save_checkpoint` writes every file into ``iter-N.partial/``, fsyncs each, writes the
manifest, fsyncs it and the folder, then renames the folder into place. :func:`load_checkpoint`
verifies every file against the manifest before parsing it; a folder without a manifest is not a
finished checkpoint. docs/reliability.md lists what is checked and the messages.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from .outputs import DISK_FULL_ERRNOS, disk_full_error, resume_run_dir

FILES = ("lora.safetensors", "optimizer.safetensors", "rng.safetensors", "trainer.json")
MANIFEST = "manifest.json"
FORMAT = "flowrl-checkpoint"
FORMAT_VERSION = 1
ADAMW_KEYS = ("exp_avg", "exp_avg_sq", "step")  # per-parameter state of torch.optim.AdamW
CHECKPOINT_NAME = re.compile(r"iter-(\d+)")  # a checkpoint folder's name: the iteration it was saved at
# AdamW param-group numbers and the range each may take (the bounds of the optim.* config keys; checkpoint.py
# cannot import flowrl.config: policy -> checkpoint -> config -> objectives -> policy; a test pins them equal)
GROUP_RANGES = {"lr": (0.0, 1.0, True), "eps": (0.0, 1.0, True), "weight_decay": (0.0, 1.0, False)}
GROUP_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable", "decoupled_weight_decay")  # bool
GROUP_OPTIONS = ("foreach", "fused")  # bool or null


class CheckpointError(ValueError):
    """A checkpoint folder that fails verification (one line: the folder, the file and why).

    Args:
        folder: the checkpoint folder.
        reason: what is wrong, starting with the file name.
    """

    def __init__(self, folder: Path, reason: str):
        self.folder, self.reason = folder, reason
        super().__init__(f"checkpoint {folder}: {reason}; resume from an earlier checkpoint")


# -- writing ---------------------------------------------------------------------------------


def _flatten_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors, scalars = {}, {}
    for pid, entry in state["state"].items():
        for name, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"state.{pid}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _encode(state: dict[str, Any]) -> dict[str, bytes]:
    """Every file of the checkpoint, as bytes (name -> content)."""
    files = {"lora.safetensors": save({k: v.contiguous() for k, v in state["lora"].items()})}
    for name, weights in state.get("adapters", {}).items():
        files[f"adapter-{name}.safetensors"] = save({k: v.contiguous() for k, v in weights.items()})
    opt_tensors, opt_meta = _flatten_optimizer(state["optimizer"])
    files["optimizer.safetensors"] = save(opt_tensors)
    files["rng.safetensors"] = save({"generator": state["generator"], "torch_rng": state["torch_rng"]})
    meta = {
        "iteration": state["iteration"],
        "samples_seen": state["samples_seen"],
        "nfe": state.get("nfe", 0),
        "optimizer": opt_meta,
        "objective": state.get("objective", {}),  # JSON scalars of the objective (e.g. SAGE-GRPO's adaptive beta)
        "advantage": state.get("advantage", {}),  # per-prompt reward history (advantage.method: per_prompt)
        "guard": state.get("guard", {}),  # skipped-update counters (flowrl.guards.UpdateGuard)
        "heldout": state.get("heldout", {}),  # reward-hacking guards (flowrl.evaluation.guard_rewards.GuardTracker)
    }
    if state.get("config") is not None:
        meta["config"] = state["config"]  # the resolved config, compared on resume
    files["trainer.json"] = json.dumps(meta, indent=2).encode()
    return files


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _manifest(files: dict[str, bytes]) -> bytes:
    listed = {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in files.items()}
    body = {"format": FORMAT, "version": FORMAT_VERSION, "files": dict(sorted(listed.items()))}
    return json.dumps({**body, "sha256": _digest(body)}, indent=2).encode()


def _write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    if os.name == "nt":  # folders cannot be opened for fsync on Windows
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes, folder: Path) -> None:
    try:
        _write_bytes(path, data)
    except OSError as err:
        if err.errno not in DISK_FULL_ERRNOS:
            raise
        raise disk_full_error(
            f"checkpoint {folder}: {path.name}", path.parent, len(data), resume_run_dir(folder)
        ) from None


def save_checkpoint(state: dict[str, Any], directory: str | Path) -> Path:
    """Write a trainer state dict into ``directory``, atomically and with a manifest.

    The files go into ``<directory>.partial`` (a stale one from an interrupted save is removed
    first), each fsynced; ``manifest.json`` is written last; then the folder is fsynced and renamed
    into place. On any error the partial folder is removed and an existing checkpoint is untouched.

    Args:
        state: output of ``Trainer.state_dict()``, optionally with ``"config"`` (the resolved
            config as :func:`flowrl.config.to_dict` gives it).
        directory: target folder (created; an existing folder of that name is replaced).

    Returns:
        The folder path.

    Raises:
        DiskFullError: no space left on the device (one line: the file, its size and the free space).
    """
    directory = Path(directory)
    files = _encode(state)
    tmp = directory.with_name(directory.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        for name, data in files.items():
            _write_file(tmp / name, data, directory)
        _write_file(tmp / MANIFEST, _manifest(files), directory)
        _fsync_dir(tmp)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
        _fsync_dir(directory.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


# -- verifying and reading ---------------------------------------------------------------------


def _read_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """The manifest's file list (name -> size, sha256), after checking the manifest itself."""
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            folder, f"{MANIFEST} is missing (not a finished checkpoint, or one from a flowrl without manifests)"
        )
    try:
        manifest = json.loads(path.read_bytes())
    except ValueError:
        raise CheckpointError(folder, f"{MANIFEST} is not valid JSON (truncated or edited)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(folder, f"{MANIFEST} is not a flowrl checkpoint manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            folder, f"{MANIFEST} has format version {manifest.get('version')!r}; this flowrl reads {FORMAT_VERSION}"
        )
    if manifest.get("sha256") != _digest({k: v for k, v in manifest.items() if k != "sha256"}):
        raise CheckpointError(folder, f"{MANIFEST} fails its own checksum (corrupt or edited)")
    return manifest["files"]


def _check_listing(folder: Path, listed: dict[str, Any]) -> None:
    for name in FILES:
        if name not in listed:
            raise CheckpointError(folder, f"{MANIFEST} does not list {name}")
    for path in sorted(folder.iterdir()):
        if path.suffix in (".safetensors", ".json") and path.name != MANIFEST and path.name not in listed:
            raise CheckpointError(folder, f"{path.name} is not listed in {MANIFEST} (added after the save)")
    for name in listed:
        if Path(name).name != name:
            raise CheckpointError(folder, f"{MANIFEST} lists {name!r}, which is not a file of the folder")


def _verified_bytes(folder: Path, name: str, entry: dict[str, Any]) -> bytes:
    path = folder / name
    if not path.is_file():
        raise CheckpointError(folder, f"{name} is missing")
    data = path.read_bytes()
    if len(data) != entry.get("size"):
        raise CheckpointError(
            folder, f"{name} is {len(data)} bytes but {MANIFEST} lists {entry.get('size')} (truncated or edited)"
        )
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise CheckpointError(folder, f"{name} fails its checksum (corrupt or edited)")
    return data


def verify_checkpoint(directory: str | Path) -> dict[str, bytes]:
    """Check a checkpoint folder against its manifest and return the verified file contents.

    Args:
        directory: a checkpoint folder (``runs/X/checkpoints/iter-N``).

    Returns:
        File name -> bytes, for every file the manifest lists (each read once).

    Raises:
        FileNotFoundError: no such folder.
        CheckpointError: no manifest, a listed file missing, truncated or failing its checksum, or
            an unlisted ``.safetensors``/``.json`` file present (one line naming the file).
    """
    folder = Path(directory)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint {folder} not found; pass a run folder or one of its checkpoints/iter-N")
    listed = _read_manifest(folder)
    if not isinstance(listed, dict) or not all(isinstance(e, dict) for e in listed.values()):
        raise CheckpointError(folder, f"{MANIFEST} has no valid file list")
    _check_listing(folder, listed)
    return {name: _verified_bytes(folder, name, entry) for name, entry in listed.items()}


def _tensors(folder: Path, name: str, data: bytes) -> dict[str, torch.Tensor]:
    try:
        return load(data)
    except SafetensorError as err:
        raise CheckpointError(folder, f"{name} is not a readable safetensors file ({err})") from None


def _counter(folder: Path, meta: dict[str, Any], key: str) -> int:
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(folder, f"trainer.json '{key}' must be a non-negative integer (got {value!r})")
    return value


def _iteration(folder: Path, iteration: int) -> None:
    """Refuse a ``trainer.json`` iteration other than the one the folder's name (``iter-N``) says."""
    match = CHECKPOINT_NAME.fullmatch(folder.name)
    if match and int(match.group(1)) != iteration:
        raise CheckpointError(
            folder, f"trainer.json 'iteration' is {iteration} but the folder is {folder.name} (edited or moved)"
        )


def _real(value: Any) -> bool:
    """Whether a JSON value is a finite number (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _group_fault(group: Any) -> str | None:
    """What is wrong with one AdamW param group from ``trainer.json``, or None."""
    if not isinstance(group, dict):
        return f"must be a mapping (got {type(group).__name__})"
    params = group.get("params")
    if not isinstance(params, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in params):
        return f"'params' must be a list of parameter indices (got {params!r})"
    for key, (lo, hi, lo_open) in GROUP_RANGES.items():
        value = group.get(key)
        if not _real(value) or not (lo < value if lo_open else lo <= value) or value > hi:
            return f"'{key}' must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}] (got {value!r})"
    betas = group.get("betas")
    if not isinstance(betas, list) or len(betas) != 2 or not all(_real(b) and 0 <= b < 1 for b in betas):
        return f"'betas' must be two numbers in [0, 1) (got {betas!r})"
    for key in GROUP_FLAGS + GROUP_OPTIONS:
        value = group.get(key, False)
        if not isinstance(value, bool) and not (key in GROUP_OPTIONS and value is None):
            return f"'{key}' must be true or false (got {value!r})"
    return None


def _param_groups(folder: Path, groups: list[Any]) -> None:
    """Refuse AdamW param groups whose values torch would take and misuse (a negative lr, betas as text)."""
    for index, group in enumerate(groups):
        fault = _group_fault(group)
        if fault:
            raise CheckpointError(folder, f"trainer.json optimizer param group {index}: {fault}")


def _trainer_meta(folder: Path, data: bytes) -> dict[str, Any]:
    try:
        meta = json.loads(data)
    except ValueError:
        raise CheckpointError(folder, "trainer.json is not valid JSON") from None
    if not isinstance(meta, dict):
        raise CheckpointError(folder, "trainer.json must hold a mapping")
    opt = meta.get("optimizer")
    if not isinstance(opt, dict) or not isinstance(opt.get("param_groups"), list):
        raise CheckpointError(folder, "trainer.json has no 'optimizer' entry with 'param_groups'")
    _param_groups(folder, opt["param_groups"])
    if not isinstance(opt.get("scalars", {}), dict):
        got = type(opt["scalars"]).__name__
        raise CheckpointError(folder, f"trainer.json optimizer 'scalars' must be a mapping (got {got})")
    _iteration(folder, _counter(folder, meta, "iteration"))
    _counter(folder, meta, "samples_seen")
    if "nfe" in meta:
        _counter(folder, meta, "nfe")
    for key in ("objective", "advantage", "guard", "heldout", "config"):
        if key in meta and not isinstance(meta[key], dict) and not (key == "config" and meta[key] is None):
            raise CheckpointError(folder, f"trainer.json '{key}' must be a mapping (got {type(meta[key]).__name__})")
    return meta


def _unflatten_optimizer(folder: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    try:
        for key, value in tensors.items():
            _, pid, name = key.split(".", 2)
            state.setdefault(int(pid), {})[name] = value
        for key, value in meta.get("scalars", {}).items():
            pid, name = key.split(".", 1)
            state.setdefault(int(pid), {})[name] = value
        groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]]
    except (ValueError, AttributeError, TypeError):
        raise CheckpointError(folder, "optimizer.safetensors has keys that are not 'state.<param>.<name>'") from None
    for pid, entry in sorted(state.items()):
        missing = [k for k in ADAMW_KEYS if k not in entry]
        if missing:
            raise CheckpointError(folder, f"optimizer.safetensors has no '{missing[0]}' for parameter {pid} (AdamW)")
    _check_finite(folder, "optimizer.safetensors", tensors)
    negative = [k for k, v in sorted(tensors.items()) if k.endswith(".exp_avg_sq") and bool((v < 0).any())]
    if negative:
        reason = f"optimizer.safetensors: tensor '{negative[0]}' holds negative values (corrupt or edited)"
        raise CheckpointError(folder, reason)
    return {"state": state, "param_groups": groups}


def _check_lora(folder: Path, name: str, weights: dict[str, torch.Tensor], dtype: torch.dtype | None) -> None:
    for key, value in weights.items():
        if not value.is_floating_point() or (dtype is not None and value.dtype != dtype):
            want = str(dtype).removeprefix("torch.") if dtype is not None else "floating point"
            got = str(value.dtype).removeprefix("torch.")
            raise CheckpointError(folder, f"{name} holds {got} tensor '{key}' (training keeps LoRA weights in {want})")
    _check_finite(folder, name, weights)


def _check_finite(folder: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse a file whose floating-point tensors hold NaN or inf (a run would sample NaN images from it)."""
    key = nonfinite_tensor(tensors)
    if key is not None:
        raise CheckpointError(folder, f"{name}: tensor '{key}' holds NaN or inf (corrupt or edited)")


def nonfinite_tensor(tensors: dict[str, torch.Tensor]) -> str | None:
    """The key of the first floating-point tensor holding NaN or inf, or None when all are finite.

    Args:
        tensors: name -> tensor, as a safetensors file holds them.

    Returns:
        The first offending key in sorted order, or None.
    """
    for key in sorted(tensors):
        value = tensors[key]
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return key
    return None


def _rng(folder: Path, data: bytes) -> dict[str, torch.Tensor]:
    rng = _tensors(folder, "rng.safetensors", data)
    size = torch.Generator().get_state().numel()  # a CPU generator's state, as both are
    for key in ("generator", "torch_rng"):
        if key not in rng or rng[key].dtype != torch.uint8:
            raise CheckpointError(folder, f"rng.safetensors has no uint8 '{key}' state")
        if rng[key].shape != (size,):
            shape = tuple(rng[key].shape)
            raise CheckpointError(folder, f"rng.safetensors '{key}' has shape {shape}; a CPU generator's is ({size},)")
    return rng


def _adapters(folder: Path, files: dict[str, bytes]) -> dict[str, dict[str, torch.Tensor]]:
    adapters = {}
    for name in sorted(n for n in files if n.startswith("adapter-") and n.endswith(".safetensors")):
        weights = _tensors(folder, name, files[name])
        _check_lora(folder, name, weights, None)  # extra adapters may follow the model's dtype
        adapters[name.removeprefix("adapter-").removesuffix(".safetensors")] = weights
    return adapters


def load_checkpoint(directory: str | Path) -> dict[str, Any]:
    """Read a folder written by :func:`save_checkpoint`, verifying it first.

    Every file is checked against ``manifest.json`` (:func:`verify_checkpoint`) before it is
    parsed; after parsing, the optimizer state must hold AdamW's keys per parameter and valid param
    groups, the LoRA tensors must be float32, no LoRA, adapter or optimizer tensor may hold NaN or inf,
    and the counters must be non-negative integers, ``iteration`` the one the folder's ``iter-N`` says.

    Args:
        directory: a checkpoint folder.

    Returns:
        A state dict for ``Trainer.load_state_dict``, plus ``"config"`` (the resolved config the
        run was saved with, or None for a checkpoint written without one).

    Raises:
        FileNotFoundError: no such folder.
        CheckpointError: a missing, corrupt, edited or inconsistent file (one line naming it).
    """
    folder = Path(directory)
    files = verify_checkpoint(folder)
    meta = _trainer_meta(folder, files["trainer.json"])
    lora = _tensors(folder, "lora.safetensors", files["lora.safetensors"])
    _check_lora(folder, "lora.safetensors", lora, torch.float32)
    adapters = _adapters(folder, files)
    rng = _rng(folder, files["rng.safetensors"])
    opt = _tensors(folder, "optimizer.safetensors", files["optimizer.safetensors"])
    return {
        "lora": lora,
        "adapters": adapters,
        "optimizer": _unflatten_optimizer(folder, opt, meta["optimizer"]),
        "generator": rng["generator"],
        "torch_rng": rng["torch_rng"],
        "iteration": meta["iteration"],
        "samples_seen": meta["samples_seen"],
        "nfe": meta.get("nfe", 0),
        "objective": meta.get("objective", {}),
        "advantage": meta.get("advantage", {}),
        "guard": meta.get("guard", {}),
        "heldout": meta.get("heldout", {}),
        "config": meta.get("config"),
    }
