"""HPSv2 through the open_clip -> transformers key conversion, against open_clip's forward written by hand.

The checkpoint is a tiny random ViT CLIP saved exactly like HPS_v2.1_compressed.pt
(``{"state_dict": open_clip keys}``). The reference below re-implements open_clip's CLIP forward
(packed in_proj attention, class token, causal text mask, argmax-EOT pooling, projections)
directly from the raw state dict, sharing no code with the converter.
"""

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F
from tiny_reward_weights import (
    IMAGE,
    clip_tokenizer,
    openclip_state_dict,
    save_clip_processor,
    save_hps_checkpoint,
    tiny_openclip_architecture,
)

from flowrl.rewards.hpsv2 import HPS_FILES, hpsv2
from flowrl.rewards.image_preprocess import clip_pixels, resize_longest_pad
from flowrl.rewards.openclip_convert import convert_openclip_state_dict

PROMPTS = ["a photo of a cat", "a red dog", "the thin cat", "a photo of a cat"]


def _block(x, sd, prefix, heads, causal):
    width = x.shape[-1]
    h = F.layer_norm(x, (width,), sd[prefix + "ln_1.weight"], sd[prefix + "ln_1.bias"], eps=1e-5)
    q, k, v = (h @ sd[prefix + "attn.in_proj_weight"].T + sd[prefix + "attn.in_proj_bias"]).chunk(3, dim=-1)
    split = lambda t: t.reshape(t.shape[0], t.shape[1], heads, width // heads).transpose(1, 2)  # noqa: E731
    logits = split(q) @ split(k).transpose(-1, -2) / math.sqrt(width // heads)
    if causal:
        n = x.shape[1]
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    att = (logits.softmax(-1) @ split(v)).transpose(1, 2).reshape(x.shape)
    x = x + att @ sd[prefix + "attn.out_proj.weight"].T + sd[prefix + "attn.out_proj.bias"]
    h = F.layer_norm(x, (width,), sd[prefix + "ln_2.weight"], sd[prefix + "ln_2.bias"], eps=1e-5)
    h = F.gelu(h @ sd[prefix + "mlp.c_fc.weight"].T + sd[prefix + "mlp.c_fc.bias"])
    return x + h @ sd[prefix + "mlp.c_proj.weight"].T + sd[prefix + "mlp.c_proj.bias"]


def openclip_reference(sd, arch, pixels, prompts):
    """HPS score = diag(normalize(encode_image) @ normalize(encode_text).T), computed by hand."""
    v, t = arch["vision_cfg"], arch["text_cfg"]
    x = F.conv2d(pixels, sd["visual.conv1.weight"], stride=v["patch_size"]).flatten(2).transpose(1, 2)
    x = (
        torch.cat([sd["visual.class_embedding"].expand(x.shape[0], 1, -1), x], dim=1)
        + sd["visual.positional_embedding"]
    )
    x = F.layer_norm(x, (v["width"],), sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"], eps=1e-5)
    for i in range(v["layers"]):
        x = _block(x, sd, f"visual.transformer.resblocks.{i}.", v["width"] // v["head_width"], causal=False)
    img = (
        F.layer_norm(x[:, 0], (v["width"],), sd["visual.ln_post.weight"], sd["visual.ln_post.bias"], eps=1e-5)
        @ sd["visual.proj"]
    )
    ids = torch.zeros(len(prompts), t["context_length"], dtype=torch.long)  # open_clip pads with 0
    for row, prompt in enumerate(prompts):
        tokens = clip_tokenizer()(prompt)["input_ids"][: t["context_length"]]
        ids[row, : len(tokens)] = torch.tensor(tokens)
    y = sd["token_embedding.weight"][ids] + sd["positional_embedding"]
    for i in range(t["layers"]):
        y = _block(y, sd, f"transformer.resblocks.{i}.", t["heads"], causal=True)
    y = F.layer_norm(y, (t["width"],), sd["ln_final.weight"], sd["ln_final.bias"], eps=1e-5)
    txt = y[torch.arange(len(prompts)), ids.argmax(-1)] @ sd["text_projection"]
    return (F.normalize(img, dim=-1) * F.normalize(txt, dim=-1)).sum(-1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hps")
    arch = tiny_openclip_architecture(len(clip_tokenizer()))
    state = openclip_state_dict(arch, seed=5)
    ckpt = save_hps_checkpoint(root / HPS_FILES["v2.1"], state)
    return arch, state, ckpt, str(save_clip_processor(root / "tokenizer"))


def test_conversion_path_matches_openclip_forward(setup):
    arch, state, ckpt, tokenizer = setup
    images = torch.rand(len(PROMPTS), 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(0))
    reward = hpsv2(checkpoint=str(ckpt), backend="transformers", architecture=arch, tokenizer=tokenizer)
    scores = reward(images, PROMPTS)
    expected = openclip_reference(state, arch, clip_pixels(images, IMAGE, longest_pad=True), PROMPTS)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
    assert scores.abs().max() <= 1.0 and not torch.allclose(scores[0], scores[1])


def test_folder_spec_picks_the_version_file_and_fp16_checkpoints_load(tmp_path, setup):
    arch, state, _, tokenizer = setup
    half = {k: v.half() for k, v in state.items()}
    save_hps_checkpoint(tmp_path / HPS_FILES["v2.0"], half)
    images = torch.rand(2, 3, 24, 40, generator=torch.Generator().manual_seed(1))  # non-square: resize + pad
    reward = hpsv2(
        checkpoint=str(tmp_path), version="v2.0", backend="transformers", architecture=arch, tokenizer=tokenizer
    )
    expected = openclip_reference(
        {k: v.float() for k, v in half.items()}, arch, clip_pixels(images, IMAGE, longest_pad=True), PROMPTS[:2]
    )
    torch.testing.assert_close(reward(images, PROMPTS[:2]), expected, rtol=1e-5, atol=1e-5)


def test_longest_side_resize_and_centred_zero_pad():
    images = torch.rand(1, 3, 8, 32, generator=torch.Generator().manual_seed(2))
    out = resize_longest_pad(images, 16)  # 8 x 32 -> 4 x 16, then 6 rows of zeros above and below
    assert out.shape == (1, 3, 16, 16)
    assert out[..., :6, :].abs().max() == 0 and out[..., 10:, :].abs().max() == 0
    expected = F.interpolate(images, size=(4, 16), mode="bicubic", antialias=True).clamp(0, 1)
    torch.testing.assert_close(out[..., 6:10, :], expected)


def test_checkpoint_errors(tmp_path, setup):
    arch, state, _, tokenizer = setup
    with pytest.raises(FileNotFoundError, match=r"HPS_v2\.1_compressed\.pt.*rewards\.hpsv2\.checkpoint"):
        hpsv2(checkpoint=str(tmp_path), backend="transformers", architecture=arch, tokenizer=tokenizer)
    wrong = dict(arch, vision_cfg=dict(arch["vision_cfg"], layers=3))
    with pytest.raises(ValueError, match="vision layers is 2 in the checkpoint but 3"):
        hpsv2(checkpoint=str(setup[2]), backend="transformers", architecture=wrong, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="has no transformers CLIPModel counterpart"):
        convert_openclip_state_dict({**state, "visual.attn_pool.query": torch.zeros(1)})
    with pytest.raises(ValueError, match="version"):
        hpsv2(version="v3")


def test_missing_hub_checkpoint_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as err:
        hpsv2(backend="transformers")
    message = str(err.value)
    assert "\n" not in message and "hf download xswu/HPSv2 HPS_v2.1_compressed.pt" in message
    assert "rewards.hpsv2.checkpoint=" in message


def test_open_clip_backend_needs_the_extra(setup):
    arch, _, ckpt, _ = setup
    if importlib.util.find_spec("open_clip") is None:
        with pytest.raises(ImportError, match=r"flowrl\[openclip\]"):
            hpsv2(checkpoint=str(ckpt), backend="open_clip", architecture=arch)
    else:  # the second test environment: the backend loads (agreement is in test_hpsv2_openclip.py)
        assert hpsv2(checkpoint=str(ckpt), backend="open_clip", architecture=arch).embedder.model is not None
