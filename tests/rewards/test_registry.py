"""Reward registry: built-ins, dotted paths, entry-point plugins, MultiReward and build_multi_reward."""

from __future__ import annotations

import math
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flowrl.rewards import (
    MultiReward,
    RewardError,
    RewardOutput,
    build_multi_reward,
    build_reward,
    ink,
    ink_amount,
    list_rewards,
    register_reward,
    registry,
)
from flowrl.rewards.digits import DigitCorrectness, Ink
from flowrl.rewards.jpeg import JpegSize

BUILTINS = {"digit_correctness", "ink", "jpeg_compressibility", "jpeg_incompressibility"}

PLUGIN_SOURCE = '''
"""Test plugin rewards."""
import torch


def constant(value: float = 1.0):
    """Constant reward for tests."""
    def reward(images, prompts, **metadata):
        return torch.full((images.shape[0],), float(value))
    return reward


constant.offline = True


def exploding(**options):
    """Factory that always fails."""
    raise RuntimeError("no model here")


def exiting(device: str = "cpu"):
    """Factory that exits the process instead of raising."""
    import sys

    sys.exit("no GPU")
'''

EXITING_AT_IMPORT = '''
"""A plugin that parses the command line at import (flowrl's own arguments, so argparse exits)."""
import argparse

argparse.ArgumentParser(prog="flowrl").parse_args()


def factory():
    return lambda images, prompts, **metadata: images.mean((1, 2, 3))
'''


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert message and "\n" not in message
    return message


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module and an installed-looking distribution exposing flowrl.rewards entry points."""
    (tmp_path / "flowrl_test_plugin_mod.py").write_text(PLUGIN_SOURCE)
    (tmp_path / "flowrl_test_plugin_exits.py").write_text(EXITING_AT_IMPORT)
    dist = tmp_path / "flowrl_test_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flowrl-test-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        textwrap.dedent("""
        [flowrl.rewards]
        plugin_constant = flowrl_test_plugin_mod:constant
        plugin_broken = flowrl_test_plugin_missing_mod:factory
        plugin_exiting = flowrl_test_plugin_exits:factory
        ink = flowrl_test_plugin_mod:constant
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_REGISTERED", {})


def test_build_builtins_by_name() -> None:
    assert isinstance(build_reward("digit_correctness"), DigitCorrectness)
    thin = build_reward("ink", target="thin")
    assert isinstance(thin, Ink) and thin.target == "thin"
    assert isinstance(build_reward("jpeg_compressibility", quality=90), JpegSize)
    assert build_reward("jpeg_incompressibility").sign == 1.0


def test_build_by_dotted_path(plugin_dir: Path) -> None:
    bold = build_reward("flowrl.rewards.digits:ink", target="bold")
    assert isinstance(bold, Ink) and bold.target == "bold"
    const = build_reward("flowrl_test_plugin_mod:constant", value=2.5)
    assert const(torch.zeros(3, 3, 8, 8), ["a", "b", "c"]).tolist() == [2.5] * 3


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("flowrl_no_such_module_xyz:factory", "ModuleNotFoundError"),
        ("flowrl.rewards.digits:no_such_factory", "no attribute"),
        ("flowrl.rewards.digits:INK_TARGETS", "not a callable"),
    ],
)
def test_bad_dotted_paths(path: str, needle: str) -> None:
    with pytest.raises(RewardError) as exc:
        build_reward(path)
    message = one_line(exc)
    assert repr(path) in message and needle in message


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(ValueError) as exc:
        build_reward("aesthetics_typo")
    message = one_line(exc)
    assert "'aesthetics_typo'" in message and all(name in message for name in BUILTINS)


def test_factory_errors_name_the_reward(plugin_dir: Path) -> None:
    with pytest.raises(RewardError) as exc:
        build_reward("ink", target="fat")
    assert "'ink'" in one_line(exc) and "'fat'" in str(exc.value)
    with pytest.raises(RewardError) as exc:
        build_reward("ink", colour="red")
    assert "'ink'" in one_line(exc) and "colour" in str(exc.value)
    with pytest.raises(RewardError) as exc:
        build_reward("flowrl_test_plugin_mod:exploding")
    assert "no model here" in one_line(exc) and isinstance(exc.value.__cause__, RuntimeError)


def test_a_misspelt_option_names_the_options_the_reward_takes(plugin_dir: Path) -> None:
    with pytest.raises(RewardError) as exc:
        build_multi_reward({"ink_band": {"weight": 1.0, "targt": "bold"}})
    message = one_line(exc)
    assert "no option 'targt'" in message and "its options: low, high" in message and "TypeError" not in message
    with pytest.raises(RewardError) as exc:
        build_reward("flowrl_test_plugin_mod:constant", valu=2.0)
    assert "its options: value" in one_line(exc)
    with pytest.raises(RewardError, match="no model here"):  # a factory taking **options takes any option
        build_reward("flowrl_test_plugin_mod:exploding", anything=1)


def test_register_reward_decorator(clean_registry: None) -> None:
    @register_reward("half")
    def half(scale: float = 0.5):
        """Half of everything."""
        return lambda images, prompts, **metadata: torch.full((images.shape[0],), scale)

    assert build_reward("half")(torch.zeros(1, 3, 8, 8), ["x"]).tolist() == [0.5]
    info = {i.name: i for i in list_rewards()}["half"]
    assert info.description == "Half of everything." and info.offline is False and info.error is None
    assert info.source == __name__
    with pytest.raises(ValueError, match="already registered"):
        register_reward("half")(half)
    with pytest.raises(ValueError, match="already registered"):
        register_reward("ink")(half)
    with pytest.raises(ValueError, match="':'"):
        register_reward("a:b")


def test_list_rewards_builtins() -> None:
    infos = {info.name: info for info in list_rewards()}
    assert BUILTINS <= infos.keys()
    for name in BUILTINS:
        info = infos[name]
        assert info.source == "flowrl" and info.offline is True and info.error is None
        assert info.description and "\n" not in info.description
    assert "DDPO" in infos["jpeg_compressibility"].description


def test_entry_point_plugins(plugin_dir: Path) -> None:
    infos = list_rewards()
    by_name = {}
    for info in infos:
        by_name.setdefault(info.name, []).append(info)
    good = by_name["plugin_constant"][0]
    assert good.source == "flowrl-test-plugin" and good.offline is True
    assert good.description == "Constant reward for tests." and good.error is None
    broken = by_name["plugin_broken"][0]
    assert broken.source == "flowrl-test-plugin" and "ModuleNotFoundError" in broken.error
    assert all(info.error is None for info in infos if info.name in BUILTINS and info.source == "flowrl")
    shadowed = [info for info in by_name["ink"] if info.source == "flowrl-test-plugin"]
    assert shadowed and "shadowed" in shadowed[0].error
    assert build_reward("plugin_constant", value=3)(torch.zeros(2, 3, 8, 8), ["a", "b"]).tolist() == [3.0, 3.0]
    assert isinstance(build_reward("ink"), Ink)  # the built-in wins
    with pytest.raises(RewardError) as exc:
        build_reward("plugin_broken")
    assert "'plugin_broken'" in one_line(exc) and "flowrl-test-plugin" in str(exc.value)


def constant_reward(values: list[float], allows_nan: bool = False):
    def reward(images, prompts, **metadata):
        return torch.tensor(values, dtype=torch.float32)

    reward.allows_nan = allows_nan
    return reward


def test_multi_reward_total_by_hand() -> None:
    multi = MultiReward(
        {
            "a": (constant_reward([1.0, 2.0]), 2.0),
            "b": (constant_reward([math.nan, 3.0], allows_nan=True), 0.5),
            "c": (constant_reward([-1.0, 0.0]), -1.0),
        }
    )
    out = multi(torch.rand(2, 3, 8, 8), ["p", "q"])
    assert isinstance(out, RewardOutput) and out.total.dtype == torch.float32
    torch.testing.assert_close(out.total, torch.tensor([2.0 + 0.0 + 1.0, 4.0 + 1.5 + 0.0]))
    assert list(out.components) == ["a", "b", "c"]
    assert math.isnan(float(out.components["b"][0])) and float(out.components["b"][1]) == 3.0
    assert multi.weights == {"a": 2.0, "b": 0.5, "c": -1.0}


def test_multi_reward_names_the_failing_component() -> None:
    multi = MultiReward(
        {
            "fine": (constant_reward([1.0, 2.0]), 1.0),
            "nanny": (constant_reward([math.nan, 1.0]), 1.0),
        }
    )
    with pytest.raises(RewardError) as exc:
        multi(torch.rand(2, 3, 8, 8), ["p", "q"])
    assert "'nanny'" in one_line(exc)
    with pytest.raises(ValueError, match="weight of reward 'x'"):
        MultiReward({"x": (constant_reward([1.0]), math.inf)})
    with pytest.raises(ValueError, match="at least one"):
        MultiReward({})
    with pytest.raises(ValueError, match="prompt"):
        multi(torch.rand(2, 3, 8, 8), ["only one"])


def test_multi_reward_batch_of_one() -> None:
    multi = MultiReward({"one": (constant_reward([0.25]), 4.0)})
    out = multi(torch.rand(1, 3, 8, 8), ["p"])
    assert out.total.shape == (1,) and out.total.tolist() == [1.0]


def test_score_parts_accepts_an_all_nan_part_and_combine_keeps_only_configured_components() -> None:
    """A chunk may be NaN for every sample (``score_parts``); ``combine`` refuses that only for the whole batch
    (unless ``allow_all_nan``), and its components are exactly the configured rewards, in their order.
    """
    nan = math.nan
    multi = MultiReward(
        {"a": (constant_reward([1.0, 2.0]), 2.0), "b": (constant_reward([nan, nan], allows_nan=True), 1.0)}
    )
    part = multi.score_parts(torch.rand(2, 3, 8, 8), ["p", "q"])
    assert list(part) == ["a", "b"] and part["a"].tolist() == [1.0, 2.0] and bool(part["b"].isnan().all())
    whole = {"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([nan, nan, 4.0]), "stale": torch.zeros(3)}
    out = multi.combine(whole)
    assert list(out.components) == ["a", "b"]
    assert out.total.tolist() == [2.0, 4.0, 10.0]
    all_nan = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([nan, nan])}
    with pytest.raises(RewardError, match="'b'.*every sample"):
        multi.combine(all_nan, batch_index=5)
    assert multi.combine(all_nan, allow_all_nan=True).total.tolist() == [2.0, 4.0]


def test_a_reward_that_bounds_its_own_time_gets_no_default_deadline() -> None:
    """Without a timeout in its entry, a reward declaring ``bounds_own_time`` (a remote one) gets deadline None;
    any other gets ``DEFAULT_TIMEOUT_S``; an explicit timeout wins for both.
    """
    from flowrl.rewards.deadline import DEFAULT_TIMEOUT_S

    own = constant_reward([1.0])
    own.bounds_own_time = True
    multi = MultiReward(
        {"own": (own, 1.0), "plain": (constant_reward([1.0]), 1.0), "given": (own, 1.0, 3.0), "off": (own, 1.0, None)}
    )
    assert multi.timeouts == {"own": None, "plain": DEFAULT_TIMEOUT_S, "given": 3.0, "off": None}


def test_build_multi_reward_matches_components() -> None:
    multi = build_multi_reward(
        {
            "ink": {"weight": 1.0, "target": "prompt"},
            "digit_correctness": {"weight": 0.5},
            "ink_bold": {"reward": "ink", "target": "bold", "weight": 0.25},
            "jpeg_compressibility": None,
        }
    )
    images = torch.rand(3, 3, 8, 8)
    prompts = ["a bold handwritten 1", "a thin handwritten 2", "a handwritten 3"]
    out = multi(images, prompts)
    amount = ink_amount(images)
    torch.testing.assert_close(out.components["ink_bold"], amount)
    prompt_ink = ink("prompt")(images, prompts)
    expected = (
        torch.nan_to_num(prompt_ink)
        + 0.5 * out.components["digit_correctness"]
        + 0.25 * amount
        + out.components["jpeg_compressibility"]
    )
    torch.testing.assert_close(out.total, expected)
    assert multi.weights["jpeg_compressibility"] == 1.0


@pytest.mark.parametrize("weight", ["heavy", math.nan, math.inf, True, None, [1.0]])
def test_build_multi_reward_rejects_bad_weights(weight) -> None:
    with pytest.raises(ValueError) as exc:
        build_multi_reward({"ink": {"weight": weight}})
    assert "'ink'" in one_line(exc) and "finite number" in str(exc.value)


def test_build_multi_reward_bad_specs() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        build_multi_reward({})
    with pytest.raises(ValueError, match="rewards.ink must be a mapping"):
        build_multi_reward({"ink": 1.0})
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        build_multi_reward({"nope": {"weight": 1.0}})
    with pytest.raises(RewardError, match="'ink'"):
        build_multi_reward({"ink": {"weight": 1.0, "target": "huge"}})


def test_weight_bound_is_on_the_magnitude_and_inclusive_and_entries_are_pairs_or_triples() -> None:
    """``|weight| <= 1e6`` (a large negative weight is refused too, 1e6 itself passes), a bool is no weight, and an
    entry must be (fn, weight) or (fn, weight, timeout_s).
    """
    from flowrl.rewards.combine import check_weight

    assert check_weight("r", 1e6) == 1e6 and check_weight("r", -1e6) == -1e6
    with pytest.raises(ValueError, match=r"weight of reward 'r' must be a number with \|weight\| <= 1e\+06"):
        check_weight("r", -1e7)
    with pytest.raises(ValueError, match="weight of reward 'r' must be a finite number; got True"):
        check_weight("r", True)
    with pytest.raises(ValueError, match=r"reward 'x' must be given as \(reward_fn, weight\[, timeout_s\]\)"):
        MultiReward({"x": (constant_reward([1.0]), 1.0, 5.0, "extra")})


def test_overwrite_replaces_a_builtin_for_build_reward(clean_registry: None) -> None:
    """``register_reward(builtin, overwrite=True)`` takes precedence: build_reward then builds the new factory."""

    @register_reward("ink", overwrite=True)
    def constant():
        return lambda images, prompts, **metadata: torch.full((images.shape[0],), 0.25)

    assert build_reward("ink")(torch.zeros(2, 3, 8, 8), ["a", "b"]).tolist() == [0.25, 0.25]


def test_the_video_option_wraps_and_is_not_a_factory_option() -> None:
    """``video`` is taken off the options (not passed to the factory, not refused by the option check) and wraps
    the reward in a FrameReward; check_reward_options accepts it too."""
    from flowrl.rewards.video import FrameReward

    reward = build_reward("ink", target="bold", video="min")
    assert isinstance(reward, FrameReward) and reward.reduce == "min"
    registry.check_reward_options({"ink": {"target": "bold", "video": "mean", "weight": 2.0, "timeout_s": 5.0}})
    with pytest.raises(RewardError, match="frames"):
        registry.check_reward_options({"ink": {"frames": 2}})


def test_required_options_are_the_parameters_without_a_default(clean_registry: None) -> None:
    """required_options lists only parameters with no default (positional or keyword-only), in order."""

    @register_reward("needs")
    def needs(url, retries=2, *, token, scale=1.0):
        return ink()

    assert registry.required_options("needs") == ["url", "token"]
    assert registry.required_options("ink") == []


def test_a_broken_offline_check_means_not_offline(clean_registry: None) -> None:
    """A factory whose ``offline()`` check raises is listed as not offline (can't tell), without an error."""

    @register_reward("flaky")
    def flaky():
        """Flaky."""
        return ink()

    def check():
        raise OSError("cache unreadable")

    flaky.offline = check
    info = {i.name: i for i in list_rewards()}["flaky"]
    assert info.offline is False and info.error is None and info.description == "Flaky."


def test_the_first_of_two_entry_points_with_one_name_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two installed ``flowrl.rewards`` entry points with the same name: the first found is used, not the last."""
    from importlib.metadata import EntryPoint

    first = EntryPoint("twin", "flowrl.rewards.digits:ink", registry.ENTRY_POINT_GROUP)
    second = EntryPoint("twin", "flowrl.rewards.jpeg:jpeg_compressibility", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry.importlib_metadata, "entry_points", lambda group=None: [first, second])
    assert registry._entry_points()["twin"] is first


def test_a_remote_reward_gets_timeout_s_itself_and_no_outer_deadline() -> None:
    """``remote:URL`` resolves to a partial of a bounds_own_time factory: its timeout_s goes to the client (one HTTP
    attempt) and MultiReward sets no deadline of its own around it."""
    multi = build_multi_reward({"r": {"reward": "remote:http://127.0.0.1:9", "timeout_s": 7}})
    assert multi.timeouts == {"r": None}
    assert multi.rewards["r"][0].timeout_s == 7.0


def test_a_plugin_that_calls_sys_exit_is_one_line_naming_it(plugin_dir: Path, monkeypatch, capsys) -> None:
    """argparse at a plugin's import (or sys.exit in its factory) ended flowrl with the plugin's usage line;
    `flowrl rewards list` died for every reward because of one plugin."""
    monkeypatch.setattr(sys, "argv", ["flowrl", "rewards", "list"])
    monkeypatch.delitem(sys.modules, "flowrl_test_plugin_exits", raising=False)  # imported by an earlier listing
    by_name = {info.name: info for info in list_rewards() if info.source != "flowrl-test-plugin" or info.name != "ink"}
    assert by_name["plugin_exiting"].error == (
        "PluginExit: it called sys.exit(2) after printing 'flowrl: error: unrecognized arguments: rewards list'"
    )
    assert by_name["plugin_constant"].error is None and by_name["ink"].error is None  # the others still listed
    for name in ("plugin_exiting", "flowrl_test_plugin_exits:factory"):
        with pytest.raises(RewardError, match="PluginExit: it called sys.exit") as exc:
            build_reward(name)
        assert name in one_line(exc)
    with pytest.raises(RewardError) as exc:
        build_reward("flowrl_test_plugin_mod:exiting", device="cuda")
    assert one_line(exc).endswith("PluginExit: it called sys.exit('no GPU')")
    assert "usage" not in capsys.readouterr().err  # what argparse printed is in the one line, not on stderr


def test_a_plugin_s_stderr_passes_through_when_it_loads(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "flowrl_test_plugin_talks.py").write_text(
        "import sys\nprint('loading weights', file=sys.stderr)\ndef factory():\n    return lambda i, p, **m: i\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert callable(build_reward("flowrl_test_plugin_talks:factory"))
    assert capsys.readouterr().err == "loading weights\n"


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        ({"reward": "remote"}, "reward 'remote' needs option 'url'; set rewards.r.url=..."),  # "config OK", then failed
        ({"reward": "ink", "timeout_s": "abc"}, "rewards.r.timeout_s must be a finite number of seconds > 0"),
        ({"reward": "ink", "timeout_s": 0}, "rewards.r.timeout_s must be a finite number of seconds > 0; got 0"),
        ({"reward": "ink", "video": "max"}, "rewards.r.video must be one of ('mean', 'min'); got 'max'"),
        ({"reward": "ink", "weight": "heavy"}, "weight of reward 'r' must be a finite number; got 'heavy'"),
    ],
)
def test_check_reward_options_checks_what_building_would_refuse(entry, fragment) -> None:
    with pytest.raises((RewardError, ValueError)) as exc:
        registry.check_reward_options({"r": entry})
    assert fragment in one_line(exc)
    with pytest.raises((RewardError, ValueError)):  # building refuses the same entry
        build_multi_reward({"r": entry})


def test_a_run_option_given_to_a_reward_itself_says_where_it_belongs() -> None:
    """``flowrl serve-reward ink timeout_s=5`` said "no option 'timeout_s' ... (and for every reward: ... timeout_s"."""
    with pytest.raises(RewardError) as exc:
        build_reward("ink", timeout_s=5)
    assert one_line(exc) == (
        "reward 'ink': 'timeout_s' is not an option of the reward itself but of a run's rewards.<name> entry; "
        "set it in the run's config; the reward's own options: target"
    )


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"url": "http://127.0.0.1:notaport"}, "has port 'notaport', not a whole number in 1..65535"),
        ({"url": "http://127.0.0.1:8765", "retrys": 3}, "unexpected keyword argument 'retrys'"),  # **options
        ({"url": "http://127.0.0.1:8765", "token": "s3cr3t\n"}, "has a space or control character at position 7"),
        ({"url": "http://user:s3cr3t@127.0.0.1:8765"}, "holds a user name or password"),
    ],
)
def test_check_builds_a_remote_reward_offline_and_never_shows_its_secrets(options, fragment) -> None:
    """``flowrl train --check`` said "config OK" for all four; the run failed only when it built its rewards (the
    first two after sampling), and the build error printed the token and the password."""
    with pytest.raises(RewardError) as exc:
        registry.check_reward_options({"judge": {"reward": "remote", **options}})
    message = one_line(exc)
    assert fragment in message and "s3cr3t" not in message
    registry.check_reward_options({"judge": {"reward": "remote", "url": "http://127.0.0.1:9", "token": "ok"}})
