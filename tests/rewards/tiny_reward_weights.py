"""Tiny random-init reward models saved in the PUBLISHED checkpoints' own layouts (test helper).

Each builder writes files the real loaders read: a transformers ``CLIPModel`` folder (PickScore,
CLIPScore, aesthetic backbone), a CLIP processor folder (tokenizer + ``preprocessor_config.json``),
the LAION aesthetic head ``.pth`` (``layers.N.*``), an HPSv2 ``.pt`` (open_clip keys under
``state_dict``) and an ``ImageReward.pt`` (``blip.visual_encoder.*``, ``blip.text_encoder.*``,
``mlp.layers.*``) with a BERT tokenizer folder. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

WORDS = ("a", "photo", "of", "cat", "dog", "handwritten", "bold", "thin", "the", "red")
IMAGE = 16  # tiny models see 16 x 16 images
PATCH = 4


def clip_tokenizer():
    """A real ``CLIPTokenizer`` with a small byte-level BPE vocab, built offline."""
    from flowrl.models.digits import build_digits_tokenizer

    return build_digits_tokenizer(WORDS)


def save_clip_processor(folder: Path, size: int = IMAGE, crop: int = IMAGE) -> Path:
    """Write a CLIP processor folder (tokenizer files + preprocessor_config.json) and return it."""
    from transformers import CLIPImageProcessor

    folder.mkdir(parents=True, exist_ok=True)
    clip_tokenizer().save_pretrained(str(folder))
    CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": crop, "width": crop}).save_pretrained(str(folder))
    return folder


def tiny_clip_config(vocab_size: int, projection_dim: int = 12, hidden_act: str = "quick_gelu"):
    """A CLIPConfig with 2-layer, width-16 towers on 16 x 16 images (patch 4)."""
    from transformers import CLIPConfig

    tok = clip_tokenizer()
    text = dict(
        vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=24, hidden_act=hidden_act, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE,
        patch_size=PATCH, hidden_act=hidden_act,
    )
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim, logit_scale_init_value=2.0)


def tiny_clip_model(seed: int = 0, projection_dim: int = 12):
    """A random-init ``transformers.CLIPModel`` matching :func:`clip_tokenizer` (eval mode)."""
    from transformers import CLIPModel

    torch.manual_seed(seed)
    return CLIPModel(tiny_clip_config(len(clip_tokenizer()), projection_dim)).eval()


def save_clip_folder(folder: Path, seed: int = 0, projection_dim: int = 12, pickle: bool = False) -> Path:
    """Save a tiny CLIPModel as transformers does (``model.safetensors``), or as ``pytorch_model.bin``."""
    model = tiny_clip_model(seed, projection_dim)
    if pickle:
        folder.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(str(folder))
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    else:
        model.save_pretrained(str(folder))
    return folder


def build_tiny_weights(root: Path) -> dict[str, dict[str, str]]:
    """Write every tiny model once; return each built-in model reward's factory options."""
    processor = str(save_clip_processor(root / "clip-processor"))
    clip = str(save_clip_processor(save_clip_folder(root / "clip-model")))  # model + processor, like OpenAI's repo
    return {
        "pickscore": {"model": clip, "processor": processor},
        "clipscore": {"model": clip},
        "aesthetic": {"model": clip, "head": str(save_aesthetic_head(root / "aesthetic" / "sac+logos+ava1-l14-linearMSE.pth"))},
    }


def laion_mlp(in_features: int = 12, seed: int = 0) -> torch.nn.Module:
    """The LAION improved-aesthetic-predictor MLP (a module whose ``layers`` Sequential has its ReLUs
    commented out upstream), narrowed; its state dict keys are ``layers.0/2/4/6/7.*``."""
    torch.manual_seed(seed)
    nn = torch.nn
    mlp = nn.Module()
    mlp.layers = nn.Sequential(
        nn.Linear(in_features, 32), nn.Dropout(0.2), nn.Linear(32, 16), nn.Dropout(0.2),
        nn.Linear(16, 8), nn.Dropout(0.1), nn.Linear(8, 4), nn.Linear(4, 1),
    )
    return mlp


def save_aesthetic_head(path: Path, in_features: int = 12, seed: int = 0) -> Path:
    """``torch.save`` of the head's state dict (keys layers.0/2/4/6/7.*), as LAION publishes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head = laion_mlp(in_features, seed)
    torch.save(head.state_dict(), path)
    return path
