"""`flowrl eval`: per-checkpoint means with CIs, diversity, drift and guards, as JSON and markdown."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import yaml
from run_folders import make_run

from flowrl.cli import main
from flowrl.comparison.checkpoints import CheckpointBank
from flowrl.comparison.evaluate import EvalSettings, checkpoints_of, evaluate_checkpoints, guard_spec, reward_spec
from flowrl.evaluation.metrics import mean_ci
from flowrl.evaluation.table import checkpoint_figures, figures_json, markdown_table, table_cells
from flowrl.prompts.files import Prompt

GUARDS = {"jpeg_incompressibility": {"tolerance": 0.05}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("eval") / "run", seed=1, guards=GUARDS)


def test_table_figures_match_the_metrics():
    images = torch.rand(6, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    base = torch.rand(6, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    total = torch.arange(6.0)
    row = checkpoint_figures(
        "x", images, ids, total, {"r": total, "nan": torch.full((6,), float("nan"))}, base_images=base
    )
    assert row.total == mean_ci(total) and row.rewards["nan"].n == 0
    assert row.diversity.n == 2 and row.drift.n == 6 and row.samples == 6
    assert figures_json([row])[0]["rewards"]["nan"]["mean"] is None  # strict JSON
    headers, cells = table_cells([row])
    assert headers == ["checkpoint", "reward total", "r", "nan", "diversity", "drift", "n"]
    assert cells[0][1] == f"{2.5:.4f} ± {row.total.half_width:.4f}" and cells[0][3] == "n/a"
    clash = checkpoint_figures("z", images, ids, total, {"drift": total, "n": total}, base_images=base)
    headers, cells = table_cells([clash])  # rewards labelled like the fixed columns keep their own cells
    assert len(cells[0]) == len(headers) == 7 and cells[0][2] == cells[0][3] == cells[0][1]
    one_seed = checkpoint_figures("y", images[:2], torch.tensor([0, 1]), total[:2], {})
    assert one_seed.diversity is None and one_seed.drift is None


def test_evaluate_scores_base_and_run_on_the_same_seeds(run):
    prompts = [Prompt("a bold handwritten 3", {}), Prompt("a thin handwritten 8", {})]
    rewards, guards = reward_spec([run]), guard_spec([run])
    assert set(rewards) == {"ink", "jpeg_compressibility"} and set(guards) == {"jpeg_incompressibility"}
    checkpoints = checkpoints_of([run])
    assert [c.label for c in checkpoints] == ["base", "run"]
    rows = evaluate_checkpoints(CheckpointBank(), checkpoints, prompts, rewards, guards, EvalSettings(seeds=3, steps=4))
    base, aligned = rows
    assert base.samples == aligned.samples == 6 and base.drift is None and aligned.drift.mean > 0
    assert set(aligned.rewards) == {"ink", "jpeg_compressibility"} and set(aligned.guards) == {"jpeg_incompressibility"}
    assert aligned.diversity.n == 2 and math.isfinite(aligned.diversity.mean)
    again = evaluate_checkpoints(
        CheckpointBank(), checkpoints, prompts, rewards, guards, EvalSettings(seeds=3, steps=4)
    )
    assert figures_json(again) == figures_json(rows)  # fixed seeds, deterministic sampling
    assert "guard: jpeg_incompressibility" in markdown_table(rows)


def test_eval_command_writes_json_and_markdown(run, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a bold handwritten 3\na thin handwritten 8\n")
    out = tmp_path / "eval"
    code = main(["eval", str(run), "--prompts", str(prompts), "--seeds", "2", "--steps", "3", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["num_prompts"] == 2 and report["seeds_per_prompt"] == 2
    labels = [c["label"] for c in report["checkpoints"]]
    assert labels == ["base", "run"]
    assert report["checkpoints"][1]["guards"]["jpeg_incompressibility"]["n"] == 4
    table = (out / "eval.md").read_text()
    assert table.startswith("| checkpoint | reward total | ink | jpeg_compressibility |") and "| run |" in table
    assert "| run |" in capsys.readouterr().out


def test_eval_command_with_chosen_rewards_and_a_bad_run(run, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a bold handwritten 1\n")
    out = tmp_path / "e"
    args = ["eval", str(run), "--prompts", str(prompts), "--seeds", "2", "--steps", "2", "--out", str(out)]
    assert main([*args, "--rewards", "jpeg_compressibility"]) == 0
    assert set(json.loads((out / "eval.json").read_text())["checkpoints"][0]["rewards"]) == {"jpeg_compressibility"}
    earlier = {name: (out / name).read_bytes() for name in ("eval.json", "eval.md")}
    assert main([*args, "--rewards", "ink"]) == 2  # it replaced the earlier figures unasked, after sampling them all
    assert capsys.readouterr().err == (
        f"flowrl: error: --out {out} already holds eval.json, eval.md of an earlier run; pass --overwrite to "
        "replace them, or name another folder\n"
    )
    assert {name: (out / name).read_bytes() for name in earlier} == earlier
    assert main([*args, "--rewards", "ink", "--overwrite"]) == 0
    assert set(json.loads((out / "eval.json").read_text())["checkpoints"][0]["rewards"]) == {"ink"}
    assert main(["eval", str(tmp_path), "--prompts", str(prompts)]) == 2
    assert "is not a run folder" in capsys.readouterr().err


def test_runs_with_other_evaluation_steps_are_compared_with_the_base_at_their_steps(tmp_path):
    """Drift is measured against the base sampled on each run's own step count (a no-op LoRA drifts by 0)."""
    runs = [
        make_run(tmp_path / name, seed=i, scale=0.0, overrides=[f"train.eval_steps={steps}"])
        for i, (name, steps) in enumerate([("a", 4), ("b", 3)])
    ]
    prompts = [Prompt("a bold handwritten 3", {}), Prompt("a thin handwritten 8", {})]
    rows = evaluate_checkpoints(
        CheckpointBank(), checkpoints_of(runs), prompts, reward_spec(runs), {}, EvalSettings(seeds=2)
    )
    assert [r.label for r in rows] == ["base", "a", "b"]
    assert rows[1].drift.mean == 0 and rows[2].drift.mean == 0


def test_a_reward_that_applies_to_no_prompt_reads_n_a_not_an_error():
    from flowrl.comparison.evaluate import build_rewards, score

    prompts = [Prompt("a handwritten 3", {}), Prompt("a handwritten 8", {})]  # no style: ink_band does not apply
    total, parts = score(build_rewards({"ink_band": {}, "jpeg_compressibility": {}}), torch.rand(2, 3, 8, 8), prompts)
    assert torch.isnan(parts["ink_band"]).all() and torch.isfinite(total).all()
    assert torch.equal(total, parts["jpeg_compressibility"])  # the NaN component counts 0 in the total, as in training


@pytest.mark.parametrize(
    ("command", "line"),
    [
        (["eval", "--prompts", "digits", "--seeds", "0"], "--seeds must be >= 1; got 0"),  # it said "got 0 and None"
        (["eval", "--prompts", "digits", "--steps", "0"], "--steps must be in [1, 1000] (as sampler.num_steps); got 0"),
        (["eval", "--prompts", "digits", "--steps", "1001"], "--steps must be in [1, 1000] (as sampler.num_steps)"),
        (["eval", "--prompts", "digits", "--seed", "-1"], "--seed must be in [0, 9223372036854775804] (the seeds"),
        (
            ["eval", "--prompts", "digits", "--seeds", "1000000"],  # days of sampling: it ran until killed
            "2 checkpoints x 10 prompts x --seeds 1000000 = 20,000,000 samples x 4 steps = 80,000,000 model "
            "evaluations is above the limit of 10,000,000; lower --seeds, --steps or the number of prompts",
        ),
        (["gallery", "--seeds", "0"], "--seeds must be >= 1; got 0"),
        (["gallery", "--steps", "5000"], "--steps must be in [1, 1000] (as sampler.num_steps); got 5000"),
        (["gallery", "--prompts", "0"], "--prompts must be >= 1; got 0"),
    ],
)
def test_a_count_below_one_names_only_its_flag(run, tmp_path, capsys, command, line):
    assert main([command[0], str(run), *command[1:], "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flowrl: error: {line}") and err.count("\n") == 1, err


def test_eval_command_passes_first_seed_and_trims_reward_names(run, tmp_path) -> None:
    """``--seed 7`` is the report's first seed; ``--rewards`` names are stripped and empty ones dropped."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("a bold handwritten 1\n")
    out = tmp_path / "e"
    args = ["eval", str(run), "--prompts", str(prompts), "--seeds", "2", "--steps", "2", "--out", str(out)]
    assert main([*args, "--seed", "7", "--rewards", " jpeg_compressibility , ,"]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["first_seed"] == 7
    assert set(report["checkpoints"][0]["rewards"]) == {"jpeg_compressibility"}


def test_runs_and_models_of_the_same_folder_name_get_distinct_labels(run, tmp_path, capsys) -> None:
    """eval labels as the demo does (offer_run): runs/a and dup/a are 'a' and 'dup/a' (both were 'a', and so were
    their rows), models m1/model and m2/model 'base (model)' and 'base (m2/model)'; a run named twice counts once."""
    first, second = (shutil.copytree(run, tmp_path / folder / "a") for folder in ("runs", "dup"))
    assert [c.label for c in checkpoints_of([first, second, tmp_path / "dup" / ".." / "runs" / "a"])] == [
        "base",
        "a",
        "dup/a",
    ]
    for name, model in (("r1", "m1"), ("r2", "m2")):
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        cfg["model"]["path"] = str(tmp_path / model / "model")
        (shutil.copytree(run, tmp_path / "mm" / name) / "config.yaml").write_text(yaml.safe_dump(cfg))
    found = checkpoints_of([tmp_path / "mm" / "r1", tmp_path / "mm" / "r2"])
    assert [c.label for c in found] == ["base (model)", "base (m2/model)", "r1", "r2"]
    assert [c.model_path for c in found[:2]] == [str(tmp_path / "m1" / "model"), str(tmp_path / "m2" / "model")]
    prompts = tmp_path / "p.txt"
    prompts.write_text("a bold handwritten 1\n")
    out = tmp_path / "e"
    args = ["eval", str(first), str(second), "--prompts", str(prompts), "--seeds", "2", "--steps", "2"]
    assert main([*args, "--out", str(out)]) == 0
    assert [c["label"] for c in json.loads((out / "eval.json").read_text())["checkpoints"]] == ["base", "a", "dup/a"]
    assert "| a |" in capsys.readouterr().out and "| dup/a |" in (out / "eval.md").read_text()
