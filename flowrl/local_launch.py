"""``flowrl train --processes N``: train on N processes of this machine through ``accelerate launch``.

On a CPU the denoiser's small matmuls do not use a second core well from one process (one thread
is steadier, :func:`flowrl.runtime.default_threads`), but two processes that each train half the
global batch do: the embedded default job runs 1.78x faster end to end on 2 processes of a 2-core
CPU at the same results (docs/performance.md). ``--processes N`` checks what it can before any
process starts (the batch split, local weights, the memory of one rank, the output folder), then runs::

    [ACCELERATE_USE_CPU=true] python -m accelerate.commands.launch --multi_gpu --num_processes N \
        --num_machines 1 --mixed_precision no --dynamo_backend no --main_process_port PORT \
        -m flowrl train ARGS

(gloo on the CPU, one GPU per process on CUDA, the same command ``docs/scale-out.md`` gives) and
waits for it; the launcher runs through :func:`run_launcher`, which ends a stopped or failed launch in
one line per failed rank instead of torchrun's traceback. ``--processes auto`` takes the most
processes, up to one per usable CPU core (or per visible GPU for a CUDA model), that the global
batch splits over.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Mapping

from .console import stderr_line
from .distributed import check_rank_device, check_rollout_split, derive_geometry, launch_world_size

if TYPE_CHECKING:
    import argparse

    from .config import Config

MAX_AUTO_PROCESSES = 8
"""``--processes auto`` starts at most this many processes (one machine's GPUs, or a CPU's cores)."""


def parse_processes(value: str) -> int | str:
    """``--processes``: a count >= 1 or ``auto``.

    Raises:
        ValueError: anything else, in one line.
    """
    if value == "auto":
        return value
    if not (value.isascii() and value.isdigit()) or int(value) < 1:  # "²" and "٣" pass isdigit alone
        raise ValueError(f"--processes must be a count >= 1 or auto; got {value!r}")
    return int(value)


def usable_slots(cfg: Config) -> int:
    """Processes this machine can run side by side: visible GPUs for a CUDA model, else usable CPU cores."""
    import torch

    if torch.device(cfg.model.device).type == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_split(cfg: Config, processes: int) -> None:
    """Check that the global batch splits over ``processes`` (as every rank checks after the launch).

    Raises:
        ValueError: an impossible combination, naming the numbers to change.
    """
    from .rollouts.collect import rollout_kind
    from .trainer import build_objective

    p = cfg.prompts
    geometry = derive_geometry(p.per_iteration, p.group_size, cfg.sampler.chunk_size, processes, 0, cfg.train.placement)
    check_rollout_split(geometry, rollout_kind(build_objective(cfg).rollout, cfg.sampler.solver))


def auto_processes(cfg: Config, slots: int) -> tuple[int, str]:
    """The most processes, up to ``slots``, that the global batch splits over (:func:`check_split`).

    Returns:
        (the count, 1 when none above 1 splits; why the largest count above 1 does not split, or "").
    """
    why = ""
    for n in range(slots, 1, -1):
        try:
            check_split(cfg, n)
        except ValueError as err:
            why = why or str(err)
            continue
        return n, ""
    return 1, why


def resolve_processes(cfg: Config, requested: int | str) -> int:
    """The process count of ``--processes``: ``requested``, or for ``auto`` the most that fit.

    ``auto``: :func:`auto_processes` over :func:`usable_slots` (at most :data:`MAX_AUTO_PROCESSES`);
    when it falls back to one process it says why on stderr.

    Raises:
        ValueError: a CUDA model with ``auto`` on a machine without a GPU.
    """
    if requested != "auto":
        return int(requested)
    slots = min(usable_slots(cfg), MAX_AUTO_PROCESSES)
    if slots < 1:
        raise ValueError(f"--processes auto: model.device={cfg.model.device!r} but no CUDA device is visible")
    processes, why = auto_processes(cfg, slots)
    if why:
        stderr_line(f"flowrl: --processes auto: one process, since {why}")
    return processes


def check_slots(cfg: Config, processes: int) -> None:
    """Check ``--processes N`` against this machine's GPUs or cores, last before the launch (``--check`` too).

    A CUDA model needs one visible GPU per process (:func:`flowrl.distributed.check_rank_device`).
    More CPU processes than usable cores run, but share the cores: a warning on stderr says so
    (after every other check passed, so a refusal stays one line).

    Raises:
        ValueError: a CUDA launch this machine cannot place, in one line.
    """
    import torch

    if processes <= 1:
        return
    slots = usable_slots(cfg)
    check_rank_device(cfg.model.device, processes, slots)
    if torch.device(cfg.model.device).type != "cuda" and processes > slots:
        stderr_line(
            f"flowrl: warning: --processes {processes} on {slots} usable CPU core(s): the processes share them, "
            f"so an iteration runs no faster than on {slots} (--processes auto picks a count that fits)"
        )


def free_port() -> int:
    """A TCP port that is free on this machine now (the launch's rendezvous, so two runs do not collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def train_argv(ns: argparse.Namespace) -> list[str]:
    """The ``flowrl train`` arguments every launched process runs: ``ns`` without ``--processes``."""
    argv = ["train", *ns.args]
    if ns.output:
        argv += ["--output", ns.output]
    if ns.overwrite:
        argv.append("--overwrite")
    if ns.resume:
        argv += ["--resume", ns.resume]
    return argv


def launch_command(cfg: Config, processes: int, argv: list[str], port: int) -> tuple[list[str], dict[str, str]]:
    """The ``accelerate launch`` command line and environment that start ``processes`` ranks of ``flowrl ARGV``."""
    import torch

    cmd = [sys.executable, "-m", "flowrl.local_launch", "--multi_gpu", "--num_processes", str(processes)]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    cmd += ["--main_process_port", str(port), "-m", "flowrl", *argv]
    from .supervisor import REPORT_FD_ENV, SUPERVISED_ENV

    # the ranks are not the supervised child: they must not write on (or close) the supervisor's report pipe
    env = {k: v for k, v in os.environ.items() if k not in (SUPERVISED_ENV, REPORT_FD_ENV)}
    if torch.device(cfg.model.device).type != "cuda":
        env["ACCELERATE_USE_CPU"] = "true"  # gloo; without it accelerate would look for GPUs
    return cmd, env


def failure_line(rank: int, exitcode: int) -> str:
    """The one line for a rank that ended the launch: its exit code, or the signal that killed it."""
    if exitcode >= 0:
        return f"flowrl: error: rank {rank} exited with code {exitcode}; its own error line is above"
    from .supervisor import signal_name

    name = signal_name(-exitcode)
    why = "killed from outside, often by the out-of-memory killer: see `dmesg`" if name == "SIGKILL" else "crashed"
    return f"flowrl: error: rank {rank} died with signal {name} ({why}); rerun with --processes 1 to see it alone"


def failure_lines(exitcodes: Mapping[int, int]) -> list[str]:
    """One line per failed rank (:func:`failure_line`), saying which ranks the launcher itself stopped.

    When a rank fails, torch elastic stops the others with SIGTERM, and they are reported as failed too: a rank
    that ended by SIGTERM while another rank failed some other way is named as stopped after that rank, not as
    crashed (which of two ranks that fail alike gets there first is a race).

    Args:
        exitcodes: rank -> exit code (negative: the signal that ended it), of the ranks torch elastic reports.

    Returns:
        The lines, by rank.
    """
    sigterm = -int(signal.SIGTERM)
    causes = [rank for rank, code in sorted(exitcodes.items()) if code != sigterm]
    lines = []
    for rank, code in sorted(exitcodes.items()):
        if code == sigterm and causes:
            lines.append(
                f"flowrl: error: rank {rank} was stopped by the launcher (SIGTERM) after rank {causes[0]} failed"
            )
        else:
            lines.append(failure_line(rank, code))
    return lines


def run_launcher(argv: list[str]) -> int:
    """Run ``accelerate launch ARGV``, ending in one line per failed rank instead of torchrun's traceback.

    ``flowrl train --processes N`` runs this (``python -m flowrl.local_launch ARGV``) in place of
    ``python -m accelerate.commands.launch ARGV``: the same launch, but a Ctrl-C or SIGTERM leaves
    with 128 + the signal (not torchrun's ``SignalException`` traceback and code 1), and a failed
    rank is named with its exit code or the signal that killed it (not torchrun's ``ChildFailedError``
    traceback).

    Args:
        argv: ``accelerate launch`` arguments.

    Returns:
        The launch's exit code: 0, 1 when a rank failed, 128 + N when signal N stopped it.
    """
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    quiet_elastic_warnings()
    try:
        launch_command(launch_command_parser().parse_args(argv))
    except SignalException as err:
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        for line in failure_lines({rank: failure.exitcode for rank, failure in err.failures.items()}):
            stderr_line(line)
        return 1
    return 0


def quiet_elastic_warnings() -> None:
    """Show only errors from torch elastic's loggers in the launcher (each sets its own level, from ``LOGLEVEL``).

    On a Ctrl-C or SIGTERM it warns "Sending process N closing signal SIGINT" once per rank and that it
    received a death signal, before flowrl's one line says the same; a failed rank gets flowrl's own line
    (:func:`failure_lines`).
    """
    import torch.distributed.run  # noqa: F401  (creates the launcher's loggers: accelerate imports it on launch)

    for name, logger in list(logging.root.manager.loggerDict.items()):
        if name.startswith("torch.distributed.elastic") and isinstance(logger, logging.Logger):
            logger.setLevel(logging.ERROR)


def launch_training(cfg: Config, ns: argparse.Namespace, processes: int) -> int:
    """Check the run for ``processes`` ranks, start them with ``accelerate launch`` and wait.

    Under the supervisor (``flowrl train`` from the console) this process becomes the launcher
    (:func:`flowrl.supervisor.hand_over`: only the torch-free supervisor waits); otherwise it runs
    the launcher as a child and waits. Ctrl-C reaches the launcher and the ranks from the terminal
    (they stop as under a manual ``accelerate launch``); a SIGTERM, or a SIGINT sent to the waiting
    process alone, is forwarded to the launcher.

    Returns:
        The launcher's exit code (128 + N when signal N ended it); under the supervisor it does not
        return (this process has become the launcher).

    Raises:
        ValueError: this process is already one of a launch, or the run cannot start (batch split,
            devices, memory), in one line naming the fix.
        FileExistsError: an occupied output folder.
    """
    from .config import to_dict
    from .models import EMBEDDED, pipeline_folder
    from .models.hub import is_hub_id
    from .outputs import check_run_dir_free
    from .resources import check_machine
    from .resume import check_resume_config, find_resume
    from .supervisor import hand_over, launch_message, wait_forwarding

    if launch_world_size() > 1:
        raise ValueError(
            "--processes starts its own launch; under accelerate launch leave it out (the launch sets the processes)"
        )
    check_split(cfg, processes)
    if cfg.model.path == EMBEDDED or not is_hub_id(cfg.model.path):  # a hub id may be fetched: the ranks do that
        pipeline_folder(cfg.model.path)  # missing weights: one line before any process starts
    check_machine(cfg, processes=processes, host_processes=processes)  # all N start on this machine
    check_run_dir_free(cfg.output.dir, ns.overwrite, ns.resume)
    if ns.resume:  # a checkpoint that does not verify or a refused config change: one line, not one per rank
        check_resume_config(find_resume(ns.resume).state.get("config"), to_dict(cfg))
    check_slots(cfg, processes)  # one GPU per process, all of them there; more CPU processes than cores: warned
    cmd, env = launch_command(cfg, processes, train_argv(ns), free_port())
    where = "CPU processes (gloo)" if env.get("ACCELERATE_USE_CPU") else "processes, one GPU each"
    print(f"flowrl: training on {processes} {where} (accelerate launch --num_processes {processes})", flush=True)
    hand_over(cmd, env)  # supervised: this process becomes the launcher; the supervisor reports the outcome
    launcher = subprocess.Popen(cmd, env=env)
    returncode, forwarded, interrupted = wait_forwarding(launcher, (signal.SIGINT, signal.SIGTERM))
    line = launch_message(returncode, bool(forwarded) or interrupted)
    if line:
        stderr_line(line)
    return 128 - returncode if returncode < 0 else returncode


if __name__ == "__main__":
    sys.exit(run_launcher(sys.argv[1:]))
