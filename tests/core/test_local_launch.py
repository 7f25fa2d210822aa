"""``flowrl train --processes N|auto`` (flowrl/local_launch.py): what is checked before any process starts.

The launch itself (real processes, gloo) is in tests/scale/test_launch.py.
"""

from __future__ import annotations

import pytest

from flowrl.cli import build_parser, main, parse_command_line
from flowrl.config import load_config
from flowrl.local_launch import auto_processes, launch_command, parse_processes, resolve_processes, train_argv
from flowrl.runtime import default_threads


def one_line_error(capsys, *args: str) -> str:
    code = main(list(args))
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("flowrl: error: "), lines
    return lines[0]


@pytest.mark.parametrize("value, parsed", [("auto", "auto"), ("1", 1), ("12", 12)])
def test_processes_is_a_count_or_auto(value, parsed):
    assert parse_processes(value) == parsed


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", "", "\u00b2", "\u0663"])  # ² crashed int(), ٣ ran 3
def test_a_bad_process_count_is_one_line(capsys, value):
    assert f"--processes must be a count >= 1 or auto; got {value!r}" in one_line_error(
        capsys, "train", "--processes", value
    )


def test_every_launched_process_runs_the_same_train_command_without_processes():
    argv = ["train", "configs/grpo/digits.yaml", "--processes", "2", "--output", "runs/x", "--overwrite", "a.b=1"]
    ns = parse_command_line(build_parser(), argv)
    assert train_argv(ns) == ["train", "configs/grpo/digits.yaml", "a.b=1", "--output", "runs/x", "--overwrite"]
    ns = parse_command_line(build_parser(), ["train", "--resume", "runs/x", "--processes", "auto"])
    assert train_argv(ns) == ["train", "--resume", "runs/x"]


def test_the_launch_command_is_accelerates_with_gloo_on_a_cpu(monkeypatch):
    monkeypatch.setenv("FLOWRL_SUPERVISED", "1")  # as in the supervised child that hands itself over
    monkeypatch.setenv("FLOWRL_SUPERVISOR_FD", "7")
    cmd, env = launch_command(load_config(None, []), 2, ["train", "x=1"], 29601)
    assert "FLOWRL_SUPERVISED" not in env and "FLOWRL_SUPERVISOR_FD" not in env  # the ranks are not supervised
    assert cmd[1:3] == ["-m", "flowrl.local_launch"]  # accelerate's launcher through run_launcher
    assert cmd[cmd.index("--num_processes") + 1] == "2" and "--multi_gpu" in cmd
    assert cmd[cmd.index("--main_process_port") + 1] == "29601"
    assert cmd[-4:] == ["-m", "flowrl", "train", "x=1"]
    assert env["ACCELERATE_USE_CPU"] == "true"


@pytest.mark.parametrize(
    "overrides, slots, expected",
    [
        (["prompts.per_iteration=20", "prompts.group_size=8", "sampler.chunk_size=40"], 2, 2),  # the default job
        (["prompts.per_iteration=6", "prompts.group_size=4", "sampler.chunk_size=4"], 4, 3),  # 4 does not split 6
        (["prompts.per_iteration=6", "prompts.group_size=4", "sampler.chunk_size=4"], 8, 6),
        (["prompts.per_iteration=4", "prompts.group_size=3", "sampler.chunk_size=6"], 4, 2),  # chunk fits 2 ranks only
        (["prompts.per_iteration=3", "prompts.group_size=2", "sampler.chunk_size=2"], 2, 1),
        (["prompts.per_iteration=4"], 1, 1),  # one core
    ],
)
def test_auto_takes_the_most_processes_the_batch_splits_over(overrides, slots, expected):
    processes, why = auto_processes(load_config(None, overrides), slots)
    assert processes == expected
    assert bool(why) == (expected == 1 and slots > 1)


def test_auto_says_why_it_falls_back_to_one_process(capsys):
    cfg = load_config(None, ["prompts.per_iteration=3", "prompts.group_size=2", "sampler.chunk_size=2"])
    processes = resolve_processes(cfg, "auto")
    err = capsys.readouterr().err
    assert processes == 1
    if err:  # a machine with more than one usable core
        assert err.startswith("flowrl: --processes auto: one process, since prompts.per_iteration=3 does not split")


def test_a_launch_inside_a_launch_is_refused(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    line = one_line_error(capsys, "train", "--processes", "2", f"output.dir={tmp_path / 'run'}")
    assert "--processes starts its own launch; under accelerate launch leave it out" in line


def test_what_every_rank_would_refuse_is_refused_before_any_process_starts(capsys, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    line = one_line_error(capsys, "train", "--processes", "2", f"output.dir={tmp_path / 'run'}")
    assert f"output folder {tmp_path / 'run'} already holds files; pass --overwrite" in line
    line = one_line_error(capsys, "train", "--processes", "2", "--output", str(tmp_path / "run"))
    assert f"output folder {tmp_path / 'run'} already holds files" in line
    line = one_line_error(capsys, "train", "--processes", "2", "prompts.per_iteration=3", f"output.dir={tmp_path}/b")
    assert "prompts.per_iteration=3 does not split into whole groups over 2 processes" in line
    assert not (tmp_path / "b").exists()
    (tmp_path / "run" / "checkpoints" / "iter-000001").mkdir(parents=True)  # a checkpoint that does not verify
    (tmp_path / "run" / "config.yaml").write_text("{}\n")  # the run's own config (--resume RUN alone reads it)
    line = one_line_error(capsys, "train", "--processes", "2", "--resume", str(tmp_path / "run"))
    assert "--resume" in line and "iter-000001" in line
    line = one_line_error(capsys, "train", "--check", "--processes", "3")  # --check refuses what the launch would
    assert "prompts.per_iteration=20 does not split into whole groups over 3 processes" in line


def test_check_with_auto_estimates_the_resolved_count(capsys):
    cfg = load_config(None, [])
    processes = resolve_processes(cfg, "auto")
    assert main(["train", "--check", "--processes", "auto"]) == 0
    auto = capsys.readouterr().out
    assert main(["train", "--check", "--processes", str(processes)]) == 0
    estimate = capsys.readouterr().out.split("; available:")[0]  # the free memory moves between the two calls
    assert estimate == auto.split("; available:")[0] and "; available:" in auto


@pytest.mark.parametrize("local", ["1", "2", "3"])
def test_default_threads_are_shared_by_the_local_processes_of_a_launch(monkeypatch, local):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = default_threads()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert default_threads() == max(1, alone // int(local))


def test_the_launcher_ends_a_stopped_or_failed_launch_in_lines_not_tracebacks(monkeypatch, capsys):
    """torchrun raises SignalException (Ctrl-C, SIGTERM) or ChildFailedError (a rank failed) out of its launcher."""
    import signal

    import accelerate.commands.launch as accelerate_launch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from flowrl.local_launch import run_launcher

    argv = ["--multi_gpu", "--num_processes", "2", "-m", "flowrl", "train"]

    def stopped(args):
        raise SignalException("Process 1 got signal: 2", sigval=signal.SIGINT)

    monkeypatch.setattr(accelerate_launch, "launch_command", stopped)
    assert run_launcher(argv) == 130  # as a Ctrl-C'd process
    failures = {
        1: ProcessFailure(local_rank=1, pid=11, exitcode=-9, error_file="<N/A>"),
        0: ProcessFailure(local_rank=0, pid=10, exitcode=2, error_file="<N/A>"),
    }

    def failed(args):
        raise ChildFailedError("flowrl", failures)

    monkeypatch.setattr(accelerate_launch, "launch_command", failed)
    assert run_launcher(argv) == 1
    assert capsys.readouterr().err.splitlines() == [
        "flowrl: error: rank 0 exited with code 2; its own error line is above",
        "flowrl: error: rank 1 died with signal SIGKILL (killed from outside, often by the out-of-memory killer: see "
        "`dmesg`); rerun with --processes 1 to see it alone",
    ]


def test_auto_names_why_the_largest_count_does_not_split() -> None:
    """When no count above 1 splits the batch, the reason given is the one of the largest count tried."""
    cfg = load_config(None, ["prompts.per_iteration=5", "prompts.group_size=2", "sampler.chunk_size=2"])
    processes, why = auto_processes(cfg, 4)
    assert processes == 1
    assert "does not split into whole groups over 4 processes" in why


def test_auto_takes_at_most_max_auto_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine with 16 usable cores --processes auto still starts MAX_AUTO_PROCESSES (8) processes."""
    import os

    from flowrl.local_launch import MAX_AUTO_PROCESSES

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    cfg = load_config(None, ["prompts.per_iteration=16", "prompts.group_size=2", "sampler.chunk_size=2"])
    assert MAX_AUTO_PROCESSES == 8
    assert resolve_processes(cfg, "auto") == 8


def test_a_rank_that_exited_with_code_zero_is_an_exit_not_a_signal() -> None:
    """failure_line reads exit code 0 as an exit and a negative code as the signal that killed the rank."""
    from flowrl.local_launch import failure_line

    assert failure_line(3, 0) == "flowrl: error: rank 3 exited with code 0; its own error line is above"
    assert failure_line(1, -11) == (
        "flowrl: error: rank 1 died with signal SIGSEGV (crashed); rerun with --processes 1 to see it alone"
    )


def test_a_rank_the_launcher_stopped_after_another_failed_is_named_so() -> None:
    """Rank 1 exits with code 2 and torch elastic SIGTERMs rank 0: rank 0 did not crash (a race on a busy host
    turned CI red when rank 1 got there first)."""
    from flowrl.local_launch import failure_lines

    exited = "flowrl: error: rank {} exited with code 2; its own error line is above"
    stopped = "flowrl: error: rank 0 was stopped by the launcher (SIGTERM) after rank 1 failed"
    assert failure_lines({0: -15, 1: 2}) == [stopped, exited.format(1)]
    assert failure_lines({0: 2, 1: 2}) == [exited.format(0), exited.format(1)]
    alone = "flowrl: error: rank 1 died with signal SIGTERM (crashed); rerun with --processes 1 to see it alone"
    assert failure_lines({1: -15}) == [alone]  # no other failure: not the launcher's doing


def _cores(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)


def test_more_cpu_processes_than_cores_are_checked_with_a_warning_after_the_report(monkeypatch, capsys):
    """--check --processes 4 on 2 usable cores: the report, and one warning line naming both counts; 2 on 2 and
    4 on 4 say nothing more."""
    _cores(monkeypatch, 2)
    assert main(["train", "--check", "--processes", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("config OK for this machine") and "(4 processes x ~" in out
    assert err.splitlines() == [
        "flowrl: warning: --processes 4 on 2 usable CPU core(s): the processes share them, so an iteration runs "
        "no faster than on 2 (--processes auto picks a count that fits)"
    ]
    assert main(["train", "--check", "--processes", "2"]) == 0 and capsys.readouterr().err == ""
    _cores(monkeypatch, 4)
    assert main(["train", "--check", "--processes", "4"]) == 0 and capsys.readouterr().err == ""


def test_a_refused_launch_on_too_few_cores_is_still_one_line(monkeypatch, capsys):
    """The warning comes after every check: a batch that does not split over 3 processes stays one error line."""
    _cores(monkeypatch, 2)
    line = one_line_error(capsys, "train", "--check", "--processes", "3")
    assert "does not split into whole groups over 3 processes" in line


def test_more_cuda_processes_than_gpus_are_refused(monkeypatch):
    """check_slots (run by --check and by the launch) on a machine showing one GPU: 2 CUDA processes are refused."""
    import flowrl.local_launch as local_launch

    monkeypatch.setattr(local_launch, "usable_slots", lambda cfg: 1)
    cuda = load_config(None, ["model.device=cuda"])
    local_launch.check_slots(cuda, 1)
    with pytest.raises(ValueError, match=r"^2 processes of a CUDA model need one GPU each but this machine shows 1; "):
        local_launch.check_slots(cuda, 2)
