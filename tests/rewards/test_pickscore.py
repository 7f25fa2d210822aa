"""PickScore loads the published layout (CLIPModel folder + CLIP-H processor folder) and scores like CLIPModel."""

import time

import numpy as np
import pytest
import torch
from conftest import PlantedPickle
from tiny_reward_weights import IMAGE, clip_tokenizer, save_clip_folder, save_clip_processor, tiny_clip_model

from flowrl.rewards.image_preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, clip_pixels, normalize
from flowrl.rewards.pickscore import pickscore

PROMPTS = ["a photo of a cat", "a red dog", "a photo of a cat"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pickscore")
    return save_clip_folder(root / "model"), save_clip_processor(root / "processor")


def _reference(images, prompts, seed=0):
    """logits_per_image of transformers' own CLIPModel forward (= exp(logit_scale) * cosine)."""
    model = tiny_clip_model(seed)
    tokens = clip_tokenizer()(prompts, padding="max_length", max_length=24, truncation=True, return_tensors="pt")
    with torch.no_grad():
        out = model(
            input_ids=tokens["input_ids"],
            attention_mask=tokens["attention_mask"],
            pixel_values=normalize(images, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD),
        )
    return out.logits_per_image.diagonal()


def test_scores_equal_clipmodel_logits(folders):
    images = torch.rand(3, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1))
    reward = pickscore(model=str(folders[0]), processor=str(folders[1]))
    scores = reward(images, PROMPTS)
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores, _reference(images, PROMPTS), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(scores[0], scores[2])  # same prompt, different image -> different score


def test_scale_option_multiplies(folders):
    images = torch.rand(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(2))
    raw = pickscore(model=str(folders[0]), processor=str(folders[1]))(images, PROMPTS[:2])
    scaled = pickscore(model=str(folders[0]), processor=str(folders[1]), scale=1 / 26)(images, PROMPTS[:2])
    torch.testing.assert_close(scaled, raw / 26)


def test_pickle_checkpoint_loads_with_weights_only(tmp_path, folders):
    folder = save_clip_folder(tmp_path / "bin", pickle=True)
    assert not list(folder.glob("*.safetensors"))
    images = torch.rand(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(3))
    scores = pickscore(model=str(folder), processor=str(folders[1]))(images, PROMPTS[:2])
    torch.testing.assert_close(scores, _reference(images, PROMPTS[:2]), rtol=1e-5, atol=1e-5)


def test_a_pickle_the_safe_loader_refuses_is_one_line_naming_the_file_and_never_runs(tmp_path, folders):
    """transformers let torch's UnpicklingError through: a traceback naming no file, advising weights_only=False."""
    folder = save_clip_folder(tmp_path / "bin", pickle=True)
    marker = tmp_path / "PLANTED"
    torch.save({"text_model.embeddings.position_ids": PlantedPickle(marker)}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError) as err:
        pickscore(model=str(folder), processor=str(folders[1]))
    msg = str(err.value)
    assert "\n" not in msg and f"refused the pickled weights in {folder} (pytorch_model.bin: Unsupported global" in msg
    assert "weights_only=False" not in msg and not marker.exists()


def test_preprocessing_matches_clip_image_processor():
    """Shorter side -> 16, centre crop 16, like transformers' CLIPImageProcessor (PIL bicubic, uint8)."""
    from transformers import CLIPImageProcessor

    gen = torch.Generator().manual_seed(4)
    smooth = torch.nn.functional.interpolate(torch.rand(1, 3, 6, 8, generator=gen), size=(24, 40), mode="bilinear")
    pil_like = (smooth * 255).round() / 255
    processor = CLIPImageProcessor(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE})
    expected = processor(
        images=[(pil_like[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)], return_tensors="pt"
    )
    ours = clip_pixels(pil_like, IMAGE)
    assert ours.shape == expected["pixel_values"].shape == (1, 3, IMAGE, IMAGE)
    assert (ours - expected["pixel_values"]).abs().max() < 0.03  # measured 0.014: uint8 rounding, resampler edges


def test_gradients_reach_the_pixels(folders):
    reward = pickscore(model=str(folders[0]), processor=str(folders[1]))
    images = torch.rand(2, 3, 20, 24, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    reward.score(images, PROMPTS[:2]).sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0
    assert reward(images, PROMPTS[:2]).requires_grad is False


def test_missing_weights_one_line_error_without_retries(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError) as err:
        pickscore(model="flowrl-tests/not-a-pickscore", processor="flowrl-tests/not-a-processor")
    message = str(err.value)
    assert time.perf_counter() - start < 5
    assert "\n" not in message and "hf download flowrl-tests/not-a-" in message
    assert "rewards.pickscore." in message and "HF_HUB_OFFLINE" in message


def test_missing_local_folder_names_the_key(tmp_path, folders):
    with pytest.raises(FileNotFoundError, match="rewards.pickscore.model"):
        pickscore(model=str(tmp_path / "nope"), processor=str(folders[1]))


def test_bfloat16_weights_score_in_float32(folders):
    images = torch.rand(3, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(6))
    full = pickscore(model=str(folders[0]), processor=str(folders[1]))(images, PROMPTS)
    reward = pickscore(model=str(folders[0]), processor=str(folders[1]), dtype="bfloat16")
    half = reward(images, PROMPTS)
    assert reward.embedder.model.dtype == torch.bfloat16 and half.dtype == torch.float32
    torch.testing.assert_close(half, full, rtol=0.05, atol=0.05)
