"""Config bounds from the durable-runs issue: values that used to be accepted silently now fail in one line."""

import pytest

from flowrl.config import ConfigError, load_config


@pytest.mark.parametrize(
    "override, culprit",
    [
        ("objective.clip_range=-0.1", "objective.clip_range"),
        ("objective.kl_beta=-1", "objective.kl_beta"),
        ("objective.updates_per_iteration=0", "objective.updates_per_iteration"),
        ("objective.updates_per_iteration=-2", "objective.updates_per_iteration"),
        ("train.time_budget_s=-5", "train.time_budget_s"),
    ],
)
def test_out_of_range_values_are_named(override, culprit):
    with pytest.raises(ConfigError, match=culprit.replace(".", r"\.")) as info:
        load_config(None, [override])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("config", ["configs/branch/digits.yaml", "configs/sage/digits.yaml"])
def test_tree_and_sage_objectives_check_their_ranges(config):
    with pytest.raises(ConfigError, match=r"objective\.clip_range"):
        load_config(config, ["objective.clip_range=0"])


def test_duplicated_yaml_key_is_refused_with_its_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 0.001\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"run\.yaml line 3: invalid YAML \(duplicated key 'lr'; keep one\)"):
        load_config(str(path))


def test_valid_bounds_still_load():
    cfg = load_config(None, ["train.time_budget_s=30", "objective.kl_beta=0", "objective.updates_per_iteration=2"])
    assert cfg.train.time_budget_s == 30 and cfg.objective["kl_beta"] == 0
