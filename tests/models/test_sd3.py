"""SD3 adapter (flowrl.models.sd3) on a tiny real StableDiffusion3Pipeline: latent shapes and loading a folder."""

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_sd3_pipeline

from flowrl.models import load_adapter
from flowrl.models.sd3 import SD3Adapter


def test_latent_shape_needs_whole_transformer_patches(tiny_sd3: SD3Adapter) -> None:
    """(C, H / f, W / f), and each side a multiple of f x patch (VAE factor 1, patch 2 here): odd sides are refused."""
    assert tiny_sd3.latent_shape(8, 8) == (4, 8, 8) and tiny_sd3.latent_shape(6, 8) == (4, 6, 8)
    for height, width in ((7, 8), (8, 5)):
        with pytest.raises(ValueError, match="SD3 resolution must be a multiple of 2"):
            tiny_sd3.latent_shape(height, width)


def test_a_folder_without_t5_loads_with_its_model_card(tmp_path: Path, tiny_sd3: SD3Adapter) -> None:
    """A saved SD3 folder without T5 loads through load_adapter; its card sets the T5 length and resolution."""
    tiny_sd3_pipeline().save_pretrained(str(tmp_path))
    (tmp_path / "flowrl.json").write_text(json.dumps({"max_sequence_length": 3, "resolution": [8, 6]}))
    model = load_adapter(str(tmp_path))
    assert isinstance(model, SD3Adapter) and model.pipe.text_encoder_3 is None and model.pipe.tokenizer_3 is None
    assert (model.max_sequence_length, model.default_resolution, model.model_id) == (3, (8, 6), str(tmp_path))
    cond = model.encode_prompt(["a bold 3", "a 7"])
    assert cond["encoder_hidden_states"].shape == (2, 8 + 3, 32)  # CLIP's 8 tokens, then 3 zero T5 tokens
    assert cond["encoder_hidden_states"][:, 8:].abs().max() == 0
    tiny_sd3.max_sequence_length = 3
    torch.testing.assert_close(cond, tiny_sd3.encode_prompt(["a bold 3", "a 7"]), rtol=0, atol=0)
