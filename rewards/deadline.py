"""Per-call deadlines for rewards: a call that does not return in time is abandoned with one line.

A Python thread cannot be killed, so :func:`call_with_deadline` runs the call on a daemon thread
and waits for it at most ``timeout_s`` seconds. When the deadline passes the caller gets
:class:`DeadlineExceeded` at once; the abandoned thread keeps running until the call returns on its
own, and, being a daemon, never keeps the interpreter alive. The caller's grad mode and CUDA device
(both per-thread in torch) are carried over, so a reward scores exactly as it would inline.

Every entry of a config's ``rewards:`` section takes ``timeout_s`` (default :data:`DEFAULT_TIMEOUT_S`).
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

import torch

DEFAULT_TIMEOUT_S = 600.0  # a reward call that takes longer than 10 minutes is treated as hung


class DeadlineExceeded(Exception):
    """A call did not return within its deadline (``args[0]`` is the deadline in seconds)."""


def check_timeout(name: str, value: object) -> float:
    """A reward's ``timeout_s`` as float; ValueError unless it is a finite number > 0 (bools rejected).

    Args:
        name: the reward's name in the config, for the message.
        value: the configured value.

    Returns:
        ``value`` as a float.

    Raises:
        ValueError: ``value`` is not a finite number > 0.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"rewards.{name}.timeout_s must be a finite number of seconds > 0; got {value!r}; "
            f"set e.g. rewards.{name}.timeout_s={DEFAULT_TIMEOUT_S:g}"
        )
    return float(value)


def _thread_state() -> Callable[[], None]:
    """A function that gives the calling thread this thread's torch grad mode and CUDA device."""
    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def apply() -> None:
        torch.set_grad_enabled(grad)
        if device is not None:
            torch.cuda.set_device(device)

    return apply


def call_with_deadline(
    fn: Callable[..., Any],
    timeout_s: float,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    name: str = "reward",
) -> Any:
    """``fn(*args, **kwargs)``, or :class:`DeadlineExceeded` once ``timeout_s`` seconds have passed.

    Args:
        fn: the callable (a reward).
        timeout_s: seconds to wait for it.
        args: positional arguments of ``fn``.
        kwargs: keyword arguments of ``fn``.
        name: the reward's name; the call's thread is named ``"reward-<name>@<caller's thread>"``
            (visible in stack dumps).

    Returns:
        What ``fn`` returned; what it raised is raised here.

    Raises:
        DeadlineExceeded: ``fn`` did not return in time (it keeps running on its daemon thread).
    """
    box: dict[str, Any] = {}
    apply_state = _thread_state()

    def run() -> None:
        try:
            apply_state()
            box["out"] = fn(*args, **(kwargs or {}))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which re-raises it
            box["err"] = exc

    thread = threading.Thread(target=run, name=f"reward-{name}@{threading.current_thread().name}", daemon=True)
    thread.start()
    thread.join(timeout_s)  # no thread outlives a call that ended in time
    if thread.is_alive():
        raise DeadlineExceeded(timeout_s)
    if "err" in box:
        raise box["err"]
    return box["out"]
