"""Find a model's diffusers folder: a local path or a Hugging Face hub id, without long waits.

A hub id is looked up in the local hub cache first (no network). Only when it is not cached,
offline mode (``HF_HUB_OFFLINE``) is off and the hub answers a 3-second reachability probe is
anything downloaded; otherwise the user gets one line naming the model, the download command
and the config key, instead of the hub client's ~25 s of retries. Remote code is never run.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

from ..rewards.weights import safetensors_damage

KNOWN_REPOS = {
    "StableDiffusion3Pipeline": "stabilityai/stable-diffusion-3.5-medium",
    "FluxPipeline": "black-forest-labs/FLUX.1-dev",
    "QwenImagePipeline": "Qwen/Qwen-Image",
    "WanPipeline": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
}
"""Example hub repos per pipeline class, used in download hints."""

logger = logging.getLogger(__name__)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json", ".gguf")
PROBE_TIMEOUT_S = 3.0


def is_hub_id(path: str) -> bool:
    """True for ``owner/name`` strings that are not an existing local path."""
    return bool(_HUB_ID.match(path)) and not Path(path).expanduser().exists()


def hub_offline() -> bool:
    """Offline mode as the hub client reads it (``HF_HUB_OFFLINE``), checked at call time."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE", "").strip().upper()
    return value in ("1", "ON", "YES", "TRUE") or bool(constants.HF_HUB_OFFLINE)


SET_MODEL_PATH = "set model.path="  # the fix a missing-weights line names (flowrl export names --base instead)


def download_fix(model: str, repo: str | None = None) -> str:
    """The fix a weights error names: the download command and the config key to set."""
    repo = repo or (model if _HUB_ID.match(model) else "<owner>/<model>")
    target = f"./models/{repo.split('/')[-1]}"
    return f"download them with `hf download {repo} --local-dir {target}` and {SET_MODEL_PATH}{target}"


def missing_weights_message(model: str, reason: str, repo: str | None = None, fix: str | None = None) -> str:
    """One line: which model, why, and the fix (default: the download command and the config key to set)."""
    return f"weights for model {model!r} are missing ({reason}); {fix or download_fix(model, repo)}"


def _endpoint() -> str:
    """The hub endpoint (``HF_ENDPOINT`` read at call time), used by the probe and the download alike."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _hub_reachable(timeout: float = PROBE_TIMEOUT_S) -> bool:
    """One TCP connect to the hub endpoint; any failure (DNS, refused, blocked) counts as unreachable."""
    url = urlparse(_endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except Exception:  # noqa: BLE001 - a probe: every failure means "do not try the hub"
        return False


def check_weights(folder: Path, model: str, fix: str | None = None) -> None:
    """Refuse, in one line, a pipeline folder whose model components lack weights or hold damaged ones.

    Components are the subfolders named in ``model_index.json`` that hold a ``config.json`` (models;
    tokenizers and schedulers have other config files) or that are missing altogether. Each
    ``.safetensors`` file's header is read (not its tensors), which catches a truncated, overlong or
    garbled file before a loader fails on it without naming it; a shard index must be valid JSON and
    every shard it lists must exist.

    Args:
        folder: the pipeline folder.
        model: the model's name in messages (``model.path`` as given).
        fix: what the message tells the user to do; default: the download command of the folder's
            pipeline class and the config key to set.

    Raises:
        FileNotFoundError: no ``model_index.json``, a component folder missing, a component without
            weight files, or a shard its index lists missing.
        ValueError: a ``.safetensors`` file or a shard index that cannot be read.
    """
    index = folder / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(
            f"model folder {folder} has no model_index.json; point model.path at a diffusers pipeline folder"
        )
    listed = json.loads(index.read_text())
    cls_name = listed.get("_class_name")
    fix = fix or download_fix(model, KNOWN_REPOS.get(cls_name) if isinstance(cls_name, str) else None)
    for name, spec in listed.items():
        if name.startswith("_") or not isinstance(spec, list) or spec[0] is None:
            continue
        sub = folder / name
        if not sub.is_dir():
            raise FileNotFoundError(missing_weights_message(model, f"component folder {sub} does not exist", fix=fix))
        if (sub / "config.json").is_file() and not any(p.name.endswith(_WEIGHT_SUFFIXES) for p in sub.iterdir()):
            raise FileNotFoundError(missing_weights_message(model, f"{sub} holds no weight files", fix=fix))
        _check_weight_files(sub, model, fix)


def _check_weight_files(sub: Path, model: str, fix: str) -> None:
    """Read each safetensors header and each shard index of one component folder (see :func:`check_weights`)."""
    for path in sorted(sub.glob("*.safetensors.index.json")):
        try:
            shards = set(json.loads(path.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(
                f"shard index {path} of model {model!r} is unreadable ({type(err).__name__}); {fix}"
            ) from None
        for shard in sorted(shards):
            if not (sub / shard).is_file():
                raise FileNotFoundError(missing_weights_message(model, f"{path.name} lists {sub / shard}", fix=fix))
    for path in sorted(sub.glob("*.safetensors")):
        if (reason := safetensors_damage(path)) is not None:
            raise ValueError(f"weight file {path} of model {model!r} is damaged ({reason}); {fix}")


def _download(repo_id: str, cache_dir: str | None) -> Path:
    """Download model_index.json, then only the component folders it names (not single-file checkpoints)."""
    from huggingface_hub import hf_hub_download, snapshot_download

    endpoint = _endpoint()
    index = Path(hf_hub_download(repo_id, "model_index.json", cache_dir=cache_dir, endpoint=endpoint))
    parts = [
        k for k, v in json.loads(index.read_text()).items() if not k.startswith("_") and isinstance(v, list) and v[0]
    ]
    patterns = ["model_index.json", *(f"{p}/*" for p in parts)]
    return Path(snapshot_download(repo_id, cache_dir=cache_dir, allow_patterns=patterns, endpoint=endpoint))


def resolve_model_path(path: str, *, cache_dir: str | None = None) -> Path:
    """A local diffusers pipeline folder for ``path`` (a folder or a hub id), with weights present.

    Args:
        path: a local folder, or a hub id ``owner/name``.
        cache_dir: hub cache folder (default: the hub client's).

    Returns:
        The folder holding ``model_index.json``.

    Raises:
        FileNotFoundError: one line naming the model, the download command and ``model.path``.
    """
    local = Path(path).expanduser()
    if local.exists():
        check_weights(local, path)
        return local
    if not is_hub_id(path):
        raise FileNotFoundError(missing_weights_message(path, f"folder {local} does not exist"))
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        folder = Path(snapshot_download(path, cache_dir=cache_dir, local_files_only=True))
    except OSError:  # LocalEntryNotFoundError: not cached
        where = f"no local folder {path!r} and not in the local hub cache"
        if hub_offline():
            raise FileNotFoundError(missing_weights_message(path, f"{where}; HF_HUB_OFFLINE is set")) from None
        if not _hub_reachable():
            raise FileNotFoundError(missing_weights_message(path, f"{where}; the hub is unreachable")) from None
        logger.warning(
            "downloading %s from the Hugging Face hub into its cache (set model.path to a local folder to skip)", path
        )
        try:
            folder = _download(path, cache_dir)
        except (HfHubHTTPError, OSError) as err:
            reason = f"download failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            raise FileNotFoundError(missing_weights_message(path, reason)) from None
    check_weights(folder, path)
    return folder
