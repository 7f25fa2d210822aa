"""The project's shipped weight files (digit classifier, digit reader): round trip and every refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flowrl.models.digits import reader
from flowrl.rewards import digit_classifier
from flowrl.rewards.shipped import asset_path, shipped_report

# (loader, saver, the module it builds, its default file, what its messages call it, its regenerate command)
FILES = {
    "classifier": (
        digit_classifier.load_digit_classifier,
        digit_classifier.save_digit_classifier,
        digit_classifier.DigitClassifier,
        digit_classifier.default_weights_path,
        "digit classifier weights",
        "python -m flowrl.rewards.digit_classifier",
    ),
    "reader": (
        reader.load_reader,
        reader.save_reader,
        reader.ReaderHead,
        reader.default_weights_path,
        "digit reader weights",
        "python -m flowrl.models.digits.reader",
    ),
}


@pytest.mark.parametrize("name", FILES)
def test_the_shipped_file_loads_frozen_in_eval_mode_with_its_report(name: str) -> None:
    load, _, cls, default, _, _ = FILES[name]
    model = load()
    assert isinstance(model, cls) and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert default() == asset_path(default().name) and default().is_file()
    assert shipped_report(default())["seed"] == 0


@pytest.mark.parametrize("name", FILES)
def test_a_saved_state_loads_back_bit_for_bit_with_its_report(name: str, tmp_path: Path) -> None:
    load, save, cls, _, _, _ = FILES[name]
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in cls().state_dict().items()}
    path = save(state, tmp_path / "sub" / "w.safetensors", {"seed": 7, "note": "x"})
    loaded = load(path).state_dict()
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    assert shipped_report(path) == {"seed": 7, "note": "x"}


@pytest.mark.parametrize("name", FILES)
def test_a_missing_file_names_the_command_that_regenerates_it(name: str, tmp_path: Path) -> None:
    load, _, _, _, what, command = FILES[name]
    with pytest.raises(FileNotFoundError, match=f"{what} not found at .*missing.safetensors.*`{command} --out"):
        load(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("damage", ["garbage", "truncated", "header"])
def test_a_corrupt_or_truncated_file_is_refused_by_name(name: str, damage: str, tmp_path: Path) -> None:
    load, _, _, default, what, command = FILES[name]
    data = default().read_bytes()
    bad = tmp_path / "bad.safetensors"
    if damage == "garbage":
        bad.write_bytes(b"not a safetensors file")
    elif damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    else:  # the header's length field says more bytes than the file holds
        bad.write_bytes((len(data) * 2).to_bytes(8, "little") + data[8:])
    with pytest.raises(ValueError, match=f"{what} at .*bad.safetensors are corrupt .*`{command} --out"):
        load(bad)


def test_each_loader_refuses_the_other_s_file_by_its_format_tag() -> None:
    for name, other in (("classifier", "reader"), ("reader", "classifier")):
        load, _, _, _, what, command = FILES[name]
        foreign = FILES[other][3]()
        with pytest.raises(ValueError, match=f"does not hold {what} .*got 'flowrl.digit_{other}/1'.*`{command}"):
            load(foreign)


@pytest.mark.parametrize("name", FILES)
def test_an_untagged_file_is_refused(name: str, tmp_path: Path) -> None:
    load, _, cls, _, what, _ = FILES[name]
    path = tmp_path / "untagged.safetensors"
    save_file(cls().state_dict(), str(path))  # right tensors, no format tag
    with pytest.raises(ValueError, match=f"does not hold {what} .*got None"):
        load(path)


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("change", ["missing", "unexpected", "misshapen"])
def test_tensors_that_do_not_match_the_module_are_refused(name: str, change: str, tmp_path: Path) -> None:
    load, save, cls, _, what, _ = FILES[name]
    state = dict(cls().state_dict())
    first = next(iter(state))
    if change == "missing":
        del state[first]
    elif change == "unexpected":
        state["extra.weight"] = torch.zeros(2)
    else:
        state[first] = torch.zeros(*state[first].shape[:-1], state[first].shape[-1] + 1)
    path = save(state, tmp_path / "w.safetensors", {})
    with pytest.raises(ValueError, match=f"{what} at .* do not match {cls.__name__}"):
        load(path)
