"""``flowrl export --merge``: fuse a trained LoRA into the base weights and save a diffusers folder.

The merged folder is a plain diffusers pipeline (``model_index.json`` + one subfolder per
component, safetensors weights): ``<PipelineClass>.from_pretrained(DIR)`` loads it offline with
no peft and no LoRA, and ``flowrl train/sample model.path=DIR`` uses it as a new base model.
The merge goes through diffusers itself: ``pipe.load_lora_weights`` (the same call users run),
``pipe.fuse_lora`` (W <- W + (alpha / r) B A, on every denoiser that holds a LoRA: Wan2.2's
two experts included) and ``pipe.unload_lora_weights``.
The base folder's ``flowrl.json`` is copied; a run's ``model.distilled_guidance`` (FLUX.1-dev) is
written into it as ``guidance_scale``, the guidance the LoRA was trained with.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from .models import EMBEDDED, load_adapter
from .models.hub import SET_MODEL_PATH
from .models.sd3 import MODEL_CARD, read_model_card
from .outputs import check_overwritable, check_run_config
from .policy.lora import adapted_denoisers, find_lora, load_saved_lora


def run_config_file(source: str | Path) -> Path | None:
    """The resolved ``config.yaml`` of the run ``source`` belongs to, or None.

    ``source``: a run folder, its ``lora/``, a LoRA folder under its ``checkpoints/`` (``best-guard``), or a
    LoRA file in one of those folders.

    Raises:
        ValueError: that ``config.yaml`` is empty (:func:`~flowrl.outputs.check_run_config`).
    """
    path = Path(source)
    if path.is_file():
        path = path.parent
    run = path.parent if path.name == "lora" else path.parent.parent if path.parent.name == "checkpoints" else path
    for folder in dict.fromkeys((path, run)):
        if (folder / "config.yaml").is_file():
            return check_run_config(folder / "config.yaml", "restore it, or pass the run's config file(s)")
    return None


def run_model_settings(source: str | Path) -> dict[str, Any]:
    """``model.path``, ``model.dtype`` and ``model.distilled_guidance`` (when set) from a run's ``config.yaml``.

    Empty when the run has no ``config.yaml``.
    """
    config = run_config_file(source)
    if config is None:
        return {}
    model = (yaml.safe_load(config.read_text()) or {}).get("model") or {}
    settings: dict[str, Any] = {k: model[k] for k in ("path", "dtype") if isinstance(model.get(k), str)}
    guidance = model.get("distilled_guidance")
    if isinstance(guidance, (int, float)) and not isinstance(guidance, bool):
        settings["distilled_guidance"] = float(guidance)
    return settings


def _base_folder(base: str) -> Path | None:
    if base in (None, EMBEDDED):
        from .models.digits.model import DIGITS_DIR

        return DIGITS_DIR
    return Path(base) if Path(base).is_dir() else None


def _load_base(base: str, dtype: str) -> Any:
    """The base model's adapter on the CPU; missing or damaged weights name ``--base`` (export's flag) as the fix.

    Raises:
        FileNotFoundError: one line naming the model, the download command and ``--base``.
        ValueError: a damaged weight file, named with the same fix (or another refusal of :func:`load_adapter`).
    """
    try:
        return load_adapter(base, dtype=dtype, device="cpu")
    except (FileNotFoundError, ValueError) as err:
        if SET_MODEL_PATH not in str(err):
            raise
        raise type(err)(str(err).replace(SET_MODEL_PATH, "pass --base ")) from None


def export_merged(
    source: str | Path, out: str | Path, *, base: str | None = None, dtype: str | None = None, overwrite: bool = False
) -> Path:
    """Write base model + LoRA fused into the transformer weights as a diffusers folder.

    Args:
        source: a run folder (its ``config.yaml`` names the base model), a ``lora/`` folder or a
            ``pytorch_lora_weights.safetensors`` file.
        out: the folder to write.
        base: base model path (default: the run's ``model.path``, else the embedded model).
        dtype: weight dtype of the export (default: the run's ``model.dtype``, else float32).
        overwrite: replace a non-empty ``out``.

    Returns:
        ``out`` as a Path.

    Raises:
        FileNotFoundError: no LoRA at ``source`` or no base weights.
        FileExistsError: ``out`` holds files and ``overwrite`` is False.
    """
    lora = find_lora(source)
    settings = run_model_settings(source)
    base = base or settings.get("path") or EMBEDDED
    dtype = dtype or settings.get("dtype") or "float32"
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"export folder {out} already holds files; pass --overwrite or choose another --out")
        check_overwritable(out, ("model_index.json",), "diffusers model", "--out")
    model = _load_base(base, dtype)
    pipe = model.pipe
    load_saved_lora(model, lora)  # diffusers' loader; Wan2.2 loads one file per expert
    pipe.fuse_lora(components=adapted_denoisers(pipe), lora_scale=1.0)
    pipe.unload_lora_weights()
    card = export_model_card(_base_folder(base), settings.get("distilled_guidance"))  # read before `out` (the base
    if out.exists():  # folder itself, with --overwrite) is replaced
        shutil.rmtree(out)
    pipe.save_pretrained(str(out), safe_serialization=True)
    if card is not None:
        (out / MODEL_CARD).write_text(card)
    return out


def export_model_card(base_folder: Path | None, distilled_guidance: float | None) -> str | None:
    """The export's ``flowrl.json`` text: the base folder's card plus the run's distilled guidance; None for no card.

    The base card holds sampling defaults (resolution, sequence length); ``model.distilled_guidance`` goes in as
    ``guidance_scale``, so a merged FLUX.1-dev samples at the guidance its LoRA was trained with.
    """
    card = base_folder / MODEL_CARD if base_folder is not None else None
    if distilled_guidance is None:
        return card.read_text() if card is not None and card.is_file() else None
    values = read_model_card(base_folder) if base_folder is not None else {}
    return json.dumps({**values, "guidance_scale": distilled_guidance}, indent=2) + "\n"
