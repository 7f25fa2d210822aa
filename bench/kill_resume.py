"""Kill test: SIGKILL real ``flowrl train`` runs at random points and inside checkpoint writes, resume, compare.

Usage: ``python -m bench.kill_resume [--kills 20] [--seed 0] [--workdir DIR] [--no-tb-server]``.

A small run on the embedded model (``OVERRIDES``: 6 iterations, a checkpoint every iteration, an
evaluation every second one) is first trained once without interruption: the reference. Then
``--kills`` kills land, half at uniformly random times of the training phase (from the moment the
run (re)opens ``metrics.jsonl`` to its exit, so the final LoRA, grid and summary writes are
included) and half inside a checkpoint write: the ``checkpoints/iter-N.partial`` folder of a
random checkpoint is watched, a random 0-10 ms after it appears the whole process group is stopped
(SIGSTOP), the folder is checked to still be there, and the group is killed (SIGKILL), so the kill
provably lands inside the write (the files already in the folder are reported). Each run is
resumed with ``flowrl train --resume RUN`` until it finishes; a resumed run is itself killed again
in about a third of the trials. A run killed before its first checkpoint is started again with
``--overwrite``, as the ``--resume`` error asks. A kill that misses (the run finished first) is not
counted and is scheduled again.

Every finished run is compared with the reference:

- weights: ``lora/pytorch_lora_weights.safetensors`` and the last checkpoint's ``lora.safetensors``,
  every tensor ``torch.equal``; state: the last checkpoint's optimizer and RNG tensors and its
  ``trainer.json`` (the config's ``output.dir`` aside);
- metrics: ``metrics.jsonl`` parses line by line, has strictly increasing steps 0..N (each once)
  and equals the reference row by row outside ``time/*`` and ``prompt_cache/*`` (wall times, and
  a prompt cache that starts cold after a restart);
- TensorBoard: every resume opens a new events file in ``tensorboard/`` and writes a
  ``SessionLog.START`` at ``purge_step``. The scalars are read three ways: TensorBoard's
  ``EventAccumulator`` (purges at every START), the ``plugin_event_accumulator`` that
  ``tensorboard --load_fast=false`` serves from (takes a run's *first* START as the session's
  start and purges only at later ones), and a replay of the raw events files in name order with
  the purge applied here; each must give one value per step per tag, equal to the reference. At
  the end one real ``tensorboard`` server per backend (``--load_fast=false`` and
  ``--load_fast=true``, the Rust data server, which ignores START events and drops a tag's points
  at or after a step that comes again) serves every run over HTTP, and each run's scalars as
  served must equal the reference's;
- ``summary.json``'s start and end evaluation figures equal the reference's.

Prints one row per kill and the totals. The checks of a run's folder live in ``bench/resume_checks.py``
(the tests, ``tests/core/test_kill_resume.py``, import them and this module's launch helpers); the
tensorboard server check is here, beside the other process handling.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.resume_checks import (
    NOT_STATE,
    check_metrics,
    check_state,
    check_summary,
    check_weights,
    compare_series,
    metrics_duplicates,
    tb_accumulated,
    tb_duplicates,
    tb_replayed,
    tb_served_python,
)
from flowrl.local_launch import free_port
from flowrl.resume import checkpoint_folders

REPO = Path(__file__).resolve().parents[1]
ITERATIONS = 6
OVERRIDES = (
    "prompts.per_iteration=2",
    "prompts.group_size=2",
    "sampler.num_steps=2",
    f"train.iterations={ITERATIONS}",
    "train.save_every=1",
    "train.eval_every=2",
    "train.eval_seeds=1",
    "train.threads=1",
    "train.progress=false",
    "output.grid_seeds=1",
)
POLL_S = 0.0005


@dataclass
class Kill:
    """When to kill one launch.

    Attributes:
        kind: ``"random"`` (``delay_s`` after the run (re)opens ``metrics.jsonl``),
            ``"checkpoint"`` (``delay_s`` after ``checkpoints/iter-<target>.partial`` appears) or
            ``"final"`` (as soon as the last checkpoint is finished: while the final LoRA, grid
            and summary are written).
        u: a uniform draw in [0, 1) that sets ``delay_s`` (:func:`run_until_finished`).
        delay_s: see ``kind``.
        target: the checkpoint iteration to kill inside (``"checkpoint"``; 0: drawn at launch
            among the checkpoints the launch will write); when its write is over before the
            group is stopped, the next checkpoint's write is tried.
    """

    kind: str
    u: float = 0.0
    delay_s: float = 0.0
    target: int = 0


@dataclass
class Launch:
    """What one ``flowrl train`` process did.

    Attributes:
        command: ``"fresh"``, ``"overwrite"`` or ``"resume"``.
        returncode: the exit status (-9 when killed).
        killed: the kill landed (the process died of SIGKILL sent here).
        kill: the kill that was planned for this launch, if any.
        train_start_s: seconds from start until ``metrics.jsonl`` was (re)written (None: never).
        end_s: seconds from start until the process was gone.
        logged_step: the last step in ``metrics.jsonl`` when the process died.
        checkpoint: the newest finished checkpoint when the process died (None: none).
        partial: for a kill inside a write, ``iter-N.partial: files already there``.
        log: the launch's stdout and stderr.
    """

    command: str
    returncode: int
    killed: bool
    kill: Kill | None
    train_start_s: float | None
    end_s: float
    logged_step: int | None
    checkpoint: int | None
    partial: str | None
    log: Path


@dataclass
class Trial:
    """One run: its launches until it finished, and its comparison with the reference."""

    run: Path
    launches: list[Launch] = field(default_factory=list)
    checks: dict[str, str] = field(default_factory=dict)  # check name -> "ok" or what differs


# -- launching and killing --------------------------------------------------------------------


def train_command(run: Path, command: str) -> list[str]:
    """The ``python -m flowrl train`` command line of a launch (``fresh``, ``overwrite`` or ``resume``)."""
    cmd = [sys.executable, "-m", "flowrl", "train", *OVERRIDES, f"output.dir={run}"]
    if command == "resume":
        cmd += ["--resume", str(run)]
    elif command == "overwrite":
        cmd.append("--overwrite")
    return cmd


def checkpoints(run: Path) -> list[int]:
    """Iterations of the finished ``checkpoints/iter-N`` folders, oldest first (``.partial`` ones are not finished)."""
    return sorted(int(p.name.removeprefix("iter-")) for p in checkpoint_folders(run))


def _last_logged_step(run: Path) -> int | None:
    steps = []
    if (run / "metrics.jsonl").is_file():
        for line in (run / "metrics.jsonl").read_text().splitlines():
            try:
                steps.append(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                pass  # a row cut by the kill
    return steps[-1] if steps else None


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _reap_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Wait for the launch and every process of its group to be gone."""
    proc.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
    raise RuntimeError(f"process group {proc.pid} still alive {timeout:.0f} s after SIGKILL")


def _partial_state(folder: Path) -> str | None:
    try:
        names = sorted(p.name for p in folder.iterdir())
    except FileNotFoundError:
        return None
    short = [n.removesuffix(".safetensors").removesuffix(".json").removesuffix("izer") for n in names]
    return f"{folder.name.removeprefix('iter-')}: {','.join(short) if short else 'empty'}"


def launch(run: Path, command: str, kill: Kill | None, log: Path, timeout: float = 600.0) -> Launch:
    """Start one ``flowrl train`` process in its own session and kill its whole group as ``kill`` says.

    A checkpoint kill stops the group (SIGSTOP) first and sends SIGKILL only while the
    ``.partial`` folder is still there, so it provably lands inside the write; when the write
    finished before the stop, the group continues and the next checkpoint's write is tried.

    Args:
        run: the run folder.
        command: ``fresh``, ``overwrite`` or ``resume``.
        kill: when to kill (None: let it finish).
        log: file for the process's stdout and stderr.
        timeout: seconds before the launch is killed and reported as failed.

    Returns:
        What happened (:class:`Launch`).
    """
    base_inode = _inode(run / "metrics.jsonl")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            train_command(run, command), cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    pgid = proc.pid
    train_start = partial_seen = None
    target = kill.target if kill else 0
    delay = kill.delay_s if kill else 0.0
    killed, partial = False, None
    try:
        while proc.poll() is None:
            now = time.perf_counter() - t0
            if now > timeout:
                _signal_group(pgid, signal.SIGKILL)
                break
            if train_start is None and _inode(run / "metrics.jsonl") not in (None, base_inode):
                train_start = now
            if kill is not None and kill.kind == "random" and train_start is not None:
                if now >= train_start + kill.delay_s:
                    _signal_group(pgid, signal.SIGKILL)
                    killed = True
                    break
            if kill is not None and kill.kind == "final" and (run / "checkpoints" / f"iter-{ITERATIONS:06d}").is_dir():
                _signal_group(pgid, signal.SIGKILL)
                killed = True
                break
            if kill is not None and kill.kind == "checkpoint":
                folder = run / "checkpoints" / f"iter-{target:06d}.partial"
                if partial_seen is None and folder.is_dir():
                    partial_seen = now
                if partial_seen is not None and now >= partial_seen + delay:
                    _signal_group(pgid, signal.SIGSTOP)
                    partial = _partial_state(folder)
                    if partial is not None:  # still writing: the kill lands inside the write
                        _signal_group(pgid, signal.SIGKILL)
                        killed = True
                        break
                    _signal_group(pgid, signal.SIGCONT)  # that write was over; try the next one
                    target, partial_seen, delay = target + 1, None, delay / 2
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None and not killed:
            _signal_group(pgid, signal.SIGKILL)
        _reap_group(proc)
    return Launch(
        command=command,
        returncode=proc.returncode,
        killed=killed and proc.returncode == -signal.SIGKILL,
        kill=kill,
        train_start_s=train_start,
        end_s=time.perf_counter() - t0,
        logged_step=_last_logged_step(run),
        checkpoint=(checkpoints(run) or [None])[-1],
        partial=partial,
        log=log,
    )


def run_until_finished(
    run: Path, kills: list[Kill], logs: Path, train_s: float, rng: random.Random, max_launches: int = 8
) -> Trial:
    """Launch, kill and resume one run until a launch finishes (exit code 0).

    The n-th launch gets the n-th kill. A launch after a kill resumes with ``--resume RUN``, or
    starts again with ``--overwrite`` when the run has no finished checkpoint yet.

    Args:
        run: the run folder (must not exist yet).
        kills: the kills, in launch order.
        logs: folder for the launches' output.
        train_s: the reference's training phase in seconds; a random kill of a launch that
            resumes from checkpoint k waits ``u * train_s * (N - k) / N``.
        rng: draws a checkpoint kill's target when it is 0.
        max_launches: give up after that many.

    Raises:
        RuntimeError: a launch failed on its own (not killed), or the run did not finish.
    """
    trial = Trial(run)
    pending = list(kills)
    for n in range(max_launches):
        if n == 0:
            command = "fresh"
        else:
            command = "resume" if checkpoints(run) else "overwrite"
        kill = pending.pop(0) if pending else None
        start = (checkpoints(run) or [0])[-1] if command == "resume" else 0
        if kill is not None and kill.kind == "random":
            kill.delay_s = kill.u * train_s * (ITERATIONS - start) / ITERATIONS
        if kill is not None and kill.kind == "checkpoint":
            kill.delay_s = kill.u * 0.01  # a write lasts about 15-30 ms here (fsyncs); halved on each retry
            if kill.target == 0:
                kill.target = rng.randint(start + 1, ITERATIONS) if start < ITERATIONS else ITERATIONS + 1
        done = launch(run, command, kill, logs / f"{run.name}-{n}.log")
        trial.launches.append(done)
        if done.returncode == 0:
            return trial
        if not done.killed:
            tail = done.log.read_text()[-2000:]
            raise RuntimeError(f"{run}: launch {n} ({command}) exited {done.returncode}:\n{tail}")
    raise RuntimeError(f"{run}: not finished after {max_launches} launches")


# -- comparing with the reference ---------------------------------------------------------------


def compare(trial: Trial, ref: Path) -> Trial:
    """Fill ``trial.checks``: weights, state, metrics, TensorBoard and summary against the reference."""
    run = trial.run
    ref_tb = tb_accumulated(ref)
    accumulated = tb_accumulated(run)
    replayed, files, doubled = tb_replayed(run)
    served = tb_served_python(run)
    trial.checks = {
        "weights": check_weights(run, ref),
        "state": check_state(run, ref),
        "metrics_dups": str(metrics_duplicates(run)),
        "metrics": check_metrics(run, ref),
        "tb_dups": str(tb_duplicates(accumulated) + tb_duplicates(replayed) + tb_duplicates(served)),
        "tb": compare_series(accumulated, ref_tb),
        "tb_replayed": compare_series(replayed, ref_tb),
        "tb_served_python": compare_series(served, ref_tb),
        "tb_files": str(files),
        "tb_raw_doubled": str(doubled),
        "summary": check_summary(run, ref),
    }
    return trial


# -- the tensorboard server ------------------------------------------------------------------


def _get(url: str) -> object:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def served_scalars(logdir: Path, runs: list[str], tags: list[str], load_fast: bool, wait_s: float = 120) -> dict:
    """Scalars as a real ``tensorboard`` server serves them: run -> tag -> [(step, value)].

    Polls until two reads a second apart agree and every run has every tag.
    """
    port = free_port()
    cmd = [
        str(Path(sys.executable).with_name("tensorboard")),
        f"--logdir={logdir}",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--load_fast={'true' if load_fast else 'false'}",
        "--reload_interval=1",
    ]
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            previous, deadline = None, time.monotonic() + wait_s
            while time.monotonic() < deadline:
                time.sleep(1)
                try:
                    current = {
                        run: {
                            tag: [
                                (int(step), float(value))
                                for _, step, value in _get(
                                    f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?"
                                    + urllib.parse.urlencode({"run": run, "tag": tag})
                                )
                            ]
                            for tag in tags
                        }
                        for run in runs
                    }
                except OSError:
                    continue  # not listening yet, or a run or tag not loaded yet (HTTP 400)
                if current == previous:
                    return current
                previous = current
            out.seek(0)
            raise RuntimeError(f"tensorboard (load_fast={load_fast}) did not settle:\n{out.read()[-2000:].decode()}")
        finally:
            _signal_group(proc.pid, signal.SIGKILL)  # the rust data server runs as a child of tensorboard
            proc.wait()


def check_served(workdir: Path, ref: Path, trials: list[Trial]) -> dict[str, dict[str, str]]:
    """Every trial's scalars from a real tensorboard server, per backend, against the reference's."""
    ref_tb = tb_accumulated(ref)
    tags = sorted(t for t in ref_tb if not t.startswith(NOT_STATE))
    runs = [str((t.run / "tensorboard").relative_to(workdir)) for t in trials]
    ref_run = str((ref / "tensorboard").relative_to(workdir))
    results: dict[str, dict[str, str]] = {}
    for name, load_fast in (("python", False), ("rust", True)):
        served = served_scalars(workdir, [ref_run, *runs], tags, load_fast)
        want = served[ref_run]
        if want != {tag: ref_tb[tag] for tag in tags}:
            raise RuntimeError(f"tensorboard ({name}) serves the reference differently from EventAccumulator")
        for trial, run in zip(trials, runs):
            got = served[run]
            dups = tb_duplicates(got)
            results.setdefault(str(trial.run), {})[name] = (
                "ok" if got == want and not dups else f"{dups} duplicates, equal={got == want}"
            )
    return results


# -- the bench ---------------------------------------------------------------------------------


def _yes(check: str) -> str:
    return "yes" if check == "ok" else f"NO ({check})"


def plan_kinds(kills: int, rng: random.Random) -> list[str]:
    """Half ``random``, half ``checkpoint`` kills (the odd one random), shuffled."""
    kinds = ["random"] * (kills - kills // 2) + ["checkpoint"] * (kills // 2)
    rng.shuffle(kinds)
    return kinds


def main(argv: list[str] | None = None) -> int:
    """Run the bench; exit status 1 when any run differs from the reference."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--no-tb-server", action="store_true", help="skip the tensorboard server check")
    args = parser.parse_args(argv)
    logging.getLogger("tensorboard").setLevel(logging.ERROR)  # EventAccumulator's note on each purge
    rng = random.Random(args.seed)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kill_resume-"))
    workdir.mkdir(parents=True, exist_ok=True)
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    t_bench = time.perf_counter()

    ref = workdir / "reference"
    reference = launch(ref, "fresh", None, logs / "reference.log")
    if reference.returncode != 0 or reference.train_start_s is None:
        raise SystemExit(f"reference run failed ({reference.returncode}), see {reference.log}")
    train_s = reference.end_s - reference.train_start_s
    print(f"reference: {reference.end_s:.1f} s, training phase {train_s:.1f} s; workdir {workdir}", flush=True)

    queue = plan_kinds(args.kills, rng)
    trials: list[Trial] = []
    landed = 0
    while queue:
        chain = [queue.pop(0)]
        if queue and rng.random() < 0.35:
            chain.append(queue.pop(0))  # the resumed run is killed too
        kills = [Kill(kind, rng.random()) for kind in chain]
        if kills[0].kind == "checkpoint":
            kills[0].target = rng.randint(1, ITERATIONS)
        trial = run_until_finished(workdir / f"trial-{len(trials) + 1:02d}", kills, logs, train_s, rng)
        landed_kills = [ln.kill for ln in trial.launches if ln.killed]
        queue.extend(k.kind for k in kills if not any(k is x for x in landed_kills))  # missed: scheduled again
        compare(trial, ref)
        trials.append(trial)
        for n, ln in enumerate(trial.launches):
            if ln.killed:
                landed += 1
                _print_row(landed, len(trials), n, ln, trial)

    served = {} if args.no_tb_server else check_served(workdir, ref, trials)
    return _report(trials, served, args, time.perf_counter() - t_bench)


HEADER = (
    f"{'kill':>4} {'trial':>5} {'launch':<10} {'when':<10} {'delay':>7} {'at kill':<14} {'in write (files there)':<38} "
    f"{'resumes':>7} {'weights':<7} {'state':<5} {'m.dup':>5} {'m=ref':<5} {'tb.dup':>6} {'tb=ref':<6} "
    f"{'files':>5} {'summary'}"
)


def _print_row(k: int, t: int, n: int, ln: Launch, trial: Trial) -> None:
    if k == 1:
        print(HEADER)
    c = trial.checks
    resumes = sum(1 for x in trial.launches if x.command == "resume")
    at = f"step {ln.logged_step if ln.logged_step is not None else '-'} ck {ln.checkpoint or '-'}"
    when = ln.kill.kind if ln.kill else "-"
    delay = f"{ln.kill.delay_s * (1000 if when == 'checkpoint' else 1):.1f}{'ms' if when == 'checkpoint' else 's'}"
    tb_ok = c["tb"] == "ok" and c["tb_replayed"] == "ok" and c["tb_served_python"] == "ok"
    print(
        f"{k:>4} {t:>5} {f'{n}:{ln.command}':<10} {when:<10} {delay:>7} {at:<14} {ln.partial or '-':<38} "
        f"{resumes:>7} {'yes' if c['weights'] == 'ok' else 'NO':<7} {'yes' if c['state'] == 'ok' else 'NO':<5} "
        f"{c['metrics_dups']:>5} {'yes' if c['metrics'] == 'ok' else 'NO':<5} {c['tb_dups']:>6} "
        f"{'yes' if tb_ok else 'NO':<6} {c['tb_files']:>5} {_yes(c['summary'])}",
        flush=True,
    )


def _report(trials: list[Trial], served: dict, args: argparse.Namespace, wall: float) -> int:
    rows = [(t, ln) for t in trials for ln in t.launches if ln.killed]
    n = len(rows)
    problems = [
        f"{t.run.name}: {name}: {value}"
        for t in trials
        for name, value in t.checks.items()
        if name in ("weights", "state", "metrics", "tb", "tb_replayed", "tb_served_python", "summary") and value != "ok"
    ]
    for run, backends in served.items():
        problems += [f"{Path(run).name}: tensorboard server ({b}): {v}" for b, v in backends.items() if v != "ok"]

    def count(ok) -> int:
        return sum(1 for t, _ in rows if ok(t))

    weights = count(lambda t: t.checks["weights"] == "ok" and t.checks["state"] == "ok")
    metrics = count(lambda t: t.checks["metrics_dups"] == "0" and t.checks["metrics"] == "ok")
    tb = count(
        lambda t: (
            t.checks["tb_dups"] == "0"
            and t.checks["tb"] == "ok"
            and t.checks["tb_replayed"] == "ok"
            and t.checks["tb_served_python"] == "ok"
            and all(v == "ok" for v in served.get(str(t.run), {}).values())
        )
    )
    summary = count(lambda t: t.checks["summary"] == "ok")
    in_write = sum(1 for _, ln in rows if ln.partial)
    files = [int(t.checks["tb_files"]) for t in trials]
    doubled = sum(int(t.checks["tb_raw_doubled"]) for t in trials)
    print()
    print(
        f"{n} kills in {len(trials)} runs ({sum(1 for _, ln in rows if ln.kill.kind == 'random')} at random times, "
        f"{in_write} inside a checkpoint write), seed {args.seed}, wall time {wall:.0f} s"
    )
    print(
        f"tensorboard: {min(files)}-{max(files)} events files per run (one per launch); {doubled} scalar points "
        "in all would be doubled by a reader that ignored the purge"
        + (f"; served by tensorboard (python and rust backends): {len(served)} runs checked" if served else "")
    )
    for line in problems:
        print("problem:", line)
    print(
        f"exact final weights: {weights}/{n}; metrics free of duplicates: {metrics}/{n}; "
        f"tensorboard free of duplicates: {tb}/{n}; summary.json as the reference: {summary}/{n}"
    )
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
