"""flowrl export --merge: base + LoRA fused into a diffusers folder that loads offline and matches."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flowrl.cli import main
from flowrl.export import export_merged
from flowrl.models import load_adapter
from flowrl.models.sd3 import SD3Adapter
from flowrl.policy.lora import add_lora, lora_state_dict


def _save_random_lora(model, lora_dir):
    """Attach a random r4 LoRA to ``model`` and save it in ``lora_dir`` the way a run saves it."""
    params = add_lora(model.transformer, rank=4, alpha=8.0, targets=model.lora_target_modules)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    lora_dir.mkdir(parents=True)
    model.save_lora(lora_dir, lora_state_dict(model.transformer))


def _random_lora_run(tmp_path):
    """The embedded model with a random r4 LoRA, saved the way a run saves it; returns (adapter, lora dir)."""
    model = load_adapter("flowrl-digits")
    lora_dir = tmp_path / "run" / "lora"
    _save_random_lora(model, lora_dir)
    (tmp_path / "run" / "config.yaml").write_text("model:\n  path: flowrl-digits\n  dtype: float32\n")
    return model, lora_dir


def _velocity(model, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((3, *model.latent_shape(*model.default_resolution)), generator=gen)
    sigma = torch.tensor([0.9, 0.5, 0.2])
    cond = model.encode_prompt(["a bold handwritten 3", "a thin handwritten 7", "a handwritten 0"])
    with torch.no_grad():
        return model.velocity(x, sigma, cond)


def test_merged_export_loads_offline_and_matches_base_plus_lora(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    trained, _ = _random_lora_run(tmp_path)
    expected = _velocity(trained)
    base = _velocity(load_adapter("flowrl-digits"))
    assert (expected - base).abs().max() > 1e-3  # the LoRA changes the model

    out = export_merged(tmp_path / "run", tmp_path / "merged")
    assert (out / "model_index.json").is_file() and (out / "flowrl.json").is_file()
    assert list((out / "transformer").glob("*.safetensors"))
    pipe = StableDiffusion3Pipeline.from_pretrained(str(out), local_files_only=True)
    assert not any("lora" in n for n, _ in pipe.transformer.named_parameters())
    merged = _velocity(SD3Adapter(pipe, max_sequence_length=trained.max_sequence_length))
    torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-4)
    # and flowrl itself can use the folder as a new base model
    assert load_adapter(str(out)).default_resolution == trained.default_resolution


def test_export_cli_and_errors(tmp_path, capsys):
    _, lora_dir = _random_lora_run(tmp_path)
    assert main(["export", "--merge", str(lora_dir), "--out", str(tmp_path / "m")]) == 0
    assert "wrote merged diffusers model" in capsys.readouterr().out
    assert main(["export", "--merge", str(lora_dir), "--out", str(tmp_path / "m")]) == 2
    assert "already holds files; pass --overwrite" in capsys.readouterr().err
    assert main(["export", "--merge", str(tmp_path / "nothing"), "--out", str(tmp_path / "n")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no LoRA at" in err
    # missing base weights name --base, the flag export takes (it said "set model.path=", which export ignores)
    assert (
        main(["export", "--merge", str(lora_dir), "--out", str(tmp_path / "b"), "--base", str(tmp_path / "gone")]) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "and pass --base ./models/<model>" in err and "model.path" not in err
    damaged = tmp_path / "damaged"
    load_adapter("flowrl-digits").pipe.save_pretrained(str(damaged))
    (damaged / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"garbage")
    assert main(["export", "--merge", str(lora_dir), "--out", str(tmp_path / "c"), "--base", str(damaged)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is damaged" in err and "and pass --base ./models/" in err
    assert "model.path" not in err


def test_merged_export_of_a_flux_lora(tmp_path):
    """The merge goes through diffusers' generic LoRA API, so FLUX (attention + MLP targets) exports too."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "models"))
    from tiny_flow_pipelines import tiny_flux, tiny_flux_pipeline

    base = tmp_path / "flux"
    tiny_flux_pipeline().save_pretrained(str(base))
    (base / "flowrl.json").write_text(json.dumps({"resolution": 16, "max_sequence_length": 8}))
    trained = tiny_flux()
    _save_random_lora(trained, tmp_path / "lora")
    out = export_merged(tmp_path / "lora", tmp_path / "merged", base=str(base))
    merged = load_adapter(str(out))
    assert type(merged).__name__ == "FluxAdapter" and (out / "flowrl.json").is_file()
    torch.testing.assert_close(_velocity(merged), _velocity(trained), rtol=1e-4, atol=1e-4)


def test_merged_flux_export_keeps_the_run_s_distilled_guidance(tmp_path):
    """A FLUX.1-dev run trained with model.distilled_guidance=2.0: the merged folder samples at 2.0, not 3.5."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "models"))
    from tiny_flow_pipelines import tiny_flux, tiny_flux_pipeline

    base = tmp_path / "flux"
    tiny_flux_pipeline().save_pretrained(str(base))
    (base / "flowrl.json").write_text(json.dumps({"resolution": 16, "max_sequence_length": 8}))
    trained = tiny_flux(guidance_scale=2.0)
    _save_random_lora(trained, tmp_path / "run" / "lora")
    (tmp_path / "run" / "config.yaml").write_text(f"model:\n  path: {base}\n  distilled_guidance: 2.0\n")
    out = export_merged(tmp_path / "run", tmp_path / "merged")
    card = json.loads((out / "flowrl.json").read_text())
    assert card == {"resolution": 16, "max_sequence_length": 8, "guidance_scale": 2.0}
    merged = load_adapter(str(out))
    assert merged.guidance_scale == 2.0
    torch.testing.assert_close(_velocity(merged), _velocity(trained), rtol=1e-4, atol=1e-4)


def test_export_over_its_own_base_folder_keeps_the_model_card(tmp_path):
    """--out naming the base folder with --overwrite (replace the base by the merged model): flowrl.json survives,
    so the merged folder keeps the base's resolution and sequence length."""
    import json

    base = tmp_path / "base"
    load_adapter("flowrl-digits").pipe.save_pretrained(str(base))
    card = {"resolution": 8, "max_sequence_length": 6}
    (base / "flowrl.json").write_text(json.dumps(card))
    trained = load_adapter(str(base))
    _save_random_lora(trained, tmp_path / "lora")
    out = export_merged(tmp_path / "lora", base, base=str(base), overwrite=True)
    assert json.loads((out / "flowrl.json").read_text()) == card
    merged = load_adapter(str(out))
    assert merged.default_resolution == (8, 8) and merged.max_sequence_length == 6
    torch.testing.assert_close(_velocity(merged), _velocity(trained), rtol=1e-4, atol=1e-4)


def test_merged_export_of_a_two_expert_wan_lora(tmp_path):
    """Wan2.2 writes one LoRA file per expert; the export fuses both into their transformers."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_wan import tiny_wan_adapter

    trained = tiny_wan_adapter(two_experts=True)
    base = tmp_path / "wan"
    trained.pipe.save_pretrained(str(base))
    _save_random_lora(trained, tmp_path / "lora")
    assert len(list((tmp_path / "lora").glob("*.safetensors"))) == 2
    out = export_merged(tmp_path / "lora", tmp_path / "merged", base=str(base))
    merged = load_adapter(str(out))
    assert merged.pipe.transformer_2 is not None
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((2, *trained.latent_shape(16, 16)), generator=gen)
    sigma = torch.tensor([0.95, 0.1])  # one sample per expert
    cond = trained.encode_prompt(["a bold handwritten 3", "a thin handwritten 7"])
    with torch.no_grad():
        expected, got = trained.velocity(x, sigma, cond), merged.velocity(x, sigma, cond)
        base_v = load_adapter(str(base)).velocity(x, sigma, cond)
    assert (expected - base_v).abs().amax(dim=tuple(range(1, x.ndim))).min() > 1e-4  # both experts changed
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_lora_file_that_is_not_one_is_one_line_everywhere(tmp_path, capsys):
    """A corrupt file, a file of another model's keys, or a checkpoint's peft-keyed file: refused, never base images."""
    from safetensors.torch import save_file

    from flowrl.policy.lora import lora_state_dict

    model, lora_dir = _random_lora_run(tmp_path)
    cases = {"corrupt": None, "foreign": {"transformer.foo.lora_A.weight": torch.zeros(2, 2)}}
    cases["peft keys"] = {k.removeprefix("transformer."): v for k, v in lora_state_dict(model.transformer).items()}
    for name, tensors in cases.items():
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        file = folder / "pytorch_lora_weights.safetensors"
        file.write_bytes(b"garbage") if tensors is None else save_file(tensors, str(file))
        for argv in (
            ["sample", "--lora", str(folder), "--prompt", "a 3", "--seeds", "1", "--out", str(tmp_path / "s.png")],
            ["export", "--merge", str(folder), "--out", str(tmp_path / "m")],
        ):
            assert main(argv) == 2, (name, argv[0])
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"LoRA {folder}: " in err and "pass a run folder" in err, (name, err)
    assert not (tmp_path / "s.png").exists() and not (tmp_path / "m").exists()


@pytest.mark.parametrize("dropped", ["lora_A", "lora_B"])
def test_a_lora_file_missing_a_tensor_is_one_line_naming_it(tmp_path, capsys, dropped):
    """One tensor deleted from a run's LoRA: diffusers built the layer and left its weight on the meta device or
    random, so flowrl eval gave other figures on every run (lora_B) or NaN images blamed on the reward (lora_A)."""
    from safetensors.torch import load_file

    _, lora_dir = _random_lora_run(tmp_path)
    file = lora_dir / "pytorch_lora_weights.safetensors"
    weights = load_file(str(file))
    key = sorted(k for k in weights if dropped in k and ".to_v." in k)[0]
    del weights[key]
    save_file(weights, str(file))
    out = tmp_path / "s.png"
    assert main(["sample", "--lora", str(lora_dir.parent), "--prompt", "a 3", "--seeds", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"LoRA {file}: 1 of the 62 weights of the adapter it describes are not" in err
    assert f"(first: {key.removeprefix('transformer.')}); it is incomplete; pass a run folder" in err
    assert not out.exists()


def test_a_lora_of_another_model_with_the_same_layer_names_is_one_line(tmp_path, capfd):
    """A FLUX LoRA (to_q, ... of other widths) on the embedded SD3 model: diffusers' multi-line log of every size
    mismatch and peft's warning are held back; the refusal is one line on stderr."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "models"))
    from tiny_flow_pipelines import tiny_flux

    _save_random_lora(tiny_flux(), tmp_path / "lora")
    capfd.readouterr()
    out = ["--prompt", "a 3", "--seeds", "1", "--out", str(tmp_path / "s.png")]
    assert main(["sample", "--lora", str(tmp_path / "lora"), *out]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "not a LoRA this model can load" in err, err


def test_sample_starts_from_the_run_s_config_and_checks_its_arguments(tmp_path, capsys):
    _, lora_dir = _random_lora_run(tmp_path)
    run = lora_dir.parent
    (run / "config.yaml").write_text(f"model:\n  path: {tmp_path / 'gone'}\n")  # the run's base model, moved away
    out = ["--prompt", "a 3", "--seeds", "1", "--out", str(tmp_path / "s.png")]
    assert main(["sample", "--lora", str(run), *out]) == 2
    assert str(tmp_path / "gone") in capsys.readouterr().err  # it looked for the run's model, not the embedded one
    assert main(["sample", "--lora", str(run), "model.path=flowrl-digits", *out]) == 0
    grid = (tmp_path / "s.png").read_bytes()
    assert main(["sample", "--lora", str(run), "model.path=flowrl-digits", *out, "--seed", "7"]) == 2
    assert capsys.readouterr().err == (  # it replaced the grid unasked
        f"flowrl: error: --out {tmp_path / 's.png'} already exists; pass --overwrite to replace it, "
        "or name another file\n"
    )
    assert (tmp_path / "s.png").read_bytes() == grid
    assert main(["sample", "--lora", str(run), "model.path=flowrl-digits", *out, "--seed", "7", "--overwrite"]) == 0
    assert (tmp_path / "s.png").read_bytes() != grid
    for bad, fragment in (
        ("--seeds=0", "--seeds must be >= 1; got 0\n"),
        ("--steps=0", "--steps must be in [1, 1000] (as sampler.num_steps); got 0\n"),
        ("--steps=5000", "--steps must be in [1, 1000] (as sampler.num_steps); got 5000\n"),  # ran until killed
        ("--seed=-1", "--seed must be in [0, 9223372036854775807] (the seeds run from --seed to"),
        ("--seed=1180591620717411303424", "got 1180591620717411303424\n"),  # was "Overflow when unpacking long long"
        ("--seeds=100000000", "1 prompts x --seeds 100000000 = 100,000,000 samples x 10 steps"),  # ran until killed
    ):
        assert main(["sample", "--lora", str(run), "model.path=flowrl-digits", *out, bad]) == 2
        assert fragment in capsys.readouterr().err
    assert main(["sample", "--lora", str(run), "model.path=flowrl-digits", *out[:-1], str(tmp_path)]) == 2
    assert "is a folder; name a PNG file" in capsys.readouterr().err
    new_folder = f"{tmp_path / 'new'}/"  # it wrote a PNG file named "new"
    assert main(["sample", "--lora", str(run), "model.path=flowrl-digits", *out[:-1], new_folder]) == 2
    assert f"--out {new_folder} is a folder" in capsys.readouterr().err and not (tmp_path / "new").exists()
    jpg = tmp_path / "s.jpg"  # it wrote PNG bytes under a .jpg name
    assert main(["sample", "--lora", str(run), "model.path=flowrl-digits", *out[:-1], str(jpg)]) == 2
    assert f"name a .png file, e.g. --out {tmp_path / 's.png'}" in capsys.readouterr().err and not jpg.exists()


def test_sample_uses_the_run_s_evaluation_steps(tmp_path, monkeypatch):
    """A run with train.eval_steps=10 and sampler.num_steps=5 (the fast recipes): flowrl sample draws on the 10-step
    grid its own samples, flowrl eval and the demo use; --steps still wins."""
    import flowrl.rollouts.chunked as chunked

    _, lora_dir = _random_lora_run(tmp_path)
    run = lora_dir.parent
    (run / "config.yaml").write_text(
        "model:\n  path: flowrl-digits\nsampler:\n  num_steps: 5\ntrain:\n  eval_steps: 10\n"
    )
    steps, real = [], chunked.sample_images

    def counting(model, prompts, seeds, sigmas, **kwargs):
        steps.append(len(sigmas) - 1)
        return real(model, prompts, seeds, sigmas, **kwargs)

    monkeypatch.setattr(chunked, "sample_images", counting)
    out = ["--prompt", "a 3", "--seeds", "1", "--out", str(tmp_path / "s.png")]
    assert main(["sample", "--lora", str(run), *out]) == 0
    assert main(["sample", "--lora", str(run), *out, "--steps=3", "--overwrite"]) == 0
    assert steps == [10, 3]


def test_export_overwrites_only_a_diffusers_folder(tmp_path, capsys, monkeypatch):
    _, lora_dir = _random_lora_run(tmp_path)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.md").write_text("x")
    assert main(["export", "--merge", str(lora_dir), "--out", str(notes), "--overwrite"]) == 2
    assert "no diffusers model (none of model_index.json)" in capsys.readouterr().err and (notes / "todo.md").is_file()
    monkeypatch.chdir(notes)
    assert main(["export", "--merge", str(lora_dir), "--out", ".", "--overwrite"]) == 2
    assert "is the current folder or one above it" in capsys.readouterr().err and (notes / "todo.md").is_file()


def test_the_run_config_of_a_lora_folder(tmp_path):
    from flowrl.export import run_config_file

    (tmp_path / "checkpoints" / "best-guard").mkdir(parents=True)
    (tmp_path / "lora").mkdir()
    (tmp_path / "config.yaml").write_text("{}\n")
    for name in ("lora", "checkpoints/best-guard"):  # a LoRA file there belongs to the run too
        (tmp_path / name / "pytorch_lora_weights.safetensors").write_bytes(b"")
    files = [tmp_path / name / "pytorch_lora_weights.safetensors" for name in ("lora", "checkpoints/best-guard")]
    for source in (tmp_path, tmp_path / "lora", tmp_path / "checkpoints" / "best-guard", *files):
        assert run_config_file(source) == tmp_path / "config.yaml", source
    assert run_config_file(tmp_path / "checkpoints") is None and run_config_file(tmp_path / "elsewhere") is None


def test_run_model_settings_read_path_dtype_and_a_numeric_guidance(tmp_path: Path) -> None:
    """model.path and model.dtype come when strings; distilled_guidance as a float when a number, never a bool."""
    from flowrl.export import run_model_settings

    config = tmp_path / "config.yaml"
    config.write_text("model:\n  path: ./models/flux\n  dtype: bfloat16\n  distilled_guidance: 3\n")
    assert run_model_settings(tmp_path) == {"path": "./models/flux", "dtype": "bfloat16", "distilled_guidance": 3.0}
    config.write_text("model:\n  path: 7\n  dtype: float16\n  distilled_guidance: true\n")
    assert run_model_settings(tmp_path) == {"dtype": "float16"}
    assert run_model_settings(tmp_path / "elsewhere") == {}


def test_export_writes_the_run_s_dtype_unless_told_otherwise(tmp_path: Path) -> None:
    """A run trained in bfloat16 exports bfloat16 weights; --dtype overrides the run's."""
    from safetensors import safe_open

    _, lora_dir = _random_lora_run(tmp_path)
    (tmp_path / "run" / "config.yaml").write_text("model:\n  path: flowrl-digits\n  dtype: bfloat16\n")

    def dtypes(out: Path) -> set[str]:
        (weights,) = (out / "transformer").glob("*.safetensors")
        with safe_open(str(weights), "pt") as f:
            return {str(f.get_slice(k).get_dtype()) for k in f.keys()}

    assert dtypes(export_merged(tmp_path / "run", tmp_path / "bf16")) == {"BF16"}
    assert dtypes(export_merged(lora_dir, tmp_path / "fp32", dtype="float32")) == {"F32"}


def test_sample_draws_seeds_from_seed_on_for_each_prompt(tmp_path: Path, monkeypatch) -> None:
    """``flowrl sample --seed 5 --seeds 2``: each prompt's samples use seeds 5 and 6, the grid one row per prompt."""
    import flowrl.rollouts.chunked as chunked

    drawn: list[tuple[list[str], list[int]]] = []
    real = chunked.sample_images

    def recording(model, prompts, seeds, sigmas, **kwargs):
        drawn.append((list(prompts), list(seeds)))
        return real(model, prompts, seeds, sigmas, **kwargs)

    monkeypatch.setattr(chunked, "sample_images", recording)
    args = ["--prompt", "a 3", "--prompt", "a 7", "--seeds", "2", "--seed", "5", "--steps", "1"]
    assert main(["sample", "model.path=flowrl-digits", *args, "--out", str(tmp_path / "s.png")]) == 0
    assert drawn == [(["a 3", "a 3", "a 7", "a 7"], [5, 6, 5, 6])]


def test_sample_out_accepts_an_upper_case_png_or_a_name_without_a_suffix() -> None:
    """``--out`` ending in ``.PNG`` or in no suffix at all is a PNG name; only another suffix is refused."""
    import argparse

    import pytest

    from flowrl.output_commands import _check_sample_args

    for out in ("grid.PNG", "grid.Png", "grid"):
        _check_sample_args(argparse.Namespace(seeds=1, seed=0, steps=None, out=out))  # no error
    with pytest.raises(ValueError, match="name a .png file"):
        _check_sample_args(argparse.Namespace(seeds=1, seed=0, steps=None, out="grid.jpg"))


def test_export_command_passes_dtype_through(tmp_path: Path) -> None:
    """``flowrl export --dtype float16`` writes float16 weights over the run's float32."""
    from safetensors import safe_open

    _, lora_dir = _random_lora_run(tmp_path)  # the run's config says dtype: float32
    out = tmp_path / "fp16"
    assert main(["export", "--merge", str(tmp_path / "run"), "--out", str(out), "--dtype", "float16"]) == 0
    (weights,) = (out / "transformer").glob("*.safetensors")
    with safe_open(str(weights), "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"F16"}
