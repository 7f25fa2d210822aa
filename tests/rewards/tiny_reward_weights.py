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
    from flowrl.models.digits.model import build_digits_tokenizer

    return build_digits_tokenizer(WORDS)


def save_clip_processor(folder: Path, size: int = IMAGE, crop: int = IMAGE) -> Path:
    """Write a CLIP processor folder (tokenizer files + preprocessor_config.json) and return it."""
    from transformers import CLIPImageProcessor

    folder.mkdir(parents=True, exist_ok=True)
    clip_tokenizer().save_pretrained(str(folder))
    CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": crop, "width": crop}).save_pretrained(
        str(folder)
    )
    return folder


def tiny_clip_config(vocab_size: int, projection_dim: int = 12, hidden_act: str = "quick_gelu"):
    """A CLIPConfig with 2-layer, width-16 towers on 16 x 16 images (patch 4)."""
    from transformers import CLIPConfig

    tok = clip_tokenizer()
    text = dict(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=24,
        hidden_act=hidden_act,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE,
        patch_size=PATCH,
        hidden_act=hidden_act,
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
    hps_arch = tiny_openclip_architecture(len(clip_tokenizer()))
    ir_ckpt, ir_tok, _ = save_imagereward(root / "imagereward")
    return {
        "pickscore": {"model": clip, "processor": processor},
        "clipscore": {"model": clip},
        "aesthetic": {
            "model": clip,
            "head": str(save_aesthetic_head(root / "aesthetic" / "sac+logos+ava1-l14-linearMSE.pth")),
        },
        "hpsv2": {
            "checkpoint": str(
                save_hps_checkpoint(root / "hps" / "HPS_v2.1_compressed.pt", openclip_state_dict(hps_arch))
            ),
            "architecture": hps_arch,
            "tokenizer": processor,
            "backend": "transformers",
        },
        "imagereward": {"checkpoint": str(ir_ckpt), "tokenizer": str(ir_tok), "architecture": IMAGEREWARD_TINY},
    }


def laion_mlp(in_features: int = 12, seed: int = 0) -> torch.nn.Module:
    """The LAION improved-aesthetic-predictor MLP (a module whose ``layers`` Sequential has its ReLUs
    commented out upstream), narrowed; its state dict keys are ``layers.0/2/4/6/7.*``."""
    torch.manual_seed(seed)
    nn = torch.nn
    mlp = nn.Module()
    mlp.layers = nn.Sequential(
        nn.Linear(in_features, 32),
        nn.Dropout(0.2),
        nn.Linear(32, 16),
        nn.Dropout(0.2),
        nn.Linear(16, 8),
        nn.Dropout(0.1),
        nn.Linear(8, 4),
        nn.Linear(4, 1),
    )
    return mlp


def save_aesthetic_head(path: Path, in_features: int = 12, seed: int = 0) -> Path:
    """``torch.save`` of the head's state dict (keys layers.0/2/4/6/7.*), as LAION publishes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head = laion_mlp(in_features, seed)
    torch.save(head.state_dict(), path)
    return path


def tiny_openclip_architecture(vocab_size: int, context_length: int = 24) -> dict:
    """An open_clip model config (JSON format) for a 2-layer, width-16 ViT CLIP on 16 x 16 images."""
    return {
        "embed_dim": 12,
        "vision_cfg": {"image_size": IMAGE, "layers": 2, "width": 16, "head_width": 8, "patch_size": PATCH},
        "text_cfg": {"context_length": context_length, "vocab_size": vocab_size, "width": 16, "heads": 2, "layers": 2},
    }


def openclip_state_dict(arch: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under open_clip's CLIP keys and shapes (MLP ratio 4, packed in_proj q/k/v)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2, offset=0.0):
        return torch.randn(*shape, generator=gen) * scale + offset

    sd: dict[str, torch.Tensor] = {}

    def block(prefix: str, width: int) -> None:
        for ln in ("ln_1", "ln_2"):
            sd[f"{prefix}{ln}.weight"], sd[f"{prefix}{ln}.bias"] = rand(width, offset=1.0), rand(width)
        sd[prefix + "attn.in_proj_weight"], sd[prefix + "attn.in_proj_bias"] = rand(3 * width, width), rand(3 * width)
        sd[prefix + "attn.out_proj.weight"], sd[prefix + "attn.out_proj.bias"] = rand(width, width), rand(width)
        sd[prefix + "mlp.c_fc.weight"], sd[prefix + "mlp.c_fc.bias"] = rand(4 * width, width), rand(4 * width)
        sd[prefix + "mlp.c_proj.weight"], sd[prefix + "mlp.c_proj.bias"] = rand(width, 4 * width), rand(width)

    v, t, embed = arch["vision_cfg"], arch["text_cfg"], arch["embed_dim"]
    vw, grid = v["width"], v["image_size"] // v["patch_size"]
    sd["visual.class_embedding"], sd["visual.positional_embedding"] = rand(vw), rand(grid * grid + 1, vw)
    sd["visual.conv1.weight"] = rand(vw, 3, v["patch_size"], v["patch_size"])
    sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"] = rand(vw, offset=1.0), rand(vw)
    for i in range(v["layers"]):
        block(f"visual.transformer.resblocks.{i}.", vw)
    sd["visual.ln_post.weight"], sd["visual.ln_post.bias"] = rand(vw, offset=1.0), rand(vw)
    sd["visual.proj"] = rand(vw, embed)
    tw = t["width"]
    sd["token_embedding.weight"], sd["positional_embedding"] = rand(t["vocab_size"], tw), rand(t["context_length"], tw)
    for i in range(t["layers"]):
        block(f"transformer.resblocks.{i}.", tw)
    sd["ln_final.weight"], sd["ln_final.bias"] = rand(tw, offset=1.0), rand(tw)
    sd["text_projection"], sd["logit_scale"] = rand(tw, embed), torch.tensor(4.6052)
    return sd


def save_hps_checkpoint(path: Path, state: dict[str, torch.Tensor]) -> Path:
    """``torch.save({"state_dict": ...})``, the layout of HPS_v2(.1)_compressed.pt."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": state}, path)
    return path


def save_bert_tokenizer(folder: Path) -> Path:
    """A real word-piece ``BertTokenizer`` (lower-case) with a tiny vocab, saved like bert-base-uncased."""
    from transformers import BertTokenizer

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]
    vocab = specials + list(WORDS) + letters + ["##" + c for c in letters]
    folder.mkdir(parents=True, exist_ok=True)
    BertTokenizer(vocab={tok: i for i, tok in enumerate(vocab)}).save_pretrained(str(folder))
    return folder


IMAGEREWARD_TINY = {"vision_heads": 2, "text_heads": 2}


def imagereward_state_dict(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under ImageReward.pt's keys: timm ViT (width 24), BLIP BERT (width 16), LAION-style mlp."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2, offset=0.0):
        return torch.randn(*shape, generator=gen) * scale + offset

    sd: dict[str, torch.Tensor] = {}

    def linear(name: str, out_f: int, in_f: int) -> None:
        sd[name + ".weight"], sd[name + ".bias"] = rand(out_f, in_f), rand(out_f)

    def norm(name: str, width: int) -> None:
        sd[name + ".weight"], sd[name + ".bias"] = rand(width, offset=1.0), rand(width)

    vw, tw, grid = 24, 16, IMAGE // PATCH
    v = "blip.visual_encoder."
    sd[v + "cls_token"], sd[v + "pos_embed"] = rand(1, 1, vw), rand(1, grid * grid + 1, vw)
    sd[v + "patch_embed.proj.weight"], sd[v + "patch_embed.proj.bias"] = rand(vw, 3, PATCH, PATCH), rand(vw)
    for i in range(2):
        b = f"{v}blocks.{i}."
        norm(b + "norm1", vw), linear(b + "attn.qkv", 3 * vw, vw), linear(b + "attn.proj", vw, vw)
        norm(b + "norm2", vw), linear(b + "mlp.fc1", 4 * vw, vw), linear(b + "mlp.fc2", vw, 4 * vw)
    norm(v + "norm", vw)
    t = "blip.text_encoder."
    sd[t + "embeddings.word_embeddings.weight"] = rand(vocab_size, tw)
    sd[t + "embeddings.position_embeddings.weight"] = rand(40, tw)
    sd[t + "embeddings.position_ids"] = torch.arange(40).expand(1, -1)  # saved by BLIP's older BERT code
    norm(t + "embeddings.LayerNorm", tw)
    for i in range(2):
        b = f"{t}encoder.layer.{i}."
        for att, kv_width in (("attention", tw), ("crossattention", vw)):
            linear(f"{b}{att}.self.query", tw, tw), linear(f"{b}{att}.self.key", tw, kv_width)
            linear(f"{b}{att}.self.value", tw, kv_width), linear(f"{b}{att}.output.dense", tw, tw)
            norm(f"{b}{att}.output.LayerNorm", tw)
        linear(b + "intermediate.dense", 32, tw), linear(b + "output.dense", tw, 32), norm(b + "output.LayerNorm", tw)
    linear("blip.vision_proj", 8, vw), linear("blip.text_proj", 8, tw)  # retrieval heads, unused by the score
    widths = [tw, 32, 16, 8, 4, 1]
    for index, (in_f, out_f) in zip((0, 2, 4, 6, 7), zip(widths, widths[1:])):
        linear(f"mlp.layers.{index}", out_f, in_f)
    return sd


def save_imagereward(folder: Path, seed: int = 0) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """Write ``ImageReward.pt`` (torch.save of the flat state dict) and a BERT tokenizer folder."""
    from transformers import AutoTokenizer

    tokenizer = save_bert_tokenizer(folder / "bert-base-uncased")
    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer))) + 2  # + BLIP's [DEC] and [ENC]
    state = imagereward_state_dict(vocab, seed)
    torch.save(state, folder / "ImageReward.pt")
    return folder / "ImageReward.pt", tokenizer, state
