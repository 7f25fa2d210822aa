"""CLIPScore loads OpenAI's layout (one folder: CLIPModel + processor) and equals 2.5 * max(cos, 0)."""

import pytest
import torch
from tiny_reward_weights import IMAGE, clip_tokenizer, save_clip_folder, save_clip_processor, tiny_clip_model

from flowrl.rewards.clipscore import clipscore
from flowrl.rewards.image_preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, normalize

PROMPTS = ["a photo of a cat", "a red dog", "the bold dog", "a thin cat", "a cat", "a dog"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = save_clip_folder(tmp_path_factory.mktemp("clipscore") / "clip-vit-large-patch14", seed=2)
    return save_clip_processor(root)  # OpenAI's repo holds model and processor together


def _cosines(images, prompts):
    """Cosine between transformers' own normalised text_embeds and image_embeds."""
    model = tiny_clip_model(seed=2)
    tokens = clip_tokenizer()(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**tokens, pixel_values=normalize(images, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD))
    return (out.text_embeds * out.image_embeds).sum(-1)


def test_clipscore_is_clamped_scaled_cosine(folder):
    images = torch.rand(len(PROMPTS), 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(0))
    scores = clipscore(model=str(folder))(images, PROMPTS)
    cos = _cosines(images, PROMPTS)
    torch.testing.assert_close(scores, 2.5 * cos.clamp(min=0), rtol=1e-5, atol=1e-6)
    assert (cos < 0).any() and (cos > 0).any()  # both branches of max(cos, 0) are exercised


def test_weight_option(folder):
    images = torch.rand(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1))
    cos = _cosines(images, PROMPTS[:2])
    torch.testing.assert_close(
        clipscore(model=str(folder), weight=1.0)(images, PROMPTS[:2]), cos.clamp(min=0), rtol=1e-5, atol=1e-6
    )


def test_missing_weights_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"OpenAI CLIP ViT-L/14.*rewards\.clipscore\.(model|processor)"):
        clipscore(model="flowrl-tests/no-clip")
