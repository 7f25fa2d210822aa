"""Input bounds of the demo form: prompt length, seed count and range, steps, guidance, sampler, selection."""

import pytest

from flowrl.demo.validation import MAX_PROMPT_CHARS, MAX_SEED, MAX_SEEDS, MAX_STEPS, parse_seeds, validate_request

KNOWN = ["base", "run-a"]
GOOD = dict(prompt="a bold handwritten 3", seeds="0-3", sampler="ode", steps=10, guidance=1.0, noise_level=0.7)


def check(**changes):
    args = {**GOOD, "checkpoints": ["base", "run-a"], **changes}
    return validate_request(**args, known=KNOWN)


def test_a_good_request_is_parsed():
    r = check(seeds="3, 0-1, 3")
    assert r.seeds == (3, 0, 1) and r.steps == 10 and r.checkpoints == ("base", "run-a")
    assert check(sampler="flow").sampler == "flow" and check(sampler="cps", noise_level=1.0).noise_level == 1.0


@pytest.mark.parametrize(
    "changes, fragment",
    [
        (dict(prompt="   "), "enter a prompt"),
        (dict(prompt="x" * (MAX_PROMPT_CHARS + 1)), f"at most {MAX_PROMPT_CHARS} characters"),
        (dict(seeds=""), "at least one seed"),
        (dict(seeds="-1"), "is not a seed"),
        (dict(seeds="abc"), "is not a seed"),
        (dict(seeds=f"0-{MAX_SEEDS}"), f"at most {MAX_SEEDS} seeds"),
        (dict(seeds=str(MAX_SEED + 1)), "out of range"),
        (dict(seeds="5-2"), "runs backwards"),
        (dict(seeds="9" * 5000), "is not a seed"),  # past int()'s digit limit: still this field's message
        (dict(prompt="a \udcff 3"), "prompt: holds characters that are not text"),  # a lone surrogate (JSON API)
        (dict(prompt="a \x07 3"), "prompt: holds characters that are not text"),
        (dict(steps=0), f"between 1 and {MAX_STEPS}"),
        (dict(steps=MAX_STEPS + 1), f"between 1 and {MAX_STEPS}"),
        (dict(steps=2.5), "integer"),
        (dict(steps="ten"), "must be a number"),
        (dict(guidance=-1), "guidance must be between"),
        (dict(guidance=float("nan")), "finite"),
        (dict(sampler="ddim"), "sampler must be one of"),
        (dict(sampler="cps", noise_level=1.5), "between 0 and 1"),
        (dict(checkpoints=[]), "at least one checkpoint"),
        (dict(checkpoints=["../../etc"]), "is not offered"),
    ],
)
def test_bad_input_is_one_line_naming_the_field(changes, fragment):
    with pytest.raises(ValueError) as err:
        check(**changes)
    message = str(err.value)
    assert fragment in message and "\n" not in message, message


def test_seed_ranges_are_inclusive_and_deduplicated():
    assert parse_seeds("0-2, 2, 7") == (0, 1, 2, 7)
    assert parse_seeds(str(MAX_SEED)) == (MAX_SEED,)


def test_a_range_ending_past_max_seed_is_out_of_range() -> None:
    """The range's upper end is checked against MAX_SEED too, not only its start."""
    with pytest.raises(ValueError, match=rf"seeds: {MAX_SEED + 1} is out of range"):
        parse_seeds(f"{MAX_SEED}-{MAX_SEED + 1}")


def test_the_bounds_of_steps_guidance_and_noise_are_inclusive() -> None:
    """guidance 0 and MAX_GUIDANCE, steps 1 and MAX_STEPS, noise level 0 and 2 (1 for cps) are all accepted."""
    from flowrl.demo.validation import MAX_GUIDANCE, MAX_NOISE_LEVEL

    assert check(guidance=0).guidance == 0.0 and check(guidance=MAX_GUIDANCE).guidance == MAX_GUIDANCE
    assert check(steps=1).steps == 1 and check(steps=MAX_STEPS).steps == MAX_STEPS
    assert check(sampler="flow", noise_level=MAX_NOISE_LEVEL).noise_level == MAX_NOISE_LEVEL
    assert check(sampler="cps", noise_level=0).noise_level == 0.0
