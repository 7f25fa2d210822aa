"""`flowrl train` under its supervisor: a crash of the training process still ends in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import tiny_sd3_pipeline

from flowrl import cli
from flowrl.supervisor import death_message, should_supervise

ROOT = Path(__file__).resolve().parents[1]
FAST = ["prompts.per_iteration=2", "prompts.group_size=2", "sampler.num_steps=2", "train.iterations=1"]


def test_when_to_supervise():
    assert should_supervise(["train", "x.yaml"], {})
    assert not should_supervise(["sample"], {})
    assert not should_supervise(["train"], {"FLOWRL_SUPERVISED": "1"})  # the child runs the command itself
    assert not should_supervise(["train"], {"FLOWRL_NO_SUPERVISOR": "1"})
    assert not should_supervise(["train"], {"WORLD_SIZE": "1"})  # a distributed launcher supervises
    assert not should_supervise(["train"], {"LOCAL_RANK": "0"})


def test_death_messages_are_one_line():
    segv = death_message(-signal.SIGSEGV)
    assert segv.startswith("flowrl: error: the training process died with signal SIGSEGV (a reward plugin")
    assert "flowrl serve-reward" in segv and "FLOWRL_NO_SUPERVISOR=1" in segv and "\n" not in segv
    killed = death_message(-signal.SIGKILL)  # it said to serve a reward remotely, though no reward was involved
    assert "out-of-memory" in killed and "flowrl train --resume RUN_DIR" in killed and "serve-reward" not in killed
    assert death_message(7).startswith("flowrl: error: the training process exited with code 7 without an error")


def test_main_with_argv_runs_in_this_process(monkeypatch, capsys):
    def refuse(argv):
        raise AssertionError("main(argv) must not spawn a supervised child")

    monkeypatch.setattr("flowrl.supervisor.supervise", refuse)
    assert cli.main(["train", "no_such_key=1"]) == 2
    assert "unknown key 'no_such_key'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_sd3")
    tiny_sd3_pipeline().save_pretrained(str(path))
    return path


def train(tmp_path: Path, model: Path, kind: str, env: dict | None = None, wait: bool = True, timeout_s: float = 2):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"model: {{path: {model}}}\nrewards:\n  judge: {{reward: 'bench.reward_faults:faulty', kind: {kind}, "
        f"timeout_s: {timeout_s}, marker: {tmp_path / 'scoring'}}}\noutput: {{dir: {tmp_path / 'run'}}}\n"
    )
    cmd = [sys.executable, "-m", "flowrl", "train", str(cfg), *FAST]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    _, stderr = proc.communicate(timeout=300)
    return proc.returncode, stderr


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("flowrl: error:")]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, code, fragment",
    [
        ("segfault", 128 + signal.SIGSEGV, "the training process died with signal SIGSEGV (a reward plugin"),
        ("exit", 7, "the training process exited with code 7 without an error message"),
        ("hang", 2, "reward 'judge' did not return within its deadline of 2 s"),
        ("raise", 2, "reward 'judge' raised RuntimeError: judge crashed"),
    ],
)
def test_a_reward_fault_in_the_training_process_ends_in_one_line(tmp_path, tiny_model, kind, code, fragment):
    returncode, stderr = train(tmp_path, tiny_model, kind)
    assert returncode == code, stderr[-3000:]
    lines = error_lines(stderr)
    assert len(lines) == 1 and fragment in lines[0], stderr[-3000:]
    if kind == "segfault":
        assert "Fatal Python error: Segmentation fault" in stderr and "reward_faults.py" in stderr  # faulthandler


@pytest.mark.slow
def test_without_the_supervisor_a_crash_says_nothing(tmp_path, tiny_model):
    returncode, stderr = train(tmp_path, tiny_model, "exit", env={"FLOWRL_NO_SUPERVISOR": "1"})
    assert returncode == 7 and not error_lines(stderr)  # what the supervisor is for


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 128 + signal.SIGTERM)])
def test_signals_to_the_supervisor_reach_the_training_process(tmp_path, tiny_model, sig, code):
    proc = train(tmp_path, tiny_model, "hang", wait=False, timeout_s=600)
    deadline = time.monotonic() + 240
    while not (tmp_path / "scoring").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)  # to the supervisor only (not from a terminal): it forwards it once
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr[-3000:]
    assert not error_lines(stderr) and "Traceback" not in stderr  # an asked-for stop is no crash
    how = "interrupted" if sig == signal.SIGINT else "stopped by SIGTERM"  # SIGTERM ended it without a word
    assert f"flowrl: {how} before the run's first checkpoint" in stderr  # and so it says it cannot resume


def test_a_launch_ends_with_one_line_only_when_it_did_not_succeed():
    from flowrl.supervisor import launch_message

    assert launch_message(0, stopped=False) is None
    assert launch_message(1, stopped=False).startswith("flowrl: error: the launch ended with code 1; the failing")
    assert launch_message(-15, stopped=True) == "flowrl: the launch was stopped by a signal"
    # a SIGINT / SIGTERM sent to the launcher alone (a job scheduler): it leaves with 128 + N, nothing failed
    assert launch_message(130, stopped=False) == launch_message(143, stopped=False) == launch_message(-15, True)


def test_only_the_train_command_is_supervised_and_only_one_opts_out() -> None:
    """The first argument must be "train" (not any argument); FLOWRL_NO_SUPERVISOR opts out with "1" alone."""
    assert not should_supervise(["export", "train"], {})
    assert not should_supervise([], {})
    assert should_supervise(["train"], {"FLOWRL_NO_SUPERVISOR": "0"})
    assert should_supervise(["train"], {"FLOWRL_NO_SUPERVISOR": ""})


def test_a_silent_exit_and_a_launch_killed_by_a_signal_get_their_lines() -> None:
    """Exit code 0 without a report is an exit, not signal 0; a launch killed by a signal nobody sent is an error."""
    from flowrl.supervisor import launch_message, signal_name

    assert death_message(0).startswith("flowrl: error: the training process exited with code 0 without an error")
    assert launch_message(-9, stopped=False) == (
        "flowrl: error: the launch ended with code -9; the failing process's error is above "
        "(rerun with --processes 1 to see it alone)"
    )
    assert launch_message(1, stopped=True) == "flowrl: the launch was stopped by a signal"
    assert signal_name(int(signal.SIGTERM)) == "SIGTERM" and signal_name(999) == "999"


def test_wait_forwarding_sends_a_signal_to_the_child_and_restores_the_handler() -> None:
    """A SIGTERM reaching the waiting process goes to the child (which dies of it), is listed, and the previous
    SIGTERM handler is back afterwards."""
    import threading

    from flowrl.supervisor import wait_forwarding

    before = signal.getsignal(signal.SIGTERM)
    # the child signals this process once told that the forwarding handler is installed, then waits to be ended
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, signal, sys, time; sys.stdin.readline(); os.kill(os.getppid(), signal.SIGTERM); "
            "time.sleep(120)",  # until the forwarded signal ends it (120 s only bounds a failure)
        ],
        stdin=subprocess.PIPE,
    )

    def go() -> None:
        while signal.getsignal(signal.SIGTERM) is before:
            time.sleep(0.01)
        assert child.stdin is not None
        child.stdin.write(b"go\n")
        child.stdin.flush()

    threading.Thread(target=go, daemon=True).start()
    waited = wait_forwarding(child, (signal.SIGTERM,))
    assert waited.returncode == -signal.SIGTERM and waited.forwarded == [signal.SIGTERM] and not waited.interrupted
    assert signal.getsignal(signal.SIGTERM) is before


CHILD = """
import os, signal, sys, time
os.write(int(os.environ["FLOWRL_SUPERVISOR_FD"]), os.environ["CHILD_SAYS"].encode())
how = os.environ["CHILD_ENDS"]
if how == "wait":
    time.sleep(120)  # until the forwarded signal ends it (120 s only bounds a failure)
elif how.startswith("sig"):
    os.kill(os.getpid(), int(how[3:]))
sys.exit(int(how))
"""


@pytest.fixture
def scripted_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """supervise() starts this script as its child: it writes CHILD_SAYS on the report pipe, then ends as CHILD_ENDS
    says (an exit code, "sigN": killed by signal N, "wait": until a signal ends it)."""
    script = tmp_path / "child"
    script.write_text(f"#!{sys.executable}\n{CHILD}")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(script))

    def run(says: str, ends: str) -> None:
        monkeypatch.setenv("CHILD_SAYS", says)
        monkeypatch.setenv("CHILD_ENDS", ends)

    return run


@pytest.mark.parametrize(
    ("says", "ends", "code", "line"),
    [
        ("1", "2", 2, None),  # it reported its own error
        ("L1", "2", 2, None),  # a hand-over that failed and reported itself: the last word counts
        ("L", "3", 3, "flowrl: error: the launch ended with code 3;"),
        ("", "7", 7, "flowrl: error: the training process exited with code 7 without an error message"),
        (
            "",
            f"sig{int(signal.SIGSEGV)}",
            128 + signal.SIGSEGV,
            "flowrl: error: the training process died with signal SIGSEGV",
        ),
    ],
)
def test_supervise_passes_the_code_through_and_says_only_what_the_child_did_not(
    scripted_child, capsys: pytest.CaptureFixture[str], says: str, ends: str, code: int, line: str | None
) -> None:
    """The child's exit code comes back (128 + N for signal N); one line only when the child did not report its end
    (its last word on the pipe), the launch line when it handed over to a launch that failed."""
    from flowrl.supervisor import supervise

    scripted_child(says, ends)
    assert supervise(["train"]) == code
    err = capsys.readouterr().err.splitlines()
    assert err == [] if line is None else (len(err) == 1 and err[0].startswith(line)), err


def test_supervise_says_nothing_when_a_forwarded_signal_ends_the_child(
    scripted_child, capsys: pytest.CaptureFixture[str]
) -> None:
    """A SIGTERM to the supervisor reaches the child; its death by that signal is asked for: 128 + 15, no line."""
    import threading

    from flowrl.supervisor import supervise

    before = signal.getsignal(signal.SIGTERM)

    def stop() -> None:
        while signal.getsignal(signal.SIGTERM) is before:  # until supervise forwards SIGTERM
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    scripted_child("", "wait")
    threading.Thread(target=stop, daemon=True).start()
    assert supervise(["train"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == ""


def test_hand_over_happens_only_in_a_supervised_child_with_its_pipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without FLOWRL_SUPERVISED or without the report pipe hand_over returns False and writes nothing; with both it
    tells the supervisor b"L" before it execs (here a missing program, so the exec fails instead)."""
    from flowrl.supervisor import hand_over

    missing = [str(tmp_path / "no-such-launcher")]
    read_fd, write_fd = os.pipe()
    try:
        os.set_blocking(read_fd, False)
        monkeypatch.delenv("FLOWRL_SUPERVISED", raising=False)
        monkeypatch.setenv("FLOWRL_SUPERVISOR_FD", str(write_fd))
        assert hand_over(missing, {}) is False
        monkeypatch.setenv("FLOWRL_SUPERVISED", "1")
        monkeypatch.delenv("FLOWRL_SUPERVISOR_FD")
        assert hand_over(missing, {}) is False
        with pytest.raises(BlockingIOError):
            os.read(read_fd, 16)  # nothing was said
        monkeypatch.setenv("FLOWRL_SUPERVISOR_FD", str(write_fd))
        with pytest.raises(FileNotFoundError):
            hand_over(missing, {})
        assert os.read(read_fd, 16) == b"L"
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_setup_child_rearms_an_ignored_sigint_and_keeps_the_pipe_from_grandchildren() -> None:
    """A child started with SIGINT ignored (nohup ... &) gets Python's KeyboardInterrupt handler back, and the report
    pipe's descriptor is made non-inheritable (in a fresh interpreter)."""
    code = (
        "import os, signal\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "r, w = os.pipe(); os.set_inheritable(w, True); os.environ['FLOWRL_SUPERVISOR_FD'] = str(w)\n"
        "from flowrl.supervisor import setup_child\n"
        "setup_child()\n"
        "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, os.get_inheritable(w))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "False"]
