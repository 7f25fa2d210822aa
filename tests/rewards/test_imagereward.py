"""ImageReward: the published ImageReward.pt layout converted into transformers' BLIP classes.

The reference re-implements BLIP's forward by hand from the raw checkpoint keys: the timm ViT
(fused qkv, pre-norm, eps 1e-6, final norm on every token), BLIP's BERT (post-norm, eps 1e-12,
self-attention with the padding mask, cross-attention to the image tokens), the [CLS] feature,
the affine MLP and the published mean/std.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_reward_weights import IMAGE, IMAGEREWARD_TINY, PATCH, save_imagereward

from flowrl.rewards.image_preprocess import clip_pixels
from flowrl.rewards.imagereward import REWARD_MEAN, REWARD_STD, TEXT_LENGTH, imagereward, load_blip_tokenizer

PROMPTS = ["a photo of a cat", "a red dog", "the bold cat 7", "a photo of a cat"]


def _attention(q_in, kv_in, sd, p, heads, key_mask=None):
    width = q_in.shape[-1]
    q = q_in @ sd[p + "query.weight"].T + sd[p + "query.bias"]
    k = kv_in @ sd[p + "key.weight"].T + sd[p + "key.bias"]
    v = kv_in @ sd[p + "value.weight"].T + sd[p + "value.bias"]
    split = lambda t: t.reshape(t.shape[0], t.shape[1], heads, width // heads).transpose(1, 2)  # noqa: E731
    logits = split(q) @ split(k).transpose(-1, -2) / math.sqrt(width // heads)
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return (logits.softmax(-1) @ split(v)).transpose(1, 2).reshape(q_in.shape)


def _vit(pixels, sd, heads):
    v = "blip.visual_encoder."
    x = (
        F.conv2d(pixels, sd[v + "patch_embed.proj.weight"], sd[v + "patch_embed.proj.bias"], stride=PATCH)
        .flatten(2)
        .transpose(1, 2)
    )
    x = torch.cat([sd[v + "cls_token"].expand(x.shape[0], -1, -1), x], dim=1) + sd[v + "pos_embed"]
    width = x.shape[-1]
    ln = lambda t, name: F.layer_norm(t, (width,), sd[name + ".weight"], sd[name + ".bias"], eps=1e-6)  # noqa: E731
    for i in range(2):
        b = f"{v}blocks.{i}."
        h = ln(x, b + "norm1")
        qkv = (h @ sd[b + "attn.qkv.weight"].T + sd[b + "attn.qkv.bias"]).reshape(
            x.shape[0], x.shape[1], 3, heads, width // heads
        )
        q, k, val = qkv.permute(2, 0, 3, 1, 4)
        att = ((q @ k.transpose(-1, -2)) * (width // heads) ** -0.5).softmax(-1) @ val
        x = x + att.transpose(1, 2).reshape(x.shape) @ sd[b + "attn.proj.weight"].T + sd[b + "attn.proj.bias"]
        h = F.gelu(ln(x, b + "norm2") @ sd[b + "mlp.fc1.weight"].T + sd[b + "mlp.fc1.bias"])
        x = x + h @ sd[b + "mlp.fc2.weight"].T + sd[b + "mlp.fc2.bias"]
    return ln(x, v + "norm")


def blip_reference(sd, pixels, ids, mask, heads):
    image = _vit(pixels, sd, heads["vision_heads"])
    t = "blip.text_encoder."
    width = sd[t + "embeddings.word_embeddings.weight"].shape[1]
    ln = lambda x, name: F.layer_norm(x, (width,), sd[name + ".weight"], sd[name + ".bias"], eps=1e-12)  # noqa: E731
    dense = lambda x, name: x @ sd[name + ".weight"].T + sd[name + ".bias"]  # noqa: E731
    x = ln(
        sd[t + "embeddings.word_embeddings.weight"][ids]
        + sd[t + "embeddings.position_embeddings.weight"][: ids.shape[1]],
        t + "embeddings.LayerNorm",
    )
    for i in range(2):
        b = f"{t}encoder.layer.{i}."
        x = ln(
            dense(
                _attention(x, x, sd, b + "attention.self.", heads["text_heads"], mask.bool()),
                b + "attention.output.dense",
            )
            + x,
            b + "attention.output.LayerNorm",
        )
        x = ln(
            dense(
                _attention(x, image, sd, b + "crossattention.self.", heads["text_heads"]),
                b + "crossattention.output.dense",
            )
            + x,
            b + "crossattention.output.LayerNorm",
        )
        x = ln(dense(F.gelu(dense(x, b + "intermediate.dense")), b + "output.dense") + x, b + "output.LayerNorm")
    h = x[:, 0]
    for index in (0, 2, 4, 6, 7):
        h = dense(h, f"mlp.layers.{index}")
    return (h[:, 0] - REWARD_MEAN) / REWARD_STD


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return save_imagereward(tmp_path_factory.mktemp("imagereward"), seed=3)


def test_scores_match_blip_forward_by_hand(published):
    ckpt, tokenizer, state = published
    images = torch.rand(len(PROMPTS), 3, 20, 28, generator=torch.Generator().manual_seed(0))
    scores = imagereward(checkpoint=str(ckpt), tokenizer=str(tokenizer), architecture=IMAGEREWARD_TINY)(images, PROMPTS)
    tokens = load_blip_tokenizer(str(tokenizer))(
        PROMPTS, padding="max_length", max_length=TEXT_LENGTH, truncation=True, return_tensors="pt"
    )
    assert tokens["input_ids"].shape == (len(PROMPTS), 35) and (tokens["attention_mask"] == 0).any()
    expected = blip_reference(
        state, clip_pixels(images, IMAGE), tokens["input_ids"], tokens["attention_mask"], IMAGEREWARD_TINY
    )
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(scores[0], scores[1])


def test_folder_spec_and_blip_specials(published):
    ckpt, tokenizer, _ = published
    reward = imagereward(checkpoint=str(ckpt.parent), tokenizer=str(tokenizer), architecture=IMAGEREWARD_TINY)
    assert reward.vision.config.layer_norm_eps == 1e-6 and reward.text.config.layer_norm_eps == 1e-12  # timm ViT / BERT
    tok = reward.tokenizer
    assert tok.bos_token == "[DEC]" and "[ENC]" in tok.all_special_tokens
    assert (
        tok.convert_tokens_to_ids(["[DEC]", "[ENC]"])
        == [len(tok) - 2, len(tok) - 1]
        == [reward.text.config.vocab_size - 2, reward.text.config.vocab_size - 1]
    )


def test_layout_errors(tmp_path, published):
    ckpt, tokenizer, state = published
    torch.save({**state, "blip.itm_head.weight": torch.zeros(2, 16)}, tmp_path / "ImageReward.pt")
    with pytest.raises(ValueError, match="blip.itm_head.weight"):
        imagereward(checkpoint=str(tmp_path), tokenizer=str(tokenizer), architecture=IMAGEREWARD_TINY)
    with pytest.raises(ValueError, match="not divisible by 5 heads"):
        imagereward(checkpoint=str(ckpt), tokenizer=str(tokenizer), architecture={"vision_heads": 2, "text_heads": 5})


def test_missing_checkpoint_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as err:
        imagereward()
    message = str(err.value)
    assert "\n" not in message and "hf download THUDM/ImageReward ImageReward.pt" in message
    assert "rewards.imagereward.checkpoint=" in message


def test_bfloat16_towers_score_in_float32(published):
    ckpt, tokenizer, _ = published
    images = torch.rand(2, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(4))
    full = imagereward(checkpoint=str(ckpt), tokenizer=str(tokenizer), architecture=IMAGEREWARD_TINY)(
        images, PROMPTS[:2]
    )
    reward = imagereward(
        checkpoint=str(ckpt), tokenizer=str(tokenizer), architecture=IMAGEREWARD_TINY, dtype="bfloat16"
    )
    half = reward(images, PROMPTS[:2])
    assert reward.vision.dtype == torch.bfloat16 and half.dtype == torch.float32
    torch.testing.assert_close(half, full, rtol=0.1, atol=0.1)
