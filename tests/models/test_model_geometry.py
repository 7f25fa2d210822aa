"""A model's geometry read from its folder without weights (flowrl.models.geometry): LoRA width, tokens, layers, VAE."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from flowrl.models.geometry import lora_width, read_geometry


def _write_folder(folder: Path, files: dict[str, dict[str, Any]]) -> Path:
    """Write JSON config files (relative path -> object) under ``folder``."""
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(data))
    return folder


def _write_header(path: Path, shapes: dict[str, list[int]]) -> None:
    """A ``.safetensors`` file holding only a header that declares F32 tensors of these shapes."""
    header = json.dumps(
        {name: {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]} for name, shape in shapes.items()}
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode())


def test_lora_width_counts_2d_weights_of_modules_a_target_names_as_peft_matches_them() -> None:
    """(in + out) of each 2-D ``<module>.weight`` whose module is a target or ends in ``.<target>``; nothing else."""
    shapes = {
        "blocks.0.attn.to_q.weight": [8, 4],  # counted: 12
        "blocks.0.attn.to_q.bias": [8],  # a bias
        "blocks.1.attn.to_q.weight": [16, 4],  # counted: 20
        "blocks.0.attn.add_to_q.weight": [32, 32],  # ends in "to_q" but not in ".to_q"
        "blocks.0.conv.to_q.weight": [8, 4, 3, 3],  # not a linear layer
        "to_out.0.weight": [2, 3],  # the module is the target itself: counted: 5
    }
    assert lora_width(shapes, ("to_q", "to_out.0")) == 12 + 20 + 5
    assert lora_width(shapes, ["add_to_q"]) == 64


def test_sd3_text_tokens_join_clip_s_77_to_t5_s(tmp_path: Path) -> None:
    """SD3 conditions on CLIP's 77 tokens followed by T5's; the card's ``max_sequence_length`` sets the T5 part."""
    files = {
        "model_index.json": {"_class_name": "StableDiffusion3Pipeline", "transformer": ["diffusers", "SD3"]},
        "transformer/config.json": {"_class_name": "SD3Transformer2DModel", "num_layers": 3},
    }
    folder = _write_folder(tmp_path, files)
    assert read_geometry(folder, None).text_tokens == 256 + 77
    (folder / "flowrl.json").write_text(json.dumps({"max_sequence_length": 6}))
    g = read_geometry(folder, None)
    assert (g.text_tokens, g.layers) == (6 + 77, 3)
    _write_folder(folder, {"tokenizer/tokenizer_config.json": {"model_max_length": 8}})
    assert read_geometry(folder, None).text_tokens == 6 + 8  # the pipeline pads CLIP to its tokenizer's length


def test_the_embedded_model_s_text_tokens_are_those_its_adapter_encodes() -> None:
    """The estimate's text sequence for flowrl-digits is the length of the prompt embeddings SD3Adapter makes."""
    from flowrl.models import load_adapter, pipeline_folder

    adapter = load_adapter()
    embeds = adapter.encode_prompt(["a handwritten digit 3"])["encoder_hidden_states"]
    assert read_geometry(pipeline_folder(None), None).text_tokens == embeds.shape[1] == 14


def test_flux_layers_and_lora_width_include_the_single_blocks(tmp_path: Path) -> None:
    """FLUX's blocks are its joint blocks plus its single blocks, and its default LoRA targets each single block."""
    files = {
        "model_index.json": {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]},
        "transformer/config.json": {"_class_name": "FluxTransformer2DModel", "num_layers": 2, "num_single_layers": 3},
    }
    folder = _write_folder(tmp_path, files)
    _write_header(
        folder / "transformer" / "diffusion_pytorch_model.safetensors",
        {
            "transformer_blocks.0.attn.to_q.weight": [8, 4],
            "single_transformer_blocks.0.proj_out.weight": [4, 12],
            "single_transformer_blocks.2.proj_out.weight": [4, 12],
            "proj_out.weight": [16, 4],  # the final output layer is not a LoRA target
        },
    )
    g = read_geometry(folder, None)
    assert g.layers == 2 + 3
    assert g.lora_width == 12 + 16 + 16
    assert g.params == {"transformer": 32 + 48 + 48 + 64}


def test_wan_vae_without_scale_factors_reads_them_from_its_downsampling(tmp_path: Path) -> None:
    """Wan VAE without ``scale_factor_*``: 2x per level in space, 2x per True level in time; the card sets defaults."""
    files = {
        "model_index.json": {"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"]},
        "transformer/config.json": {"_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2]},
        "vae/config.json": {"_class_name": "AutoencoderKLWan", "z_dim": 16, "temperal_downsample": [False, True, True]},
    }
    folder = _write_folder(tmp_path, files)
    g = read_geometry(folder, None)
    assert (g.vae_factor, g.temporal_factor, g.latent_channels, g.patch) == (8, 4, 16, 2)
    assert (g.default_frames, g.default_resolution, g.vae_widths) == (81, (480, 832), (96, 192, 384, 384))
    (folder / "flowrl.json").write_text(json.dumps({"num_frames": 33, "resolution": [240, 416]}))
    g = read_geometry(folder, None)
    assert (g.default_frames, g.default_resolution) == (33, (240, 416))
