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
        ("prompts.test_fraction=1", "'prompts.test_fraction' must be > 0 and < 1; got 1.0"),  # passed --check
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


def test_yaml_merge_keys_load_as_safe_load_reads_them(tmp_path):
    """``<<: *anchor`` was "invalid YAML (could not determine a constructor for the tag ...merge)"."""
    path = tmp_path / "run.yaml"
    path.write_text("base: &short {iterations: 3, eval_every: 3}\ntrain:\n  <<: *short\n  eval_every: 1\n")
    with pytest.raises(ConfigError, match="unknown key 'base'"):
        load_config(str(path))  # the anchor's own key is still a key of the file
    path.write_text("train:\n  <<: &short {iterations: 3, eval_every: 3}\n  eval_every: 1\n")
    cfg = load_config(str(path))
    assert (cfg.train.iterations, cfg.train.eval_every) == (3, 1)  # the key beside the merge overrides it
    path.write_text("train:\n  <<: {iterations: 3}\n  eval_every: 1\n  eval_every: 2\n")
    with pytest.raises(ConfigError, match=r"line 4: invalid YAML \(duplicated key 'eval_every'; keep one\)"):
        load_config(str(path))


def _alias_bomb(levels: int) -> str:
    """YAML of nested aliases under rewards.ink: each level lists the one before 9 times (9^levels values)."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return "rewards:\n  ink:\n    junk:\n" + "".join(f"      {line}\n" for line in lines)


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    """A 9-level alias bomb in a reward's options took --check past 60 s and 1.9 GB (json.dumps expanded it)."""
    import time

    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(9))
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"bomb\.yaml: its YAML aliases expand to [\d,]+ values, above the limit"):
        load_config(str(path))
    assert time.perf_counter() - start < 5
    with pytest.raises(ConfigError, match=r"value of 'rewards\.ink\.junk': its YAML aliases expand"):
        load_config(
            None,
            [
                "rewards.ink.junk={a: &a [x, x, x, x, x, x, x, x, x, x], "
                + ", ".join(
                    f"b{i}: &b{i} [" + ", ".join([f"*{'a' if i == 0 else f'b{i - 1}'}"] * 10) + "]" for i in range(6)
                )
                + "}"
            ],
        )
    path.write_text("rewards:\n  ink: &a\n    x: [*a]\n")
    with pytest.raises(ConfigError, match="a YAML alias refers to a list or mapping that contains it"):
        load_config(str(path))
    path.write_text("optim: &o\n  lr: 0.002\ntrain:\n  seed: 3\n")  # a plain anchor still loads
    assert load_config(str(path)).optim.lr == 0.002


def test_valid_bounds_still_load():
    cfg = load_config(None, ["train.time_budget_s=30", "objective.kl_beta=0", "objective.updates_per_iteration=2"])
    assert cfg.train.time_budget_s == 30 and cfg.objective["kl_beta"] == 0


# -- every numeric key has a range; the user's mutations fail in one line through `flowrl train` -------


def _one_line_error(capsys, *args: str) -> str:
    """Run ``flowrl train ARGS`` in-process; it must fail with exit code 2 and one ``flowrl: error:`` line."""
    from flowrl.cli import main

    assert main(["train", *args, "--output", "unused-run-dir"]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("flowrl: error: "), err
    return lines[0]


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("model.device=gpu", "'model.device' is not a device torch knows: 'gpu'; use cpu, cuda, cuda:N or mps"),
        ("model.device=cuda:-1", "'model.device' is not a device torch knows"),
        ("model.device=meta", "'model.device' names a 'meta' device, which flowrl does not run on"),
        ("model.device=7", "'model.device' must be str; got 7"),
        ("rewards.ink.device=gpu", "'rewards.ink.device' is not a device torch knows"),
        ("model.resolution=1000000", "'model.resolution' must be >= 1 and <= 16384 (pixels per side); got 1000000"),
        ("model.resolution=[8,0]", "'model.resolution' items must be >= 1 and <= 16384"),
        ("train.threads=1000000", "'train.threads' must be >= 1 and <= 1024; got 1000000"),
        ("prompts.per_iteration=1000000000", "'prompts.per_iteration' must be >= 1 and <= 100000"),
        ("prompts.group_size=1000000000", "'prompts.group_size' must be >= 1 and <= 10000"),
        ("sampler.num_steps=1000000000", "'sampler.num_steps' must be >= 1 and <= 1000"),
        ("train.eval_seeds=1000000000", "'train.eval_seeds' must be >= 1 and <= 10000"),
        ("train.eval_steps=1000000000", "'train.eval_steps' must be >= 1 and <= 1000"),
        ("lora.rank=1000000", "'lora.rank' must be >= 1 and <= 1024 (LoRA ranks of 4-128 are usual"),
        ("train.seed=-1", "'train.seed' must be >= 0 and <= 9223372036854775807"),
        ("rewards.ink.weight=1e300", "weight of reward 'ink' must be a number with |weight| <= 1e+06; got 1e+300"),
        ("optim.beta2=1", "'optim.beta2' must be < 1 (AdamW divides by 1 - beta); got 1.0"),
        ("optim.lr=10", "'optim.lr' must be > 0 and <= 1; got 10.0"),
        ("sampler.sde_window=[0.9,0.3]", "'sampler.sde_window' must be [lo, hi] with lo <= hi"),
        ("sampler.sde_window=[0.3,1.5]", "'sampler.sde_window' items must be >= 0 and <= 1 (sigmas lie in [0, 1])"),
        ("sampler.window_range=[5,2]", "'sampler.window_range' must be [lo, hi] with lo <= hi"),
        ("sampler.guidance_scale=1e9", "'sampler.guidance_scale' must be >= 0 and <= 100"),
        ("sampler.tree.factors=[0]", "'sampler.tree.factors' items must be >= 1 and <= 1024"),
        ("sampler.tree.width_keep=0", "'sampler.tree.width_keep' must be > 0 and <= 1"),
        ("output.grid_seeds=1000000000", "'output.grid_seeds' must be >= 1 and <= 256"),
        ("objective.kl_beta=.nan", "'objective.kl_beta' must be a finite number; got nan"),
        ("prompts.train=" + "x" * 300, "'prompts.train' has a file or folder name longer than 255 bytes"),
        ("model.path=/tmp/" + "y" * 256 + "/model", "'model.path' has a file or folder name longer than 255 bytes"),
        ('output.dir="runs/a\\0b"', "'output.dir' holds a NUL character; remove it"),
    ],
)
def test_extreme_values_fail_in_one_line_through_the_cli(capsys, override, fragment):
    line = _one_line_error(capsys, override)
    assert fragment in line and "command line" in line


def test_cps_noise_level_is_a_fraction(capsys):
    line = _one_line_error(capsys, "sampler.sde=cps", "sampler.noise_level=1.5")
    assert "'sampler.noise_level' must be <= 1 with sampler.sde=cps; got 1.5" in line


def test_a_window_longer_than_the_schedule_is_refused(capsys):
    line = _one_line_error(capsys, "sampler.window=fixed", "sampler.window_size=20")
    assert "'sampler.window_size' (20) must be <= sampler.num_steps (10)" in line


@pytest.mark.parametrize(
    "config, override, key",
    [
        ("configs/nft/digits.yaml", "objective.train_fraction=0", "objective.train_fraction"),
        ("configs/nft/digits.yaml", "objective.adv_clip=-1", "objective.adv_clip"),
        ("configs/nft/digits.yaml", "objective.ema_decay_max=2", "objective.ema_decay_max"),
        ("configs/nft/digits.yaml", "objective.kl_beta=-1", "objective.kl_beta"),
        ("configs/awm/digits.yaml", "objective.power=0", "objective.power"),
        ("configs/awm/digits.yaml", "objective.num_timesteps=0", "objective.num_timesteps"),
        ("configs/awm/digits.yaml", "objective.timestep_fraction=1.5", "objective.timestep_fraction"),
        ("configs/awm/digits.yaml", "objective.ema_beta=-0.5", "objective.ema_beta"),
    ],
)
def test_forward_process_objectives_check_their_ranges(capsys, config, override, key):
    line = _one_line_error(capsys, config, override)
    assert f"{key} is out of range" in line


def test_the_bounds_accept_their_edges():
    cfg = load_config(
        None,
        [
            "model.resolution=[8, 16384]",
            "lora.rank=1024",
            "train.threads=1024",
            "sampler.num_steps=1000",
            "rewards.ink.weight=-1e6",
            "optim.beta1=0",
            "model.device=cuda:3",  # a spelling check only: the machine is checked by flowrl.resources
            "rewards.ink.device=mps",
        ],
    )
    assert cfg.model.resolution == [8, 16384] and cfg.rewards["ink"]["weight"] == -1e6


def _numeric_fields(cls: type, prefix: str = ""):
    """(dotted key, field) for every int / float field of a config dataclass, sections walked recursively."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _numeric_fields(tp, f"{prefix}{f.name}.")
        elif (
            typing.get_origin(tp) is not typing.Literal and tp is not bool and ("int" in str(tp) or "float" in str(tp))
        ):
            yield prefix + f.name, f


def test_every_numeric_config_key_has_a_range():
    from flowrl.config import Config

    missing = [key for key, f in _numeric_fields(Config) if "lo" not in f.metadata]
    assert not missing, f"numeric keys without a range (add metadata=_rng(...)): {missing}"


def _objective_keys():
    from flowrl.objectives import OBJECTIVES

    return [(name, key) for name, cls in OBJECTIVES.items() for key, _ in _numeric_fields(cls)]


@pytest.mark.parametrize("name, key", _objective_keys())
def test_every_numeric_objective_key_refuses_a_huge_negative(name, key):
    configs = {"branch_grpo": "configs/branch/digits.yaml"}
    with pytest.raises(ConfigError, match=rf"objective\.{key}"):
        load_config(configs.get(name), [f"objective.name={name}", f"objective.{key}=-1000000000"])
