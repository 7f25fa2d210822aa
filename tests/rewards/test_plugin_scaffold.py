"""A scaffolded plugin installs offline, is listed, passes the kit and trains the embedded model."""

import os
import re
import subprocess
import sys

import pytest
import tomllib

from flowrl.scaffold import scaffold_reward


def test_scaffold_install_list_and_train(tmp_path):
    root = scaffold_reward("sharpness", tmp_path)
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(site),
            str(root),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(site)}
    listed = subprocess.run(
        [sys.executable, "-m", "flowrl", "rewards", "list"], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    line = next(row for row in listed.stdout.splitlines() if row.startswith("sharpness"))
    assert "flowrl-reward-sharpness" in line and "yes" in line
    kit = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(root / "tests")],
        env=env,
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert kit.returncode == 0, kit.stdout[-2000:]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("rewards:\n  sharpness: {weight: 1.0, target: 0.3}\n")
    small = [
        "prompts.per_iteration=2",
        "prompts.group_size=4",
        "sampler.chunk_size=8",
        "train.iterations=1",
        "train.eval_seeds=1",
        "output.grid_seeds=1",
        f"output.dir={tmp_path / 'run'}",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "flowrl", "train", str(cfg), *small],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert '"reward/sharpness"' in (tmp_path / "run" / "metrics.jsonl").read_text()


def test_bad_names_and_existing_folder(tmp_path):
    with pytest.raises(ValueError, match="lowercase identifier"):
        scaffold_reward("My-Reward", tmp_path)
    with pytest.raises(ValueError, match="not ending in _"):  # wrote name = "flowrl-reward-any-", which pip refuses
        scaffold_reward("any_", tmp_path)
    # would write a plugin that does not import (or whose test calls itself: test_conformance)
    for name in ("pass", "match", "torch", "check_reward", "test_conformance"):
        with pytest.raises(ValueError, match=f"'{name}' is a Python keyword or a name the plugin's module uses"):
            scaffold_reward(name, tmp_path)
    for name in ("ink", "remote", "pickscore"):  # the built-in wins: training with rewards.ink would not use it
        with pytest.raises(ValueError, match=f"'{name}' is a built-in reward's, which would shadow the plugin"):
            scaffold_reward(name, tmp_path)
    assert not any(tmp_path.glob("flowrl-reward-*"))
    scaffold_reward("ok", tmp_path)
    with pytest.raises(FileExistsError, match="already exists"):
        scaffold_reward("ok", tmp_path)


def test_a_folder_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path, capsys):
    """--dir under a file (or /proc/sys) gave a raw "[Errno 20] Not a directory"; now the flag and the fix."""
    from flowrl.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["reward", "new", "sharp", "--dir", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"flowrl: error: cannot write the plugin under {blocker / 'sub'} ("
    ), err
    assert err.rstrip().endswith("; pass --dir a writable folder") and blocker.read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_rewards_list_keeps_its_columns_for_a_plugin_named_after_its_distribution(monkeypatch, capsys):
    import flowrl.rewards
    from flowrl.reward_commands import cmd_rewards_list
    from flowrl.rewards.registry import RewardInfo

    rows = [RewardInfo("ink", "flowrl", True, "Stroke weight."), RewardInfo("sharp", "flowrl-reward-sharp", True, "S.")]
    monkeypatch.setattr(flowrl.rewards, "list_rewards", lambda: rows)
    assert cmd_rewards_list(None) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len({line.index(word) for line, word in zip(lines, ("offline", "yes", "yes"))}) == 1, lines


def test_a_name_with_underscores_gets_a_dashed_distribution_and_its_own_entry_point(tmp_path) -> None:
    """my_reward: folder and distribution flowrl-reward-my-reward, package flowrl_reward_my_reward, entry point
    my_reward; a name starting with a digit is refused."""
    root = scaffold_reward("my_reward", tmp_path)
    assert root == tmp_path / "flowrl-reward-my-reward"
    pyproject = (root / "pyproject.toml").read_text()
    assert 'name = "flowrl-reward-my-reward"' in pyproject
    for name in ("a", "a2", "a_b_c", "x__y"):  # PEP 508 project names: start and end with a letter or digit
        project = tomllib.loads((scaffold_reward(name, tmp_path) / "pyproject.toml").read_text())["project"]["name"]
        assert re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?", project), project
    assert 'my_reward = "flowrl_reward_my_reward.reward:my_reward"' in pyproject
    assert (root / "flowrl_reward_my_reward" / "reward.py").is_file()
    with pytest.raises(ValueError, match="lowercase identifier"):
        scaffold_reward("3d_reward", tmp_path)
