"""Shared fixtures: tiny real diffusers/transformers models built in-process (no downloads)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import socket

import pytest
import torch

torch.set_num_threads(1)
# Triton reads TRITON_INTERPRET when it is first imported, and other code imports it early (torch's
# FlopCounterMode, which the bench modules some tests import, pulls triton in), so the kernel tests'
# interpreter must be chosen here, before any test module is collected (tests/kernels/kernel_devices.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_real_connect = socket.socket.connect


def _guarded_connect(sock, address):
    """Tests must never reach the network: only loopback and unix sockets are allowed."""
    host = address[0] if isinstance(address, tuple) else None
    if host is not None and host not in ("127.0.0.1", "::1", "localhost"):
        raise RuntimeError(f"test tried to open a network connection to {address}; tests must stay offline")
    return _real_connect(sock, address)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Fail any test that opens a non-loopback connection (hub downloads included)."""
    monkeypatch.setattr(socket.socket, "connect", _guarded_connect)


def tiny_sd3_pipeline(
    seed: int = 0,
    *,
    size: int = 8,
    num_layers: int = 1,
    attention_head_dim: int = 8,
    caption_projection_dim: int = 16,
):
    """A random-init StableDiffusion3Pipeline (the real classes): 4 latent channels, a one-block VAE (scale 1).

    Args:
        seed: torch seed of the random weights.
        size: image side in pixels (= latent side); patch 2, so (size / 2)^2 image tokens.
        num_layers: joint transformer blocks.
        attention_head_dim: width of each of the 2 heads.
        caption_projection_dim: text tokens' projection width.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from flowrl.models.digits.model import build_digits_tokenizer

    torch.manual_seed(seed)
    tok = build_digits_tokenizer()
    text_cfg = CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=8,
        projection_dim=16,
        bos_token_id=len(tok) - 2,
        eos_token_id=len(tok) - 1,
        pad_token_id=len(tok) - 1,
    )
    transformer = SD3Transformer2DModel(
        sample_size=size,
        patch_size=2,
        in_channels=4,
        out_channels=4,
        num_layers=num_layers,
        attention_head_dim=attention_head_dim,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=caption_projection_dim,
        pooled_projection_dim=32,
        pos_embed_max_size=size // 2,
    )
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(8,),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=size,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0,
        scaling_factor=1.0,
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
        vae=vae,
        text_encoder=CLIPTextModelWithProjection(text_cfg),
        tokenizer=tok,
        text_encoder_2=CLIPTextModelWithProjection(text_cfg),
        tokenizer_2=build_digits_tokenizer(),
        text_encoder_3=None,
        tokenizer_3=None,
    )


def tiny_sd3_transformer_inputs(seed: int, device: str = "cpu") -> dict:
    """Keyword inputs of one call of :func:`tiny_sd3_pipeline`'s transformer: 3 latents (4, 8, 8), 5 text tokens."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(3, 4, 8, 8, generator=g).to(device),
        "encoder_hidden_states": torch.randn(3, 5, 32, generator=g).to(device),
        "pooled_projections": torch.randn(3, 32, generator=g).to(device),
        "timestep": torch.tensor([900.0, 500.0, 200.0], device=device),
        "return_dict": False,
    }


def tiny_flux_transformer(*, guidance_embeds: bool = True):
    """A real ``FluxTransformer2DModel``, random init from the current RNG: 1 double + 2 single blocks, width 16."""
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=16,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=[2, 2, 4],
    )


@pytest.fixture
def keep_threads():
    """Restore torch's thread count after a test that sets it (the benches' CPU mode runs on one thread)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_sd3():
    """A fresh SD3Adapter over a tiny random pipeline."""
    from flowrl.models.sd3 import SD3Adapter

    return SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8))


def custom_code_folder(source, tmp_path, diffusers_class: str):
    """A copy of the pipeline folder ``source`` whose transformer names a module of the folder's own.

    The module (written at the folder's root and in ``transformer/``) would create ``tmp_path/executed``
    when imported and then re-export ``diffusers_class``: a loader that ran it leaves that marker.

    Returns:
        (the folder, its model_index.json as a dict before the change, the marker path).
    """
    import json
    import shutil

    folder = tmp_path / "custom"
    shutil.copytree(source, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "transformer": ["my_transformer", "MyTransformer"]}))
    marker = tmp_path / "executed"
    code = f"open({str(marker)!r}, 'w').write('ran')\nfrom diffusers import {diffusers_class} as MyTransformer\n"
    for where in (folder, folder / "transformer"):
        (where / "my_transformer.py").write_text(code)
    return folder, index, marker


class PlantedPickle:
    """A pickle that would create ``path`` when unpickled without restriction (safe loaders must refuse it)."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))
