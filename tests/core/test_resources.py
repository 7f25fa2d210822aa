"""Machine checks before a run (flowrl/resources.py): devices, threads, work and memory, through the real CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_sd3_pipeline

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.memory_estimate import _activations, sample_sizes
from flowrl.models.digits.model import DIGITS_DIR
from flowrl.models.geometry import read_geometry, tensor_shapes
from flowrl.resources import MAX_SAMPLE_STEPS
from flowrl.runtime import THREADS_PER_CORE

REPO = Path(__file__).resolve().parents[2]
DIGITS_CONFIGS = sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("digits*.yaml"))
CUDA_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(capsys, *args: str) -> str:
    code, _, err = run_cli(capsys, *args)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("flowrl: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def unbounded_sd3(tmp_path_factory) -> Path:
    """A tiny SD3 pipeline folder whose position embedding is computed for any size (pos_embed_max_size null)."""
    path = tmp_path_factory.mktemp("unbounded_sd3")
    tiny_sd3_pipeline().save_pretrained(str(path))
    config = path / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pos_embed_max_size": None}))
    return path


# -- devices -------------------------------------------------------------------------------------


def missing_device_message(key: str, device: str) -> str:
    """What this machine should answer for a CUDA / MPS device it may lack."""
    if device.startswith("mps"):
        return f"{key}={device!r} but this machine has no MPS (Apple GPU) device; use {key}=cpu"
    if CUDA_COUNT == 0:
        return f"{key}={device!r} but this machine has no CUDA device; use {key}=cpu"
    return f"{key}={device!r} but this machine has {CUDA_COUNT} CUDA device(s)"


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="the machine has an MPS device")
@pytest.mark.parametrize(
    "key, device",
    [("model.device", "cuda:99"), ("model.device", "mps"), ("rewards.digit_correctness.device", "cuda:99")],
)
def test_a_device_the_machine_lacks_is_one_line(capsys, key, device):
    line = one_line_error(capsys, "train", "--check", f"{key}={device}")
    assert missing_device_message(key, device) in line


@pytest.mark.skipif(CUDA_COUNT > 0, reason="the machine has CUDA")
def test_plain_cuda_without_cuda_is_one_line(capsys):
    line = one_line_error(capsys, "train", "--check", "model.device=cuda")
    assert "model.device='cuda' but this machine has no CUDA device; use model.device=cpu" in line


def test_train_and_sample_check_the_machine_before_building_anything(capsys, tmp_path):
    out = tmp_path / "run"
    line = one_line_error(capsys, "train", "model.device=cuda:99", f"output.dir={out}")
    assert missing_device_message("model.device", "cuda:99") in line and not out.exists()
    line = one_line_error(capsys, "sample", "model.device=cuda:99", "--out", str(tmp_path / "s.png"))
    assert missing_device_message("model.device", "cuda:99") in line


# -- threads and work ------------------------------------------------------------------------------


def test_threads_far_above_the_cores_are_refused(capsys):
    cores = os.cpu_count() or 1
    limit = THREADS_PER_CORE * cores
    if limit >= 1024:
        pytest.skip("the config's own cap (1024) is below this machine's limit")
    line = one_line_error(capsys, "train", "--check", f"train.threads={limit + 1}")
    assert f"train.threads={limit + 1} but this machine has {cores} CPU cores; use at most {limit}" in line


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (
            ["prompts.per_iteration=100000", "prompts.group_size=1000"],
            "one iteration (prompts.per_iteration=100000 x prompts.group_size=1000 x sampler.num_steps=10) is "
            "1,000,000,000 sample-steps",
        ),
        (["train.eval_seeds=10000", "train.eval_steps=1000"], "one evaluation (20 prompts x train.eval_seeds=10000"),
    ],
)
def test_sizes_that_would_run_for_days_are_refused(capsys, overrides, fragment):
    line = one_line_error(capsys, "train", "--check", *overrides)
    assert fragment in line and f"above the limit of {MAX_SAMPLE_STEPS:,}" in line


# -- memory --------------------------------------------------------------------------------------


def test_a_huge_resolution_is_refused_with_the_estimate(capsys, unbounded_sd3):
    line = one_line_error(capsys, "train", "--check", f"model.path={unbounded_sd3}", "model.resolution=16384")
    assert "of host memory (largest part: " in line and "model.resolution=16384x16384" in line
    assert "but this machine has " in line and " available; lower " in line and "model.resolution" in line


def test_resolution_beyond_the_position_embedding_is_refused(capsys):
    line = one_line_error(capsys, "train", "--check", "model.resolution=16")
    assert "model.resolution=16x16 is larger than flowrl-digits covers (at most 8 pixels per side" in line


def test_the_estimate_names_the_batch_when_it_dominates(capsys, unbounded_sd3):
    line = one_line_error(
        capsys,
        "train",
        "--check",
        f"model.path={unbounded_sd3}",
        "model.resolution=2048",
        "prompts.per_iteration=1000",
        "prompts.group_size=100",
        "sampler.chunk_size=1",
    )
    assert "largest part: rollout latents (prompts.per_iteration=1000 x prompts.group_size=100 samples" in line
    assert "lower prompts.per_iteration, prompts.group_size, sampler.num_steps or model.resolution" in line


# -- healthy configs pass ------------------------------------------------------------------------


@pytest.mark.parametrize("config", [None, *DIGITS_CONFIGS], ids=str)
def test_the_embedded_jobs_fit_this_machine(capsys, monkeypatch, config):
    monkeypatch.chdir(REPO)
    code, out, err = run_cli(capsys, "train", "--check", *([config] if config else []))
    assert code == 0, err
    assert out.startswith("config OK for this machine: the run needs ~") and " of host memory" in out


def test_a_model_that_is_not_local_is_not_estimated(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "train", "--check", f"model.path={tmp_path / 'absent'}")
    assert code == 0 and "is not available locally: memory not estimated" in out


# -- the geometry is read from the folder without loading, and matches the loaded model ---------------


def test_geometry_of_the_embedded_model_matches_the_built_policy():
    from flowrl.policy import build_policy

    cfg = load_config(None, ["lora.rank=4"])
    g = read_geometry(DIGITS_DIR, None)
    policy = build_policy(cfg, trainable=True)
    z = sample_sizes(cfg, g)
    assert (g.latent_channels, *(s // g.vae_factor for s in g.default_resolution)) == policy.latent_shape
    assert z.latent == torch.Size(policy.latent_shape).numel()
    assert g.lora_width * cfg.lora.rank == sum(p.numel() for p in policy.params)
    modules = [m for m in policy.model.pipe.components.values() if isinstance(m, torch.nn.Module)]
    loaded = sum(p.numel() for m in modules for p in m.parameters()) - sum(p.numel() for p in policy.params)
    assert abs(sum(g.params.values()) - loaded) <= 0.01 * loaded  # stored tensors: parameters + persistent buffers


def test_the_activation_estimate_is_an_upper_bound_within_ten_times():
    """Against what autograd saves for the backward pass of one training chunk of the embedded model."""
    from flowrl.policy import build_policy

    cfg = load_config(None, ["sampler.chunk_size=16"])
    g = read_geometry(DIGITS_DIR, None)
    model = build_policy(cfg, trainable=True).model
    weights = {p.untyped_storage().data_ptr() for p in model.transformer.parameters()}
    saved: dict[int, int] = {}

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    cond = model.encode_prompt(["a bold handwritten 3"] * 16)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model.velocity(torch.randn(16, 4, 8, 8), torch.full((16,), 0.5), cond)
    measured = sum(n for ptr, n in saved.items() if ptr not in weights)
    estimate = _activations(cfg, g, sample_sizes(cfg, g), 16, training=True)
    assert measured <= estimate <= 10 * measured


def test_unreadable_weight_headers_are_skipped(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 8 + b"junk")
    (tmp_path / "short.safetensors").write_bytes(b"\x01")
    assert tensor_shapes(tmp_path) == {}
    assert read_geometry(tmp_path, None) is None


def test_the_rollout_estimate_reads_the_built_objective():
    """SAGE-GRPO's rollout kind is a property of its options: the estimate must see its trajectory."""
    from flowrl.memory_estimate import _rollout_kind

    flat = load_config(overrides=["objective.name=sage_grpo"])
    tree = load_config(overrides=["objective.name=sage_grpo", "objective.tree=true"])
    assert (_rollout_kind(flat), _rollout_kind(tree)) == ("sde", "tree")
    assert _rollout_kind(load_config(overrides=["objective.name=diffusion_nft"])) == "solver"


# -- a sharded launch is estimated per rank ------------------------------------------------------------


def _denoiser_part(cfg_overrides: list[str], processes: int):
    from flowrl.memory_estimate import estimate_memory

    cfg = load_config(None, cfg_overrides)
    est = estimate_memory(cfg, read_geometry(DIGITS_DIR, None), processes=processes)
    return next(p for p in est.parts if p.name.startswith("denoiser weights"))


@pytest.mark.parametrize("sharding", ["fsdp2", "zero3"])
def test_parameter_sharding_estimates_one_ranks_share_of_the_denoiser(sharding):
    g = read_geometry(DIGITS_DIR, None)
    full = _denoiser_part([], 4).nbytes
    sharded = _denoiser_part([f"train.sharding={sharding}"], 4)
    assert sharded.nbytes == pytest.approx(full / 4 + 2 * full / g.layers)
    assert f"{sharding}: 1/4 of them + 2 gathered blocks" in sharded.name
    assert _denoiser_part([f"train.sharding={sharding}"], 1).nbytes == full  # one process holds it all
    assert _denoiser_part(["train.sharding=zero2"], 4).nbytes == full  # ZeRO-2 keeps the base whole


def test_check_takes_the_processes_of_the_launch(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    code, launched, err = run_cli(capsys, "train", "--check", "train.sharding=fsdp2")
    assert code == 0, err
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert run_cli(capsys, "train", "--check", "train.sharding=fsdp2", "--processes", "2")[1] == launched
    code, alone, _ = run_cli(capsys, "train", "--check", "train.sharding=fsdp2")
    assert code == 0 and alone != launched
    assert "--processes must be a count >= 1 or auto; got '0'" in one_line_error(
        capsys, "train", "--check", "--processes", "0"
    )


@pytest.mark.parametrize(
    "name, extra, sigmas",
    [
        ("diffusion_nft", ["objective.train_fraction=0.5"], 2),
        ("diffusion_nft", [], 4),
        ("awm", [], 4),
        ("flow_grpo", [], 0),
    ],
)
def test_the_estimate_counts_the_plans_training_noise_per_rank(name, extra, sigmas):
    """DiffusionNFT / AWM plans hold fresh noise for each row and training sigma; a rank holds its rows' share."""
    from flowrl.memory_estimate import estimate_memory

    overrides = [
        f"objective.name={name}",
        "sampler.num_steps=5",
        "prompts.per_iteration=10",
        "prompts.group_size=4",
        *extra,
    ]
    g = read_geometry(DIGITS_DIR, None)
    cfg = load_config(None, overrides)
    latent = sample_sizes(cfg, g).latent
    for processes in (1, 2):
        parts = [p for p in estimate_memory(cfg, g, processes=processes).parts if p.name.startswith("training noise")]
        if not sigmas:
            assert parts == []
            continue
        (part,) = parts
        assert part.nbytes == 40 // processes * sigmas * latent * 4
        assert f"x {sigmas} sigmas" in part.name and f"training sigmas of {name}" in part.fix


def test_wan_geometry_reads_the_vae_s_own_scale_factors(tmp_path):
    """Wan2.2-TI2V-5B's VAE patchifies 2x2 on 3 downsamplings: WanPipeline reads 16 from its config, not 2**3."""
    configs = {
        "model_index.json": {"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"]},
        "transformer/config.json": {
            "_class_name": "WanTransformer3DModel",
            "patch_size": [1, 2, 2],
            "num_attention_heads": 24,
            "attention_head_dim": 128,
            "in_channels": 48,
            "out_channels": 48,
            "num_layers": 30,
        },
        "vae/config.json": {  # as published for Wan2.2-TI2V-5B-Diffusers
            "_class_name": "AutoencoderKLWan",
            "base_dim": 160,
            "z_dim": 48,
            "dim_mult": [1, 2, 4, 4],
            "temperal_downsample": [False, True, True],
            "patch_size": 2,
            "scale_factor_spatial": 16,
            "scale_factor_temporal": 4,
        },
    }
    for name, data in configs.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps(data))
    g = read_geometry(tmp_path, None)
    assert (g.vae_factor, g.temporal_factor) == (16, 4)
    cfg = load_config(None, [f"model.path={tmp_path}", "model.resolution=[704,1280]", "model.num_frames=121"])
    assert sample_sizes(cfg, g).latent == 48 * 31 * (704 // 16) * (1280 // 16)  # WanAdapter.latent_shape's count


@pytest.mark.parametrize("guidance_embeds, tokens", [(True, 512), (False, 256)])
def test_flux_geometry_counts_the_adapter_s_t5_tokens(tmp_path, guidance_embeds, tokens):
    """Without a model card FluxAdapter encodes 512 T5 tokens for FLUX.1-dev and 256 for schnell; the estimate too."""
    configs = {
        "model_index.json": {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]},
        "transformer/config.json": {"_class_name": "FluxTransformer2DModel", "guidance_embeds": guidance_embeds},
    }
    for name, data in configs.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps(data))
    assert read_geometry(tmp_path, None).text_tokens == tokens


# -- each term of the estimate follows its formula (the module docstring's) ---------------------------------------


def _estimate_parts(overrides: list[str], *, training: bool = True, processes: int = 1) -> dict[str, float]:
    """Part name -> bytes of the embedded model's estimate (100 train and 10 eval prompts)."""
    from flowrl.memory_estimate import estimate_memory

    cfg = load_config(None, overrides)
    est = estimate_memory(
        cfg, read_geometry(DIGITS_DIR, None), training=training, train_prompts=100, eval_prompts=10, processes=processes
    )
    return {p.name: p.nbytes for p in est.parts}


def _part(parts: dict[str, float], prefix: str) -> tuple[str, float]:
    (found,) = [(name, n) for name, n in parts.items() if name.startswith(prefix)]
    return found


def test_human_bytes_steps_at_each_thousand() -> None:
    """Sizes are decimal: 999 B, then 1.0 KB at 1000; past PB the number grows instead of the unit."""
    from flowrl.memory_estimate import human_bytes

    assert [human_bytes(n) for n in (999, 1000, 1_500_000, 2.5e9, 2e18)] == [
        "999 B",
        "1.0 KB",
        "1.5 MB",
        "2.5 GB",
        "2000.0 PB",
    ]


def test_training_activations_follow_precision_guidance_and_checkpointing() -> None:
    """One training chunk keeps rows x tokens x hidden x 28 values per layer (layers + 28 with checkpointing),
    in 4 bytes (2 under autocast), twice under true CFG."""
    g = read_geometry(DIGITS_DIR, None)
    per_value = 40 * 30 * g.hidden  # sampler.chunk_size=40 rows of 8x8 / patch 2 = 16 tokens + 14 text tokens
    assert g.layers == 4
    cases = {
        (): per_value * 4 * 4 * 28,
        ("memory.gradient_checkpointing=true",): per_value * 4 * (4 + 28),
        ("memory.autocast=bf16",): per_value * 2 * 4 * 28,
        ("sampler.guidance_scale=4.5",): 2 * per_value * 4 * 4 * 28,
    }
    for overrides, nbytes in cases.items():
        assert _part(_estimate_parts(list(overrides)), "activations of one training chunk")[1] == nbytes, overrides


def test_vae_decode_is_one_sample_when_sliced_and_512_pixels_when_tiled() -> None:
    """The decode holds 3 fp32 maps of 32 channels at full size for each of the chunk's rows; slicing decodes one
    row, tiling caps each side at 512."""
    assert _part(_estimate_parts([]), "VAE decode")[1] == 3 * 40 * 32 * 8 * 8 * 4
    assert _part(_estimate_parts(["memory.vae_slicing=true"]), "VAE decode")[1] == 3 * 1 * 32 * 8 * 8 * 4
    tiled = _estimate_parts(["model.resolution=1024", "memory.vae_tiling=true"])
    assert _part(tiled, "VAE decode")[1] == 3 * 40 * 32 * 512 * 512 * 4


def test_the_prompt_cache_holds_what_the_run_encodes() -> None:
    """Prompts encoded over the iterations (all when free_encoders_when_cached warms them up front) plus the eval
    prompts, each 14 tokens (8 CLIP + 6 T5) x 64 in fp32, twice under true CFG."""
    entry = 14 * 64 * 4
    assert _part(_estimate_parts(["train.iterations=2"]), "prompt cache (50 prompts)")[1] == 50 * entry
    warmed = _estimate_parts(["train.iterations=2", "memory.free_encoders_when_cached=true"])
    assert _part(warmed, "prompt cache (110 prompts)")[1] == 110 * entry
    assert _part(_estimate_parts(["sampler.guidance_scale=4.5"]), "prompt cache (110 prompts)")[1] == 2 * 110 * entry


def test_lora_state_is_split_only_under_sharding_and_grids_count_before_and_after() -> None:
    """The LoRA's 24 bytes per parameter split over the processes only with a train.sharding; the grids hold
    before and after images of up to 20 eval prompts x output.grid_seeds."""
    g = read_geometry(DIGITS_DIR, None)
    lora = g.lora_width * 8 * 24
    assert _part(_estimate_parts([], processes=4), "LoRA weights")[1] == lora
    assert _part(_estimate_parts(["train.sharding=zero2"], processes=4), "LoRA weights") == (
        "LoRA weights and optimizer state (lora.rank=8, 1/4 per process)",
        lora / 4,
    )
    assert _part(_estimate_parts([]), "before/after grids (80 images)")[1] == 2 * 10 * 4 * 192 * 4


def test_rollout_latents_keep_every_step_of_tree_rollouts_and_a_rank_rounds_up() -> None:
    """A tree rollout keeps num_steps + 1 latents per sample; 160 samples over 3 processes are 54 on a rank."""
    latents = "rollout latents"
    assert _part(_estimate_parts(["objective.name=branch_grpo"]), latents)[1] == 160 * 11 * 256 * 4
    assert _part(_estimate_parts(["objective.name=diffusion_nft"]), latents)[1] == 160 * 1 * 256 * 4
    assert _part(_estimate_parts([], processes=3), latents)[1] == 54 * 11 * 256 * 4


def test_the_larger_phase_is_the_one_counted_and_sampling_chunks_are_at_least_64() -> None:
    """Training counts the larger of the iteration and the evaluation phase; a sampling chunk holds at least
    64 samples whatever sampler.chunk_size says."""
    from flowrl.memory_estimate import estimate_memory

    cfg = load_config(None, ["train.eval_seeds=1000"])  # 10 eval prompts x 1000 seeds outweigh the 160 rollouts
    names = [p.name for p in estimate_memory(cfg, read_geometry(DIGITS_DIR, None), eval_prompts=10).parts]
    assert any(n.startswith("evaluation latents (10000 samples") for n in names)
    assert not any(n.startswith("rollout") for n in names)
    sampling = _estimate_parts(["sampler.chunk_size=8"], training=False)
    assert _part(sampling, "activations of one sampling chunk (64 samples")[1] == 64 * 30 * 128 * 4 * 16


def test_sol_rl_stage_one_and_a_test_split_round_up() -> None:
    """Rank 0 explores ceil(per_iteration / processes) whole prompts; a test split holds at least one prompt."""
    from flowrl.memory_estimate import prompt_counts, stage1_candidates

    assert stage1_candidates(load_config(None, []), 3) == 112  # prompts 0, 3, ..., 18 on rank 0: 7 x 16
    assert stage1_candidates(load_config(None, []), 4) == 80  # 5 x 16: whole prompts divide evenly
    assert prompt_counts(load_config(None, ["prompts.test_fraction=0.001"])) == (19, 1)


# -- mutation round: the checks' own boundaries ------------------------------------------------------


def test_check_memory_refuses_only_a_need_above_what_is_available() -> None:
    """A pool whose need equals what is available passes; one byte more is refused, naming the largest part."""
    from flowrl.memory_estimate import Estimate, Part
    from flowrl.resources import check_memory

    parts = [Part("small", 100.0, "lower a", False), Part("big", 900.0, "lower b", False)]
    check_memory(Estimate("cpu", parts, {"host": 1000.0}, {"host": 1000.0}))
    check_memory(Estimate("cpu", parts, {"host": 1000.0}, {"host": None}))  # unknown availability: not refused
    with pytest.raises(ValueError, match=r"largest part: big, ~900 B\), but this machine has 999 B available; lower b"):
        check_memory(Estimate("cpu", parts, {"host": 1000.0}, {"host": 999.0}))


def test_a_width_beyond_the_position_embedding_is_refused(capsys) -> None:
    """The larger side is checked: a [height, width] whose width alone exceeds the model's 8 pixels is refused."""
    line = one_line_error(capsys, "train", "--check", "model.resolution=[8,16]")
    assert "model.resolution=8x16 is larger than flowrl-digits covers (at most 8 pixels per side" in line


def test_check_work_counts_a_rank_s_ceil_share_and_allows_exactly_the_limit() -> None:
    """A rank's share is ceil(1579 x 19 / 3) = 10001 samples, so x 1000 steps is refused; a product equal to
    MAX_SAMPLE_STEPS passes and one step more is refused."""
    from flowrl.resources import check_work

    share = load_config(None, ["prompts.per_iteration=1579", "prompts.group_size=19", "sampler.num_steps=1000"])
    with pytest.raises(ValueError, match=r"/ 3 processes\) is 10,001,000 sample-steps"):
        check_work(share, 0, processes=3)
    at_limit = load_config(None, ["prompts.per_iteration=1000", "prompts.group_size=1000", "sampler.num_steps=10"])
    check_work(at_limit, 0)  # 10**7 sample-steps: exactly the limit
    over = load_config(None, ["prompts.per_iteration=1000", "prompts.group_size=1000", "sampler.num_steps=11"])
    with pytest.raises(ValueError, match=r"is 11,000,000 sample-steps, above the limit of 10,000,000"):
        check_work(over, 0)


def test_check_report_refuses_fewer_than_one_process() -> None:
    """check_report itself refuses processes=0 (the CLI's own parser is not the only guard)."""
    from flowrl.resources import check_report

    with pytest.raises(ValueError, match=r"--processes must be >= 1; got 0"):
        check_report(load_config(None, []), processes=0)


# -- the processes of a launch share this machine's host memory ----------------------------------------


def _host_need(processes: int | None, monkeypatch, world: str | None = None, local: str | None = None) -> str:
    from flowrl.resources import check_report

    for name, value in (("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", local)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    return check_report(load_config(None, []), processes)


def test_the_host_memory_of_every_process_on_this_machine_adds_up(monkeypatch):
    """--processes 3 starts three processes here: 3 x one process's host need (its share of the batch plus the
    process itself); a launch over two machines (WORLD_SIZE 4, LOCAL_WORLD_SIZE 2) counts the two here."""
    from functools import partial

    from flowrl.memory_estimate import PROCESS_BYTES, estimate_memory, human_bytes
    from flowrl.resources import prompt_counts

    cfg = load_config(None, [])
    train_prompts, eval_prompts = prompt_counts(cfg)
    estimate = partial(estimate_memory, cfg, read_geometry(DIGITS_DIR, None), train_prompts=train_prompts)
    estimate = partial(estimate, eval_prompts=eval_prompts)
    one = estimate(processes=3).need["host"]
    assert one > PROCESS_BYTES  # the process itself is counted, once per process
    assert estimate(processes=3, host_processes=3).need["host"] == pytest.approx(3 * one)
    assert f"~{human_bytes(3 * one)} of host memory (3 processes x ~{human_bytes(one)})" in _host_need(3, monkeypatch)
    share = estimate(processes=4).need["host"]
    line = _host_need(None, monkeypatch, world="4", local="2")
    assert f"~{human_bytes(2 * share)} of host memory (2 processes x ~{human_bytes(share)})" in line
    assert "processes x" not in _host_need(None, monkeypatch)  # one process: no product shown


def test_a_launch_whose_processes_together_exceed_host_memory_is_refused(monkeypatch):
    """Each process fits alone, all of them together do not: refused, naming the product and the fix."""
    import flowrl.memory_estimate as estimate

    cfg = load_config(None, [])
    one = estimate.estimate_memory(cfg, read_geometry(DIGITS_DIR, None), processes=4).need["host"]
    monkeypatch.setattr(estimate, "available_memory", lambda pool, device: 2.5 * one)
    _host_need(2, monkeypatch)  # two processes' share fits
    with pytest.raises(ValueError, match=r"host memory \(4 processes x ~.*, or launch fewer processes$"):
        _host_need(4, monkeypatch)
