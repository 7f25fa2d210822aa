"""Finding and reading reward-model weights: local paths or Hugging Face hub ids, safe loading only.

A weight spec is either a local path (folder or file) or a hub reference:

- ``"owner/repo"``: a hub repository (a model folder, or the repository holding a known file);
- ``"owner/repo/path/in/repo.pt"``: one file inside a hub repository.

Hub references are resolved with ``huggingface_hub.snapshot_download`` and then loaded from the
local snapshot, so loaders never retry the network: with ``HF_HUB_OFFLINE=1`` only the local cache
is used, and a miss is one :class:`FileNotFoundError` line naming the model, the download command
and the config key to set. Checkpoints are read with safetensors, or ``torch.load(weights_only=True)``
for the published ``.pt``/``.pth``/``.bin`` files; nothing is ever unpickled without restriction.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CONFIG_FILES = ("*.json", "*.txt", "*.model")
SAFETENSORS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "model-*.safetensors")
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*.bin")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class WeightSource:
    """What a loader needs to say when weights are missing.

    Attributes:
        model: human name of the model, e.g. "PickScore_v1".
        config_key: the config key that takes the path, e.g. "rewards.pickscore.model".
    """

    model: str
    config_key: str


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype for "float32" / "bfloat16" / "float16" (or a torch.dtype, returned as is).

    Raises:
        ValueError: unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"reward dtype must be one of {sorted(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set to a true value now."""
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return any(f.strip().upper() in {"1", "ON", "YES", "TRUE"} for f in flags)


def _download_hint(repo_id: str, filename: str | None, source: WeightSource) -> str:
    what = f"{repo_id} {filename}" if filename else repo_id
    target = f"/models/{repo_id.split('/')[-1]}"
    value = f"{target}/{filename}" if filename else target
    return (
        f"download it on a machine with hub access (`hf download {what} --local-dir {target}`) "
        f"and set {source.config_key}={value}"
    )


def safetensors_damage(path: Path) -> str | None:
    """Why a ``.safetensors`` file cannot be opened (truncated, overlong, garbled header), or None when it can.

    Reads the header only, not the tensors, so it costs the same for any file size. A loader that meets
    such a file fails without naming it (transformers) or with a generic line (diffusers); callers
    check first and name the file and the fix.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt"):
            return None
    except Exception as err:  # noqa: BLE001 - safetensors raises several error types for damaged files
        return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _is_hub_ref(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) >= 2 and not spec.startswith(("/", ".", "~")) and all(parts) and "\\" not in spec


def _cached(repo_id: str, patterns: Sequence[str]) -> Path | None:
    """The local-cache snapshot folder of ``repo_id``, or None (never touches the network)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(patterns), local_files_only=True))
    except Exception:  # noqa: BLE001 - any cache miss means "not cached"
        return None


class CachedDefaults:
    """A reward factory's ``offline`` check: are its default hub weights in the local cache?

    ``flowrl rewards list`` calls it (no network) and shows ``cached`` when it returns True.

    Args:
        *needs: (hub id, file patterns) pairs; every pair must have a cached snapshot holding at
            least one file matching each pattern group.
    """

    def __init__(self, *needs: tuple[str, Sequence[Sequence[str]]]) -> None:
        self.needs = needs

    def __call__(self) -> bool:
        """Whether every (hub id, pattern groups) pair has a cached snapshot (no network)."""
        for repo_id, groups in self.needs:
            folder = _cached(repo_id, [p for group in groups for p in group])
            if folder is None or not all(_has_any(folder, group) for group in groups):
                return False
        return True


def _download(repo_id: str, patterns: Sequence[str], source: WeightSource, filename: str | None) -> Path:
    """Fetch ``patterns`` of ``repo_id`` (one attempt, no retry loop); one-line error when offline or failing."""
    from huggingface_hub import snapshot_download

    if hub_offline():
        raise FileNotFoundError(
            f"{source.model} weights {repo_id!r} are not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
            + _download_hint(repo_id, filename, source)
        )
    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(patterns)))
    except Exception as err:  # noqa: BLE001 - one line naming the model instead of the hub's traceback
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise FileNotFoundError(
            f"{source.model} weights {repo_id!r} could not be downloaded ({type(err).__name__}: {first}); "
            + _download_hint(repo_id, filename, source)
        ) from None


def _has_any(folder: Path, patterns: Sequence[str]) -> bool:
    return any(any(folder.glob(p)) for p in patterns)


def _hub_model_folder(repo_id: str, source: WeightSource, weights: bool) -> Path:
    """Cached snapshot when complete; else download configs plus safetensors (or .bin when there are none)."""
    wanted = SAFETENSORS_WEIGHTS + PICKLE_WEIGHTS if weights else ()
    folder = _cached(repo_id, CONFIG_FILES + wanted)
    if folder is not None and _has_any(folder, CONFIG_FILES) and (not weights or _has_any(folder, wanted)):
        return folder
    folder = _download(repo_id, CONFIG_FILES + (SAFETENSORS_WEIGHTS if weights else ()), source, None)
    if weights and not _has_any(folder, SAFETENSORS_WEIGHTS):
        folder = _download(repo_id, CONFIG_FILES + PICKLE_WEIGHTS, source, None)
    return folder


def resolve_model_folder(spec: str | os.PathLike, source: WeightSource, *, weights: bool = True) -> Path:
    """A local folder in transformers' ``save_pretrained`` layout for a local path or hub id.

    Args:
        spec: local folder, or hub repository id ("owner/name").
        source: model name and config key for error messages.
        weights: also require model weights (False for processor/tokenizer folders).

    Returns:
        The folder (a hub snapshot is fetched with safetensors weights, or ``pytorch_model.bin``
        when the repository has no safetensors).

    Raises:
        FileNotFoundError: the folder or the weights are missing (one line: how to download, which key).
        ValueError: a ``.safetensors`` file in it is damaged (one line naming it, with the same fix).
    """
    path = Path(os.fspath(spec)).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"{source.model}: {path} is a file; set {source.config_key} to the model folder")
        folder = path
    elif _is_hub_ref(str(spec)):
        folder = _hub_model_folder(str(spec), source, weights)
    else:
        raise FileNotFoundError(
            f"{source.model}: local path {path} does not exist; set {source.config_key} to a folder or hub id"
        )
    if not (folder / "config.json").is_file() and weights:
        raise FileNotFoundError(
            f"{source.model}: {folder} has no config.json; set {source.config_key} to a transformers model folder"
        )
    if weights and not _has_any(folder, SAFETENSORS_WEIGHTS + PICKLE_WEIGHTS):
        raise FileNotFoundError(
            f"{source.model}: {folder} holds no model weights; " + _download_hint(str(spec), None, source)
        )
    for file in sorted(folder.glob("*.safetensors")) if weights else ():
        if (reason := safetensors_damage(file)) is not None:
            raise ValueError(
                f"{source.model}: weight file {file} is damaged ({reason}); " + _download_hint(str(spec), None, source)
            )
    return folder


def resolve_file(spec: str | os.PathLike, source: WeightSource, default_filename: str) -> Path:
    """A local checkpoint file for a local file, a local folder holding ``default_filename``, or a hub ref.

    Args:
        spec: a local file; a local folder (``default_filename`` inside it); a hub repo id
            ("owner/name", file ``default_filename``); or "owner/name/path/in/repo".
        source: model name and config key for error messages.
        default_filename: the published file name, e.g. "ImageReward.pt".

    Raises:
        FileNotFoundError: one line saying how to download the file and which key to set.
    """
    path = Path(os.fspath(spec)).expanduser()
    if path.is_dir():
        path = path / default_filename
    if path.is_file():
        return path
    if path.exists() or not _is_hub_ref(str(spec)):
        raise FileNotFoundError(
            f"{source.model}: checkpoint {path} does not exist; set {source.config_key} to the {default_filename} file"
        )
    parts = str(spec).split("/")
    repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:]) or default_filename
    cached = _cached(repo_id, [filename])
    if cached is not None and (cached / filename).is_file():
        return cached / filename
    local = _download(repo_id, [filename], source, filename) / filename
    if not local.is_file():
        raise FileNotFoundError(
            f"{source.model}: {repo_id} has no file {filename!r}; " + _download_hint(repo_id, filename, source)
        )
    return local


def load_checkpoint(path: Path, *, nested_key: str | None = None) -> dict[str, Tensor]:
    """Read a state dict from safetensors or a ``torch.load(weights_only=True)`` checkpoint.

    Args:
        path: ``.safetensors``, or a ``.pt``/``.pth``/``.bin`` file written by ``torch.save``.
        nested_key: when the file holds ``{nested_key: state_dict, ...}`` (e.g. "state_dict"), unwrap it.

    Returns:
        Tensors by name, on the CPU. A leading "module." (DataParallel) is stripped from every key.

    Raises:
        ValueError: the file is damaged or not a tensor state dict (the message names the file).
    """
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        if (reason := safetensors_damage(path)) is not None:
            raise ValueError(f"{path} is damaged ({reason}); download it again")
        state = load_file(str(path), device="cpu")
    else:
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - name the file and the safe-loading rule
            raise ValueError(
                f"{path} could not be read with torch.load(weights_only=True) ({type(err).__name__}: "
                f"{unpickler_reason(err)}); flowrl reads only tensor checkpoints: convert it to safetensors"
            ) from None
    if nested_key is not None and isinstance(state, dict) and isinstance(state.get(nested_key), dict):
        state = state[nested_key]
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(
            f"{path} does not hold a flat dict of tensors; expected a state dict (optionally under {nested_key!r})"
        )
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}
    return state


def refused_pickle(err: BaseException) -> pickle.UnpicklingError | None:
    """The ``UnpicklingError`` of torch's ``weights_only`` loader behind ``err`` (diffusers wraps it in an OSError)."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, pickle.UnpicklingError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def unpickler_reason(err: BaseException) -> str:
    """What torch's ``weights_only`` loader refused (``Unsupported global: ...``), not its paragraph of advice."""
    text = str(err)
    _, marker, after = text.partition("WeightsUnpickler error:")
    lines = [line.strip() for line in (after if marker else text).splitlines() if line.strip()]
    return lines[0].split(" Please use ")[0][:160] if lines else type(err).__name__  # drop "add_safe_globals" advice


def pickle_refusal(what: str, folder: Path, err: pickle.UnpicklingError) -> str:
    """One line for pickled weights in ``folder`` that torch's ``weights_only`` loader refused, naming the files.

    Args:
        what: whose weights, e.g. ``model 'sd3'`` or ``PickScore_v1``.
        folder: the folder the loader read.
        err: the loader's error (see :func:`refused_pickle`).
    """
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.name.endswith(PICKLE_SUFFIXES))
    named = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "") or "a pickled file"
    return (
        f"{what}: torch's safe loader (weights_only) refused the pickled weights in {folder} ({named}: "
        f"{unpickler_reason(err)}); flowrl never unpickles with arbitrary code, so the file may be tampered with: "
        "replace it with .safetensors weights"
    )
