"""A thin supervisor for ``flowrl train``: a crash of the training process still ends in one line.

A reward plugin or a native library that calls ``os._exit`` or segfaults inside the training
process cannot report on itself. So ``flowrl train``, run from the console script or
``python -m flowrl``, runs the training in a child process (the same command, marked by
``FLOWRL_SUPERVISED=1``) and only waits for it. This process imports neither torch nor the
trainer. It forwards SIGTERM, and SIGINT unless the terminal already sent that Ctrl-C to the
child, and passes the child's exit code through. The child writes one byte to a pipe when it
ends on its own terms (success, a ``flowrl: error:`` line, Ctrl-C or a Python traceback); a child
that ends without it, by a signal or a silent exit, gets one line from here, e.g.::

    flowrl: error: the training process died with signal SIGSEGV (a reward plugin or native library
    crashed; its Python stack is printed above); serve that reward with `flowrl serve-reward` and use
    it as remote: to isolate it from training, or set FLOWRL_NO_SUPERVISOR=1 to run without this supervisor

``train.rewards_async: process`` does not fully isolate a crashing reward: when the rollout ends, the
trainer scores the chunks the worker has not started itself (``RolloutScorer``), in this process.

The child enables ``faulthandler``, so a segfault also leaves its Python stack on stderr. Nothing is
supervised under a distributed launcher (``WORLD_SIZE`` or ``LOCAL_RANK`` set), with
``FLOWRL_NO_SUPERVISOR=1``, or when ``flowrl.cli.main(argv)`` is called with an explicit ``argv``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Mapping, NamedTuple, Sequence

SUPERVISED_ENV = "FLOWRL_SUPERVISED"  # set in the child: run the command itself
NO_SUPERVISOR_ENV = "FLOWRL_NO_SUPERVISOR"  # "1": never supervise
REPORT_FD_ENV = "FLOWRL_SUPERVISOR_FD"  # the pipe on which the child says it reported its own outcome
LAUNCHER_ENVS = ("WORLD_SIZE", "LOCAL_RANK")
_FIX = (
    "serve that reward with `flowrl serve-reward` and use it as remote: to isolate it from training, "
    "or set FLOWRL_NO_SUPERVISOR=1 to run without this supervisor"
)


def should_supervise(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether ``flowrl ARGV`` should run in a supervised child process.

    Args:
        argv: the arguments after ``flowrl``.
        env: the environment.

    Returns:
        True for ``flowrl train`` outside a child, a distributed launcher and ``FLOWRL_NO_SUPERVISOR=1``.
    """
    return (
        list(argv[:1]) == ["train"]
        and not env.get(SUPERVISED_ENV)
        and env.get(NO_SUPERVISOR_ENV) != "1"
        and not any(name in env for name in LAUNCHER_ENVS)
    )


def _report_fd() -> int | None:
    try:
        return int(os.environ[REPORT_FD_ENV])
    except (KeyError, ValueError):
        return None


def setup_child() -> None:
    """In a supervised child: dump the Python stack on a crash, and keep the report pipe from grandchildren."""
    import faulthandler

    faulthandler.enable()
    fd = _report_fd()
    if fd is not None:
        try:
            os.set_inheritable(fd, False)
        except OSError:
            pass


def report_outcome() -> None:
    """In a supervised child: tell the supervisor that this process reported its own outcome."""
    fd = _report_fd()
    if fd is not None:
        try:
            os.write(fd, b"1")
        except OSError:
            pass


def _terminal_sent_it() -> bool:
    """Whether a SIGINT came from the terminal: then it reached the child too (same foreground process group)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def signal_name(signum: int) -> str:
    """``"SIGSEGV"`` for 11; the number itself for a signal Python does not name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def death_message(returncode: int) -> str:
    """The one line for a child that ended without reporting its own outcome.

    Args:
        returncode: ``Popen.returncode`` (negative: killed by that signal).

    Returns:
        The ``flowrl: error: ...`` line.
    """
    if returncode >= 0:
        return (
            f"flowrl: error: the training process exited with code {returncode} without an error message "
            f"(a reward plugin or native library ended the process); {_FIX}"
        )
    name = signal_name(-returncode)
    if name == "SIGKILL":
        cause = "killed from outside, often by the out-of-memory killer: see `dmesg`"
    else:
        cause = "a reward plugin or native library crashed; its Python stack is printed above"
    return f"flowrl: error: the training process died with signal {name} ({cause}); {_FIX}"


class Waited(NamedTuple):
    """How a child that :func:`wait_forwarding` waited for ended.

    Attributes:
        returncode: ``Popen.returncode`` (negative: killed by that signal).
        forwarded: the signals forwarded to it, in order.
        interrupted: a Ctrl-C from the terminal reached this process (and the child) while it waited.
    """

    returncode: int
    forwarded: list[int]
    interrupted: bool


def wait_forwarding(child: subprocess.Popen, signals: Sequence[int]) -> Waited:
    """Wait for ``child``, forwarding ``signals`` that reach this process to it.

    A SIGINT the terminal sent is not forwarded: it reached the child too (the same foreground
    process group). The previous handlers are restored before returning.
    """
    forwarded: list[int] = []
    interrupted = False

    def forward(signum: int, frame: object) -> None:
        nonlocal interrupted
        if signum == signal.SIGINT and _terminal_sent_it():
            interrupted = True
            return
        forwarded.append(signum)
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in signals}
    try:
        returncode = child.wait()
        return Waited(returncode, forwarded, interrupted)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def supervise(argv: Sequence[str]) -> int:
    """Run ``python -m flowrl ARGV`` in a child process and wait for it.

    Args:
        argv: the arguments after ``flowrl``.

    Returns:
        The child's exit code (128 + N when signal N ended it), after one error line when it ended
        without reporting its own outcome.
    """
    read_fd, write_fd = os.pipe()
    env = {**os.environ, SUPERVISED_ENV: "1", REPORT_FD_ENV: str(write_fd)}
    child = subprocess.Popen([sys.executable, "-m", "flowrl", *argv], env=env, pass_fds=(write_fd,))
    os.close(write_fd)
    returncode, forwarded, _ = wait_forwarding(child, (signal.SIGINT, signal.SIGTERM))
    os.set_blocking(read_fd, False)  # the byte, if any, was written before the child ended
    try:
        reported = bool(os.read(read_fd, 1))
    except BlockingIOError:
        reported = False
    finally:
        os.close(read_fd)
    if not reported and not (returncode < 0 and -returncode in forwarded):
        print(death_message(returncode), file=sys.stderr, flush=True)
    return 128 - returncode if returncode < 0 else returncode
