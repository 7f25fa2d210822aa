"""Config sources as nested dicts: YAML files (duplicated keys refused) and ``key=value`` overrides.

:mod:`flowrl.config` merges them over the defaults and validates the result.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

_DOTTED_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")  # section.key, e.g. train.iterations


class ConfigError(ValueError):
    """A bad config key or value (one line: key, file, what is allowed)."""


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"command line: cannot set '{dotted}': '{part}' is not a section")
    node[parts[-1]] = value


def _check_remote_key(key: str) -> None:
    """Refuse an override whose key holds a remote reward's URL: its dots would split it into sections.

    Raises:
        ConfigError: ``rewards.remote:http://127.0.0.1:8765.weight`` (its URL quoted or not), with the label form
            to write instead.
    """
    if key.strip().replace('"', "").replace("'", "").startswith("rewards.remote:"):  # quoted or not
        raise ConfigError(
            f"command line: override key '{key.strip()}' holds a URL, whose dots split the key; name the reward by a "
            "label instead: rewards.judge.reward=remote rewards.judge.url=http://HOST:PORT rewards.judge.weight=1"
        )


MAX_YAML_VALUES = 100_000
"""Most values a config file or override may hold once its YAML aliases are expanded (real configs hold a few
hundred); above it is an alias bomb, whose expansion (``json.dumps`` of reward options) would take minutes and GBs."""


def _expanded_values(data: Any) -> int:
    """Values in ``data`` with every shared (aliased) list or mapping counted each time it appears.

    Counted over the object graph with a memo, so an alias bomb is measured without being expanded.

    Raises:
        ValueError: ``data`` contains itself (a recursive alias).
    """
    memo: dict[int, int] = {}

    def count(obj: Any) -> int:
        if not isinstance(obj, (dict, list)):
            return 1
        if memo.get(id(obj)) == -1:
            raise ValueError("a YAML alias refers to a list or mapping that contains it")
        if id(obj) not in memo:
            memo[id(obj)] = -1
            items = [*obj.keys(), *obj.values()] if isinstance(obj, dict) else obj
            memo[id(obj)] = 1 + sum(count(x) for x in items)
        return memo[id(obj)]

    return count(data)


def check_yaml_size(data: Any, where: str) -> None:
    """Refuse YAML whose aliases expand to more than :data:`MAX_YAML_VALUES` values, or refer to themselves.

    Raises:
        ConfigError: one line naming ``where`` and the fix.
    """
    try:
        n = _expanded_values(data)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}; write the values out") from None
    except RecursionError:
        raise ConfigError(f"{where}: lists or mappings nested too deeply; flatten the YAML") from None
    if n > MAX_YAML_VALUES:
        raise ConfigError(
            f"{where}: its YAML aliases expand to {n:,} values, above the limit of {MAX_YAML_VALUES:,} "
            "(an alias bomb?); write the values out instead of nesting aliases"
        )


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["sampler.noise_level=0.5", ...]`` -> nested dict (values parsed as YAML scalars)."""
    data: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"command line: override {item!r} must look like key=value, e.g. train.iterations=50")
        key, raw = item.split("=", 1)
        _check_remote_key(key)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as err:
            raise ConfigError(f"command line: value of '{key}' is not valid YAML: {raw!r}") from err
        check_yaml_size(value, f"command line: value of '{key}'")
        _set_dotted(data, key.strip(), value)
    return data


def merge_layers(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` merged over ``base`` section by section; each reward's options merged by name."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "rewards":
            out[key] = merge_layers(out[key], value)
        elif key == "rewards" and isinstance(value, dict) and isinstance(out.get(key), dict):
            merged = {k: dict(v) if isinstance(v, dict) else v for k, v in out[key].items()}
            for name, opts in value.items():
                merged[name] = merge_layers(merged.get(name) or {}, opts) if isinstance(opts, dict) else opts
            out[key] = merged
        else:
            out[key] = value
    return out


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (YAML would keep the last silently).

    Merge keys (``<<: *anchor``) work as in ``yaml.safe_load``: a key written beside them overrides the merged one.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """Build a mapping, raising on a duplicated key.

        Raises:
            yaml.constructor.ConstructorError: the key and the line of its second occurrence.
        """
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *anchor": merged (and overridable) by super()
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicated key {key!r}; keep one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _missing_file_error(path: Path) -> ConfigError:
    """The error for a config file that does not exist; ``train.iterations`` (an override missing its ``=``) says so."""
    text = str(path)
    if _DOTTED_KEY.fullmatch(text) and path.suffix not in (".yaml", ".yml"):
        return ConfigError(
            f"config file {text} not found; to set that key write {text}=VALUE (one word, no spaces around '='), "
            "or pass an existing YAML file"
        )
    return ConfigError(f"config file {path} not found; pass an existing YAML file (see configs/)")


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; one-line ConfigError for a missing file or bad YAML."""
    path = Path(path)
    if not path.is_file():
        raise _missing_file_error(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text (byte {err.start}); re-save it as UTF-8") from None
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{line}: invalid YAML ({getattr(err, 'problem', err)})") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections (model:, sampler:, ...)")
    check_yaml_size(data, str(path))
    return data


def split_config_args(args: list[str]) -> tuple[list[str] | None, list[str]]:
    """Split CLI positionals into config files and ``key=value`` overrides.

    Positionals without ``=`` are config files, merged in order (model config, then presets);
    ``key=value`` positionals are overrides applied last.
    """
    configs, overrides = [], []
    for arg in args:  # a file that exists is a config even when its path holds "=" (runs/lr=0.1/config.yaml)
        (overrides if "=" in arg and not _is_file(arg) else configs).append(arg)
    return configs or None, overrides


def _is_file(arg: str) -> bool:
    """Whether ``arg`` names an existing file; False for text no filesystem takes as a path (too long, NUL)."""
    try:
        return Path(arg).is_file()
    except (OSError, ValueError):
        return False
