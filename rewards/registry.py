"""Reward registry: names -> factories, plugins, and building rewards from config.

A reward name resolves, in order, to:

1. a factory registered with :func:`register_reward` or a built-in (``digit_correctness``,
   ``ink``, ``ink_band``, ``stroke_width``, ``jpeg_compressibility``, ``jpeg_incompressibility``, ...);
2. ``"remote:http://host:port"``: a reward served by ``flowrl serve-reward`` (client options
   ``timeout_s``, ``retries``, ``batch_size``, ... see :mod:`flowrl.rewards.remote`);
3. a dotted path ``"package.module:factory"``;
4. an installed entry point in the group ``flowrl.rewards``, e.g. in a plugin's pyproject.toml::

       [project.entry-points."flowrl.rewards"]
       aesthetic = "my_plugin.rewards:aesthetic"

A factory may set ``factory.offline = True`` to declare that it needs no download, or a
zero-argument check (``CachedDefaults``) that says whether its default weights are in the local
cache; factories that do neither are listed as not offline.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import io
import re
import sys
from importlib import metadata as importlib_metadata
from typing import Any, Callable, Mapping, NamedTuple, TypeVar

from .combine import MultiReward, check_weight
from .contract import RewardError, RewardFn
from .deadline import DEFAULT_TIMEOUT_S, check_timeout

ENTRY_POINT_GROUP = "flowrl.rewards"
BUILTIN_SOURCE = "flowrl"

RewardFactory = Callable[..., RewardFn]

_BUILTINS: dict[str, str] = {
    "digit_correctness": "flowrl.rewards.digits:digit_correctness",
    "ink": "flowrl.rewards.digits:ink",
    "ink_band": "flowrl.rewards.ink_band:ink_band",
    "stroke_width": "flowrl.rewards.stroke:stroke_width_reward",
    "jpeg_compressibility": "flowrl.rewards.jpeg:jpeg_compressibility",
    "jpeg_incompressibility": "flowrl.rewards.jpeg:jpeg_incompressibility",
    "pickscore": "flowrl.rewards.pickscore:pickscore",
    "clipscore": "flowrl.rewards.clipscore:clipscore",
    "aesthetic": "flowrl.rewards.aesthetic:aesthetic",
    "hpsv2": "flowrl.rewards.hpsv2:hpsv2",
    "imagereward": "flowrl.rewards.imagereward:imagereward",
    "remote": "flowrl.rewards.remote:remote",
    "temporal_consistency": "flowrl.rewards.video:temporal_consistency",
}
REMOTE_PREFIX = "remote:"  # "remote:http://host:port" names a reward served by `flowrl serve-reward`
_REGISTERED: dict[str, RewardFactory] = {}


class RewardInfo(NamedTuple):
    """One available reward.

    Attributes:
        name: registry name.
        source: "flowrl" for built-ins, the distribution name for entry points, the module for
            factories registered with :func:`register_reward`.
        offline: True when the reward can be built without a download: it needs none
            (``factory.offline = True``) or its default weights are in the local Hugging Face
            cache (``factory.offline`` is a check such as :class:`~flowrl.rewards.weights.CachedDefaults`).
        description: first line of the factory's docstring.
        error: why the factory could not be loaded (None when it loads).
        cached: True when ``offline`` holds only because the default weights are cached.
    """

    name: str
    source: str
    offline: bool
    description: str
    error: str | None = None
    cached: bool = False


COMMON_OPTIONS = ("weight", "timeout_s", "video")
"""Options of a run's ``rewards.<name>`` entry that flowrl applies itself; every other option goes to the factory."""

_T = TypeVar("_T")


class PluginExit(Exception):
    """A reward's module or factory called ``sys.exit`` (argparse parsing flowrl's own command line, say)."""


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def _without_exit(call: Callable[[], _T]) -> _T:
    """Run a plugin's import or factory, turning a ``sys.exit`` in it into :class:`PluginExit`.

    What the plugin writes to stderr is held while it runs: passed on afterwards, except when it exits, when its
    last line (argparse's ``error: ...``) becomes part of the one-line message instead.

    Raises:
        PluginExit: the plugin raised ``SystemExit``.
    """
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            return call()
    except SystemExit as exc:
        said = [line.strip() for line in held.getvalue().splitlines() if line.strip()]
        held = io.StringIO()
        printed = f" after printing {said[-1]!r}" if said else ""
        raise PluginExit(f"it called sys.exit({exc.code!r}){printed}") from None
    finally:
        sys.stderr.write(held.getvalue())


def register_reward(name: str, *, overwrite: bool = False) -> Callable[[RewardFactory], RewardFactory]:
    """Decorator registering a reward factory under ``name``.

    Args:
        name: registry name (a non-empty string without ':').
        overwrite: allow replacing an existing registration or built-in.

    Returns:
        The decorator; it returns the factory unchanged.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"reward name must be a non-empty string without ':'; got {name!r}")

    def decorator(factory: RewardFactory) -> RewardFactory:
        if not callable(factory):
            raise TypeError(f"register_reward({name!r}) needs a callable factory; got {type(factory).__name__}")
        if not overwrite and (name in _REGISTERED or name in _BUILTINS):
            raise ValueError(f"reward {name!r} is already registered; pick another name or pass overwrite=True")
        _REGISTERED[name] = factory
        return factory

    return decorator


def _load_path(name: str, path: str) -> RewardFactory:
    """Import the factory named by ``"package.module:attr"``."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward path {path!r} must look like 'package.module:factory'")
    try:
        obj: Any = _without_exit(lambda: importlib.import_module(module_name))
    except Exception as err:  # noqa: BLE001 - a broken plugin must be reported by name
        raise RewardError(
            f"reward {name!r} failed to import {module_name!r} ({_one_line(err)}); install or fix that module"
        ) from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardError(
                f"reward {name!r}: module {module_name!r} has no attribute {attr!r}; check the path {path!r}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardError(
            f"reward {name!r}: {path!r} is {type(obj).__name__}, not a callable factory; point to a factory function"
        )
    return obj


def _entry_points() -> dict[str, importlib_metadata.EntryPoint]:
    """Installed ``flowrl.rewards`` entry points by name (first one wins)."""
    found: dict[str, importlib_metadata.EntryPoint] = {}
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep)
    return found


def _entry_point_source(ep: importlib_metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.name if dist is not None else "unknown"


def _load_entry_point(ep: importlib_metadata.EntryPoint) -> RewardFactory:
    try:
        factory = _without_exit(ep.load)
    except Exception as err:  # noqa: BLE001 - a broken plugin must be reported by name
        raise RewardError(
            f"reward {ep.name!r} from {_entry_point_source(ep)} failed to load {ep.value!r} ({_one_line(err)}); "
            "reinstall or fix the plugin"
        ) from err
    if not callable(factory):
        raise RewardError(f"reward {ep.name!r}: entry point {ep.value!r} is not a callable factory; fix the plugin")
    return factory


def builtin_reward_names() -> list[str]:
    """Sorted names of the built-in rewards (a plugin of one of these names is shadowed by the built-in)."""
    return sorted(_BUILTINS)


def known_reward_names() -> list[str]:
    """Sorted names of built-in, registered and entry-point rewards."""
    try:
        plugins = list(_entry_points())
    except Exception:  # noqa: BLE001 - broken metadata must not hide the built-ins
        plugins = []
    return sorted({*_BUILTINS, *_REGISTERED, *plugins})


def resolve_factory(name: str) -> RewardFactory:
    """The factory for a registry name, dotted path or entry point.

    Raises:
        ValueError: unknown name (lists the known names).
        RewardError: the factory's module could not be imported.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty string; got {name!r}")
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in _BUILTINS:
        return _load_path(name, _BUILTINS[name])
    if name.startswith(REMOTE_PREFIX):
        return functools.partial(_load_path("remote", _BUILTINS["remote"]), name[len(REMOTE_PREFIX) :])
    if ":" in name:
        return _load_path(name, name)
    ep = _entry_points().get(name)
    if ep is not None:
        return _load_entry_point(ep)
    raise ValueError(
        f"unknown reward {name!r}; known: {', '.join(known_reward_names())} (or give a 'package.module:factory' path)"
    )


def _check_options(name: str, factory: RewardFactory, options: Mapping[str, Any]) -> None:
    """Refuse an option the factory does not take, naming the options it does take.

    Raises:
        RewardError: an option that is not a parameter of the factory (a factory taking ``**kwargs`` takes any).
    """
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature: let the call decide
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    allowed = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(options) - set(allowed))
    if not unknown:
        return
    if unknown[0] in COMMON_OPTIONS:  # given to build_reward itself (flowrl serve-reward): only a run applies it
        raise RewardError(
            f"reward {name!r}: {unknown[0]!r} is not an option of the reward itself but of a run's rewards.<name> "
            f"entry; set it in the run's config; the reward's own options: {', '.join(allowed) or 'none'}"
        )
    raise RewardError(
        f"reward {name!r} has no option {unknown[0]!r}; its options: {', '.join(allowed) or 'none'} "
        f"(and for every reward: {', '.join(COMMON_OPTIONS)})"
    )


SECRET_OPTIONS = ("token",)
"""Options whose values never appear in a message (a remote reward's bearer token)."""


def _shown(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` as a message may show them: secrets and the ``user:password@`` of URLs hidden."""
    shown = {}
    for key, value in options.items():
        if key in SECRET_OPTIONS and value:
            value = "<hidden>"
        elif isinstance(value, str) and "://" in value and "@" in value:
            value = re.sub(r"://[^/]*@", "://<hidden>@", value)
        shown[key] = value
    return shown


def _is_remote(factory: RewardFactory) -> bool:
    """Whether ``factory`` is the ``remote`` reward's (bare, or bound to a URL by ``remote:URL``)."""
    base = factory.func if isinstance(factory, functools.partial) else factory
    return base is resolve_factory("remote")


def _check_common_options(label: str, entry: Mapping[str, Any]) -> None:
    """Refuse a bad ``weight``, ``timeout_s`` or ``video`` of a run's ``rewards.<label>`` entry.

    Raises:
        ValueError: a weight that is not a finite number, a timeout that is not a finite number > 0, or a
            ``video`` reduction other than those of :data:`~flowrl.rewards.video.FRAME_REDUCTIONS`.
    """
    from .video import check_reduction

    if "weight" in entry:
        check_weight(label, entry["weight"])
    if "timeout_s" in entry:
        check_timeout(label, entry["timeout_s"])
    if "video" in entry:
        check_reduction(entry["video"], f"rewards.{label}.video")


def required_options(name: str) -> list[str]:
    """The options a reward cannot be built without (factory parameters with no default, e.g. ``remote``'s url).

    Raises:
        RewardError: ``name`` is not a known reward.
    """
    return _required(resolve_factory(name))


def _required(factory: RewardFactory) -> list[str]:
    """The parameters of ``factory`` without a default (see :func:`required_options`)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature: nothing known to be required
        return []
    required = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in required and p.default is inspect.Parameter.empty]


def check_reward_options(spec: Mapping[str, Any]) -> None:
    """Refuse an option a configured reward does not take, without building any reward (``flowrl train --check``).

    Args:
        spec: a config's ``rewards`` section (see :func:`build_multi_reward`).

    Raises:
        RewardError: an unknown reward, an option its factory does not take (one line naming its options), or an
            option it cannot be built without (``remote``'s url) left out.
        ValueError: a bad ``weight``, ``timeout_s`` or ``video`` (:func:`_check_common_options`).
    """
    for label, entry in spec.items():
        options = dict(entry) if isinstance(entry, Mapping) else {}
        _check_common_options(str(label), options)
        for common in COMMON_OPTIONS:
            options.pop(common, None)
        name = str(options.pop("reward", label))
        factory = resolve_factory(name)
        _check_options(name, factory, options)
        missing = [option for option in _required(factory) if option not in options]  # the factory resolved once
        if missing:
            raise RewardError(
                f"reward {name!r} needs option {missing[0]!r}; set rewards.{label}.{missing[0]}=... (docs/rewards.md)"
            )
        if _is_remote(factory):  # built here: it loads nothing and contacts no server, and checks url, token, ...
            build_reward(name, **options)


def build_reward(name: str, **options: Any) -> RewardFn:
    """Build a reward by name with factory options.

    Args:
        name: registry name, ``"package.module:factory"`` path, entry-point name, or
            ``"remote:http://host:port"`` for a reward served by ``flowrl serve-reward``.
        **options: keyword arguments for the factory. The option ``video`` ("mean" or "min") is
            not passed on: it wraps the image reward to score (B, F, 3, H, W) clips frame by
            frame (:class:`~flowrl.rewards.video.FrameReward`).

    Returns:
        The reward callable ``(images (B, 3, H, W), prompts, **metadata) -> (B,) float32``.

    Raises:
        ValueError: unknown name.
        RewardError: the factory failed to import, raised, or returned a non-callable.
    """
    factory = resolve_factory(name)
    video = options.pop("video", None)
    _check_options(name, factory, options)
    try:
        reward = _without_exit(lambda: factory(**options))
    except Exception as err:  # noqa: BLE001 - any factory failure is re-raised with the reward's name
        raise RewardError(
            f"reward {name!r} could not be built with options {_shown(options)!r}: {_one_line(err)}"
        ) from err
    if not callable(reward):
        raise RewardError(
            f"reward {name!r}: its factory returned {type(reward).__name__}, not a callable reward; fix the factory"
        )
    if video is not None:
        from .video import frame_reward

        return frame_reward(reward, video, name)
    return reward


def build_multi_reward(spec: Mapping[str, Mapping[str, Any] | None]) -> MultiReward:
    """Build the weighted :class:`~flowrl.rewards.combine.MultiReward` of a config ``rewards:`` section.

    Args:
        spec: ``{name: {"weight": float, "timeout_s": float, **factory_options}}``. ``weight`` defaults
            to 1.0. ``timeout_s`` is the deadline of one call of the reward (default
            :data:`~flowrl.rewards.deadline.DEFAULT_TIMEOUT_S`); a remote reward (a factory with
            ``bounds_own_time = True``) receives it instead as the deadline of each HTTP attempt. An
            optional ``"reward"`` key names the factory when the entry's key is only a label, e.g.
            ``{"ink_bold": {"reward": "ink", "target": "bold", "weight": 0.5}}``.

    Returns:
        The MultiReward whose components are keyed by the spec's names.

    Raises:
        ValueError: empty spec, an entry that is not a mapping, a non-finite weight or a timeout that
            is not a finite number > 0.
        RewardError: a reward failed to build.
    """
    if not isinstance(spec, Mapping) or not spec:
        raise ValueError(f"rewards spec must be a non-empty mapping {{name: {{weight: 1.0, ...}}}}; got {spec!r}")
    rewards: dict[str, tuple[RewardFn, float, float | None]] = {}
    for label, entry in spec.items():
        if entry is None:
            entry = {}
        if not isinstance(entry, Mapping):
            raise ValueError(f"rewards.{label} must be a mapping like {{weight: 1.0}}; got {entry!r}")
        options = dict(entry)
        weight = check_weight(str(label), options.pop("weight", 1.0))
        factory_name = options.pop("reward", label)
        timeout = _deadline(str(label), factory_name, options)
        rewards[str(label)] = (build_reward(factory_name, **options), weight, timeout)
    return MultiReward(rewards)


def _deadline(label: str, factory_name: object, options: dict[str, Any]) -> float | None:
    """Pop the common option ``timeout_s``: the call's deadline, or None for a reward that bounds its own time.

    A factory with ``bounds_own_time = True`` (the remote reward) gets ``timeout_s`` back in ``options``.
    """
    given = "timeout_s" in options
    timeout = check_timeout(label, options.pop("timeout_s")) if given else DEFAULT_TIMEOUT_S
    factory = resolve_factory(factory_name)  # type: ignore[arg-type]
    if not getattr(getattr(factory, "func", factory), "bounds_own_time", False):
        return timeout
    if given:
        options["timeout_s"] = timeout
    return None


def _describe(factory: Any) -> str:
    doc = inspect.getdoc(factory) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def _info(name: str, source: str, load: Callable[[], RewardFactory]) -> RewardInfo:
    try:
        factory = load()
    except Exception as err:  # noqa: BLE001 - one broken reward must not hide the others
        cause = err.__cause__ if isinstance(err, RewardError) and err.__cause__ is not None else err
        return RewardInfo(name, source, False, "", _one_line(cause))
    declared = getattr(factory, "offline", False)
    if declared is True or not callable(declared):
        return RewardInfo(name, source, bool(declared), _describe(factory))
    try:
        cached = bool(declared())
    except Exception:  # noqa: BLE001 - a broken check means "can't tell": not offline
        cached = False
    return RewardInfo(name, source, cached, _describe(factory), cached=cached)


def list_rewards() -> list[RewardInfo]:
    """Every available reward, sorted by name; plugins that fail to load carry an ``error``."""
    infos: dict[str, RewardInfo] = {}
    for name, path in _BUILTINS.items():
        infos[name] = _info(name, BUILTIN_SOURCE, lambda name=name, path=path: _load_path(name, path))
    for name, factory in _REGISTERED.items():
        infos[name] = _info(name, getattr(factory, "__module__", "unknown") or "unknown", lambda f=factory: f)
    try:
        plugins = _entry_points()
    except Exception as err:  # noqa: BLE001 - broken metadata must not hide the built-ins
        infos["<entry points>"] = RewardInfo("<entry points>", "unknown", False, "", _one_line(err))
        plugins = {}
    for name, ep in plugins.items():
        source = _entry_point_source(ep)
        if name in infos:
            infos[f"{name} ({source})"] = RewardInfo(
                name, source, False, "", f"shadowed by the {infos[name].source} reward {name!r}; rename the entry point"
            )
            continue
        infos[name] = _info(name, source, lambda ep=ep: _load_entry_point(ep))
    return [infos[key] for key in sorted(infos)]
