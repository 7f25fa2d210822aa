"""Cross-key checks of a loaded config: rewards, devices, paths and the sampler (per-key ranges are checked on load).

Called by :func:`flowrl.config.load_config`; every check raises one :class:`ConfigError` line that names the key,
the file and the fix.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config_files import ConfigError

if TYPE_CHECKING:
    from .config import Config, SamplerConfig

DEVICE_TYPES = ("cpu", "cuda", "mps")
DEFAULT_PROMPTS = "digits-styles"  # prompts.train and prompts.eval of the embedded job

RESERVED_REWARD_LABELS = ("reward_mean", "reward_ci95", "drift", "diversity", "diversity_base", "diversity_ratio", "n")
"""Figures the held-out evaluation and the eval table name themselves; a reward labelled so would overwrite one."""


def validate_rewards(rewards: dict[str, Any], where: str) -> None:
    """Each reward entry must be a mapping with a finite numeric weight."""
    if not rewards:
        raise ConfigError(f"{where}: 'rewards' is empty; name at least one reward (see `flowrl rewards list`)")
    for name, opts in rewards.items():
        if name in RESERVED_REWARD_LABELS:
            raise ConfigError(
                f"{where}: 'rewards.{name}' is named like an evaluation figure (eval/{name}); give it another label "
                f"and the reward as an option: rewards: {{my_{name}: {{reward: {name}}}}}"
            )
        if not isinstance(opts, dict):
            raise ConfigError(f"{where}: 'rewards.{name}' must be a mapping like {{weight: 1.0}}; got {opts!r}")
        if "weight" in opts:
            opts["weight"] = _as_float(opts["weight"])
        weight = opts.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ConfigError(f"{where}: 'rewards.{name}.weight' must be a finite number; got {weight!r}")
        _check_reward_weight(str(name), weight, where)
        if "device" in opts:
            check_device_string(opts["device"], f"rewards.{name}.device", where)


def _as_float(value: Any) -> Any:
    """A number written as a string ("1e-3": YAML 1.1 reads it as one) as float; anything else unchanged."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _check_reward_weight(name: str, weight: float, where: str) -> None:
    """The reward library's own bound on ``|weight|`` (:func:`flowrl.rewards.combine.check_weight`)."""
    from .rewards.combine import check_weight

    try:
        check_weight(name, weight)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None


def check_device_string(device: Any, key: str, where: str) -> None:
    """Refuse a device string torch cannot parse, or one of a kind flowrl does not run on.

    Only the spelling is checked here; whether the device exists is a property of the machine,
    checked by :func:`flowrl.resources.check_machine` (a config stays loadable anywhere).

    Raises:
        ConfigError: one line naming the key and the accepted forms.
    """
    import torch

    accepted = "use cpu, cuda, cuda:N or mps"
    if not isinstance(device, str):
        raise ConfigError(f"{where}: '{key}' must be a device string; got {device!r}; {accepted}")
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise ConfigError(f"{where}: '{key}' is not a device torch knows: {device!r}; {accepted}") from None
    if kind not in DEVICE_TYPES:
        raise ConfigError(f"{where}: '{key}' names a {kind!r} device, which flowrl does not run on; {accepted}")


def validate_sections(cfg: Config, where: str) -> None:
    """Cross-key checks of the ``model``, ``sampler`` and ``optim`` sections (per-key ranges are checked on load).

    Raises:
        ConfigError: the first bad combination, naming its keys and the fix.
    """
    check_device_string(cfg.model.device, "model.device", where)
    resolution = cfg.model.resolution
    if isinstance(resolution, list) and len(resolution) != 2:
        raise ConfigError(f"{where}: 'model.resolution' must be one int (square) or [height, width]; got {resolution}")
    paths = {"model.path": cfg.model.path, "prompts.train": cfg.prompts.train, "prompts.eval": cfg.prompts.eval}
    paths.update({"prompts.cache_dir": cfg.prompts.cache_dir, "output.dir": cfg.output.dir})
    for key, value in paths.items():
        _check_path_string(value, key, where)
    if cfg.prompts.test_fraction and cfg.prompts.eval != DEFAULT_PROMPTS:
        raise ConfigError(
            f"{where}: 'prompts.test_fraction' holds out the eval prompts from prompts.train, so "
            f"prompts.eval={cfg.prompts.eval!r} would be ignored; set one of the two"
        )
    for key in ("beta1", "beta2"):
        beta = getattr(cfg.optim, key)
        if beta >= 1:
            raise ConfigError(f"{where}: 'optim.{key}' must be < 1 (AdamW divides by 1 - beta); got {beta}")
    _check_sampler(cfg.sampler, where)


def _check_path_string(value: str | None, key: str, where: str) -> None:
    """Refuse a path no filesystem takes (a NUL byte, a name over 255 bytes, the usual NAME_MAX) or an empty one.

    An empty path would silently mean the current folder (``output.dir=`` with ``--overwrite`` would empty it).
    """
    if value is None:
        return
    if not value.strip():
        raise ConfigError(f"{where}: '{key}' is empty; set it to a path")
    if "\x00" in value:
        raise ConfigError(f"{where}: '{key}' holds a NUL character; remove it")
    if any(len(part.encode()) > 255 for part in Path(value).parts):
        raise ConfigError(f"{where}: '{key}' has a file or folder name longer than 255 bytes; use a shorter name")


def _check_sampler(s: SamplerConfig, where: str) -> None:
    if s.sde == "cps" and s.noise_level > 1:
        raise ConfigError(f"{where}: 'sampler.noise_level' must be <= 1 with sampler.sde=cps; got {s.noise_level}")
    pairs = {"sde_window": s.sde_window, "window_range": s.window_range}
    for key, pair in pairs.items():
        if len(pair) != 2 or pair[0] > pair[1]:
            raise ConfigError(f"{where}: 'sampler.{key}' must be [lo, hi] with lo <= hi; got {pair}")
    if s.window != "none" and s.window_size > s.num_steps:
        raise ConfigError(
            f"{where}: 'sampler.window_size' ({s.window_size}) must be <= sampler.num_steps ({s.num_steps}); "
            "lower window_size or raise num_steps"
        )
    if s.window == "fixed" and s.window_start + s.window_size > s.num_steps:
        raise ConfigError(
            f"{where}: 'sampler.window_start' ({s.window_start}) + window_size ({s.window_size}) must be <= "
            f"sampler.num_steps ({s.num_steps}); set window_start <= {s.num_steps - s.window_size}"
        )
    lo, hi = s.window_range
    if s.window == "random" and (hi > s.num_steps or hi - lo < s.window_size):
        raise ConfigError(
            f"{where}: 'sampler.window_range' [{lo}, {hi}) must lie in [0, sampler.num_steps={s.num_steps}] and hold "
            f"window_size={s.window_size} steps; e.g. sampler.window_range=[0,{s.num_steps}]"
        )
