"""Convert an open_clip CLIP state dict (ViT image tower + causal text tower) into transformers' ``CLIPModel``.

open_clip keys (as in HPSv2's published checkpoints) map onto ``CLIPModel`` like this
(``{t}`` = ``transformer.resblocks.N`` / ``visual.transformer.resblocks.N``):

==========================================  ==================================================
open_clip                                   transformers ``CLIPModel``
==========================================  ==================================================
``token_embedding.weight``                  ``text_model.embeddings.token_embedding.weight``
``positional_embedding`` (L, D)             ``text_model.embeddings.position_embedding.weight``
``{t}.attn.in_proj_weight`` (3D, D)         ``...self_attn.{q,k,v}_proj.weight`` (split in 3)
``{t}.attn.in_proj_bias`` (3D,)             ``...self_attn.{q,k,v}_proj.bias``
``{t}.attn.out_proj.*``                     ``...self_attn.out_proj.*``
``{t}.ln_1.*`` / ``{t}.ln_2.*``             ``...layer_norm1.*`` / ``...layer_norm2.*``
``{t}.mlp.c_fc.*`` / ``{t}.mlp.c_proj.*``   ``...mlp.fc1.*`` / ``...mlp.fc2.*``
``ln_final.*``                              ``text_model.final_layer_norm.*``
``text_projection`` (D, E)                  ``text_projection.weight`` (E, D) = transpose
``visual.class_embedding`` (D,)             ``vision_model.embeddings.class_embedding``
``visual.conv1.weight``                     ``vision_model.embeddings.patch_embedding.weight``
``visual.positional_embedding`` (N+1, D)    ``vision_model.embeddings.position_embedding.weight``
``visual.ln_pre.*`` / ``visual.ln_post.*``  ``vision_model.pre_layrnorm.*`` / ``vision_model.post_layernorm.*``
``visual.proj`` (D, E)                      ``visual_projection.weight`` (E, D) = transpose
``logit_scale`` (log of the scale)          ``logit_scale``
==========================================  ==================================================

Shapes give every width, depth and size; the head counts and the activation come from the open_clip
model config (``vision_cfg.width / vision_cfg.head_width`` and ``text_cfg.heads``; GELU unless
``quick_gelu``). Reference: Ilharco et al., OpenCLIP (2021); Cherti et al., "Reproducible scaling
laws for contrastive language-image learning", CVPR 2023.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch
from torch import Tensor

# open_clip's ViT-H-14 model config (open_clip/model_configs/ViT-H-14.json), the HPSv2 backbone.
VIT_H_14: dict[str, Any] = {
    "embed_dim": 1024,
    "vision_cfg": {"image_size": 224, "layers": 32, "width": 1280, "head_width": 80, "patch_size": 14},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 1024, "heads": 16, "layers": 24},
}
KNOWN_ARCHITECTURES = {"ViT-H-14": VIT_H_14}

_BLOCK = re.compile(r"^(visual\.)?transformer\.resblocks\.(\d+)\.(.+)$")
_BLOCK_PARTS = {
    "ln_1.weight": "layer_norm1.weight",
    "ln_1.bias": "layer_norm1.bias",
    "ln_2.weight": "layer_norm2.weight",
    "ln_2.bias": "layer_norm2.bias",
    "attn.out_proj.weight": "self_attn.out_proj.weight",
    "attn.out_proj.bias": "self_attn.out_proj.bias",
    "mlp.c_fc.weight": "mlp.fc1.weight",
    "mlp.c_fc.bias": "mlp.fc1.bias",
    "mlp.c_proj.weight": "mlp.fc2.weight",
    "mlp.c_proj.bias": "mlp.fc2.bias",
}
_PLAIN = {
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "logit_scale": "logit_scale",
}
_TRANSPOSED = {"text_projection": "text_projection.weight", "visual.proj": "visual_projection.weight"}
_IGNORED = {"attn_mask", "visual.attn_mask"}  # causal-mask buffers some open_clip versions saved


def architecture_config(architecture: str | Mapping[str, Any]) -> dict[str, Any]:
    """An open_clip model config by name ("ViT-H-14") or as a dict in open_clip's JSON format."""
    if isinstance(architecture, str):
        if architecture not in KNOWN_ARCHITECTURES:
            raise ValueError(
                f"unknown open_clip architecture {architecture!r}; known: {sorted(KNOWN_ARCHITECTURES)} "
                "or pass its config dict"
            )
        return KNOWN_ARCHITECTURES[architecture]
    if not isinstance(architecture, Mapping) or not {"embed_dim", "vision_cfg", "text_cfg"} <= set(architecture):
        raise ValueError(
            "open_clip architecture must be a name or a dict with embed_dim, vision_cfg, text_cfg; "
            f"got {architecture!r}"
        )
    return dict(architecture)


def _convert_block(tower: str, index: str, part: str, value: Tensor, out: dict[str, Tensor]) -> bool:
    prefix = f"{tower}.encoder.layers.{index}."
    if part in _BLOCK_PARTS:
        out[prefix + _BLOCK_PARTS[part]] = value
        return True
    if part in ("attn.in_proj_weight", "attn.in_proj_bias"):
        kind = part.rsplit("_", 1)[-1]  # "weight" or "bias"
        for name, chunk in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0)):
            out[f"{prefix}self_attn.{name}.{kind}"] = chunk.clone()
        return True
    return False


def convert_openclip_state_dict(state: Mapping[str, Tensor], where: str = "checkpoint") -> dict[str, Tensor]:
    """Rename and reshape an open_clip CLIP state dict into ``transformers.CLIPModel`` keys.

    Args:
        state: open_clip ``model.state_dict()`` (e.g. ``checkpoint["state_dict"]`` of HPSv2).
        where: file named in error messages.

    Returns:
        A state dict for ``CLIPModel.load_state_dict(strict=True)``.

    Raises:
        ValueError: a key this converter does not know (e.g. an attention-pool or layer-scale model).
    """
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if key in _IGNORED:
            continue
        if key in _PLAIN:
            out[_PLAIN[key]] = value.reshape(()) if key == "logit_scale" else value
            continue
        if key in _TRANSPOSED:
            out[_TRANSPOSED[key]] = value.t().contiguous()
            continue
        block = _BLOCK.match(key)
        tower = "vision_model" if block and block.group(1) else "text_model"
        if block and _convert_block(tower, block.group(2), block.group(3), value, out):
            continue
        raise ValueError(
            f"{where}: open_clip key {key!r} has no transformers CLIPModel counterpart; "
            "this converter supports plain ViT CLIP towers"
        )
    return out


def _count_blocks(state: Mapping[str, Tensor], prefix: str) -> int:
    found = {int(m.group(2)) for k in state if (m := _BLOCK.match(k)) and bool(m.group(1)) == (prefix == "visual.")}
    return max(found) + 1 if found else 0


def clip_config_from_openclip(
    state: Mapping[str, Tensor], architecture: Mapping[str, Any], eos_token_id: int, where: str = "checkpoint"
) -> Any:
    """A ``transformers.CLIPConfig`` for an open_clip state dict (sizes from shapes, heads from the config).

    Args:
        state: open_clip state dict.
        architecture: open_clip model config (``embed_dim``, ``vision_cfg``, ``text_cfg``, optional ``quick_gelu``).
        eos_token_id: the tokenizer's end-of-text id (the text tower pools at its first occurrence).
        where: file named in error messages.

    Raises:
        ValueError: the state dict does not match the architecture (names the mismatching size).
    """
    from transformers import CLIPConfig

    vcfg, tcfg = dict(architecture["vision_cfg"]), dict(architecture["text_cfg"])
    v_width, _, patch, _ = state["visual.conv1.weight"].shape
    grid = int(round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5))
    vocab, t_width = state["token_embedding.weight"].shape
    embed_dim = state["visual.proj"].shape[1]
    found = {
        "vision width": (v_width, vcfg.get("width")),
        "patch size": (patch, vcfg.get("patch_size")),
        "image size": (grid * patch, vcfg.get("image_size")),
        "vision layers": (_count_blocks(state, "visual."), vcfg.get("layers")),
        "text width": (t_width, tcfg.get("width")),
        "text layers": (_count_blocks(state, ""), tcfg.get("layers")),
        "vocab size": (vocab, tcfg.get("vocab_size")),
        "embed dim": (embed_dim, architecture.get("embed_dim")),
        "context length": (state["positional_embedding"].shape[0], tcfg.get("context_length")),
    }
    for name, (got, want) in found.items():
        if want is not None and int(got) != int(want):
            raise ValueError(
                f"{where}: {name} is {int(got)} in the checkpoint but {int(want)} in the architecture; "
                "pass the matching architecture"
            )
    act = "quick_gelu" if architecture.get("quick_gelu", False) else "gelu"
    v_heads = int(v_width) // int(vcfg.get("head_width", 64))
    text = dict(
        vocab_size=int(vocab),
        hidden_size=int(t_width),
        num_attention_heads=int(tcfg.get("heads", 8)),
        num_hidden_layers=found["text layers"][0],
        intermediate_size=int(state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0]),
        max_position_embeddings=int(found["context length"][0]),
        hidden_act=act,
        layer_norm_eps=1e-5,
        eos_token_id=int(eos_token_id),
        bos_token_id=int(eos_token_id) - 1,
        pad_token_id=0,
    )
    vision = dict(
        hidden_size=int(v_width),
        num_attention_heads=v_heads,
        num_hidden_layers=found["vision layers"][0],
        intermediate_size=int(state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0]),
        image_size=int(grid * patch),
        patch_size=int(patch),
        hidden_act=act,
        layer_norm_eps=1e-5,
    )
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=int(embed_dim))


def openclip_to_transformers(
    state: Mapping[str, Tensor], architecture: Mapping[str, Any], eos_token_id: int, where: str = "checkpoint"
) -> Any:
    """A ``transformers.CLIPModel`` (float32, eval) holding an open_clip checkpoint's weights."""
    from transformers import CLIPModel

    config = clip_config_from_openclip(state, architecture, eos_token_id, where)
    with torch.device("meta"):
        model = CLIPModel(config)
    converted = {k: v.float() for k, v in convert_openclip_state_dict(state, where).items()}
    model.load_state_dict(converted, strict=True, assign=True)
    for embeddings in (model.text_model.embeddings, model.vision_model.embeddings):  # non-persistent, left on meta
        count = embeddings.position_ids.shape[-1]
        embeddings.register_buffer("position_ids", torch.arange(count).expand((1, -1)).clone(), persistent=False)
    return model.eval().requires_grad_(False)
