"""Tests for the embedded flowrl-digits model: builder, data, shipped weights, pretraining."""

from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file

from flowrl.models import EMBEDDED
from flowrl.models.digits import EVAL_REPORTS, style_report
from flowrl.models.digits.evaluation import digit_accuracy, sample_digits_with_pipeline
from flowrl.models.digits.model import (
    DIGITS_DIR,
    MAX_SEQUENCE_LENGTH,
    RESOLUTION,
    build_digits_pipeline,
    build_digits_t5_tokenizer,
    build_digits_tokenizer,
    digits_prompt,
    encode_prompts,
    load_digit_images,
)
from flowrl.models.digits.pretrain import pretrain_digits
from flowrl.models.digits.prompts import DIGITS_SETS, digits_set

torch.set_num_threads(1)


def test_prompts() -> None:
    assert digits_prompt(7, None) == "a handwritten 7"
    assert digits_prompt(7, "bold") == "a bold handwritten 7"
    assert digits_prompt(0, "thin") == "a thin handwritten 0"
    with pytest.raises(ValueError):
        digits_prompt(10, None)
    with pytest.raises(ValueError):
        digits_prompt(3, "italic")


def test_prompt_sets_use_digits_prompt() -> None:
    assert list(DIGITS_SETS) == ["digits-styles", "digits", "digits-all"]
    sets = {"digits": (None,), "digits-styles": ("bold", "thin"), "digits-all": (None, "bold", "thin")}
    for name, styles in sets.items():
        prompts = DIGITS_SETS[name]()
        assert prompts == digits_set(styles)
        assert [p.text for p in prompts] == [digits_prompt(d, s) for s in styles for d in range(10)]
        assert [p.metadata for p in prompts] == [{"digit": d, "style": s} for s in styles for d in range(10)]
    with pytest.raises(ValueError, match="style"):
        digits_set(("italic",))


FIRST_IMPORTS = ["flowrl.prompts.sets", "flowrl.models.digits.report", "flowrl.models.digits.prompts"]


@pytest.mark.parametrize("first", FIRST_IMPORTS)
def test_no_import_cycle_whichever_module_comes_first(first) -> None:
    # prompts.sets serves the digits sets and the digits modules use flowrl.prompts: any may be imported first
    code = f"import {first}; from flowrl.prompts.sets import load_prompts; assert len(load_prompts('digits-all')) == 30"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_eval_reports_table(monkeypatch) -> None:
    import flowrl.models.digits.report as report

    assert list(EVAL_REPORTS) == [EMBEDDED]
    calls = []

    def fake(sample_fn, seeds_per_prompt=10):
        calls.append((sample_fn, seeds_per_prompt))
        return {"accuracy": 1.0}

    monkeypatch.setattr(report, "style_report", fake)  # the table's entry imports the report on each call
    sample = object()
    assert EVAL_REPORTS[EMBEDDED](sample) == {"accuracy": 1.0} and calls == [(sample, 10)]


def test_style_report_inputs_and_metric_names() -> None:
    seen = []

    def sample_fn(prompts, seeds):  # blank images: only the inputs and the keys are checked
        seen.append((list(prompts), list(seeds)))
        return torch.zeros(len(prompts), 3, RESOLUTION, RESOLUTION)

    out = style_report(sample_fn, 2)
    # the keys, in order, are what the recipe logs as eval/<key>
    assert list(out) == ["accuracy", "accuracy_bold", "accuracy_thin", "ink_bold", "ink_thin", "ink_gap"]
    ((prompts, seeds),) = seen
    assert prompts == [p for p in DIGITS_SETS["digits-styles"]() for _ in range(2)]
    assert seeds == [3_000_000 + i % 2 for i in range(40)]


def test_clip_tokenizer_whole_words() -> None:
    tok = build_digits_tokenizer()
    assert tok.model_max_length == 8
    tokens = tok.convert_ids_to_tokens(tok("a bold handwritten 7").input_ids)
    assert tokens == ["<|startoftext|>", "a</w>", "bold</w>", "handwritten</w>", "7</w>", "<|endoftext|>"]
    for word in ("thin", "digit", "number"):
        assert tok.convert_ids_to_tokens(tok(word).input_ids)[1:-1] == [word + "</w>"]
    unknown = tok.convert_ids_to_tokens(tok("zebra").input_ids)[1:-1]
    assert unknown == ["z", "e", "b", "r", "a</w>"]


def test_t5_tokenizer_whole_words() -> None:
    tok = build_digits_t5_tokenizer()
    tokens = tok.convert_ids_to_tokens(tok("a thin handwritten 3").input_ids)
    assert tokens == ["\u2581a", "\u2581thin", "\u2581handwritten", "\u25813", "</s>"]
    assert len(tokens) <= MAX_SEQUENCE_LENGTH


def test_build_pipeline_real_classes_and_one_step() -> None:
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    pipe = build_digits_pipeline(seed=0)
    assert isinstance(pipe, StableDiffusion3Pipeline)
    assert isinstance(pipe.transformer, SD3Transformer2DModel)
    assert isinstance(pipe.vae, AutoencoderKL) and pipe.vae_scale_factor == 1
    assert isinstance(pipe.text_encoder, CLIPTextModelWithProjection)
    assert isinstance(pipe.text_encoder_2, CLIPTextModelWithProjection)
    assert isinstance(pipe.text_encoder_3, T5EncoderModel)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert float(pipe.transformer.proj_out.weight.detach().abs().sum()) == 0.0  # adaLN-Zero init
    embeds, pooled = encode_prompts(pipe, ["a handwritten 1", "a bold handwritten 2"])
    assert embeds.shape == (2, 8 + MAX_SEQUENCE_LENGTH, 64) and pooled.shape == (2, 64)
    assert embeds.requires_grad
    out = pipe(
        prompt=["a handwritten 1"] * 3,
        height=8,
        width=8,
        num_inference_steps=1,
        guidance_scale=1.0,
        output_type="pt",
        max_sequence_length=MAX_SEQUENCE_LENGTH,
    ).images
    assert out.shape == (3, 3, RESOLUTION, RESOLUTION) and torch.isfinite(out).all()


def test_load_digit_images() -> None:
    images, labels, styles = load_digit_images()
    assert images.shape == (1797, 3, 8, 8) and images.dtype == torch.float32
    assert labels.shape == (1797,) and labels.dtype == torch.int64
    assert float(images.min()) == 0.0 and float(images.max()) == 1.0
    assert torch.equal(images[:, 0], images[:, 2])
    ink = images.mean(dim=(1, 2, 3))
    for digit in range(10):
        for style in ("bold", "thin"):
            assert any(s == style and int(y) == digit for s, y in zip(styles, labels))
    thin = ink[[i for i, s in enumerate(styles) if s == "thin"]].mean()
    bold = ink[[i for i, s in enumerate(styles) if s == "bold"]].mean()
    assert thin < ink.mean() < bold
    assert 0.25 < sum(s is None for s in styles) / len(styles) < 0.4


def _shipped_files() -> list:
    return [p for p in DIGITS_DIR.rglob("*") if p.is_file()]


def test_shipped_folder_is_small_and_safetensors_only() -> None:
    files = _shipped_files()
    assert (DIGITS_DIR / "model_index.json").is_file() and (DIGITS_DIR / "flowrl.json").is_file()
    assert sum(p.stat().st_size for p in files) <= 20 * 1024 * 1024
    assert not [p for p in files if p.suffix in {".bin", ".pt", ".pth", ".pkl", ".ckpt"}]
    weights = [p for p in files if p.suffix == ".safetensors"]
    assert len(weights) == 5  # transformer, vae, three text encoders


def test_shipped_model_draws_legible_digits() -> None:
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(DIGITS_DIR), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    labels = torch.arange(10).repeat_interleave(10)  # 100 samples: the CI smoke threshold is 90%
    prompts = [digits_prompt(int(d), None) for d in labels]
    images = sample_digits_with_pipeline(pipe, prompts, seeds=list(range(1000, 1100)), steps=10)
    assert images.shape == (100, 3, 8, 8) and torch.isfinite(images).all()
    assert digit_accuracy(images, labels) >= 0.9


def test_tiny_pretrain_is_loadable_and_deterministic(tmp_path) -> None:
    from diffusers import StableDiffusion3Pipeline

    kwargs = dict(seed=3, vae_steps=3, flow_steps=3, batch_size=16, threads=1, eval_per_class=0, log=lambda _: None)
    report = pretrain_digits(tmp_path / "a", **kwargs)
    pretrain_digits(tmp_path / "b", **kwargs)
    assert report["flow"]["final_loss"] > 0 and report["size_bytes"] > 0
    for sub in (
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
        "text_encoder/model.safetensors",
        "text_encoder_3/model.safetensors",
    ):
        a, b = load_file(tmp_path / "a" / sub), load_file(tmp_path / "b" / sub)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    fresh = build_digits_pipeline(seed=3).transformer.state_dict()
    trained = load_file(tmp_path / "a" / "transformer/diffusion_pytorch_model.safetensors")
    assert not torch.equal(trained["proj_out.weight"], fresh["proj_out.weight"])
    pipe = StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "a"), local_files_only=True)
    assert pipe.vae.config.scaling_factor == pytest.approx(report["vae"]["scaling_factor"])
