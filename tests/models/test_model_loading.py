"""Loading FLUX / Qwen-Image folders through load_adapter: dispatch, hub ids, missing weights without waits."""

import json
import pickle
import shutil
import time

import pytest
import torch
from conftest import PlantedPickle, custom_code_folder
from tiny_flow_pipelines import tiny_flux, tiny_flux_pipeline

from flowrl.models import load_adapter
from flowrl.models.flux import FluxAdapter
from flowrl.models.hub import resolve_model_path
from flowrl.policy import build_policy


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_flux_dev")
    tiny_flux_pipeline().save_pretrained(str(path))
    (path / "flowrl.json").write_text(json.dumps({"resolution": 16, "max_sequence_length": 8, "guidance_scale": 5.0}))
    return path


def _check_velocity(loaded, reference):
    cond = reference.encode_prompt(["a bold handwritten 3", "a 2"])
    x = torch.randn(2, *reference.latent_shape(16, 16), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.7, 0.2])
    torch.testing.assert_close(loaded.encode_prompt(["a bold handwritten 3", "a 2"]), cond, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        loaded.velocity(x, sigma, cond), reference.velocity(x, sigma, cond), rtol=1e-4, atol=1e-5
    )


def test_flux_folder_loads_by_class_name_with_model_card(flux_folder):
    model = load_adapter(str(flux_folder))
    assert isinstance(model, FluxAdapter)
    assert model.default_resolution == (16, 16) and model.max_sequence_length == 8 and model.guidance_scale == 5.0
    _check_velocity(model, tiny_flux(guidance_scale=5.0))


def test_schnell_folder_loads_without_guidance(tmp_path):
    tiny_flux_pipeline(guidance_embeds=False).save_pretrained(str(tmp_path))
    assert load_adapter(str(tmp_path)).max_sequence_length == 256  # schnell's T5 length when the card does not say
    (tmp_path / "flowrl.json").write_text(
        json.dumps({"resolution": 16, "max_sequence_length": 8, "guidance_scale": 3.5})
    )
    model = load_adapter(str(tmp_path))
    assert isinstance(model, FluxAdapter) and model.guidance_scale is None  # card guidance ignored: no embedding
    _check_velocity(model, tiny_flux(guidance_embeds=False))


def test_missing_weights_is_one_line_with_download_command(flux_folder, tmp_path):
    broken = tmp_path / "flux"
    shutil.copytree(flux_folder, broken)
    for f in (broken / "transformer").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError) as err:
        load_adapter(str(broken))
    msg = str(err.value)
    assert "\n" not in msg and "transformer holds no weight files" in msg
    assert "hf download black-forest-labs/FLUX.1-dev" in msg and "model.path=" in msg
    with pytest.raises(FileNotFoundError, match="does not exist.*model.path="):
        load_adapter(str(tmp_path / "no" / "such" / "folder"))


def test_a_missing_component_folder_is_one_line_with_download_command(flux_folder, tmp_path) -> None:
    """A component model_index.json lists but the folder lacks is named before diffusers tries to load it."""
    broken = tmp_path / "flux"
    shutil.copytree(flux_folder, broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(FileNotFoundError) as err:
        load_adapter(str(broken))
    msg = str(err.value)
    assert "\n" not in msg and f"component folder {broken / 'vae'} does not exist" in msg
    assert "hf download black-forest-labs/FLUX.1-dev" in msg


def _damage(path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # garbage: not a safetensors file at all
        path.write_bytes(b"garbage" * 10)


@pytest.mark.parametrize("component", ["transformer", "vae", "text_encoder_2"])
@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_a_damaged_weight_file_is_named_in_one_line_before_loading(flux_folder, tmp_path, component, how) -> None:
    """diffusers said "Unable to load weights" and transformers named no file at all; the header check names it."""
    broken = tmp_path / "flux"
    shutil.copytree(flux_folder, broken)
    (weights,) = (broken / component).glob("*.safetensors")
    _damage(weights, how)
    with pytest.raises(ValueError) as err:
        load_adapter(str(broken))
    msg = str(err.value)
    assert "\n" not in msg and f"weight file {weights} of model {str(broken)!r} is damaged" in msg
    assert "hf download black-forest-labs/FLUX.1-dev" in msg and "model.path=" in msg


def test_a_config_json_that_no_longer_describes_its_weights_is_one_line_naming_the_fix(flux_folder, tmp_path):
    """diffusers' own line advised ignore_mismatched_sizes=True (random weights) and named no folder."""
    broken = tmp_path / "flux"
    shutil.copytree(flux_folder, broken)
    config = json.loads((broken / "transformer" / "config.json").read_text())
    config["joint_attention_dim"] *= 2
    (broken / "transformer" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        load_adapter(str(broken))
    msg = str(err.value)
    assert "\n" not in msg and f"could not be loaded from {broken}: a component's config.json does not" in msg
    assert "expected shape" in msg and "ignore_mismatched_sizes" not in msg and "restore that config.json" in msg


@pytest.mark.parametrize(
    "component, name", [("transformer", "diffusion_pytorch_model.bin"), ("text_encoder_2", "pytorch_model.bin")]
)
def test_a_pickle_the_safe_loader_refuses_is_one_line_naming_the_file_and_never_runs(
    flux_folder, tmp_path, component, name
):
    """diffusers wraps torch's UnpicklingError in an OSError, transformers lets it through (a traceback before)."""
    broken = tmp_path / "flux"
    shutil.copytree(flux_folder, broken)
    for f in (broken / component).glob("*.safetensors"):
        f.unlink()
    marker = tmp_path / "PLANTED"
    (broken / component / name).write_bytes(pickle.dumps(PlantedPickle(marker), protocol=2))
    with pytest.raises(ValueError) as err:
        load_adapter(str(broken))
    msg = str(err.value)
    assert "\n" not in msg and f"refused the pickled weights in {broken} ({component}/{name}: " in msg
    assert "Unsupported global" in msg and ".safetensors weights" in msg
    assert not marker.exists()


def test_pickled_weights_the_safe_loader_accepts_still_load(flux_folder, tmp_path) -> None:
    """A plain state dict in ``.bin`` files (older hub repos) loads as before: only a refused pickle is an error."""
    pickled = tmp_path / "flux"
    shutil.copytree(flux_folder, pickled)
    reference = load_adapter(str(flux_folder))
    for component, name in (("transformer", "diffusion_pytorch_model.bin"), ("text_encoder_2", "pytorch_model.bin")):
        for f in (pickled / component).glob("*.safetensors"):
            f.unlink()
        torch.save(getattr(reference.pipe, component).state_dict(), pickled / component / name)
    _check_velocity(load_adapter(str(pickled)), reference)


def test_a_sharded_component_loads_and_a_missing_shard_or_a_bad_index_is_named(flux_folder, tmp_path) -> None:
    sharded = tmp_path / "flux"
    shutil.copytree(flux_folder, sharded)
    reference = load_adapter(str(flux_folder))
    for f in (sharded / "transformer").glob("*.safetensors"):
        f.unlink()
    reference.transformer.save_pretrained(str(sharded / "transformer"), max_shard_size="20KB")
    shards = sorted((sharded / "transformer").glob("*.safetensors"))
    (index,) = (sharded / "transformer").glob("*.safetensors.index.json")
    assert len(shards) > 2
    _check_velocity(load_adapter(str(sharded)), reference)
    text = index.read_text()
    index.write_text(text[:-20])
    with pytest.raises(ValueError, match=f"shard index {index} of model .* is unreadable .*hf download"):
        load_adapter(str(sharded))
    index.write_text(text)
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=f"are missing \\({index.name} lists {shards[1]}\\); download"):
        load_adapter(str(sharded))


def test_the_embedded_model_s_damaged_or_missing_weights_name_the_rebuild_command(tmp_path, monkeypatch) -> None:
    """Not the download command of the SD3 class it shares (it said `hf download stabilityai/...` before)."""
    from flowrl.models.digits import model as digits_model

    copy = tmp_path / "flowrl-digits"
    shutil.copytree(digits_model.DIGITS_DIR, copy)
    monkeypatch.setattr(digits_model, "DIGITS_DIR", copy)
    load_adapter()  # the copy loads
    vae = copy / "vae" / "diffusion_pytorch_model.safetensors"
    _damage(vae, "truncated")
    with pytest.raises(ValueError) as damaged:
        load_adapter("flowrl-digits")
    vae.unlink()
    with pytest.raises(FileNotFoundError) as missing:
        load_adapter()
    assert f"weight file {vae} of model 'flowrl-digits' is damaged" in str(damaged.value)
    assert f"{vae.parent} holds no weight files" in str(missing.value)
    for err in (damaged, missing):
        assert str(err.value).endswith("rebuild them with `flowrl pretrain-digits --overwrite` (or reinstall flowrl)")
        assert "hf download" not in str(err.value)


@pytest.mark.parametrize(
    "file, damage, fragment",
    [
        ("transformer/config.json", "truncate", "transformer/config.json' is not a valid JSON file"),
        ("scheduler/scheduler_config.json", "truncate", "scheduler_config.json' is not a valid JSON file"),
        ("vae/config.json", "delete", "no file named config.json found in directory"),
    ],
)
def test_a_component_config_the_loaders_cannot_read_is_one_line_with_the_fix(
    flux_folder, tmp_path, file, damage, fragment
) -> None:
    """diffusers raised an OSError without an errno, which the CLI printed as a traceback."""
    broken = tmp_path / "flux"
    shutil.copytree(flux_folder, broken)
    if damage == "delete":
        (broken / file).unlink()
    else:
        (broken / file).write_text((broken / file).read_text()[:10])
    with pytest.raises(ValueError) as err:
        load_adapter(str(broken))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"model {str(broken)!r} could not be loaded from {broken} (")
    assert fragment in msg and "hf download black-forest-labs/FLUX.1-dev" in msg


def test_uncached_hub_id_fails_fast_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_path("black-forest-labs/FLUX.1-dev", cache_dir=str(tmp_path))
    assert time.perf_counter() - start < 2.0
    msg = str(err.value)
    assert (
        "\n" not in msg
        and "'black-forest-labs/FLUX.1-dev'" in msg
        and "not in the local hub cache; HF_HUB_OFFLINE" in msg
    )
    assert "hf download black-forest-labs/FLUX.1-dev --local-dir" in msg and "model.path=" in msg


def test_uncached_hub_id_without_offline_mode_does_not_wait_for_retries(tmp_path, monkeypatch):
    """Offline mode off and no network (the test guard refuses connections): one probe, no retry loop."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # loopback, refused at once: nothing downloads
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="hub is unreachable.*hf download Qwen/Qwen-Image"):
        resolve_model_path("Qwen/Qwen-Image", cache_dir=str(tmp_path))
    assert time.perf_counter() - start < 5.0


def test_a_hub_id_is_owner_slash_name_that_is_not_a_local_path(tmp_path, monkeypatch) -> None:
    """``owner/name`` is a hub id unless a local path of that name exists; other strings never are."""
    from flowrl.models.hub import is_hub_id

    monkeypatch.chdir(tmp_path)
    assert is_hub_id("tiny-org/tiny-flux") and is_hub_id("Qwen/Qwen-Image")
    (tmp_path / "tiny-org" / "tiny-flux").mkdir(parents=True)
    assert not is_hub_id("tiny-org/tiny-flux")
    assert not any(is_hub_id(p) for p in ("flux", "./org/model", "/org/model", "a/b/c", "-org/model"))


@pytest.mark.parametrize("value, offline", [("1", True), ("on", True), ("Yes", True), ("true", True), ("0", False)])
def test_offline_mode_is_read_from_the_environment_at_call_time(monkeypatch, value: str, offline: bool) -> None:
    """``HF_HUB_OFFLINE`` set after the hub client was imported still decides, in each spelling the client accepts."""
    from huggingface_hub import constants

    from flowrl.models.hub import hub_offline

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert hub_offline() is offline


@pytest.mark.parametrize(
    "endpoint, address",
    [
        ("https://hub.example", ("hub.example", 443)),
        ("http://hub.example/", ("hub.example", 80)),
        ("http://h:8080", ("h", 8080)),
    ],
)
def test_the_reachability_probe_dials_the_endpoint_s_port(monkeypatch, endpoint: str, address: tuple) -> None:
    """The probe dials ``HF_ENDPOINT``'s host at its port (default 443 for https, 80 for http); a failure is False."""
    import socket

    from flowrl.models.hub import _hub_reachable

    dialled = []

    def refuse(addr: tuple, timeout: float) -> None:
        dialled.append((addr, timeout))
        raise OSError("refused")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    assert _hub_reachable(0.5) is False
    assert dialled == [(address, 0.5)]


def test_hub_id_resolves_from_the_local_cache(flux_folder, tmp_path, monkeypatch):
    from huggingface_hub import constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--tiny-org--tiny-flux"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(flux_folder, repo / "snapshots" / commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path("tiny-org/tiny-flux", cache_dir=str(tmp_path)) == repo / "snapshots" / commit
    model = load_adapter("tiny-org/tiny-flux")
    assert isinstance(model, FluxAdapter) and model.model_id == "tiny-org/tiny-flux"


def test_unknown_pipeline_class_is_named(flux_folder, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(flux_folder, other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "MysteryPipeline"}))
    with pytest.raises(ValueError, match="MysteryPipeline"):
        load_adapter(str(other))


@pytest.mark.parametrize(
    "text, message", [("[1, 2]", "must hold a JSON object with a _class_name; got a list"), ("{", "is not valid JSON")]
)
def test_a_malformed_model_index_is_one_value_error(tmp_path, text: str, message: str) -> None:
    """A model_index.json that is not a JSON object is refused in one line before any weight check reads it."""
    (tmp_path / "model_index.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_adapter(str(tmp_path))


def test_distilled_guidance_config_key_reaches_the_adapter(flux_folder, tmp_path):
    from flowrl.config import ConfigError, load_config

    assert load_config(None, ["model.distilled_guidance=2.5"]).model.distilled_guidance == 2.5
    with pytest.raises(ConfigError, match="distilled_guidance"):
        load_config(None, ["model.distilled_guidance=-1"])
    model = load_adapter(str(flux_folder), distilled_guidance=2.0)  # overrides the model card's 5.0
    seen = []
    model.transformer.register_forward_pre_hook(
        lambda _, args, kw: seen.append(kw["guidance"].clone()), with_kwargs=True
    )
    x = torch.zeros(1, *model.latent_shape(16, 16))
    model.velocity(x, torch.tensor([0.5]), model.encode_prompt(["a 1"]))
    assert model.guidance_scale == 2.0 and seen[0].tolist() == [2.0]
    schnell = tmp_path / "schnell"
    tiny_flux_pipeline(guidance_embeds=False).save_pretrained(str(schnell))
    with pytest.raises(ValueError, match="guidance_embeds=False.*remove model.distilled_guidance"):
        load_adapter(str(schnell), distilled_guidance=3.5)
    other = tmp_path / "other"
    shutil.copytree(flux_folder, other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusion3Pipeline"}))
    with pytest.raises(ValueError, match="StableDiffusion3Pipeline has no guidance embedding"):
        load_adapter(str(other), distilled_guidance=3.5)


@pytest.mark.slow
def test_flux_trains_and_samples_through_the_cli(flux_folder, tmp_path):
    """`flowrl train` / `flowrl sample` on a FLUX folder, as a user runs them (subprocesses)."""
    import os
    import subprocess
    import sys

    def flowrl(*args):
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        return subprocess.run(
            [sys.executable, "-m", "flowrl", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )

    out = tmp_path / "run"
    fast = [
        "prompts.per_iteration=2",
        "prompts.group_size=2",
        "sampler.num_steps=2",
        "sampler.chunk_size=2",
        "sampler.schedule=dynamic_shift",
        "train.iterations=1",
        "train.eval_every=1",
        "train.eval_seeds=1",
        "output.grid_seeds=1",
        "lora.rank=4",
        "lora.alpha=8",
        "model.distilled_guidance=4.0",
    ]
    result = flowrl("train", f"model.path={flux_folder}", *fast, f"output.dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
    sample = flowrl(
        "sample",
        f"model.path={flux_folder}",
        "model.distilled_guidance=4.0",
        "sampler.schedule=model",
        "--lora",
        str(out),
        "--prompt",
        "a bold handwritten 3",
        "--seeds",
        "2",
        "--out",
        str(tmp_path / "s.png"),
    )
    assert sample.returncode == 0 and (tmp_path / "s.png").is_file(), sample.stderr[-2000:]
    bad = flowrl(
        "train",
        f"model.path={flux_folder}",
        "model.distilled_guidance=4.0",
        "model.path=no/such-model",
        f"output.dir={tmp_path / 'r2'}",
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "hf download no/such-model" in bad.stderr and "model.path=" in bad.stderr


def test_bfloat16_dtype_policy_and_exact_first_ratio(flux_folder):
    """Weights in the configured dtype, velocity as the model computes it, log-probs fp32, ratio exactly 1."""
    from flowrl.config import load_config
    from flowrl.prompts.sets import load_prompts
    from flowrl.rewards import build_multi_reward
    from flowrl.rollouts.chunked import chunked_rollout
    from flowrl.samplers import sde_noise_levels
    from flowrl.trainer import Trainer

    model = load_adapter(str(flux_folder), dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.pipe.text_encoder_2.dtype == torch.bfloat16
    cond = model.encode_prompt(["a bold handwritten 3", "a 2"])
    assert all(v.dtype == torch.bfloat16 for v in cond.values())
    x = torch.randn(2, *model.latent_shape(16, 16), generator=torch.Generator().manual_seed(0))
    assert model.velocity(x, torch.tensor([0.5, 0.5]), cond).dtype == torch.bfloat16
    traj = chunked_rollout(
        model,
        cond,
        x,
        model.sigmas(2, 16, 16),
        sde_noise_levels(2, 0.7),
        chunk_size=2,
        generator=torch.Generator().manual_seed(1),
    )
    assert traj.latents.dtype == torch.float32 and traj.log_probs.dtype == torch.float32
    assert model.decode(traj.latents[:, -1]).dtype == torch.float32
    cfg = load_config(
        None,
        [
            "prompts.per_iteration=2",
            "prompts.group_size=2",
            "sampler.num_steps=2",
            "sampler.chunk_size=2",
            "sampler.schedule=model",
            "model.dtype=bfloat16",
            "lora.rank=4",
            "lora.alpha=8",
        ],
    )
    prompts = load_prompts("digits-styles")
    trainer = Trainer(
        cfg,
        build_policy(cfg, model=model, trainable=True),
        build_multi_reward({"ink": {"weight": 1.0}}),
        prompts,
        prompts[:2],
    )
    assert all(p.dtype == torch.float32 for p in trainer.params)  # LoRA weights train in fp32
    assert trainer.train_step()["train/first_ratio"] == 1.0


@pytest.mark.parametrize("kind", ["flux", "qwen_image"])
def test_export_merge_writes_a_loadable_folder_with_the_trained_velocity(kind, tmp_path):
    """`flowrl export --merge` on FLUX / Qwen-Image: the fused folder reproduces the LoRA policy's velocity."""
    from tiny_flow_pipelines import tiny_qwen_image, tiny_qwen_image_pipeline

    from flowrl.export import export_merged
    from flowrl.policy.lora import add_lora, lora_state_dict

    build_pipe, build = (
        (tiny_flux_pipeline, tiny_flux) if kind == "flux" else (tiny_qwen_image_pipeline, tiny_qwen_image)
    )
    base = tmp_path / "base"
    build_pipe().save_pretrained(str(base))
    seq = 8 if kind == "flux" else 24
    (base / "flowrl.json").write_text(json.dumps({"resolution": 16, "max_sequence_length": seq}))
    trained = build()
    add_lora(trained.transformer, rank=4, alpha=8, targets=trained.lora_target_modules)
    for name, p in trained.transformer.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.1)
    trained.save_lora(tmp_path / "lora", lora_state_dict(trained.transformer))
    out = export_merged(tmp_path / "lora", tmp_path / "merged", base=str(base))
    merged = load_adapter(str(out))
    assert type(merged) is type(trained) and not hasattr(merged.transformer, "peft_config")
    cond = trained.encode_prompt(["a bold handwritten 3", "a 2"])
    x = torch.randn(2, *trained.latent_shape(16, 16), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.8, 0.3])
    torch.testing.assert_close(merged.velocity(x, sigma, cond), trained.velocity(x, sigma, cond), rtol=1e-4, atol=1e-5)


def test_custom_code_in_a_folder_is_never_run(flux_folder, tmp_path):
    """trust_remote_code stays off: a component that needs the folder's own Python module is refused, unexecuted."""
    folder, index, marker = custom_code_folder(flux_folder, tmp_path, "FluxTransformer2DModel")
    with pytest.raises(ValueError) as err:
        load_adapter(str(folder))
    assert "trust_remote_code stays off" in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": ["my_pipeline", "MyPipeline"]}))
    with pytest.raises(ValueError, match="no flowrl adapter for pipeline class"):
        load_adapter(str(folder))
    assert not marker.exists()


def test_reachable_hub_that_fails_gives_one_line_quickly(tmp_path, monkeypatch):
    """Offline mode off and a hub that answers (a local stub replying 404): the download attempt fails in one line."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from huggingface_hub import constants

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)  # read at call time by the probe and the download
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    start = time.perf_counter()
    try:
        with pytest.raises(FileNotFoundError) as err:
            resolve_model_path("some-org/some-model", cache_dir=str(tmp_path))
    finally:
        server.shutdown()
    assert time.perf_counter() - start < 10.0
    msg = str(err.value)
    assert "\n" not in msg and "download failed" in msg and "hf download some-org/some-model" in msg
