"""Guards, monitors and logging in real runs of a tiny SD3 pipeline (resolution-free, rewards set explicitly)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from flowrl.cli import main

SMALL = [
    "prompts.per_iteration=2",
    "prompts.group_size=4",
    "sampler.num_steps=2",
    "sampler.chunk_size=8",
    "train.eval_every=1",
    "train.eval_seeds=2",
    "train.threads=1",
    "train.progress=false",
    "output.grid_seeds=1",
    "objective.kl_beta=0",
    "objective.clip_range=0.2",
]
# the trained reward dims the images ("thin" = 1 - mean intensity); the guard reads their brightness
HACKING = [
    "optim.lr=0.3",
    "guards.bright.reward=ink",
    "guards.bright.target=bold",
    "guards.bright.tolerance=0.005",
    "guards.diversity.tolerance=0.9",
    "guards.diversity.relative=true",
]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Path:
    from conftest import tiny_sd3_pipeline

    folder = tmp_path_factory.mktemp("tiny") / "sd3"
    tiny_sd3_pipeline().save_pretrained(str(folder))
    # a config file's rewards replace the defaults whole (an override would merge with them)
    (folder.parent / "thin.yaml").write_text("rewards:\n  ink: {target: thin}\n")
    return folder


def _train(pipeline: Path, out: Path, *extra: str) -> int:
    config = str(pipeline.parent / "thin.yaml")
    return main(["train", config, *SMALL, f"model.path={pipeline}", f"output.dir={out}", *extra])


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.fixture(scope="module")
def hacked(pipeline, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hacked") / "run"
    assert _train(pipeline, out, *HACKING, "train.iterations=6", "guards.bright.on_trip=stop") == 0
    return out


def test_guard_stops_a_hacking_run_and_keeps_the_best_guard_lora(hacked, pipeline, capsys, tmp_path):
    guards = _summary(hacked)["guards"]
    trip = guards["trips"][0]
    assert trip["name"] == "bright" and trip["value"] < trip["best"] - 0.005
    assert guards["stopped"].startswith("guard 'bright' fell from its best")
    assert _summary(hacked)["iterations"] == trip["iteration"] < 6  # stopped at the evaluation that tripped
    kept = hacked / "checkpoints" / "best-guard"
    meta = json.loads((kept / "guard.json").read_text())
    assert meta["iteration"] == guards["kept_iteration"] < trip["iteration"]
    assert meta["metrics"]["guard/bright"] >= trip["best"] - 0.005
    assert load_file(str(kept / "pytorch_lora_weights.safetensors"))  # diffusers layout
    rows = [json.loads(line) for line in (hacked / "metrics.jsonl").read_text().splitlines()]
    assert all({"guard/bright", "guard/diversity", "eval/drift", "eval/diversity"} <= set(r) for r in rows)
    assert rows[0]["eval/drift"] == 0.0 and rows[-1]["eval/drift"] > 0  # the base model's own samples: no drift
    # `flowrl sample` loads the kept LoRA
    png = tmp_path / "kept.png"
    args = ["sample", f"model.path={pipeline}", "sampler.num_steps=2", "--lora", str(kept), "--out", str(png)]
    assert main([*args, "--prompt", "a thin 3", "--seeds", "2"]) == 0 and png.is_file()


def test_samples_are_logged_as_images(hacked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = _summary(hacked)["iterations"]
    assert sorted(p.name for p in (hacked / "samples").iterdir()) == [f"iter-{i:06d}.png" for i in range(steps + 1)]
    events = EventAccumulator(str(hacked / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert [e.step for e in events.Images("eval/samples")] == list(range(steps + 1))
    assert (hacked / "reward_curve.png").is_file()


def test_healthy_run_does_not_trip(pipeline, tmp_path, capsys):
    out = tmp_path / "run"
    healthy = [*HACKING, "optim.lr=1e-5", "guards.bright.on_trip=stop"]
    assert _train(pipeline, out, *healthy, "train.iterations=3", "output.image_every=0") == 0
    guards = _summary(out)["guards"]
    assert guards["trips"] == [] and guards["stopped"] is None and guards["kept_iteration"] == 3
    assert _summary(out)["iterations"] == 3 and not (out / "samples").exists()
    assert "guard" not in capsys.readouterr().err


def test_resume_keeps_guard_state(pipeline, tmp_path):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    common = [*HACKING, "train.save_every=1"]
    assert _train(pipeline, straight, *common, "train.iterations=4") == 0
    assert _train(pipeline, cut, *common, "train.iterations=2") == 0
    state = json.loads((cut / "checkpoints" / "iter-000002" / "trainer.json").read_text())["heldout"]
    assert set(state["best"]) == {"bright", "diversity"}
    assert _train(pipeline, cut, *common, "train.iterations=4", "--resume", str(cut)) == 0
    a, b = _summary(straight)["guards"], _summary(cut)["guards"]
    assert a == b and a["trips"]  # the same best values, trips (warned once) and kept evaluation


def test_guard_tolerance_may_change_on_resume(pipeline, tmp_path):
    from flowrl.config import load_config, to_dict
    from flowrl.resume import check_resume_config

    config = pipeline.parent / "thin.yaml"
    saved = to_dict(load_config(config, HACKING))
    check_resume_config(saved, to_dict(load_config(config, [*HACKING, "guards.bright.tolerance=0.5"])))
    with pytest.raises(ValueError, match="guards.bright.target changed"):  # (target=thin would be the trained reward)
        check_resume_config(saved, to_dict(load_config(config, [*HACKING, "guards.bright.target=prompt"])))


def test_wandb_enabled_but_missing_is_one_line(pipeline, tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as when not installed
    assert _train(pipeline, tmp_path / "run", "output.wandb=true", "train.iterations=1") == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "flowrl: error: output.wandb is true but wandb is not installed: `pip install wandb`, or set "
        "output.wandb=false (TensorBoard logs either way)"
    )
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_wandb_offline_receives_the_rows_and_images(pipeline, tmp_path, monkeypatch):
    """The real wandb package (in the dev extra), offline: a run writes its wandb files beside its metrics."""
    wandb = pytest.importorskip("wandb", reason="wandb is in the dev extra: pip install -e '.[dev]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    assert _train(pipeline, out, "output.wandb=true", "train.iterations=2", "train.eval_every=1") == 0
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), sorted(p.name for p in (out / "wandb").iterdir())
    assert wandb.run is None  # the run was finished when training ended


def test_the_first_stop_guard_to_trip_names_why_the_run_stopped(pipeline: Path, tmp_path: Path) -> None:
    """Two stop-guards trip at the same evaluation: summary guards.stopped names the first in config order."""
    out = tmp_path / "run"
    twin = [f"guards.bright_twin.{k}" for k in ("reward=ink", "target=bold", "tolerance=0.005", "on_trip=stop")]
    extra = [*HACKING, "guards.bright.on_trip=stop", *twin, "train.iterations=6", "output.image_every=0"]
    assert _train(pipeline, out, *extra) == 0
    guards = _summary(out)["guards"]
    trips = [(t["name"], t["iteration"]) for t in guards["trips"]]
    assert trips[:2] == [("bright", trips[0][1]), ("bright_twin", trips[0][1])]  # both at one evaluation
    assert guards["stopped"].startswith("guard 'bright' fell from its best")
