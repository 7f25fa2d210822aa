"""Command-line interface of the ``flowrl`` console script.

Subcommands: ``flowrl train | sample | export | eval | gallery | demo | rewards list | reward new | serve-reward |
pretrain-digits``.

User errors (bad config, missing weights, a broken reward, an occupied output folder) print one
line ``flowrl: error: ...`` and exit with code 2; set ``FLOWRL_DEBUG=1`` for the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .config_files import split_config_args
from .console import stderr_line
from .output_commands import cmd_demo, cmd_eval, cmd_export, cmd_gallery, cmd_pretrain_digits, cmd_sample
from .reward_commands import cmd_reward_new, cmd_rewards_list, cmd_serve_reward
from .supervisor import Terminated, ignore_stop_signals, stop_code

if TYPE_CHECKING:
    from .config import Config

USER_ERRORS = (ValueError, TypeError, FileNotFoundError, FileExistsError)
STACK_HELP = "[CONFIG.yaml ...] [key=value ...]: config files merge left to right (recipe, then preset), then overrides"


def _check_single_process() -> None:
    """Refuse a launch that did not start what was asked for, before any work.

    ``accelerate launch --cpu --num_processes N`` silently starts ONE process
    (:func:`flowrl.distributed.silent_single_process`); ``WORLD_SIZE`` > 1 without a launcher's
    rendezvous (``MASTER_ADDR``) cannot form a process group.
    """
    from .distributed import launch_world_size, silent_single_process, single_process_message

    asked = silent_single_process()
    if asked:
        raise ValueError(single_process_message(asked))
    world = launch_world_size()
    if world > 1 and not os.environ.get("MASTER_ADDR"):
        raise ValueError(
            f"WORLD_SIZE={world} but no launcher set MASTER_ADDR; start several processes with "
            f"`accelerate launch --num_processes {world} -m flowrl train ...` (docs/scale-out.md)"
        )


def _stopped_by(err: KeyboardInterrupt) -> str:
    """``interrupted`` for a Ctrl-C, ``stopped by SIGTERM`` for a :class:`~flowrl.supervisor.Terminated`."""
    return "stopped by SIGTERM" if isinstance(err, Terminated) else "interrupted"


def _interrupted_line(run_dir: Path, save_every: int, err: KeyboardInterrupt) -> str:
    """What an interrupted ``flowrl train`` leaves: the command that resumes it, or that nothing can.

    Args:
        run_dir: the run folder.
        save_every: ``train.save_every``, named when no checkpoint was written yet.
        err: the stop (a Ctrl-C, or a SIGTERM: :class:`~flowrl.supervisor.Terminated`).

    Returns:
        One ``flowrl: interrupted; ...`` (or ``flowrl: stopped by SIGTERM; ...``) line.
    """
    from .resume import checkpoint_folders

    finished = [folder for folder in checkpoint_folders(run_dir) if (folder / "manifest.json").is_file()]
    how = _stopped_by(err)
    if finished:
        iteration = int(finished[0].name.removeprefix("iter-"))
        return f"flowrl: {how}; continue from iteration {iteration} with: flowrl train --resume {run_dir}"
    return (
        f"flowrl: {how} before the run's first checkpoint (train.save_every={save_every}), so it cannot be "
        "resumed; rerun it with --overwrite, and set a smaller train.save_every to checkpoint sooner"
    )


def _check_resume(path: str, cfg: Config) -> None:
    """``--check --resume PATH``: the checkpoint the resume would take verifies and its config allows ``cfg``.

    Raises:
        ValueError: no checkpoint verifies, or a key changed that a resume refuses (one line).
    """
    from .config import to_dict
    from .resume import check_resume_config, find_resume

    found = find_resume(path)
    for warning in found.warnings:
        stderr_line(f"flowrl: warning: {warning}")
    check_resume_config(found.state.get("config"), to_dict(cfg))


def _check_only(cfg: Config, ns: argparse.Namespace, processes: int | None) -> int:
    """``flowrl train --check``: every check the command would make before it builds anything, then the report.

    The launch's split and slots (``--processes``), the machine (devices, threads, work, memory), the output
    folder, the resume's checkpoint and config change; keys of a feature the run leaves off are warned of
    (:func:`~flowrl.config.unread_key_lines`).

    Returns:
        0 (a failed check raises its one-line error).
    """
    from .config import unread_key_lines
    from .local_launch import check_slots, check_split
    from .outputs import check_run_dir_free
    from .resources import check_report

    if processes is not None and processes > 1:
        check_split(cfg, processes)  # as the launch checks before it starts anything
    report = check_report(cfg, processes)
    if processes is not None:
        check_slots(cfg, processes)
    check_run_dir_free(cfg.output.dir, ns.overwrite, ns.resume)
    for line in unread_key_lines(cfg):
        stderr_line(f"flowrl: warning: {line}")
    if ns.resume:  # the checkpoint verifies and its config allows this one, as the resume will check
        _check_resume(ns.resume, cfg)
    print(report)
    return 0


def cmd_train(ns: argparse.Namespace) -> int:
    """``flowrl train``: load the config (files + overrides), run training and print a summary.

    With ``--resume`` and no config file given, the config is the run's own ``config.yaml`` (then the
    overrides); with no run folder given (``--output`` or ``output.dir`` in a config file or
    override), the run continues in the folder the checkpoint belongs to. With ``--processes`` N > 1
    (or ``auto`` resolving to more than one) it starts N processes of this command through
    ``accelerate launch`` (:mod:`flowrl.local_launch`) and returns the launch's exit code.

    Args:
        ns: parsed arguments (``args``, ``output``, ``overwrite``, ``resume``, ``check``, ``processes``).

    Returns:
        The exit code: 0, or a launch's.
    """
    from .config import load_config, read_yaml
    from .outputs import resume_run_dir
    from .recipe import Run
    from .resume import check_resume_path

    _check_single_process()
    if ns.output is not None and not ns.output.strip():
        raise ValueError("--output must name the run folder; got an empty string; e.g. --output runs/my-run")
    if ns.resume is not None:
        check_resume_path(ns.resume)  # "" or a typo: named now, not as a fresh run or a busy output folder
    config, overrides = split_config_args(ns.args)
    run_dir = resume_run_dir(ns.resume) if ns.resume else None
    given = config  # the config files the user named (the run's own config.yaml is not one)
    if config is None and run_dir is not None:  # --resume RUN alone continues with the run's own config
        if not (run_dir / "config.yaml").is_file():  # else the defaults would be compared with the checkpoint's
            raise FileNotFoundError(
                f"--resume: {run_dir / 'config.yaml'} is missing; restore it, or pass the run's config file(s) "
                "and overrides after --resume"
            )
        from .outputs import check_run_config

        config = [str(check_run_config(run_dir / "config.yaml", "restore it, or pass the run's config file(s)"))]
    cfg = load_config(config, overrides)
    processes = None
    if ns.processes is not None:
        from .local_launch import parse_processes, resolve_processes

        processes = resolve_processes(cfg, parse_processes(ns.processes))
    dir_given = any(o.split("=", 1)[0].strip() == "output.dir" for o in overrides) or any(
        "dir" in (read_yaml(path).get("output") or {}) for path in given or []
    )
    if ns.output is not None:
        cfg.output.dir = ns.output
    elif run_dir is not None and not dir_given:
        cfg.output.dir = str(run_dir)
    if ns.check:
        return _check_only(cfg, ns, processes)
    if processes is not None and processes > 1:  # every rank runs this command again without --processes
        from .local_launch import launch_training

        return launch_training(cfg, ns, processes)
    run = Run(cfg, overwrite=ns.overwrite, resume=ns.resume)
    try:
        summary = run.execute()
    except KeyboardInterrupt as err:
        ignore_stop_signals()  # the run has closed; a second Ctrl-C must not cut the line below into a traceback
        if run.is_main:  # rank 0 speaks for a launch; the others stop quietly
            stderr_line(_interrupted_line(Path(cfg.output.dir), cfg.train.save_every, err))
        return stop_code(err)
    if not run.is_main:  # rank 0 reports for the whole launch
        return 0
    start, end = summary["start"], summary["end"]
    resumed = summary.get("resumed_at_iteration")
    session = "" if resumed is None else f" ({summary['iterations'] - resumed} after resuming at iteration {resumed})"
    print(
        f"done: {summary['iterations']} iterations{session} in {summary['train_wall_s']:.0f} s"
        f"{_early_stop(summary, cfg)}; "
        f"eval reward {start.get('eval/reward_mean', float('nan')):.4f} -> "
        f"{end.get('eval/reward_mean', float('nan')):.4f}; "
        f"outputs in {cfg.output.dir}"
    )
    return 0


def _early_stop(summary: dict, cfg: Any) -> str:
    """Why a run ended before ``train.iterations`` (a guard or ``train.time_budget_s``), for the done line; "" if not.

    Args:
        summary: what :meth:`flowrl.recipe.Run.execute` returns (``iterations``, ``guards``).
        cfg: the run's config.

    Returns:
        `` (stopped ... of train.iterations=N)`` or an empty string.
    """
    if summary["iterations"] >= cfg.train.iterations:
        return ""
    if (summary.get("guards") or {}).get("stopped"):
        by = "a guard (its warning is above)"
    elif cfg.train.time_budget_s is not None:
        by = f"train.time_budget_s={cfg.train.time_budget_s:g}"
    else:
        return ""
    return f" (stopped by {by}, before train.iterations={cfg.train.iterations})"


def build_parser() -> argparse.ArgumentParser:
    """Build the ``flowrl`` argument parser; each subcommand sets ``func`` to its ``cmd_*`` handler."""
    parser = argparse.ArgumentParser(prog="flowrl", description="RL alignment for flow-matching models.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train with a config (default: the embedded digits job)")
    train.add_argument("args", nargs="*", help=STACK_HELP)
    train.add_argument("--output", help="run folder (same as output.dir=...)")
    train.add_argument("--overwrite", action="store_true", help="replace an existing run folder")
    train.add_argument(
        "--check", action="store_true", help="check the config against this machine (devices, memory) and exit"
    )
    train.add_argument(
        "--processes",
        default=None,
        metavar="N",
        help="train on N processes of this machine through accelerate launch (gloo on a CPU); auto: one per CPU "
        "core (per GPU for a CUDA model) that the batch splits over; with --check: estimate one of N processes' share "
        "(default: this launch's WORLD_SIZE)",
    )
    train.add_argument(
        "--resume",
        metavar="RUN_OR_CHECKPOINT",
        help="continue a run: a run folder (its latest checkpoint that verifies) or runs/X/checkpoints/iter-N; "
        "without config files the run's own config.yaml is the config (overrides apply on top)",
    )
    train.set_defaults(func=cmd_train)

    sample = sub.add_parser("sample", help="sample an image grid (optionally with a trained LoRA)")
    sample.add_argument("args", nargs="*", help=STACK_HELP)
    sample.add_argument(
        "--lora",
        help="a run folder (its config.yaml is the base config unless one is given), its lora/ folder or a LoRA file",
    )
    sample.add_argument("--prompt", action="append", help="prompt (repeatable); default: the config's eval prompts")
    sample.add_argument("--seeds", type=int, default=4, help="samples per prompt")
    sample.add_argument("--seed", type=int, default=0, help="first seed")
    sample.add_argument("--steps", type=int, help="ODE steps (default: train.eval_steps, else sampler.num_steps)")
    sample.add_argument("--out", default="samples.png", help="output PNG")
    sample.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    sample.set_defaults(func=cmd_sample)

    rewards = sub.add_parser("rewards", help="reward registry")
    rsub = rewards.add_subparsers(dest="rewards_command", required=True)
    rlist = rsub.add_parser("list", help="list available rewards")
    rlist.set_defaults(func=cmd_rewards_list)

    reward = sub.add_parser("reward", help="reward plugin authoring")
    wsub = reward.add_subparsers(dest="reward_command", required=True)
    new = wsub.add_parser("new", help="scaffold an installable reward plugin package")
    new.add_argument("name", help="reward name (lowercase identifier)")
    new.add_argument("--dir", default=".", help="parent folder")
    new.set_defaults(func=cmd_reward_new)

    serve = sub.add_parser("serve-reward", help="serve one reward over HTTP for `remote:` rewards (docs/rewards.md)")
    serve.add_argument("name", help="reward name, module:factory path or entry point")
    serve.add_argument("options", nargs="*", help="factory options as key=value (e.g. target=bold video=mean)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (non-loopback needs --token)")
    serve.add_argument("--port", type=int, default=8765, help="TCP port (0 = any free port)")
    serve.add_argument("--token", help="require 'Authorization: Bearer TOKEN' (default: $FLOWRL_REWARD_TOKEN)")
    serve.add_argument("--max-body-mb", type=float, default=1024.0, help="largest request accepted")
    serve.add_argument(
        "--max-image-pixels",
        type=int,
        default=4096 * 4096,
        help="largest image or frame, height x width, read from the header before decoding (default 4096x4096)",
    )
    serve.add_argument(
        "--max-request-pixels",
        type=int,
        default=8192 * 8192,
        help="most pixels of all images of one request, checked before decoding (default 8192x8192)",
    )
    serve.add_argument("--log", action="store_true", help="print one line per request")
    serve.add_argument(
        "--idle-exit", type=float, metavar="SECONDS", help="stop after SECONDS without a request (default: never)"
    )
    serve.set_defaults(func=cmd_serve_reward)

    export = sub.add_parser("export", help="write base model + trained LoRA fused, as a diffusers folder")
    export.add_argument(
        "--merge", metavar="RUN_OR_LORA", help="a run folder, its lora/ folder or a pytorch_lora_weights.safetensors"
    )
    export.add_argument("--out", required=True, help="folder to write (diffusers save_pretrained layout)")
    export.add_argument("--base", help="base model folder (default: the run's model.path, else flowrl-digits)")
    export.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), help="weight dtype (default: the run's model.dtype)"
    )
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    export.set_defaults(func=cmd_export)

    ev = sub.add_parser("eval", help="score run checkpoints and the base model on a prompt set (table + JSON)")
    ev.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders written by flowrl train")
    ev.add_argument("--prompts", required=True, help="prompt file (.txt/.jsonl/.csv/.json), folder or built-in set")
    ev.add_argument("--rewards", help="comma-separated reward names (default: every reward the runs configure)")
    ev.add_argument("--seeds", type=int, default=4, help="samples per prompt (>= 2 for diversity)")
    ev.add_argument("--seed", type=int, default=3_000_000, help="first seed")
    ev.add_argument("--steps", type=int, help="Euler ODE steps (default: each run's evaluation steps)")
    ev.add_argument("--out", default="eval", help="folder for eval.json and eval.md")
    ev.add_argument("--overwrite", action="store_true", help="replace eval.json and eval.md already in --out")
    ev.set_defaults(func=cmd_eval)

    gal = sub.add_parser("gallery", help="regenerate the README images from run folders and benchmark results")
    gal.add_argument("runs", nargs="*", metavar="RUN_DIR", help="run folders written by flowrl train")
    gal.add_argument("--out", default="gallery", help="output folder (default gallery/)")
    gal.add_argument(
        "--benchmarks",
        nargs="*",
        metavar="JSON",
        help="bench.convergence result files (default: docs/benchmarks-convergence*.json when present)",
    )
    gal.add_argument("--seeds", type=int, default=4, help="fixed seeds per prompt in the before/after grids")
    gal.add_argument("--prompts", type=int, default=20, help="eval prompts per grid (the run's first ones; default 20)")
    gal.add_argument("--steps", type=int, help="Euler ODE steps (default: each run's evaluation steps)")
    gal.set_defaults(func=cmd_gallery)

    demo = sub.add_parser("demo", help="Gradio app comparing the base model and aligned checkpoints side by side")
    demo.add_argument("runs", nargs="*", metavar="RUN_DIR", help="run folders or folders of runs (default: runs/)")
    demo.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    demo.add_argument("--port", type=int, help="TCP port (default: Gradio's first free port from 7860)")
    demo.add_argument("--share", action="store_true", help="also create a public Gradio share link (explicit opt-in)")
    demo.add_argument("--device", help="device for every model (default: each run's model.device)")
    demo.set_defaults(func=cmd_demo)

    pre = sub.add_parser("pretrain-digits", help="rebuild the embedded flowrl-digits model", add_help=False)
    pre.add_argument("args", nargs=argparse.REMAINDER)
    pre.set_defaults(func=cmd_pretrain_digits)
    return parser


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``, accepting config files and ``key=value`` overrides anywhere on the line.

    argparse stops filling a ``nargs="*"`` positional at the first option, so ``flowrl train
    --output DIR lr=...`` would leave the override unrecognised; such leftovers join ``args``.

    Args:
        parser: the parser from :func:`build_parser`.
        argv: the arguments after ``flowrl``.

    Returns:
        The parsed namespace.
    """
    ns, extra = parser.parse_known_args(argv)
    if extra and (not hasattr(ns, "args") or any(e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        ns.args = [*ns.args, *extra]
    return ns


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``flowrl`` console script.

    Args:
        argv: the arguments after ``flowrl``; None reads ``sys.argv``, and then ``flowrl train`` runs
            under :mod:`flowrl.supervisor` (a crash of the training process still ends in one line).
            An explicit ``argv`` always runs in this process and returns.

    Returns:
        The exit code: 0, 2 for a user error, 130 for Ctrl-C (supervised: the training process's code).
        One process of a multi-process launch run from the command line does not return: it leaves
        through :func:`flowrl.distributed.exit_launched_process` with that code.
    """
    from .supervisor import SUPERVISED_ENV, report_outcome, setup_child, should_supervise, supervise

    launched = argv is None and _launched()  # one of several processes: leave without finalization
    if argv is None:
        argv = sys.argv[1:]
        if should_supervise(argv, os.environ):
            return supervise(argv)
    if os.environ.get(SUPERVISED_ENV):
        setup_child()
    try:
        code = _run(argv)
    except SystemExit:
        raise  # a plugin's sys.exit(): not an outcome this process reported (argparse's are, in _run)
    except BaseException as err:
        report_outcome()
        if launched:
            _report_launched_failure(err)
            _leave(1)
        raise  # Python prints the traceback
    report_outcome()
    if launched:
        _leave(code)
    return code


def _launched() -> bool:
    """Whether this process is one of several of a distributed launch (torch is imported only then)."""
    if "WORLD_SIZE" not in os.environ:
        return False
    from .distributed import launch_world_size

    return launch_world_size() > 1


def _report_launched_failure(err: BaseException) -> None:
    """A launched process's unexpected error: one line when another rank's end caused it, else the traceback."""
    from .distributed import lost_peer_message

    line = lost_peer_message(err)
    if line is None or os.environ.get("FLOWRL_DEBUG"):
        traceback.print_exc()
    else:
        stderr_line(line)


def _leave(code: int) -> NoReturn:
    """End this launched process with ``code`` (:func:`flowrl.distributed.exit_launched_process`)."""
    from .distributed import exit_launched_process

    exit_launched_process(code)


def _run(argv: list[str]) -> int:
    """Parse ``argv`` and run the command; user errors become one ``flowrl: error:`` line."""
    try:
        if argv[:1] == ["pretrain-digits"]:  # its own parser owns every option, --help included
            ns = argparse.Namespace(func=cmd_pretrain_digits, args=argv[1:])
        else:
            ns = parse_command_line(build_parser(), argv)
    except SystemExit:
        from .supervisor import report_outcome

        report_outcome()  # argparse printed the usage or the help
        raise
    try:
        return ns.func(ns)
    except USER_ERRORS as err:
        if os.environ.get("FLOWRL_DEBUG"):
            raise
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        stderr_line(f"flowrl: error: {message}")
        return 2
    except OSError as err:  # a path the filesystem refuses (too long, no permission, read-only): name it
        if os.environ.get("FLOWRL_DEBUG") or err.errno is None:
            raise
        where = f" ({str(err.filename)[:120]})" if err.filename else ""
        stderr_line(f"flowrl: error: {err.strerror or err}{where}; check the path, or set FLOWRL_DEBUG=1 for a trace")
        return 2
    except KeyboardInterrupt as err:
        ignore_stop_signals()
        stderr_line(f"flowrl: {_stopped_by(err)}; checkpoints written so far are kept")
        return stop_code(err)


if __name__ == "__main__":
    sys.exit(main())
