"""The reward subcommands of the ``flowrl`` console script: ``rewards list``, ``reward new``, ``serve-reward``.

Imported by :mod:`flowrl.cli`, which parses the arguments and turns user errors into one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .rewards.server import RewardServer


def cmd_rewards_list(ns: argparse.Namespace) -> int:
    """``flowrl rewards list``: print a table of the registered rewards (source, offline use, description).

    Args:
        ns: parsed arguments (unused).

    Returns:
        The exit code, 0.
    """
    from .rewards import list_rewards

    rows = list_rewards()
    width = max(len(r.name) for r in rows)
    source_width = max(12, *(len(r.source) for r in rows))  # a plugin's source is its distribution's name
    print(f"{'name':<{width}}  {'source':<{source_width}} offline  description")
    for r in rows:
        note = f"(failed to load: {r.error})" if r.error else r.description
        offline = "cached" if r.cached else "yes" if r.offline else "no"
        print(f"{r.name:<{width}}  {r.source:<{source_width}} {offline:<7}  {note}")
    return 0


def cmd_reward_new(ns: argparse.Namespace) -> int:
    """``flowrl reward new``: scaffold an installable reward plugin package.

    Args:
        ns: parsed arguments (``name``, ``dir``).

    Returns:
        The exit code, 0.
    """
    from .scaffold import scaffold_reward

    root = scaffold_reward(ns.name, ns.dir)
    print(f"wrote {root}; next: pip install -e {root} && flowrl rewards list")
    return 0


def cmd_serve_reward(ns: argparse.Namespace) -> int:
    """``flowrl serve-reward``: serve one reward over HTTP until SIGINT, SIGTERM or the idle timeout.

    Args:
        ns: parsed arguments (``name``, ``options``, ``host``, ``port``, ``token``, ``max_body_mb``,
            ``max_image_pixels``, ``max_request_pixels``, ``log``, ``idle_exit``).

    Returns:
        The exit code, 0.

    Raises:
        ValueError: the server cannot bind to ``host:port``, or a limit is not a positive number.
    """
    from .config import parse_overrides
    from .rewards import build_reward
    from .rewards.server import TOKEN_ENV, RewardServer, check_bind, check_limits

    options = parse_overrides(ns.options)
    token = ns.token or os.environ.get(TOKEN_ENV) or None
    check_bind(ns.host, token)  # before loading a possibly large model
    check_limits(ns.max_body_mb, ns.idle_exit)
    reward = build_reward(ns.name, **options)
    try:
        server = RewardServer(
            reward,
            ns.name,
            host=ns.host,
            port=ns.port,
            token=token,
            max_body_mb=ns.max_body_mb,
            max_image_pixels=ns.max_image_pixels,
            max_request_pixels=ns.max_request_pixels,
            log=ns.log,
            idle_exit_s=ns.idle_exit,
        )
    except (OSError, OverflowError) as err:  # OverflowError: a port outside 0-65535
        reason = getattr(err, "strerror", None) or str(err)
        raise ValueError(f"cannot serve on {ns.host}:{ns.port} ({reason}); pick another --port or --host") from None
    print(
        f"serving reward {ns.name!r} at {server.url} (POST /score, GET /health, GET /info; "
        f"token {'required' if token else 'off'}); Ctrl-C stops",
        flush=True,
    )
    _serve_until_signal(server)
    if server.stopped_idle:
        print(f"no request for {ns.idle_exit:g} s; stopped", flush=True)
    return 0


def _serve_until_signal(server: RewardServer) -> None:
    """Serve on a thread until SIGINT/SIGTERM or the idle exit, then stop cleanly (``RewardServer.stop``).

    The signal handler only sets a flag (it may run while this thread holds a lock); this thread polls
    it. A second signal during the drain falls back to the default action (Ctrl-C: KeyboardInterrupt).
    When a reward is still scoring after the grace period the process ends with ``os._exit``: running
    interpreter finalization while a thread is inside torch's C++ code aborts the process.
    """
    import signal
    import time

    stop: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        stop.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        while not stop and server.serving:
            time.sleep(0.05)
        if not server.stop():
            print(
                f"flowrl: error: reward {server.name!r} was still scoring when the shutdown grace period ended; "
                "exited without waiting for it",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
