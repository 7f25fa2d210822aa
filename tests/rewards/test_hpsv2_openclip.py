"""HPSv2 cross-check: the open_clip path and the transformers conversion path agree on the same weights.

Runs only in the second environment (``.venv-openclip``: torch 2.14.1 + torchvision 0.29.1 +
open_clip_torch 3.3.0) with ``pytest -m openclip``; the main suite deselects it. open_clip is
imported inside the tests, so collecting this file never needs it.
"""

import gzip

import pytest
import torch
from tiny_reward_weights import IMAGE, PATCH

from flowrl.rewards.hpsv2 import HPS_FILES, hpsv2
from flowrl.rewards.image_preprocess import clip_pixels
from flowrl.rewards.openclip_convert import VIT_H_14, clip_config_from_openclip, convert_openclip_state_dict

pytestmark = pytest.mark.openclip

PROMPTS = [
    "a photo of a cat",
    "A Red DOG, sitting on a bench!",
    "café au lait 🐱 at 3pm",
    " ".join(["a very long prompt"] * 30),  # > 77 tokens: truncated, EOT kept last
    "a photo of a cat",
]
ARCH = {
    "embed_dim": 12,
    "vision_cfg": {"image_size": IMAGE, "layers": 2, "width": 16, "head_width": 8, "patch_size": PATCH},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 2},
}


def _clip_byte_chars():
    """CLIP's byte-to-unicode table in its vocab order: printable bytes first, then the others."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    rest = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + i) for i in range(len(rest))]


def hf_tokenizer_from_open_clip_vocab(folder):
    """transformers' CLIPTokenizer built offline from open_clip's bpe_simple_vocab_16e6.txt.gz (49,408 tokens)."""
    from open_clip.tokenizer import default_bpe
    from transformers import CLIPTokenizer

    lines = gzip.open(default_bpe()).read().decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1 : 49152 - 256 - 2 + 1]]
    chars = _clip_byte_chars()
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    tokenizer = CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, model_max_length=77)
    tokenizer.save_pretrained(str(folder))
    return tokenizer


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A tiny random open_clip CLIP (every parameter perturbed) saved like HPS_v2.1_compressed.pt."""
    import open_clip

    root = tmp_path_factory.mktemp("hps-openclip")
    torch.manual_seed(0)
    model = open_clip.model.CLIP(
        embed_dim=ARCH["embed_dim"], vision_cfg=ARCH["vision_cfg"], text_cfg=ARCH["text_cfg"]
    ).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    torch.save({"state_dict": model.state_dict()}, root / HPS_FILES["v2.1"])
    hf_tokenizer_from_open_clip_vocab(root / "tokenizer")
    return model, root


def test_open_clip_path_equals_published_formula_and_conversion_path(published):
    import open_clip

    model, root = published
    images = torch.rand(len(PROMPTS), 3, 24, 40, generator=torch.Generator().manual_seed(1))
    via_open_clip = hpsv2(checkpoint=str(root), backend="open_clip", architecture=ARCH)(images, PROMPTS)
    via_transformers = hpsv2(
        checkpoint=str(root), backend="transformers", architecture=ARCH, tokenizer=str(root / "tokenizer")
    )(images, PROMPTS)
    with torch.no_grad():  # HPSv2's own scoring: diag(encode_image(normalize=True) @ encode_text(normalize=True).T)
        img = model.encode_image(clip_pixels(images, IMAGE, longest_pad=True), normalize=True)
        txt = model.encode_text(open_clip.tokenizer.SimpleTokenizer(context_length=77)(PROMPTS), normalize=True)
    published_formula = (img @ txt.T).diagonal()
    torch.testing.assert_close(via_open_clip, published_formula, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(via_transformers, via_open_clip, rtol=1e-5, atol=1e-5)
    assert via_open_clip.std() > 1e-3


def test_hf_tokenizer_ids_equal_open_clip_ids(published):
    import open_clip
    from transformers import AutoTokenizer

    _, root = published
    ours = AutoTokenizer.from_pretrained(str(root / "tokenizer"))(
        PROMPTS, padding="max_length", truncation=True, max_length=77, return_tensors="pt"
    )
    ids = ours["input_ids"] * ours["attention_mask"]  # open_clip pads with 0
    torch.testing.assert_close(ids, open_clip.tokenizer.SimpleTokenizer(context_length=77)(PROMPTS))


def test_torch_preprocessing_matches_open_clip_transform():
    """Longest side -> 16 and centred zero pad, like open_clip's resize_mode='longest' (HPSv2's ResizeMaxSize)."""
    import open_clip
    from PIL import Image

    transform = open_clip.image_transform(IMAGE, is_train=False, resize_mode="longest")
    gen = torch.Generator().manual_seed(2)
    for h, w in ((24, 40), (40, 24), (30, 30), (12, 20)):
        smooth = torch.nn.functional.interpolate(torch.rand(1, 3, 6, 6, generator=gen), size=(h, w), mode="bilinear")
        x = (smooth * 255).round() / 255
        pil = Image.fromarray((x[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy())
        expected = transform(pil)[None]
        ours = clip_pixels(x, IMAGE, longest_pad=True)
        assert ours.shape == expected.shape == (1, 3, IMAGE, IMAGE)
        assert (ours - expected).abs().max() < 0.03, (h, w, (ours - expected).abs().max())  # uint8 + resampler edges


def test_vit_h_14_config_and_key_coverage():
    """Our ViT-H-14 constant is open_clip's, and every key of a real ViT-H-14 state dict converts (meta tensors)."""
    import open_clip
    from transformers import CLIPModel

    assert VIT_H_14 == open_clip.get_model_config("ViT-H-14")
    with torch.device("meta"):
        real = open_clip.model.CLIP(
            embed_dim=VIT_H_14["embed_dim"], vision_cfg=VIT_H_14["vision_cfg"], text_cfg=VIT_H_14["text_cfg"]
        )
        state = real.state_dict()
        config = clip_config_from_openclip(state, VIT_H_14, eos_token_id=49407)
        converted = CLIPModel(config)
    assert (config.vision_config.num_attention_heads, config.text_config.num_attention_heads) == (16, 16)
    assert (config.vision_config.hidden_act, config.vision_config.intermediate_size) == ("gelu", 5120)
    missing, unexpected = converted.load_state_dict(convert_openclip_state_dict(state), strict=False, assign=True)
    assert not unexpected and set(missing) <= {
        "text_model.embeddings.position_ids",
        "vision_model.embeddings.position_ids",
    }
