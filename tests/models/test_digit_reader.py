"""The independent digit reader: held-out accuracy, robustness to transforms, unreadable images,
independence from the reward classifier, input errors (weight-file errors: tests/rewards/test_shipped.py)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from flowrl.models.digits import reader, reader_augment, reader_checks, reader_features
from flowrl.models.digits.reader import read_digits, reader_accuracy, reader_probabilities, reader_report
from flowrl.models.digits.reader_checks import VARIANTS, transformed_digits, unreadable_images
from flowrl.rewards.digit_data import digit_part


@pytest.fixture(scope="module")
def test_digits() -> tuple[torch.Tensor, torch.Tensor]:
    _, images, labels = digit_part("test")
    return torch.as_tensor(images)[:, None], torch.as_tensor(labels)


def test_heldout_real_digits(test_digits) -> None:
    images, labels = test_digits
    acc = reader_accuracy(images, labels)
    assert acc >= 0.95, acc
    rgb = images.expand(-1, 3, -1, -1)
    assert torch.equal(read_digits(rgb), read_digits(images))
    probs = reader_probabilities(rgb)
    assert probs.shape == (len(images), 10)
    torch.testing.assert_close(probs.sum(dim=1), torch.ones(len(images)))


@pytest.mark.parametrize("size", [8, 16, 28, 32, 64])
def test_any_resolution(test_digits, size: int) -> None:
    images, labels = test_digits
    resized = torch.nn.functional.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    assert reader_accuracy(resized if size != 8 else images, labels) >= 0.95


def test_stroke_width_robustness(test_digits) -> None:
    images, labels = test_digits
    for size in (8, 16):
        plain = reader_accuracy(transformed_digits(images, f"plain {size}x{size}"), labels)
        for kind in ("eroded", "dilated"):
            acc = reader_accuracy(transformed_digits(images, f"{kind} {size}x{size}"), labels)
            assert acc >= plain - 0.04, (kind, size, acc, plain)


@pytest.mark.parametrize(
    "variant,floor",
    [
        ("dim x0.35 8x8", 0.95),
        ("gray bg 0.3 + noise 16x16", 0.95),
        ("rotated +12 16x16", 0.95),
        ("rotated -12 16x16", 0.95),
        ("blurred 16x16", 0.95),
        ("skeleton 1.5px 16x16", 0.85),
        ("skeleton 6px 16x16", 0.85),
    ],
)
def test_transformed_digits(test_digits, variant: str, floor: float) -> None:
    images, labels = test_digits
    assert variant in VARIANTS
    assert reader_accuracy(transformed_digits(images, variant), labels) >= floor


def test_unreadable_images_are_not_read_with_confidence() -> None:
    for name, images in unreadable_images().items():
        top = reader_probabilities(images).max(dim=1).values
        limit = 0.1 + 1e-6 if name in ("blank", "uniform gray", "all white") else 0.5
        assert (top <= limit).all(), (name, top)
        if name in ("blank", "uniform gray", "all white"):  # no digit at all: never counted as a zero
            assert (read_digits(images) == -1).all() and reader_accuracy(images, [0] * len(images)) == 0.0


def test_dimmed_digit_is_still_read(test_digits) -> None:
    images, labels = test_digits
    faint = images * 0.2  # still legible: ink 0.2 on black
    assert reader_accuracy(faint, labels) >= 0.95


def test_trained_only_on_the_reader_part() -> None:
    report = reader_report()
    reader_idx, _, _ = digit_part("reader")
    reward_idx, _, _ = digit_part("reward")
    test_idx, _, _ = digit_part("test")
    assert report["train_part"] == "reader"
    assert report["train_indices_sha256"] == reader.indices_digest(reader_idx)
    assert not set(reader_idx) & set(reward_idx)
    assert not set(reader_idx) & set(test_idx)


def test_never_loads_the_reward_classifier(monkeypatch) -> None:
    flowrl_imports, relative = set(), set()
    for module in (reader, reader_augment, reader_checks, reader_features):
        for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                relative.add(node.module)
            elif isinstance(node, ast.ImportFrom) and node.module.startswith("flowrl"):
                flowrl_imports.add(node.module)
            elif isinstance(node, ast.Import):
                flowrl_imports |= {a.name for a in node.names if a.name.startswith("flowrl")}
    # the data split, and the weight-file format (shipped.py imports nothing of the classifier)
    assert flowrl_imports == {"flowrl.rewards.digit_data", "flowrl.rewards.shipped"}
    assert relative <= {"reader_augment", "reader_features"}
    from flowrl.rewards import digit_classifier

    def refuse(*args, **kwargs):
        raise AssertionError("the reader touched the reward classifier")

    monkeypatch.setattr(digit_classifier, "load_digit_classifier", refuse)
    monkeypatch.setattr(digit_classifier.DigitClassifier, "__init__", refuse)
    monkeypatch.setattr(reader, "_cached_reader", functools.lru_cache(maxsize=4)(reader.load_reader))
    _, images, labels = digit_part("test")
    assert reader_accuracy(torch.as_tensor(images[:50])[:, None], labels[:50]) >= 0.9


def test_bad_input_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="images must be"):
        read_digits(torch.rand(2, 2, 8, 8))
    with pytest.raises(ValueError, match="images must be"):
        read_digits(torch.rand(8, 8))
    with pytest.raises(ValueError, match="empty batch"):
        read_digits(torch.rand(0, 3, 16, 16))
    nan = torch.rand(2, 3, 16, 16)
    nan[1, 0, 3, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        read_digits(nan)
    with pytest.raises(TypeError, match="torch.Tensor"):
        read_digits(np.zeros((1, 3, 8, 8)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="labels must be"):
        reader_accuracy(torch.rand(3, 1, 8, 8), [1, 2])
    with pytest.raises(ValueError, match="unknown variant"):
        transformed_digits(torch.rand(3, 1, 8, 8), "sideways")


def test_thinning_gives_one_pixel_skeletons() -> None:
    bar = torch.zeros(1, 12, 12, dtype=torch.bool)
    bar[0, 2:10, 4:8] = True  # a 4-pixel-wide vertical bar
    skeleton = reader_augment.thin(bar)
    assert skeleton.any()
    assert (skeleton.sum(dim=2) <= 1).all()  # one pixel per row
    assert not (skeleton & ~bar).any()


@pytest.mark.slow
def test_training_is_deterministic_and_learns() -> None:
    first, report = reader.train_reader(seed=3, epochs=2, copies=2)
    second, _ = reader.train_reader(seed=3, epochs=2, copies=2)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert report["train_part"] == "reader"
    assert report["test_accuracy"] >= 0.8
