"""The CLI as a user runs it: end-to-end training into a temp folder, and one-line errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_sd3_pipeline

FAST = [
    "prompts.per_iteration=2",
    "prompts.group_size=3",
    "sampler.num_steps=3",
    "sampler.chunk_size=3",
    "train.iterations=2",
    "train.eval_every=1",
    "train.eval_seeds=1",
    "output.grid_seeds=2",
]


def flowrl(*args: str, cwd: Path, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if extra_path:
        env["PYTHONPATH"] = str(extra_path)
    return subprocess.run(
        [sys.executable, "-m", "flowrl", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_sd3")
    tiny_sd3_pipeline().save_pretrained(str(path))
    return path


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("flowrl: error:")]
    assert len(lines) == 1, result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_train_writes_every_output(tiny_folder, tmp_path):
    out = tmp_path / "run"
    result = flowrl("train", f"model.path={tiny_folder}", *FAST, f"output.dir={out}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "reward_curve.png",
        "grid_before_after.png",
        "summary.json",
        "lora/pytorch_lora_weights.safetensors",
        "checkpoints/iter-000002/trainer.json",
    ):
        assert (out / name).is_file(), name
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/reward_mean" in rows[0] and "reward_mean" in rows[1]
    assert json.loads((out / "summary.json").read_text())["iterations"] == 2
    # a second run into the same folder is refused, and --overwrite replaces it
    again = flowrl("train", f"model.path={tiny_folder}", *FAST, f"output.dir={out}", cwd=tmp_path)
    assert_one_line_error(again, "already holds files", "--overwrite")
    resumed = flowrl(
        "train",
        f"model.path={tiny_folder}",
        *FAST,
        "train.iterations=3",
        f"output.dir={out}",
        "--resume",
        str(out / "checkpoints/iter-000002"),
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (out / "checkpoints/iter-000003/manifest.json").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # no extra eval row at the resume step
    sample = flowrl(
        "sample",
        f"model.path={tiny_folder}",
        "--lora",
        str(out),
        "--prompt",
        "a bold handwritten 3",
        "--seeds",
        "2",
        "--out",
        str(tmp_path / "s.png"),
        cwd=tmp_path,
    )
    assert sample.returncode == 0 and (tmp_path / "s.png").is_file(), sample.stderr[-2000:]


def test_unknown_config_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("sampler:\n  noise_levle: 0.7\n")
    assert_one_line_error(flowrl("train", str(cfg), cwd=tmp_path), "c.yaml", "'sampler.noise_levle'", "allowed keys")


def test_bad_override_value(tmp_path):
    assert_one_line_error(flowrl("train", "optim.lr=-1", cwd=tmp_path), "'optim.lr' must be > 0")


def test_malformed_prompt_file(tiny_folder, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a bold handwritten 1"}\nnot json\n')
    result = flowrl(
        "train", f"model.path={tiny_folder}", f"prompts.train={prompts}", f"output.dir={tmp_path / 'r'}", cwd=tmp_path
    )
    assert_one_line_error(result, "p.jsonl line 2")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "body, fragment",
    [
        ("return torch.full((images.shape[0],), float('nan'))", "NaN"),
        ("return torch.zeros(images.shape[0], 2)", "shape"),
        ("return torch.zeros(images.shape[0], dtype=torch.float64)", "float64"),
    ],
)
def test_bad_reward_is_named_and_nothing_is_written(tiny_folder, tmp_path, body, fragment):
    (tmp_path / "myrewards.py").write_text(
        "import torch\n\ndef factory():\n    def bad_reward(images, prompts, **metadata):\n        "
        + body
        + "\n    return bad_reward\n"
    )
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"model: {{path: {tiny_folder}}}\nrewards:\n  'myrewards:factory': {{weight: 1.0}}\n"
        f"output: {{dir: {tmp_path / 'r'}}}\n"
    )
    result = flowrl("train", str(cfg), *FAST[:-1], cwd=tmp_path, extra_path=tmp_path)
    assert_one_line_error(result, "myrewards:factory", fragment)
    assert not (tmp_path / "r").exists()


def test_missing_model_weights(tmp_path):
    result = flowrl("train", f"model.path={tmp_path / 'nowhere'}", cwd=tmp_path)
    assert_one_line_error(result, "nowhere", "download")


def test_a_damaged_model_weight_file_is_one_line_naming_it(tiny_folder, tmp_path):
    broken = tmp_path / "tiny"
    shutil.copytree(tiny_folder, broken)
    (weights,) = (broken / "text_encoder").glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:1000])
    result = flowrl("train", f"model.path={broken}", f"output.dir={tmp_path / 'out'}", cwd=tmp_path)
    assert_one_line_error(result, f"weight file {weights}", "is damaged", "hf download")
    assert not (tmp_path / "out").exists()


def test_rewards_list(tmp_path):
    result = flowrl("rewards", "list", cwd=tmp_path)
    assert result.returncode == 0
    for name in ("digit_correctness", "ink", "jpeg_compressibility", "jpeg_incompressibility"):
        assert name in result.stdout


def test_two_iterations_on_the_embedded_model(tmp_path):
    out = tmp_path / "run"
    small = [
        "prompts.per_iteration=4",
        "prompts.group_size=4",
        "sampler.chunk_size=16",
        "train.iterations=2",
        "train.eval_every=1",
        "train.eval_seeds=1",
        "output.grid_seeds=1",
    ]
    result = flowrl("train", *small, f"output.dir={out}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "reward_curve.png",
        "grid_before_after.png",
        "summary.json",
        "lora/pytorch_lora_weights.safetensors",
        "checkpoints/iter-000002/lora.safetensors",
        "checkpoints/iter-000002/optimizer.safetensors",
        "checkpoints/iter-000002/rng.safetensors",
    ):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    for key in ("eval/reward_mean", "eval/accuracy", "eval/ink_bold", "eval/ink_thin", "eval/ink_gap"):
        assert key in summary["start"] and key in summary["end"], key
    assert summary["start"]["eval/accuracy"] >= 0.9  # the shipped base model reads as the prompted digit


def test_overrides_are_accepted_anywhere_on_the_command_line():
    from flowrl.cli import build_parser, parse_command_line

    ns = parse_command_line(
        build_parser(), ["train", "--output", "runs/x", "optim.lr=0.01", "--overwrite", "train.iterations=2"]
    )
    assert ns.args == ["optim.lr=0.01", "train.iterations=2"] and ns.output == "runs/x" and ns.overwrite
    ns = parse_command_line(build_parser(), ["sample", "--seeds", "2", "sampler.num_steps=3"])
    assert ns.args == ["sampler.num_steps=3"] and ns.seeds == 2
    with pytest.raises(SystemExit):
        parse_command_line(build_parser(), ["train", "--output", "runs/x", "--no-such-flag"])


def test_a_config_file_whose_path_holds_an_equals_sign_is_a_config(tmp_path):
    from flowrl.config_files import split_config_args

    config = tmp_path / "lr=0.1" / "config.yaml"
    config.parent.mkdir()
    config.write_text("train:\n  iterations: 3\n")
    assert split_config_args([str(config), "optim.lr=0.1"]) == ([str(config)], ["optim.lr=0.1"])
    assert split_config_args(["a.yaml", "x=1"]) == (["a.yaml"], ["x=1"])


def test_a_path_the_filesystem_refuses_is_one_line(tmp_path, capsys):
    from flowrl.cli import main

    too_long = str(tmp_path / ("x" * 300)) + ".png"
    assert main(["sample", "--prompt", "a 3", "--seeds", "1", "--out", too_long]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flowrl: error: File name too long (")
    assert main(["train", "--check", "x" * 300 + "=1"]) == 2  # not a file: an override, named as one
    assert "unknown key" in capsys.readouterr().err


def test_an_override_written_with_a_space_says_to_join_it_with_equals(tmp_path, capsys):
    from flowrl.cli import main

    assert main(["train", "--check", "train.iterations", "4", "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "write train.iterations=VALUE" in err
    assert main(["train", "--check", str(tmp_path / "missing.yaml")]) == 2  # a YAML path stays a missing file
    assert "pass an existing YAML file (see configs/)" in capsys.readouterr().err


def test_an_interrupted_run_says_how_to_resume_it_or_that_it_cannot(tmp_path, monkeypatch, capsys):
    import flowrl.recipe
    from flowrl.cli import main

    class Interrupted:
        is_main = True

        def __init__(self, cfg, overwrite, resume):
            pass

        def execute(self):
            raise KeyboardInterrupt

    monkeypatch.setattr(flowrl.recipe, "Run", Interrupted)
    run = tmp_path / "run"
    assert main(["train", f"output.dir={run}"]) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "before the run's first checkpoint (train.save_every=50)" in err
    for iteration, finished in ((2, True), (4, False)):  # iter-4 lost its manifest: not a checkpoint to resume
        (run / "checkpoints" / f"iter-{iteration:06d}").mkdir(parents=True)
        if finished:
            (run / "checkpoints" / f"iter-{iteration:06d}" / "manifest.json").write_text("{}")
    assert main(["train", f"output.dir={run}"]) == 130
    assert f"continue from iteration 2 with: flowrl train --resume {run}\n" in capsys.readouterr().err
    monkeypatch.setattr(Interrupted, "is_main", False)  # another rank of a launch: rank 0 says it once
    assert main(["train", f"output.dir={run}"]) == 130
    assert "interrupted" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "example"),
    [
        (["eval", "runs/a", "--prompts", "digits"], "eval"),
        (["gallery", "runs/a"], "gallery"),
        (["export", "--merge", "runs/a"], "merged"),
    ],
)
def test_an_out_folder_that_is_a_file_is_refused_before_any_work(tmp_path, capsys, command, example):
    from flowrl.cli import main

    taken = tmp_path / "bold3.png"
    taken.write_bytes(b"png")
    assert main([*command, "--out", str(taken)]) == 2  # eval computed every figure, then failed to write them
    err = capsys.readouterr().err
    assert (
        err == f"flowrl: error: --out {taken} is a file; name a folder to write into, e.g. --out {tmp_path / example}\n"
    )
    assert taken.read_bytes() == b"png"


@pytest.mark.parametrize(
    "command",
    [
        ["sample", "--prompt", "a 3", "--seeds", "1"],
        ["eval", "runs/a", "--prompts", "digits"],
        ["gallery", "runs/a"],
        ["export", "--merge", "runs/a"],
    ],
)
def test_an_out_below_a_file_is_refused_before_any_work(tmp_path, capsys, command):
    """``--out notes.txt/grid.png``: sample drew every image and then failed with "[Errno 17] File exists"."""
    from flowrl.cli import main

    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    out = taken / "deeper" / ("grid.png" if command[0] == "sample" else "out")
    assert main([*command, "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"flowrl: error: --out {out}: {taken} is a file, not a folder; pass a path inside a folder\n"
    )
    assert taken.read_text() == "mine"


def test_export_names_the_pipeline_class_to_load_with():
    import flowrl
    from flowrl.output_commands import _pipeline_class

    assets = Path(flowrl.__file__).parent / "assets"
    assert _pipeline_class(assets / "flowrl-digits") == "StableDiffusion3Pipeline"
    assert _pipeline_class(assets / "no-such-model") == "DiffusionPipeline"


def test_the_done_line_says_why_a_run_ended_before_its_iterations():
    from flowrl.cli import _early_stop
    from flowrl.config import load_config

    cfg = load_config(None, ["train.iterations=70", "train.time_budget_s=15"])
    assert _early_stop({"iterations": 70}, cfg) == ""
    budget = " (stopped by train.time_budget_s=15, before train.iterations=70)"  # it said only "done: 3 iterations"
    assert _early_stop({"iterations": 3}, cfg) == budget
    assert "stopped by a guard" in _early_stop({"iterations": 3, "guards": {"stopped": "ink collapsed"}}, cfg)


def test_check_refuses_a_misspelt_reward_option_without_building_the_run(capsys):
    """``flowrl train --check`` catches ``rewards.ink_band.weigth`` (the run would stop at once on it)."""
    from flowrl.cli import main

    assert main(["train", "--check", "rewards.ink_band.weigth=0.5"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "flowrl: error: reward 'ink_band' has no option 'weigth'; its options: low, high "
        "(and for every reward: weight, timeout_s, video)"
    )
    assert main(["train", "--check", "rewards.ink_band.weight=0.5", "rewards.judge.reward=ink_band"]) == 0


def test_an_interrupted_run_names_its_newest_finished_checkpoint(tmp_path: Path) -> None:
    """With several finished checkpoints the interrupted line resumes from the newest one, not the oldest."""
    from flowrl.cli import _interrupted_line
    from flowrl.supervisor import Terminated, stop_code

    for iteration in (2, 4, 6):
        folder = tmp_path / "checkpoints" / f"iter-{iteration:06d}"
        folder.mkdir(parents=True)
        if iteration != 6:  # iter-6 lost its manifest: not finished
            (folder / "manifest.json").write_text("{}")
    assert (
        _interrupted_line(tmp_path, 2, KeyboardInterrupt())
        == f"flowrl: interrupted; continue from iteration 4 with: flowrl train --resume {tmp_path}"
    )
    assert _interrupted_line(tmp_path, 2, Terminated()).startswith("flowrl: stopped by SIGTERM; continue from iter")
    assert (stop_code(KeyboardInterrupt()), stop_code(Terminated())) == (130, 143)


def test_a_leftover_argument_of_a_command_without_overrides_is_a_usage_error() -> None:
    """``flowrl rewards list extra`` exits through argparse's usage error; only train/sample take leftover overrides."""
    from flowrl.cli import build_parser, parse_command_line

    for argv in (["rewards", "list", "extra"], ["rewards", "list", "x=1"]):
        with pytest.raises(SystemExit) as exc:
            parse_command_line(build_parser(), argv)
        assert exc.value.code == 2


def test_the_grid_samples_each_prompt_on_its_own_fixed_seeds() -> None:
    """The before/after grid: the first GRID_MAX_PROMPTS eval prompts, each on seeds GRID_SEED_BASE + 0..seeds-1."""
    from flowrl.prompts.files import Prompt
    from flowrl.recipe import GRID_MAX_PROMPTS, GRID_SEED_BASE, _grid_inputs

    prompts = [Prompt(f"a {i}", {}) for i in range(GRID_MAX_PROMPTS + 3)]
    chosen, seeds = _grid_inputs(prompts, 3)
    assert [p.text for p in chosen] == [f"a {i}" for i in range(GRID_MAX_PROMPTS) for _ in range(3)]
    assert seeds == [GRID_SEED_BASE + j for _ in range(GRID_MAX_PROMPTS) for j in range(3)]


def test_an_empty_output_is_refused_not_ignored(tmp_path, capsys, monkeypatch):
    """``--output ''`` trained into the default runs/digits-bold-thin (``if ns.output:``); now one line."""
    from flowrl.cli import main

    monkeypatch.chdir(tmp_path)  # had it run, it would have written under tmp_path/runs
    for empty in ("", "  "):
        assert main(["train", "train.iterations=1", "--output", empty]) == 2
        err = capsys.readouterr().err
        assert err == (
            "flowrl: error: --output must name the run folder; got an empty string; e.g. --output runs/my-run\n"
        )
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("content", ["", "\n  \n", "# flowrl run config\n"])
def test_a_run_whose_config_yaml_is_empty_is_refused_not_read_as_the_defaults(tmp_path, capsys, content):
    """An empty run config.yaml was read as the default config: another model, other rewards, no guards."""
    from flowrl.cli import main

    run = tmp_path / "run"
    (run / "lora").mkdir(parents=True)
    (run / "lora" / "pytorch_lora_weights.safetensors").write_bytes(b"unread")
    (run / "checkpoints" / "iter-000001").mkdir(parents=True)
    (run / "config.yaml").write_text(content)
    empty = f"{run / 'config.yaml'} is empty, but a run's config.yaml holds its whole resolved config; "
    for argv in (
        ["sample", "--lora", str(run), "--prompt", "a 3", "--out", str(tmp_path / "s.png")],
        ["eval", str(run), "--prompts", "digits", "--out", str(tmp_path / "eval")],
        ["train", "--resume", str(run)],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and empty in err, (argv, err)
