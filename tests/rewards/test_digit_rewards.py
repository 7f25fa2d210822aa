"""digit_correctness (shipped classifier on unseen real digits), ink and the classifier itself."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from flowrl.rewards import RewardError, build_reward, digit_correctness, ink, ink_amount, score_reward
from flowrl.rewards.digit_classifier import (
    DigitClassifier,
    MaxPool2x2,
    augment,
    default_weights_path,
    digits_split,
    dilate,
    erode,
    load_digit_classifier,
    train_digit_classifier,
)
from flowrl.rewards.digits import digit_from_prompt, prompt_style, to_gray8


@pytest.fixture(scope="module")
def heldout() -> tuple[torch.Tensor, torch.Tensor]:
    """The 25% split the shipped classifier never trained on (seed 0), 3-channel, first 200."""
    _, _, x_test, y_test = digits_split(0)
    return x_test[:200].expand(-1, 3, -1, -1).contiguous(), y_test[:200]


@pytest.fixture(scope="module")
def correctness():
    return digit_correctness()


def prompts_for(labels: torch.Tensor, style: str = "") -> list[str]:
    return [f"a {style}handwritten {int(d)}" for d in labels]


def test_shipped_weights_are_small_and_report_high_heldout_accuracy() -> None:
    path = default_weights_path()
    assert path.is_file() and path.stat().st_size < 1_000_000
    with safe_open(str(path), framework="pt") as f:
        report = json.loads(f.metadata()["report"])
    assert report["heldout_accuracy"] >= 0.98 and report["seed"] == 0


def test_correct_prompts_score_high_and_wrong_prompts_low(correctness, heldout) -> None:
    images, labels = heldout
    right = correctness(images, prompts_for(labels))
    wrong = correctness(images, prompts_for((labels + 1) % 10))
    assert right.shape == (len(labels),) and right.dtype == torch.float32
    assert float(right.mean()) > 0.9 and float((right > 0.5).float().mean()) >= 0.97
    assert float(wrong.mean()) < 0.05
    assert bool(((right >= 0) & (right <= 1)).all())


def test_metadata_digit_overrides_prompt_and_none_falls_back(correctness, heldout) -> None:
    images, labels = heldout[0][:8], heldout[1][:8]
    misleading = prompts_for((labels + 3) % 10)
    from_meta = correctness(images, misleading, digit=labels.tolist())
    from_tensor = correctness(images, misleading, digit=labels)
    from_prompt = correctness(images, prompts_for(labels))
    torch.testing.assert_close(from_meta, from_prompt)
    torch.testing.assert_close(from_tensor, from_prompt)
    mixed = [None] * 4 + labels[4:].tolist()
    torch.testing.assert_close(correctness(images, prompts_for(labels), digit=mixed), from_prompt)


def test_larger_images_are_area_resized(correctness, heldout) -> None:
    images, labels = heldout[0][:16], heldout[1][:16]
    big = images.repeat_interleave(4, dim=2).repeat_interleave(4, dim=3)  # 32x32, exact area inverse
    torch.testing.assert_close(correctness(big, prompts_for(labels)), correctness(images, prompts_for(labels)))
    assert to_gray8(torch.rand(2, 3, 24, 40)).shape == (2, 1, 8, 8)


def test_bold_thin_and_faint_digits_still_classify(correctness, heldout) -> None:
    images, labels = heldout
    gray = images[:, :1]
    variants = {
        "bold": gray + 0.5 * (dilate(gray) - gray),
        "thin": gray + 0.5 * (erode(gray) - gray),
        "faint": gray * 0.5,
    }
    for name, variant in variants.items():
        score = correctness(variant.expand(-1, 3, -1, -1), prompts_for(labels))
        assert float(score.mean()) > 0.85, name


def test_batch_of_one(correctness, heldout) -> None:
    images, labels = heldout
    out = score_reward("digit_correctness", correctness, images[:1], prompts_for(labels[:1]), {})
    assert out.shape == (1,) and float(out[0]) > 0.5


def test_prompt_parsing() -> None:
    assert digit_from_prompt("a bold handwritten 7") == 7
    assert digit_from_prompt("draw 3, no wait, 8.") == 8
    assert digit_from_prompt("7 is lucky") == 7
    with pytest.raises(ValueError, match="'a handwritten 10'") as exc:
        digit_from_prompt("a handwritten 10")
    assert "\n" not in str(exc.value)
    assert prompt_style("A BOLD handwritten 2") == "bold"
    assert prompt_style("a boldly thinner 2") is None
    with pytest.raises(ValueError, match="both"):
        prompt_style("bold and thin 3")


def test_prompt_without_digit_is_named(correctness) -> None:
    with pytest.raises(RewardError) as exc:
        score_reward("digit_correctness", correctness, torch.rand(2, 3, 8, 8), ["a handwritten 1", "a cat"], {})
    message = str(exc.value)
    assert "\n" not in message and "'digit_correctness'" in message and "'a cat'" in message


@pytest.mark.parametrize("digits", [[1, 10], [1, -1], [1, 2, 3], [1, 2.5]])
def test_bad_metadata_digits(correctness, digits) -> None:
    with pytest.raises(ValueError):
        correctness(torch.rand(2, 3, 8, 8), ["a 1", "a 2"], digit=digits)


def test_missing_and_corrupt_weights_name_path_and_fix(tmp_path) -> None:
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError) as exc:
        digit_correctness(str(missing))
    assert str(missing) in str(exc.value) and "python -m flowrl.rewards.digit_classifier" in str(exc.value)
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x00garbage" * 20)
    with pytest.raises(ValueError) as exc:
        digit_correctness(str(corrupt))
    assert "\n" not in str(exc.value) and str(corrupt) in str(exc.value)
    with pytest.raises(RewardError) as exc:
        build_reward("digit_correctness", weights=str(corrupt))
    assert "'digit_correctness'" in str(exc.value) and "\n" not in str(exc.value)


def test_ink_ordering_bold_thin_and_brightness(heldout) -> None:
    gray = heldout[0][:32, :1]
    thicker = dilate(gray)
    thinner = erode(gray)
    rgb = lambda x: x.expand(-1, 3, -1, -1)  # noqa: E731
    assert bool((ink_amount(rgb(thicker)) > ink_amount(rgb(gray))).all())
    assert bool((ink_amount(rgb(thinner)) < ink_amount(rgb(gray))).all())
    assert bool((ink_amount(rgb(gray * 0.5)) < ink_amount(rgb(gray))).all())
    torch.testing.assert_close(ink_amount(torch.ones(2, 3, 5, 7)), torch.ones(2))
    torch.testing.assert_close(ink_amount(torch.zeros(1, 3, 16, 16)), torch.zeros(1))


def test_ink_targets() -> None:
    images = torch.stack([torch.full((3, 8, 8), v) for v in (0.2, 0.6, 0.4)])
    prompts = ["a bold handwritten 1", "a thin handwritten 2", "a handwritten 3"]
    torch.testing.assert_close(ink("bold")(images, prompts), torch.tensor([0.2, 0.6, 0.4]))
    torch.testing.assert_close(ink("thin")(images, prompts), torch.tensor([0.8, 0.4, 0.6]))
    by_prompt = ink("prompt")
    out = by_prompt(images, prompts)
    assert out.dtype == torch.float32 and by_prompt.allows_nan and not ink("bold").allows_nan
    torch.testing.assert_close(out[:2], torch.tensor([0.2, 0.4]))
    assert math.isnan(float(out[2]))
    with_meta = by_prompt(images, prompts, style=["thin", None, "bold"])
    torch.testing.assert_close(with_meta, torch.tensor([0.8, 0.4, 0.4]))
    with pytest.raises(ValueError, match="target"):
        ink("fat")


def test_ink_prompt_all_styleless_batch_is_rejected_by_contract() -> None:
    with pytest.raises(RewardError, match="every sample"):
        score_reward("ink", ink("prompt"), torch.rand(2, 3, 8, 8), ["a handwritten 1", "a handwritten 2"], {})
    one = score_reward("ink", ink("prompt"), torch.full((1, 3, 8, 8), 0.25), ["a thin handwritten 1"], {})
    torch.testing.assert_close(one, torch.tensor([0.75]))


def test_training_is_deterministic_and_augmentation_stays_in_range() -> None:
    state_a, report_a = train_digit_classifier(seed=3, epochs=1)
    state_b, _ = train_digit_classifier(seed=3, epochs=1)
    assert state_a.keys() == DigitClassifier().state_dict().keys()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert report_a["n_train"] == 1347 and report_a["n_test"] == 450 and report_a["heldout_accuracy"] > 0.1
    x = digits_split(0)[0][:64]
    aug = augment(x, torch.Generator().manual_seed(0))
    assert aug.shape == x.shape and float(aug.min()) >= 0 and float(aug.max()) <= 1
    assert not torch.equal(aug, x)
    assert F.mse_loss(augment(x, torch.Generator().manual_seed(1)), aug) > 0


@pytest.mark.parametrize("shape", [(40, 32, 8, 8), (3, 64, 4, 4), (1, 1, 2, 2), (5, 7, 9, 11), (2, 3, 2, 6)])
def test_channels_last_pooling_is_max_pool2d_bit_for_bit(shape) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g)
    x = torch.cat([x, (2 * x).round(), torch.zeros_like(x)])  # with ties: equal maxima in a window
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ref, ours = F.max_pool2d(a, 2), MaxPool2x2()(b)
    assert ours.is_contiguous() and torch.equal(ours, ref)
    grad = torch.randn(ref.shape, generator=g)
    ref.backward(grad)
    ours.backward(grad)
    assert torch.equal(a.grad, b.grad)  # the gradient reaches the same elements


def test_the_shipped_classifier_scores_as_with_torchs_pooling() -> None:
    model = load_digit_classifier()
    reference = DigitClassifier()
    reference.load_state_dict(model.state_dict())
    reference.features[4] = torch.nn.MaxPool2d(2)
    reference.features[7] = torch.nn.MaxPool2d(2)
    reference.eval()
    x = torch.cat([digits_split(0)[2][:100], torch.rand(37, 1, 8, 8, generator=torch.Generator().manual_seed(0))])
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
