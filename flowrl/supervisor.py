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
    """In a supervised child: dump the Python stack on a crash, keep the report pipe, honour a forwarded SIGINT.

    The report pipe is kept from grandchildren. A background launch (``nohup ... &``) starts with SIGINT
    ignored, which Python keeps; the supervisor forwards SIGINT as a stop request, so it is re-armed here.
    A SIGTERM (a job scheduler, ``kill``) stops the run as a Ctrl-C does (:class:`Terminated`): the run
    ends cleanly and says how to resume, instead of dying without a word.
    """
    import faulthandler
    import signal

    faulthandler.enable()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if "WORLD_SIZE" not in os.environ:  # a rank of a launch is stopped by its launcher, which names how
        signal.signal(signal.SIGTERM, _terminate)
    fd = _report_fd()
    if fd is not None:
        try:
            os.set_inheritable(fd, False)
        except OSError:
            pass


class Terminated(KeyboardInterrupt):
    """A SIGTERM asking a supervised ``flowrl train`` to stop: handled as a Ctrl-C, the exit code 143 (128 + 15)."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


def stop_code(err: KeyboardInterrupt) -> int:
    """The exit code of a run stopped by ``err``: 143 for a SIGTERM (:class:`Terminated`), 130 for a Ctrl-C."""
    return 128 + (signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT)


def ignore_stop_signals() -> None:
    """Ignore further SIGINT / SIGTERM while a stopped run prints its last line (a second one made a traceback)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)


REPORTED, LAUNCHED = b"1", b"L"
"""What a supervised child writes on the report pipe: it reported its own outcome; it is about to
become accelerate's launcher (``flowrl train --processes N``), whose exit code is the outcome."""


def _tell(byte: bytes) -> None:
    fd = _report_fd()
    if fd is not None:
        try:
            os.write(fd, byte)
        except OSError:
            pass


def report_outcome() -> None:
    """In a supervised child: tell the supervisor that this process reported its own outcome."""
    _tell(REPORTED)


def hand_over(cmd: Sequence[str], env: Mapping[str, str]) -> bool:
    """In a supervised child: become ``cmd`` (``os.execve``), the supervisor waiting for it instead of this process.

    Used by ``flowrl train --processes N`` so that only the torch-free supervisor waits while accelerate's
    launcher runs (the launching process's memory is returned). The supervisor is told first, so it
    reports the launch's outcome in one line (:func:`launch_message`).

    Returns:
        False when this process is not a supervised child (the caller then runs ``cmd`` itself); it
        does not return otherwise.
    """
    if not os.environ.get(SUPERVISED_ENV) or _report_fd() is None:
        return False
    _tell(LAUNCHED)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execve(cmd[0], list(cmd), dict(env))
    return True  # not reached


LAUNCHER_STOPPED = frozenset({128 + signal.SIGINT, 128 + signal.SIGTERM})
"""The launcher's own exit codes for a SIGINT or SIGTERM it received (``local_launch.run_launcher``); a failed
rank is 1. A job scheduler that signals the launcher alone gets these without the supervisor seeing a signal."""


def launch_message(returncode: int, stopped: bool) -> str | None:
    """The line after a launch of several processes ended: stopped by a signal, failed, or None when it succeeded.

    Args:
        returncode: the launcher's exit code (negative: killed by that signal).
        stopped: whether this process forwarded a signal to the launcher or saw the terminal's Ctrl-C.
    """
    if stopped or returncode in LAUNCHER_STOPPED:
        return "flowrl: the launch was stopped by a signal"
    if returncode:
        return (
            f"flowrl: error: the launch ended with code {returncode}; the failing process's error is above "
            "(rerun with --processes 1 to see it alone)"
        )
    return None


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
    if name == "SIGKILL":  # nothing of ours crashed: the fix is to continue the run, not to isolate a reward
        return (
            f"flowrl: error: the training process died with signal {name} (killed from outside, often by the "
            "out-of-memory killer: see `dmesg`); continue from its last checkpoint with "
            "`flowrl train --resume RUN_DIR` (RUN_DIR: this run's output.dir)"
        )
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
    returncode, forwarded, interrupted = wait_forwarding(child, (signal.SIGINT, signal.SIGTERM))
    os.set_blocking(read_fd, False)  # the bytes, if any, were written before the child ended
    try:
        told = os.read(read_fd, 16)[-1:]  # the last word counts (a failed hand-over then reports itself)
    except BlockingIOError:
        told = b""
    finally:
        os.close(read_fd)
    if told == LAUNCHED:
        line = launch_message(returncode, bool(forwarded) or interrupted)
        if line:
            print(line, file=sys.stderr, flush=True)
    elif not told and not (returncode < 0 and -returncode in forwarded):
        print(death_message(returncode), file=sys.stderr, flush=True)
    return 128 - returncode if returncode < 0 else returncode
