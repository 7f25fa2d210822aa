"""Building a typed config section (a dataclass) from a plain mapping, with one-line errors.

Each value is checked against its field's annotation (``Literal``, unions, lists, numbers; an int
is accepted for a float) and against the range in the field's metadata (``flowrl.config._rng``);
an unknown key names the keys allowed. Errors are :class:`~flowrl.config_files.ConfigError`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal

from .config_files import ConfigError


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _yaml_word(value: bool, allowed: tuple[Any, ...]) -> Any:
    """The word a YAML 1.1 bool was written as, when the field allows it (``off`` -> "off"); else the bool."""
    for word in ("on", "yes", "true") if value else ("off", "no", "false"):
        if word in allowed:
            return word
    return value


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key, where)
            except ConfigError:
                continue
    elif origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool):  # YAML 1.1 reads a bare off / on (no, yes) as a bool
            value = _yaml_word(value, allowed)
        if value in allowed:
            return value
    elif origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, list):
            return [_coerce(v, item, key, where) for v in value]
    elif origin is dict:
        if isinstance(value, dict):
            return value
    elif tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    what = "a finite number" if tp is float and isinstance(value, float) else _type_name(tp)
    raise ConfigError(f"{where}: '{key}' must be {what}; got {value!r}")


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _in_range(value: Any, meta: dict[str, Any]) -> bool:
    lo, hi = meta["lo"], meta["hi"]
    bad_lo = lo is not None and (value <= lo if meta["lo_open"] else value < lo)
    bad_hi = hi is not None and (value >= hi if meta["hi_open"] else value > hi)
    return not (bad_lo or bad_hi)


def _check_range(value: Any, meta: dict[str, Any], key: str, where: str) -> None:
    """Raise unless ``value`` (each item of a list) lies in the field's ``_rng`` range; None passes."""
    if value is None or "lo" not in meta:
        return
    items = value if isinstance(value, list) else [value]
    if all(_in_range(v, meta) for v in items):
        return
    lo, hi = meta["lo"], meta["hi"]
    low = "" if lo is None else (f"> {_num(lo)}" if meta["lo_open"] else f">= {_num(lo)}")
    high = "" if hi is None else (f"< {_num(hi)}" if meta["hi_open"] else f"<= {_num(hi)}")
    what = "items must be" if isinstance(value, list) else "must be"
    note = f" ({meta['note']})" if meta.get("note") else ""
    raise ConfigError(f"{where}: '{key}' {what} {' and '.join(p for p in (low, high) if p)}{note}; got {value!r}")


def build_section(cls: type, data: Any, prefix: str, where: str) -> Any:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and bad values."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: '{prefix[:-1] or 'config'}' must be a mapping; got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            allowed = ", ".join(fields)
            raise ConfigError(
                f"{where}: unknown key '{prefix}{key}'; allowed keys{' in ' + prefix[:-1] if prefix else ''}: {allowed}"
            )
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build_section(tp, data[name], f"{prefix}{name}.", where)
        else:
            kwargs[name] = _coerce(data[name], tp, prefix + name, where)
            _check_range(kwargs[name], dict(f.metadata), prefix + name, where)
    return cls(**kwargs)
