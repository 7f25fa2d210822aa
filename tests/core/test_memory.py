"""Memory controls on a tiny real SD3 pipeline: checkpointing, autocast, VAE, offload, attention, freed encoders."""

import importlib.util

import pytest
import torch

from flowrl.config import load_config
from flowrl.models.sd3 import SD3_LORA_TARGETS
from flowrl.policy import build_policy
from flowrl.policy.lora import add_lora
from flowrl.policy.memory import MemoryAdapter, apply_memory_settings, set_attention_backend, text_encoders
from flowrl.prompts.sets import load_prompts
from flowrl.rewards import build_multi_reward
from flowrl.samplers.flow_sde import flow_sde_step
from flowrl.trainer import Trainer

FAST = [
    "prompts.per_iteration=2",
    "prompts.group_size=3",
    "sampler.num_steps=3",
    "sampler.chunk_size=3",
    "train.eval_seeds=1",
]


def _memory(*overrides):
    return load_config(None, [f"memory.{o}" for o in overrides]).memory


def _inputs(model, batch=2):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((batch, *model.latent_shape(8, 8)), generator=gen)
    sigma = torch.full((batch,), 0.6)
    return x, sigma, model.encode_prompt(["a bold handwritten 1", "a thin handwritten 2"][:batch])


def _lora_grads(model):
    params = add_lora(model.transformer, rank=4, alpha=4.0, targets=SD3_LORA_TARGETS)
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    x, sigma, cond = _inputs(model)
    model.velocity(x, sigma, cond).square().mean().backward()
    return [p.grad.clone() for p in params]


def test_gradient_checkpointing_keeps_lora_gradients(tiny_sd3):
    from conftest import tiny_sd3_pipeline

    from flowrl.models.sd3 import SD3Adapter

    plain = _lora_grads(tiny_sd3)
    other = SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8))
    wrapped = apply_memory_settings(other, _memory("gradient_checkpointing=true"))
    assert other.transformer.gradient_checkpointing and not tiny_sd3.transformer.gradient_checkpointing
    checkpointed = _lora_grads(wrapped)
    assert any(g.abs().sum() > 0 for g in checkpointed)
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("autocast, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_runs_the_denoiser_in_half_but_sde_math_in_fp32(tiny_sd3, autocast, dtype):
    model = apply_memory_settings(tiny_sd3, _memory(f"autocast={autocast}"))
    seen = []
    linear = tiny_sd3.transformer.transformer_blocks[0].attn.to_q
    handle = linear.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    x, sigma, cond = _inputs(model)
    v = model.velocity(x, sigma, cond)
    handle.remove()
    assert seen == [dtype] and v.dtype == torch.float32
    step = flow_sde_step(x, v, sigma, torch.full((2,), 0.3), 0.7, generator=torch.Generator().manual_seed(1))
    assert step.mean.dtype == torch.float32 and step.log_prob.dtype == torch.float32
    reference = tiny_sd3.velocity(x, sigma, cond)
    assert reference.dtype == torch.float32
    torch.testing.assert_close(v, reference, rtol=0.1, atol=0.05)  # half-precision rounding only


def test_bf16_autocast_training_keeps_ratio_one_and_fp32_log_probs(tiny_sd3):
    cfg = load_config(None, FAST + ["memory.autocast=bf16", "objective.kl_beta=0.01"])
    prompts = load_prompts("digits-styles")
    trainer = Trainer(
        cfg, build_policy(cfg, model=tiny_sd3, trainable=True), build_multi_reward(cfg.rewards), prompts, prompts[:2]
    )
    batch, _ = trainer.collect()
    assert batch.trajectory.log_probs.dtype == torch.float32 and batch.trajectory.latents.dtype == torch.float32
    stats = trainer.update(batch)
    assert stats["first_ratio"] == 1.0 and torch.isfinite(torch.tensor(stats["loss"]))


@pytest.mark.parametrize("setting", ["memory.autocast=fp16", "model.dtype=float16"])
def test_fp16_training_is_refused_before_the_model_loads_but_fp16_sampling_builds(tiny_sd3, setting):
    """No loss scaling: fp16 gradients underflow (80 % of the LoRA's gradient entries zero at a 16x64x64 latent)."""
    from conftest import tiny_sd3_pipeline

    from flowrl.models.sd3 import SD3Adapter
    from flowrl.resources import check_machine

    cfg = load_config(None, FAST + [setting])
    with pytest.raises(ValueError, match=rf"{setting} can't train: flowrl has no loss scaling.*model.dtype=bfloat16"):
        build_policy(cfg, trainable=True)  # model.path is never read: the refusal comes first
    with pytest.raises(ValueError, match=rf"{setting} can't train"):
        check_machine(cfg)  # flowrl train --check says it too
    check_machine(cfg, training=False)
    half = SD3Adapter(tiny_sd3_pipeline().to(torch.float16), max_sequence_length=2, resolution=(8, 8))
    with pytest.raises(ValueError, match="model.dtype=float16 can't train"):
        build_policy(load_config(None, FAST), model=half, trainable=True)  # the model's own dtype counts
    assert build_policy(cfg, model=tiny_sd3).params == []  # sampling in fp16 is fine


def test_vae_tiling_and_slicing(tiny_sd3):
    latents = torch.randn(3, *tiny_sd3.latent_shape(8, 8), generator=torch.Generator().manual_seed(0))
    plain = tiny_sd3.decode(latents)
    model = apply_memory_settings(tiny_sd3, _memory("vae_tiling=true", "vae_slicing=true"))
    assert tiny_sd3.vae.use_tiling and tiny_sd3.vae.use_slicing
    torch.testing.assert_close(model.decode(latents), plain, rtol=1e-5, atol=1e-6)


def test_offload_moves_encoders_and_vae_only_for_their_phase(tiny_sd3):
    pipe = tiny_sd3.pipe
    moves = []
    modules = {**text_encoders(pipe), "vae": pipe.vae}  # spy on .to: record the target, then really move
    for name, module in modules.items():
        original = module.to

        def spy(*args, _name=name, _original=original, **kwargs):
            moves.append((_name, str(args[0] if args else kwargs.get("device"))))
            return _original(*args, **kwargs)

        module.to = spy
    model = apply_memory_settings(tiny_sd3, _memory("offload_encoders=true", "offload_vae=true"))
    assert moves == [("text_encoder", "cpu"), ("text_encoder_2", "cpu"), ("vae", "cpu")]  # parked at start
    moves.clear()
    cond = model.encode_prompt(["a bold handwritten 3"])
    assert moves == [("text_encoder", "cpu"), ("text_encoder_2", "cpu")] * 2  # to the compute device, then back
    moves.clear()
    images = model.decode(torch.zeros(1, *model.latent_shape(8, 8)))
    assert moves == [("vae", "cpu"), ("vae", "cpu")] and images.shape == (1, 3, 8, 8)
    moves.clear()
    model.velocity(torch.zeros(1, *model.latent_shape(8, 8)), torch.full((1,), 0.5), cond)
    assert moves == []  # the denoiser phase touches neither
    torch.testing.assert_close(
        cond["pooled_projections"], tiny_sd3.encode_prompt(["a bold handwritten 3"])["pooled_projections"]
    )


def test_attention_backend(tiny_sd3):
    before = [type(m.processor).__name__ for m in tiny_sd3.transformer.modules() if hasattr(m, "processor")]
    apply_memory_settings(tiny_sd3, _memory("attention_backend=sdpa"))
    after = [type(m.processor).__name__ for m in tiny_sd3.transformer.modules() if hasattr(m, "processor")]
    assert before == after == ["JointAttnProcessor2_0"]  # torch SDPA, diffusers' default
    expected = "pip install xformers" if importlib.util.find_spec("xformers") is None else "runs only on CUDA"
    with pytest.raises(ValueError, match=expected):
        set_attention_backend(tiny_sd3.transformer, "xformers", torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        set_attention_backend(tiny_sd3.transformer, "flash9", torch.device("cpu"))


def test_free_encoders_when_cached(tiny_sd3, tmp_path):
    cfg = load_config(None, FAST + ["memory.free_encoders_when_cached=true", f"prompts.cache_dir={tmp_path}"])
    prompts = load_prompts("digits-styles")
    trainer = Trainer(
        cfg,
        build_policy(cfg, model=tiny_sd3, trainable=True),
        build_multi_reward(cfg.rewards),
        prompts[:6],
        prompts[:2],
    )
    assert tiny_sd3.pipe.text_encoder is None and tiny_sd3.pipe.text_encoder_2 is None
    assert trainer.prompt_cache.misses == 6 and len(list(tmp_path.rglob("*.safetensors"))) == 6
    metrics = trainer.train_step()
    assert metrics["prompt_cache/misses"] == 6 and metrics["prompt_cache/hits"] > 0
    trainer.evaluate()
    with pytest.raises(
        ValueError, match=r"^prompt 'a thin handwritten 9' is not in the prompt cache and the text encoders were freed"
    ):
        trainer.prompt_cache.encode(["a thin handwritten 9"])


def test_memory_adapter_is_applied_once(tiny_sd3):
    model = apply_memory_settings(tiny_sd3, _memory())
    assert isinstance(model, MemoryAdapter) and apply_memory_settings(model, _memory()) is model
    assert model.transformer is tiny_sd3.transformer and model.default_resolution == (8, 8)


def test_free_encoders_under_true_cfg_keeps_the_negative_in_each_entry(tiny_sd3):
    cfg = load_config(
        None, FAST + ["memory.free_encoders_when_cached=true", "sampler.guidance_scale=3.0", "memory.autocast=bf16"]
    )
    prompts = load_prompts("digits-styles")
    trainer = Trainer(
        cfg,
        build_policy(cfg, model=tiny_sd3, trainable=True),
        build_multi_reward(cfg.rewards),
        prompts[:4],
        prompts[:2],
    )
    assert tiny_sd3.pipe.text_encoder is None and trainer.prompt_cache.misses == 4
    cond = trainer.prompt_cache.encode([prompts[0].text])
    assert any(k.startswith("uncond.") for k in cond)
    metrics = trainer.train_step()
    assert metrics["train/first_ratio"] == 1.0


def test_every_memory_control_on_wan_video_with_true_cfg(tmp_path):
    from tiny_wan import tiny_wan_adapter

    model = tiny_wan_adapter()
    cfg = load_config(
        None,
        [
            "model.resolution=16",
            "model.num_frames=5",
            "prompts.per_iteration=2",
            "prompts.group_size=2",
            "sampler.num_steps=2",
            "sampler.chunk_size=2",
            "sampler.guidance_scale=3.0",
            "lora.rank=4",
            "lora.alpha=8",
            f"prompts.cache_dir={tmp_path}",
            "memory.gradient_checkpointing=true",
            "memory.autocast=bf16",
            "memory.vae_tiling=true",
            "memory.vae_slicing=true",
            "memory.offload_encoders=true",
            "memory.offload_vae=true",
            "memory.free_encoders_when_cached=true",
        ],
    )
    prompts = load_prompts("digits-styles")
    trainer = Trainer(
        cfg,
        build_policy(cfg, model=model, trainable=True),
        build_multi_reward({"ink": {"weight": 1.0, "video": "mean"}}),
        prompts[:3],
        prompts[:1],
    )
    assert model.transformer.gradient_checkpointing and model.vae.use_tiling and model.pipe.text_encoder is None
    metrics = trainer.train_step()
    assert metrics["train/first_ratio"] == 1.0 and torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert metrics["prompt_cache/misses"] == 3 and len(list(tmp_path.rglob("*.safetensors"))) == 3  # 3 distinct prompts


def test_flowrl_sample_applies_the_memory_section(tmp_path, capsys):
    from flowrl.cli import main

    out = tmp_path / "grid.png"
    args = [
        "sample",
        "memory.vae_slicing=true",
        "memory.offload_encoders=true",
        "memory.autocast=bf16",
        "sampler.num_steps=2",
        "--prompt",
        "a bold handwritten 3",
        "--seeds",
        "2",
        "--out",
        str(out),
    ]
    assert main(args) == 0 and out.is_file()
    other = str(tmp_path / "xformers.png")
    assert main(["sample", "memory.attention_backend=xformers", "--prompt", "a 3", "--out", other]) == 2
    assert "memory.attention_backend=xformers" in capsys.readouterr().err


def test_trainable_attention_leaves_out_cudnn_and_cpu_results_unchanged():
    """Off CUDA only the cuDNN flag changes, which no CPU kernel reads (the CUDA case: tests/test_cuda.py)."""
    from flowrl.policy.memory import trainable_attention

    q = torch.randn(1, 2, 4, 8)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with trainable_attention():
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
        inside = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    assert torch.equal(inside, torch.nn.functional.scaled_dot_product_attention(q, q, q))


def test_every_pass_of_a_training_run_uses_the_training_attention_kernels(tiny_sd3):
    """Rollout, training and evaluation forwards all run without cuDNN SDPA, so in bf16 on a GPU the rollout's
    no-grad forward and the training forward of a sample use one kernel (torch would pick cuDNN for the first)."""
    cfg = load_config(None, FAST)
    prompts = load_prompts("digits-styles")
    trainer = Trainer(
        cfg, build_policy(cfg, model=tiny_sd3, trainable=True), build_multi_reward(cfg.rewards), prompts, prompts[:2]
    )
    seen: list[tuple[bool, bool]] = []  # (grad enabled, cuDNN SDPA enabled) at each denoiser call
    hook = tiny_sd3.transformer.register_forward_pre_hook(
        lambda *_: seen.append((torch.is_grad_enabled(), torch.backends.cuda.cudnn_sdp_enabled()))
    )
    try:
        metrics = trainer.train_step()
        trainer.evaluate()
    finally:
        hook.remove()
    assert metrics["train/first_ratio"] == 1.0
    assert {grad for grad, _ in seen} == {False, True}  # no-grad rollouts and evaluation, differentiated training
    assert not any(cudnn for _, cudnn in seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after each call


def test_gradient_checkpointing_on_a_model_without_support_is_one_line() -> None:
    """memory.gradient_checkpointing on a module without diffusers' checkpointing support names the setting."""
    from flowrl.policy.memory import enable_gradient_checkpointing

    with pytest.raises(ValueError, match=r"^memory.gradient_checkpointing: Linear does not support gradient checkpo"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))


def test_vae_tiling_and_slicing_are_switched_on_only_where_asked(tiny_sd3) -> None:
    """configure_vae turns on exactly the flags set: slicing alone leaves tiling off; both off needs no VAE."""
    from flowrl.policy.memory import configure_vae

    configure_vae(tiny_sd3.vae, tiling=False, slicing=True)
    assert tiny_sd3.vae.use_slicing and not tiny_sd3.vae.use_tiling
    configure_vae(None, tiling=False, slicing=False)
    with pytest.raises(ValueError, match=r"memory.vae_tiling: NoneType has no enable_tiling\(\); set it to false"):
        configure_vae(None, tiling=True, slicing=False)


def test_an_unknown_autocast_is_one_line(tiny_sd3) -> None:
    """MemoryAdapter refuses an autocast other than none / bf16 / fp16 with a ValueError naming the choices."""
    with pytest.raises(ValueError, match=r"^memory.autocast must be one of 'none', 'bf16', 'fp16'; got 'fp32'$"):
        MemoryAdapter(tiny_sd3, autocast="fp32")
