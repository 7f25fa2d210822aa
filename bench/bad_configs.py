"""Config fuzzer: mutated configs through the real ``flowrl train`` path, up to the point where training starts.

Usage: ``HF_HUB_OFFLINE=1 python -m bench.bad_configs [--cases 240] [--seed 0] [--timeout 60] [--jobs 2]``.

Bases: the default config and every flowrl config under ``configs/`` (presets stacked on nothing).
Each case mutates one base deterministically (seeded): extreme numbers, negatives, zero, 1e9,
NaN / inf, wrong types, bad strings, bad devices, unknown keys, duplicated YAML keys, nested wrong
types, reward weights, objective fields, odd model folders. Every case then runs, in a forked
child with a timeout, exactly what ``flowrl train`` does before its first iteration:
``load_config``, :func:`flowrl.resources.check_machine` and ``Run(cfg)`` (model, rewards, prompts,
trainer built), with the CLI's own error handling (:data:`flowrl.cli.USER_ERRORS`). Nothing is trained.

Outcomes: ``clean`` (a user error with a one-line message: what ``flowrl: error:`` prints),
``accepted`` (the run was ready to train), ``multi-line`` (a user error whose message spans lines;
the CLI would print its first line only), ``traceback`` (any other exception) and ``hang`` (the
timeout). The target is 0 tracebacks and 0 hangs; every non-clean, non-accepted case is listed.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import multiprocessing as mp
import random
import resource
import sys
import tempfile
import time
import traceback
import typing
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
MEMORY_LIMIT = 16 * 2**30  # address-space limit of a case's child process

INT_VALUES = ["0", "-1", "1000000000", "1e9", "1000000000000000000000", ".nan", ".inf", "abc", "[1, 2]", "{a: 1}"]
INT_VALUES += ["true", "2.5", "null", "-1000000000", "1", "2", "1000", "16384"]  # edges that pass the config
FLOAT_VALUES = ["0", "-1", "1.0e300", "-1.0e300", "1e9", ".nan", ".inf", "-.inf", "abc", "[1]", "true", "1e-300"]
FLOAT_VALUES += ["null", "1.0e9", "{x: 1}", "1", "0.5", "100"]
BOOL_VALUES = ["2", "maybe", "[true]", "null", "0", "'true'"]
STR_VALUES = ["''", "nosuch", "123", "[a]", "{a: b}", "null", "x" * 300, "../../etc/passwd", "'   '", '"a\\0b"']
INT_LIST_VALUES = ["[]", "[1000000000]", "[-1]", "[a]", "3", "[[1]]", "[.nan]", "[0, 0, 0]", "[5, 2]"]
FLOAT_LIST_VALUES = ["[]", "[.nan, 1]", "[0.9, 0.3]", "[-1, 0.5]", "abc", "[1e9, 1e9]", "[0.1]", "[.inf, 1]"]
DEVICE_VALUES = ["gpu", "cuda:7", "cuda", "mps", "cuda:-1", "CPU", "xla", "meta", "cpu:0", "''", "7", "cuda:0:1"]
DEVICE_VALUES += ["mps:1", "[cuda]"]
NESTED = [
    "model=3",
    "sampler.tree=5",
    "rewards=[1]",
    "rewards.ink=3",
    "objective=[1]",
    "objective.name=nosuch",
    "prompts=null",
    "train=[]",
    "memory=abc",
    "optim={lr: {x: 1}}",
    "model.path.x=1",
    "rewards.ink.weight.x=1",
]
UNKNOWN = ["bogus=1", "model.bogus=1", "sampler.tree.bogus=1", "objective.bogus=1", "rewards.nosuch.weight=1"]
UNKNOWN += ["train.iteration=5", "rewards.ink.bogus_option=1", "=3", "model.=1", ".x=1"]
REWARD_VALUES = ["1.0e300", "-1.0e9", ".nan", ".inf", "abc", "[1]", "true", "1e7", "-1e6", "0"]


class Case(NamedTuple):
    """One mutated config: files and overrides as on the command line, and a label."""

    label: str
    files: list[str]
    overrides: list[str]


class Outcome(NamedTuple):
    """What ``flowrl train`` made of a case."""

    kind: str  # clean | accepted | multi-line | traceback | hang
    detail: str


# -- the key catalogue --------------------------------------------------------------------------


def leaf_keys() -> list[tuple[str, Any]]:
    """Every dotted config key with its annotation (dataclass sections walked recursively)."""
    from flowrl.config import Config

    def walk(cls: type, prefix: str) -> list[tuple[str, Any]]:
        hints, out = typing.get_type_hints(cls), []
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                out += walk(tp, f"{prefix}{f.name}.")
            elif typing.get_origin(tp) is not dict:
                out.append((prefix + f.name, tp))
        return out

    return walk(Config, "")


def values_for(key: str, tp: Any) -> list[str]:
    """The mutation values that fit a key's annotation."""
    text = str(tp)
    if key.endswith("device"):
        return DEVICE_VALUES
    if "list[int]" in text:
        return INT_LIST_VALUES
    if "list[float]" in text:
        return FLOAT_LIST_VALUES
    if tp is bool or text.startswith("bool"):
        return BOOL_VALUES
    if "float" in text:
        return FLOAT_VALUES
    if "int" in text:
        return INT_VALUES
    return STR_VALUES


def objective_fields(name: str) -> list[tuple[str, Any]]:
    """The objective's own fields (``objective.<field>``), with annotations."""
    from flowrl.objectives import OBJECTIVES

    cls = OBJECTIVES.get(name)
    if cls is None:
        return []
    hints = typing.get_type_hints(cls)
    return [(f"objective.{f.name}", hints[f.name]) for f in dataclasses.fields(cls) if f.name != "name"]


def bases() -> list[tuple[str, list[str], dict[str, Any]]]:
    """(label, files, loaded config as a dict) for the default config and every flowrl config that loads."""
    from flowrl.config import ConfigError, load_config, to_dict

    out = [("default", [], to_dict(load_config()))]
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        rel = str(path.relative_to(ROOT))
        try:
            out.append((rel, [rel], to_dict(load_config(path))))
        except ConfigError:
            continue  # not a flowrl config (e.g. an accelerate config)
    return out


# -- case generation --------------------------------------------------------------------------------


def _yaml_case(rng: random.Random, label: str, files: list[str], tmp: Path, i: int) -> Case:
    """A YAML file with a duplicated key or a nested wrong type, stacked on the base."""
    texts = [
        "optim:\n  lr: 0.001\n  lr: 0.1\n",
        "sampler:\n  num_steps: 5\nsampler:\n  chunk_size: 3\n",
        "sampler: 3\n",
        "rewards:\n  ink: {weight: 1}\n  ink: {weight: 2}\n",
        "model:\n  resolution: {h: 8}\n",
        "- just\n- a list\n",
        "train:\n  iterations: [1, 2\n",
        "objective:\n  name: flow_grpo\n  kl_beta: .nan\n",
        "prompts: {per_iteration: 1000000000}\n",
        "\t bad: indentation\n",
    ]
    path = tmp / f"case-{i}.yaml"
    path.write_text(rng.choice(texts))
    return Case(f"{label}: YAML {path.read_text()[:40]!r}", [*files, str(path)], [])


def _model_path_case(rng: random.Random, label: str, files: list[str], tmp: Path, i: int) -> Case:
    """``model.path`` at a folder with an odd ``model_index.json``, a file, or nothing."""
    folder = tmp / f"model-{i}"
    folder.mkdir()
    index = rng.choice(["[1, 2]", '{"_class_name": 3}', '{"_class_name": "NoSuchPipeline"}', "not json", "{}"])
    (folder / "model_index.json").write_text(index)
    target = rng.choice([str(folder), str(folder / "model_index.json"), str(tmp / "absent"), "owner/not-cached"])
    return Case(f"{label}: model.path -> {index!r} / {Path(target).name}", files, [f"model.path={target}"])


def make_case(rng: random.Random, base: tuple[str, list[str], dict[str, Any]], keys, tmp: Path, i: int) -> Case:
    """One deterministic mutation of ``base``."""
    label, files, data = base
    family = rng.choices(
        ["key", "device", "unknown", "nested", "reward", "objective", "yaml", "model_path", "pair"],
        weights=[40, 8, 7, 7, 8, 10, 6, 4, 10],
    )[0]
    if family == "yaml":
        return _yaml_case(rng, label, files, tmp, i)
    if family == "model_path":
        return _model_path_case(rng, label, files, tmp, i)
    if family == "device":
        key = rng.choice(["model.device", *(f"rewards.{r}.device" for r in data["rewards"])])
        return Case(label, files, [f"{key}={rng.choice(DEVICE_VALUES)}"])
    if family == "unknown":
        return Case(label, files, [rng.choice(UNKNOWN)])
    if family == "nested":
        return Case(label, files, [rng.choice(NESTED)])
    if family == "reward":
        name = rng.choice(list(data["rewards"]))
        return Case(label, files, [f"rewards.{name}.weight={rng.choice(REWARD_VALUES)}"])
    pool = objective_fields(data["objective"]["name"]) if family == "objective" else keys
    picks = rng.sample(pool, 2) if family == "pair" else [rng.choice(pool)]
    return Case(label, files, [f"{k}={rng.choice(values_for(k, tp))}" for k, tp in picks])


def user_findings() -> list[Case]:
    """The mutations of the user report on issue 13 item 4 (always tried)."""
    overrides = [
        "model.device=gpu",
        "model.device=cuda:7",
        "model.resolution=1000000",
        "train.threads=1000000",
        "prompts.per_iteration=1000000000",
        "prompts.group_size=1000000000",
        "sampler.num_steps=1000000000",
        "train.eval_seeds=1000000000",
        "lora.rank=1000000",
        "rewards.ink.weight=1.0e300",
    ]
    return [Case("default (user finding)", [], [o]) for o in overrides]


def make_cases(n: int, seed: int, tmp: Path) -> list[Case]:
    """The user's findings, the unmodified bases (healthy), then ``n`` seeded mutations."""
    rng = random.Random(seed)
    all_bases, keys = bases(), leaf_keys()
    cases = user_findings() + [Case(f"{label} (unmodified)", files, []) for label, files, _ in all_bases]
    for i in range(n):
        cases.append(make_case(rng, rng.choice(all_bases), keys, tmp, i))
    return cases


# -- running one case as `flowrl train` does, up to the first iteration ------------------------------


def prepare_run(case: Case, out_dir: Path) -> None:
    """What ``flowrl train FILES OVERRIDES --output OUT_DIR`` does before training: config, machine, Run."""
    from flowrl.config import load_config
    from flowrl.recipe import Run
    from flowrl.resources import check_machine

    cfg = load_config(case.files or None, case.overrides)
    cfg.output.dir = str(out_dir)
    check_machine(cfg)  # Run calls it too once wired; the CLI path is the same either way
    run = Run(cfg, overwrite=True)
    run.trainer.close()


def _child(case: Case, out_dir: Path, conn: Any) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    from flowrl.cli import USER_ERRORS

    sink = io.StringIO()
    try:
        with redirect_stdout(sink), redirect_stderr(sink):
            prepare_run(case, out_dir)
        result = Outcome("accepted", "")
    except USER_ERRORS as err:
        message = str(err)
        kind = "clean" if message and "\n" not in message else "multi-line"
        result = Outcome(kind, f"{type(err).__name__}: {message}")
    except BaseException as err:  # noqa: BLE001 - the point is to catch what the CLI would not
        tb = traceback.format_exception(err)
        result = Outcome("traceback", f"{type(err).__name__}: {str(err)[:300]} | {tb[-2].strip()[:300]}")
    conn.send(result)
    conn.close()


def run_case(case: Case, timeout: float, tmp: Path, i: int) -> Outcome:
    """Run one case in a forked child; a child still running after ``timeout`` s is a hang."""
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(case, tmp / f"run-{i}", send))
    proc.start()
    send.close()
    result = receive.recv() if receive.poll(timeout) else Outcome("hang", f"still running after {timeout:g} s")
    proc.join(1)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return result


def _preload() -> None:
    """Import what every case needs once, so forked children start warm.

    The repository root leaves ``sys.path`` first: ``python -m`` puts it there, and its ``kernels/``
    folder would then shadow the Hugging Face ``kernels`` package that diffusers probes for.
    """
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    import torch
    from diffusers import StableDiffusion3Pipeline  # noqa: F401 - loaded by every case that builds a model

    import flowrl.cli  # noqa: F401
    import flowrl.recipe  # noqa: F401
    import flowrl.resources  # noqa: F401

    torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> int:
    """Generate the cases, run them (``--jobs`` at a time), print the table and every bad case."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=240, help="seeded mutations (on top of the fixed cases)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case before it counts as a hang")
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once")
    ap.add_argument("--show", type=int, default=8, help="clean messages to print as examples")
    args = ap.parse_args(argv)
    _preload()
    from concurrent.futures import ThreadPoolExecutor

    with tempfile.TemporaryDirectory(prefix="flowrl-bad-configs-") as tmp:
        cases = make_cases(args.cases, args.seed, Path(tmp))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.jobs) as pool:
            outcomes = list(pool.map(lambda ic: run_case(ic[1], args.timeout, Path(tmp), ic[0]), enumerate(cases)))
        wall = time.perf_counter() - t0
    report(cases, outcomes, wall, args)
    return 0 if not any(o.kind in ("traceback", "hang") for o in outcomes) else 1


def report(cases: list[Case], outcomes: list[Outcome], wall: float, args: argparse.Namespace) -> None:
    """Print the outcome table, every traceback / hang / multi-line case, and a few clean messages."""
    kinds = ["clean", "accepted", "multi-line", "traceback", "hang"]
    counts = {k: sum(o.kind == k for o in outcomes) for k in kinds}
    print(f"bench.bad_configs: seed {args.seed}, {len(cases)} cases, {wall:.0f} s, timeout {args.timeout:g} s")
    print("| tried | clean one-line error | accepted (healthy) | multi-line error | traceback | hang |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {len(cases)} | " + " | ".join(str(counts[k]) for k in kinds) + " |")
    for case, out in zip(cases, outcomes):
        if out.kind in ("multi-line", "traceback", "hang"):
            print(f"{out.kind}: {case.label} {case.overrides}: {out.detail}")
    clean = [(c, o) for c, o in zip(cases, outcomes) if o.kind == "clean"]
    for case, out in random.Random(args.seed).sample(clean, min(args.show, len(clean))):
        print(f"example: {case.label} {case.overrides} -> {out.detail[:220]}")
    accepted = [f"{c.label} {c.overrides}" for c, o in zip(cases, outcomes) if o.kind == "accepted"]
    print(f"accepted: {'; '.join(accepted)}")


if __name__ == "__main__":
    sys.exit(main())
