"""What a resumed run is checked against: an uninterrupted reference run of the same config.

Used by ``bench/kill_resume.py`` (which also asks real ``tensorboard`` servers) and
``tests/core/test_kill_resume.py``. Every check takes the finished run's folder and the reference's
and returns ``"ok"`` or what differs (counts are returned as ints):

- weights and state: the final LoRA and the last checkpoint's LoRA, optimizer and RNG tensors,
  every tensor ``torch.equal``, and its ``trainer.json`` (the config's ``output.dir`` aside);
- metrics: ``metrics.jsonl`` parses line by line, has strictly increasing steps 0..N (each once)
  and equals the reference row by row outside ``NOT_STATE``;
- TensorBoard: the scalars as ``EventAccumulator``, as ``tensorboard --load_fast=false`` and as a
  replay of the raw events files give them;
- ``summary.json``: the start and end evaluation figures.
"""

from __future__ import annotations

import json
from pathlib import Path

from flowrl.resume import checkpoint_folders

NOT_STATE = ("time/", "prompt_cache/")  # wall times; the prompt cache is cold again after a restart


# -- metrics, weights, state -------------------------------------------------------------------


def last_checkpoint(ref: Path) -> str:
    """The reference's newest finished checkpoint, relative to the run (``checkpoints/iter-NNNNNN``)."""
    folders = checkpoint_folders(ref)
    if not folders:
        raise ValueError(f"{ref}: the reference run has no checkpoint; train it with train.save_every >= 1")
    return f"checkpoints/{folders[0].name}"


def _tensors_equal(a: Path, b: Path) -> str:
    import torch
    from safetensors.torch import load_file

    if not a.is_file():
        return f"{a.name} missing"
    x, y = load_file(str(a)), load_file(str(b))
    if x.keys() != y.keys():
        return f"{a.name}: keys differ"
    bad = [k for k in x if x[k].dtype != y[k].dtype or not torch.equal(x[k], y[k])]
    return f"{a.name}: {len(bad)} tensors differ (e.g. {bad[0]})" if bad else "ok"


def check_weights(run: Path, ref: Path) -> str:
    """Final LoRA and the last checkpoint's LoRA, every tensor exactly equal to the reference's."""
    last = last_checkpoint(ref)
    for name in ("lora/pytorch_lora_weights.safetensors", f"{last}/lora.safetensors"):
        result = _tensors_equal(run / name, ref / name)
        if result != "ok":
            return result
    return "ok"


def check_state(run: Path, ref: Path) -> str:
    """The last checkpoint's optimizer and RNG tensors and trainer.json (config's output.dir aside)."""
    last = last_checkpoint(ref)
    for name in ("optimizer.safetensors", "rng.safetensors"):
        result = _tensors_equal(run / last / name, ref / last / name)
        if result != "ok":
            return result
    mine, theirs = (json.loads((r / last / "trainer.json").read_text()) for r in (run, ref))
    for meta in (mine, theirs):
        meta["config"]["output"].pop("dir")
    return "ok" if mine == theirs else "trainer.json differs"


def metrics_rows(run: Path) -> tuple[list[dict], int]:
    """The rows of ``metrics.jsonl`` and the number of lines that do not parse."""
    rows, bad = [], 0
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            bad += 1
    return rows, bad


def _not_new(steps: list[int]) -> int:
    """How many steps are not above every step before them (a duplicate or an out-of-order step)."""
    seen, count = -1, 0
    for step in steps:
        count += step <= seen
        seen = max(seen, step)
    return count


def metrics_duplicates(run: Path) -> int:
    """Rows of ``metrics.jsonl`` whose step is not new (duplicates, or steps out of order), plus unparsable lines."""
    rows, bad = metrics_rows(run)
    return _not_new([row["step"] for row in rows]) + bad


def check_metrics(run: Path, ref: Path) -> str:
    """``metrics.jsonl`` equals the reference's row by row outside the wall-time and prompt-cache keys."""
    (rows, _), (ref_rows, _) = metrics_rows(run), metrics_rows(ref)
    steps = [r["step"] for r in rows]
    if steps != list(range(len(ref_rows))):
        return f"steps {steps}"

    def state(row: dict) -> dict:
        return {k: v for k, v in row.items() if not k.startswith(NOT_STATE)}

    diff = [r["step"] for r, q in zip(rows, ref_rows) if state(r) != state(q)]
    return f"rows differ at steps {diff}" if diff else "ok"


def tb_accumulated(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars per tag as TensorBoard's ``EventAccumulator`` gives them (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def tb_served_python(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars per tag as ``tensorboard --load_fast=false`` serves them (its ``plugin_event_accumulator``).

    That reader takes a run's first ``SessionLog.START`` as the start of the session and purges
    only at later ones.
    """
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    scalars = events.PluginTagToContent("scalars")  # eval sample grids are image tensors: not compared here
    return {
        tag: [(e.step, float(make_ndarray(e.tensor_proto).item())) for e in events.Tensors(tag)]
        for tag in events.Tags()["tensors"]
        if tag in scalars
    }


def tb_replayed(run: Path) -> tuple[dict[str, list[tuple[int, float]]], int, int]:
    """Scalars per tag replayed from the raw events files, in name order, with SessionLog.START purges.

    Returns:
        (tag -> [(step, value)], number of events files, scalar points that a reader ignoring
        the purge would show twice).
    """
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog

    files = sorted(p for p in (run / "tensorboard").iterdir() if ".tfevents." in p.name)
    series: dict[str, list[tuple[int, float]]] = {}
    raw: dict[str, list[int]] = {}
    for path in files:
        for record in RawEventFileLoader(str(path)).Load():  # the records as written, no migration
            event = Event.FromString(record)
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                for tag in series:
                    series[tag] = [(s, v) for s, v in series[tag] if s < event.step]
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    series.setdefault(value.tag, []).append((event.step, value.simple_value))
                    raw.setdefault(value.tag, []).append(event.step)
    doubled = sum(len(steps) - len(set(steps)) for steps in raw.values())
    return series, len(files), doubled


def tb_duplicates(series: dict[str, list[tuple[int, float]]]) -> int:
    """Points whose step is not new in their tag's series (a duplicate or an out-of-order step)."""
    return sum(_not_new([s for s, _ in points]) for points in series.values())


def compare_series(mine: dict, ref: dict) -> str:
    """``ok`` when every tag holds the reference's (step, value) points, else the first tag that differs."""
    if mine.keys() != ref.keys():
        return f"tags differ: {sorted(set(mine) ^ set(ref))[:3]}"
    for tag in sorted(ref):
        if tag.startswith(NOT_STATE):
            if [s for s, _ in mine[tag]] != [s for s, _ in ref[tag]]:
                return f"{tag}: steps {[s for s, _ in mine[tag]]}"
        elif mine[tag] != ref[tag]:
            return f"{tag}: {mine[tag]} != {ref[tag]}"
    return "ok"


def check_summary(run: Path, ref: Path) -> str:
    """``summary.json``'s start and end evaluation figures equal the reference's."""
    mine, theirs = (json.loads((r / "summary.json").read_text()) for r in (run, ref))
    for key in ("start", "end", "iterations", "samples_seen"):
        if mine[key] != theirs[key]:
            return f"summary {key} differs ({json.dumps(mine[key])[:60]})"
    return "ok"
