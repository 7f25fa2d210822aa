"""Config loading: defaults, YAML diffs, overrides and one-line errors."""

from pathlib import Path

import pytest

from flowrl.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


def test_defaults_are_the_embedded_job():
    cfg = load_config()
    assert cfg.model.path == "flowrl-digits"
    assert cfg.objective["name"] == "flow_grpo"
    assert set(cfg.rewards) == {"ink_band", "digit_correctness"}


def test_overrides_merge_into_sections_and_rewards():
    cfg = load_config(None, ["sampler.noise_level=0.5", "rewards.ink_band.weight=2", "train.threads=null"])
    assert cfg.sampler.noise_level == 0.5
    assert cfg.rewards["ink_band"] == {"weight": 2}
    assert "digit_correctness" in cfg.rewards
    assert cfg.train.threads is None


def test_int_and_exponent_strings_accepted_for_float():
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0
    assert load_config(None, ["optim.lr=1e-3"]).optim.lr == 1e-3  # YAML 1.1 reads this as a string


@pytest.mark.parametrize(
    "override, fragment",
    [
        (["sampler.nois=1"], "unknown key 'sampler.nois'; allowed keys in sampler:"),
        (["bogus=1"], "unknown key 'bogus'"),
        (["sampler.noise_level=abc"], "'sampler.noise_level' must be float; got 'abc'"),
        (["train.iterations=0"], "'train.iterations' must be >= 1; got 0"),
        (["model.dtype=fp8"], "'model.dtype' must be one of 'float32', 'bfloat16', 'float16'"),
        (["rewards.ink.weight=nan"], "'rewards.ink.weight' must be a finite number"),
        (["optim.beta1=1.5"], "'optim.beta1' must be >= 0 and <= 1"),
        (["sampler"], "must look like key=value"),
        (["sampler=3"], "'sampler' must be a mapping"),
        (["model.resolution=[8,8,8]"], "'model.resolution' must be one int (square) or [height, width]"),
        (["objective.name=[]"], "'objective.name' must be one of 'flow_grpo'"),
        (["sampler.window=fixed", "sampler.window_start=50"], "'sampler.window_start' (50) + window_size (2)"),
        (["sampler.window=random", "sampler.num_steps=5"], "'sampler.window_range' [0, 9) must lie in [0, sampler"),
        (["output.dir="], "'output.dir' is empty; set it to a path"),
        (["output.dir=' '"], "'output.dir' is empty; set it to a path"),  # blank, not only empty
        (["prompts.group_size=1"], "'prompts.group_size' must be >= 2 for advantage.method=sum"),
        (["sampler.noise_level=0"], "'sampler.noise_level' is 0: objective.name=flow_grpo trains on stochastic"),
        (["rewards.drift.weight=1"], "'rewards.drift' is named like an evaluation figure (eval/drift)"),
        (["rewards.remote:http://127.0.0.1:8765.weight=1"], "rewards.judge.reward=remote rewards.judge.url=http://"),
        (['rewards."remote:http://127.0.0.1:8765".weight=1'], "rewards.judge.reward=remote"),  # quoted: "import"
    ],
)
def test_bad_values_give_one_line_errors(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    message = str(err.value)
    assert fragment in message
    assert "\n" not in message
    assert "command line" in message


def test_a_file_with_an_empty_rewards_section_is_refused(tmp_path):
    """A file's ``rewards: {}`` replaces the defaults whole, so it would leave nothing to train on: one line."""
    path = tmp_path / "none.yaml"
    path.write_text("rewards: {}\n")
    with pytest.raises(ConfigError, match=r"none.yaml: 'rewards' is empty; name at least one reward"):
        load_config(path)


RANDOM = "sampler.window=random"


@pytest.mark.parametrize(
    "override, refused",
    [
        (["sampler.sde=cps", "sampler.noise_level=1"], ["sampler.sde=cps", "sampler.noise_level=1.01"]),
        (["sampler.sde_window=[0.5,0.5]"], ["sampler.sde_window=[0.6,0.5]"]),
        (["sampler.window=fixed", "sampler.window_size=4"], ["sampler.window=fixed", "sampler.window_size=5"]),
        (["sampler.window=fixed", "sampler.window_start=2"], ["sampler.window=fixed", "sampler.window_start=3"]),
        ([RANDOM, "sampler.window_range=[2,4]"], [RANDOM, "sampler.window_range=[3,4]"]),
        ([RANDOM, "sampler.window_range=[0,4]"], [RANDOM, "sampler.window_range=[0,5]"]),
    ],
)
def test_sampler_cross_key_bounds_are_inclusive(override, refused):
    """Each cross-key sampler bound admits its edge (noise_level 1 with cps, lo == hi, a window filling the steps,
    a random range exactly window_size long or ending at num_steps) and refuses one step past it.
    """
    steps = ["sampler.num_steps=4", "sampler.window_size=2"]
    assert load_config(None, steps + override) is not None
    with pytest.raises(ConfigError, match="'sampler."):
        load_config(None, steps + refused)


def test_default_weights_a_later_file_s_rewards_and_a_group_as_large_as_the_candidates(tmp_path):
    """The embedded job weights digit_correctness 0.5; a later file's ``rewards`` replaces the earlier one's whole
    (not merged); solrl.mode=regenerate keeps K <= N seeds, K == N included.
    """
    assert load_config().rewards == {"ink_band": {"weight": 1.0}, "digit_correctness": {"weight": 0.5}}
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("rewards:\n  ink: {target: bold}\n")
    second.write_text("rewards:\n  ink_band: {weight: 2.0}\n")
    assert load_config([first, second]).rewards == {"ink_band": {"weight": 2.0}}
    regenerate = ["objective.name=diffusion_nft", "solrl.mode=regenerate", "solrl.candidates=4"]
    assert load_config(None, regenerate + ["prompts.group_size=4"]).prompts.group_size == 4


def test_yaml_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sampler:\n  noise_levl: 0.5\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key 'sampler.noise_levl'"):
        load_config(bad)
    broken = tmp_path / "broken.yaml"
    broken.write_text("sampler: [1, 2\n")
    with pytest.raises(ConfigError, match=r"broken.yaml line \d+: invalid YAML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"train:\n  iterations: 2\n  # caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin1.yaml is not UTF-8 text \(byte 30\); re-save it as UTF-8"):
        load_config(latin1)


def test_a_files_rewards_replace_the_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rewards:\n  jpeg_compressibility: {weight: 1.0}\n")
    assert set(load_config(path).rewards) == {"jpeg_compressibility"}


def test_every_shipped_config_validates():
    files = sorted(p for p in (REPO / "configs").rglob("*.yaml") if p.parent.name != "accelerate")  # launcher configs
    assert files, "configs/ must hold at least the embedded default"
    for path in files:
        load_config(path)


def test_a_bare_off_in_yaml_or_on_the_command_line_is_the_word_off(tmp_path):
    assert load_config(None, ["solrl.mode=off"]).solrl.mode == "off"  # YAML 1.1 reads off as False
    path = tmp_path / "c.yaml"
    path.write_text("solrl:\n  mode: off\n")
    assert load_config(str(path)).solrl.mode == "off"
    with pytest.raises(ConfigError, match="'solrl.mode' must be one of"):
        load_config(None, ["solrl.mode=yes"])  # no allowed word for True


@pytest.mark.parametrize(
    "override, fragment",
    [
        (
            ["prompts.test_fraction=0.1", "prompts.eval=prompts/eval.txt"],
            "'prompts.test_fraction' holds out the eval prompts from prompts.train, so prompts.eval='prompts/eval.txt'",
        ),
        (["output.dir=runs/" + "é" * 128], "'output.dir' has a file or folder name longer than 255 bytes"),
        (["model.resolution=[8]"], "'model.resolution' must be one int (square) or [height, width]; got [8]"),
    ],
)
def test_cross_key_checks_refuse_in_one_line(override: list[str], fragment: str) -> None:
    """A test split with its own eval file, a 128-character name of 256 UTF-8 bytes, a one-item resolution."""
    with pytest.raises(ConfigError) as err:
        load_config(None, override)
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "path, overrides, fragment",
    [
        (
            "configs/grpo/digits.yaml",
            ["sampler.solver=heun"],
            "sampler.solver=heun is not read: objective.name=flow_gr",
        ),
        ("configs/branch/digits.yaml", ["sampler.solver=euler"], "sampler.solver=euler is not read"),
        ("configs/grpo/digits.yaml", ["sampler.tree.width_keep=0.5"], "sampler.tree.width_keep is not read: only tree"),
        ("configs/nft/digits.yaml", ["prompts.negative=blurry"], "prompts.negative is not read: the negative prompt"),
        ("configs/nft/digits.yaml", ["solrl.candidates=64"], "solrl.mode=off, so solrl.candidates=64 is not read"),
    ],
)
def test_keys_of_a_feature_left_off_are_named_in_one_warning_each(path, overrides, fragment):
    """Each was accepted and ignored (a Flow-GRPO run with sampler.solver=heun logged the default run's figures)."""
    from flowrl.config import unread_key_lines

    assert unread_key_lines(load_config(path)) == []
    (line,) = unread_key_lines(load_config(path, overrides))
    assert fragment in line and "\n" not in line


def test_keys_a_run_reads_raise_no_warning():
    from flowrl.config import unread_key_lines

    for path, overrides in (
        ("configs/nft/digits.yaml", ["sampler.solver=heun"]),
        ("configs/nft/digits.yaml", ["sampler.solver=tree", "sampler.tree.width_keep=0.5"]),
        ("configs/branch/digits.yaml", ["sampler.tree.width_keep=0.5"]),
        ("configs/grpo/digits.yaml", ["prompts.negative=blurry", "sampler.guidance_scale=3"]),
    ):
        assert unread_key_lines(load_config(path, overrides)) == [], overrides
