"""Wan2.1/2.2 adapter on a tiny real WanPipeline: shapes, parity with the pipeline (CFG, two experts),
2-step rollout with log-probs, one Flow-GRPO update through the Trainer, LoRA round trip, cache, loading."""

import json

import pytest
import torch
from conftest import custom_code_folder
from tiny_wan import tiny_wan_adapter, tiny_wan_pipeline, tiny_wan_transformer

from flowrl.models import load_adapter
from flowrl.models.adapter import model_latent_shape
from flowrl.models.wan import WanAdapter
from flowrl.models.wan_experts import WanExperts, split_expert_state
from flowrl.objectives import FlowGRPO, RolloutBatch
from flowrl.policy import build_policy
from flowrl.policy.counting import CountingAdapter
from flowrl.policy.guidance import GuidedAdapter, split_cond
from flowrl.policy.lora import adapters_disabled, add_lora, lora_state_dict
from flowrl.prompts.cache import PromptCache
from flowrl.rollouts.chunked import chunked_rollout
from flowrl.samplers import linear_sigmas, sde_noise_levels
from flowrl.samplers.ode_solve import ode_solve

PROMPTS = ["a red fox running", "a blue cat jumping slowly"]
NEGATIVE = "blurry static"


def _latents(model, n=2, seed=0):
    return torch.randn(n, *model.latent_shape(16, 16), generator=torch.Generator().manual_seed(seed))


def _randomize_lora(transformer, std=0.05, seed=3):
    gen = torch.Generator().manual_seed(seed)
    for name, p in transformer.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, std, generator=gen)


def clip_brightness(images, prompts, **metadata):
    """A video reward for the tests: mean brightness of each clip (B, F, 3, H, W) -> (B,)."""
    return images.mean(dim=(1, 2, 3, 4)).float()


def test_latent_shape_follows_the_vae_factors():
    model = tiny_wan_adapter()
    assert model.latent_shape(16, 16, 5) == (16, 2, 2, 2)  # F_lat = (5 - 1) // 4 + 1
    assert model.latent_shape(32, 16, 9) == (16, 3, 4, 2)
    assert model.latent_shape(16, 16) == (16, 2, 2, 2)  # default_num_frames = 5
    assert model_latent_shape(model, (16, 16), 13) == (16, 4, 2, 2)
    with pytest.raises(ValueError, match="4k \\+ 1"):
        model.latent_shape(16, 16, 6)
    with pytest.raises(ValueError, match="multiple of 16x16"):
        model.latent_shape(24, 16, 5)
    assert model.guidance == "cfg" and model.default_shift == 3.0


def test_image_models_reject_a_frame_count(tiny_sd3):
    assert model_latent_shape(tiny_sd3, (8, 8)) == tiny_sd3.latent_shape(8, 8)
    with pytest.raises(ValueError, match="image model.*model.num_frames"):
        model_latent_shape(tiny_sd3, (8, 8), 5)


def _pipeline_and_guided_euler(model, x: torch.Tensor, size: int, frames: int, steps: int, scale: float, output: str):
    """``WanPipeline(guidance_scale=scale, negative_prompt)`` from latents ``x``, and our guided Euler on its sigmas.

    Returns:
        (the pipeline's ``frames`` output, our final latents (B, C, F', h, w)).
    """
    ref = model.pipe(
        prompt=PROMPTS,
        negative_prompt=[NEGATIVE] * 2,
        height=size,
        width=size,
        num_frames=frames,
        num_inference_steps=steps,
        guidance_scale=scale,
        latents=x.clone(),
        output_type=output,
        max_sequence_length=8,
    ).frames
    guided = GuidedAdapter(model, scale, NEGATIVE)
    cond = guided.encode_prompt(PROMPTS)
    with torch.no_grad():
        ours = ode_solve(lambda z, s: guided.velocity(z, s, cond), x, model.pipe.scheduler.sigmas.double())
    return ref, ours


def test_guided_euler_and_decode_match_the_wan_pipeline():
    """Same latents and sigmas: guided Euler + decode == WanPipeline(guidance_scale=5, negative_prompt)."""
    model = tiny_wan_adapter()
    frames, final = _pipeline_and_guided_euler(model, _latents(model), 16, 5, 3, 5.0, "pt")
    video = model.decode(final)
    assert video.shape == (2, 5, 3, 16, 16) and video.dtype == torch.float32
    assert frames.shape == video.shape
    torch.testing.assert_close(video, frames.float(), rtol=1e-4, atol=1e-4)


def test_per_token_timesteps_match_the_pipeline():
    """expand_timesteps (Wan2.2-TI2V layout): one timestep per latent token, as WanPipeline builds it."""
    model = tiny_wan_adapter(expand_timesteps=True)
    x = torch.randn(2, *model.latent_shape(32, 32, 9), generator=torch.Generator().manual_seed(4))
    ref, ours = _pipeline_and_guided_euler(model, x, 32, 9, 2, 2.0, "latent")
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_cfg_batching_one_call_equals_two_calls():
    model = tiny_wan_adapter()
    guided = GuidedAdapter(model, 4.0, NEGATIVE)
    cond = guided.encode_prompt(PROMPTS)
    x, sigma = _latents(model), torch.tensor([0.8, 0.3])
    seen = []
    hook = model.transformer.register_forward_hook(
        lambda m, a, kw, out: seen.append(kw["hidden_states"].shape[0]), with_kwargs=True
    )
    v = guided.velocity(x, sigma, cond)
    hook.remove()
    assert seen == [4]
    pos, neg = split_cond(cond)
    v_c, v_u = model.velocity(x, sigma, pos), model.velocity(x, sigma, neg)
    torch.testing.assert_close(v, v_u + 4.0 * (v_c - v_u), rtol=1e-5, atol=1e-5)


def test_two_step_rollout_log_probs_and_ratio_one_with_cfg():
    model = tiny_wan_adapter()
    add_lora(model.transformer, rank=4, alpha=4, targets=model.lora_target_modules)
    _randomize_lora(model.transformer)
    guided = CountingAdapter(GuidedAdapter(model, 4.5, NEGATIVE))
    prompts = PROMPTS * 2
    cond = guided.encode_prompt(prompts)
    gen = torch.Generator().manual_seed(0)
    traj = chunked_rollout(
        guided, cond, _latents(model, 4), linear_sigmas(2), sde_noise_levels(2, 0.7), chunk_size=2, generator=gen
    )
    assert traj.latents.shape == (4, 3, 16, 2, 2, 2) and traj.log_probs.shape == (4, 2)
    assert torch.isfinite(traj.log_probs).all() and traj.log_probs.dtype == torch.float32
    assert guided.nfe == 4 * 2 * 2
    adv, keep = torch.randn(4, generator=gen), torch.ones(4, dtype=torch.bool)
    batch = RolloutBatch(
        prompts, torch.arange(4), cond, traj.latents[:, -1], traj, traj.sigmas, None, adv, adv, keep, 2
    )
    objective = FlowGRPO(clip_range=1e-3, kl_beta=0.1)
    plan = [mb for group in objective.plan(batch, gen) for mb in group]
    assert len(plan) == 2  # 2 chunks x 1 stochastic step
    for mb in plan:
        _, stats = objective.loss(guided, batch, mb)
        assert stats["ratio"] == 1.0 and stats["kl"] > 0.0, stats


def test_flow_grpo_update_through_the_trainer_and_lora_loads_in_wan_pipeline(tmp_path):
    from flowrl.config import load_config
    from flowrl.outputs import save_before_after
    from flowrl.prompts.sets import load_prompts
    from flowrl.rewards.combine import MultiReward
    from flowrl.trainer import Trainer

    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    prompts = load_prompts(str(tmp_path / "prompts.txt"))
    cfg = load_config(
        None,
        [
            "model.resolution=16",
            "model.num_frames=5",
            "prompts.per_iteration=2",
            "prompts.group_size=2",
            "sampler.num_steps=2",
            "sampler.chunk_size=2",
            "sampler.guidance_scale=5.0",
            f"prompts.negative={NEGATIVE}",
            "objective.kl_beta=0.01",
            "objective.clip_range=0.001",
            "optim.lr=0.05",
            "lora.rank=4",
            "lora.alpha=4",
            "train.eval_seeds=1",
        ],
    )
    model = tiny_wan_adapter()
    trainer = Trainer(
        cfg,
        build_policy(cfg, model=model, trainable=True),
        MultiReward({"brightness": (clip_brightness, 1.0)}),
        prompts,
        prompts,
    )
    metrics = trainer.train_step()
    assert metrics["train/first_ratio"] == 1.0
    assert metrics["nfe"] == 2 * (4 * 2 + 2 * 4)  # CFG: rollout 4 x 2 steps + policy and KL passes at 1 SDE step
    cond = model.encode_prompt(PROMPTS)
    x, sigma = _latents(model), torch.tensor([0.9, 0.4])
    with torch.no_grad(), adapters_disabled(model.transformer):
        base = model.velocity(x, sigma, cond)
    assert (model.velocity(x, sigma, cond) - base).abs().max() > 1e-3  # the update moved the policy
    videos = trainer.sample(prompts, [7, 8])
    assert videos.shape == (2, 5, 3, 16, 16)
    assert set(trainer.evaluate()) == {"eval/reward_mean", "eval/reward_ci95", "eval/brightness", "eval/drift"}
    save_before_after(videos, videos, 2, tmp_path / "grid.png")  # middle frames
    assert (tmp_path / "grid.png").is_file()

    path = model.save_lora(tmp_path / "lora", lora_state_dict(model.transformer))
    assert path.is_file()
    fresh = tiny_wan_pipeline()
    fresh.load_lora_weights(str(tmp_path / "lora"))
    loaded = WanAdapter(fresh, max_sequence_length=8, resolution=(16, 16), num_frames=5)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.velocity(x, sigma, cond), model.velocity(x, sigma, cond), rtol=1e-5, atol=1e-5
        )


def test_prompt_cache_hit_path(tmp_path):
    model = tiny_wan_adapter()
    cache = PromptCache(model, tmp_path)
    first = cache.encode(PROMPTS + PROMPTS)
    assert (cache.misses, cache.hits) == (2, 2)
    torch.testing.assert_close(
        first["encoder_hidden_states"][:2], model.encode_prompt(PROMPTS)["encoder_hidden_states"]
    )
    warm = PromptCache(tiny_wan_adapter(), tmp_path)
    assert torch.equal(warm.encode(PROMPTS)["encoder_hidden_states"], first["encoder_hidden_states"][:2])
    assert (warm.misses, warm.hits) == (0, 2)


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_wan")
    tiny_wan_pipeline().save_pretrained(str(path))
    card = {"resolution": 16, "num_frames": 5, "max_sequence_length": 8, "shift": 5.0}
    (path / "flowrl.json").write_text(json.dumps(card))
    return path


def test_load_adapter_dispatches_wan_folders(wan_folder):
    model = load_adapter(str(wan_folder))
    assert isinstance(model, WanAdapter)
    assert model.default_resolution == (16, 16) and model.default_num_frames == 5 and model.default_shift == 5.0
    assert model.vae.dtype == torch.float32 and model.model_id == str(wan_folder)
    reference = tiny_wan_adapter()
    cond = reference.encode_prompt(PROMPTS)
    torch.testing.assert_close(model.encode_prompt(PROMPTS), cond, rtol=1e-4, atol=1e-5)
    x, sigma = _latents(reference), torch.tensor([0.7, 0.2])
    torch.testing.assert_close(model.velocity(x, sigma, cond), reference.velocity(x, sigma, cond), rtol=1e-4, atol=1e-5)


def test_missing_wan_weights_are_one_line_with_the_download_command(wan_folder, tmp_path):
    import shutil

    broken = tmp_path / "wan"
    shutil.copytree(wan_folder, broken)
    for f in (broken / "transformer").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError) as err:
        load_adapter(str(broken))
    msg = str(err.value)
    assert "\n" not in msg and "hf download Wan-AI/Wan2.1-T2V-1.3B-Diffusers" in msg and "model.path=" in msg
    with pytest.raises(FileNotFoundError, match="does not exist.*model.path="):
        load_adapter(str(tmp_path / "no" / "wan"))


def test_a_wan_folder_with_custom_code_is_refused_as_such_not_as_missing_weights(wan_folder, tmp_path):
    """A component that needs the folder's own module: the one-line trust_remote_code refusal, never run, no download
    hint (the Wan loader turns missing weights into a download command; custom code is another problem)."""
    folder, _, marker = custom_code_folder(wan_folder, tmp_path, "WanTransformer3DModel")
    with pytest.raises(ValueError, match="ships custom model code that flowrl does not run") as err:
        load_adapter(str(folder))
    assert "\n" not in str(err.value) and "hf download" not in str(err.value) and not marker.exists()


# -- Wan2.2 two-expert layout -------------------------------------------------------------------


def test_two_experts_follow_the_pipeline_boundary():
    model = tiny_wan_adapter(two_experts=True, boundary_ratio=0.5)
    pipe = model.pipe
    assert model.boundary_timestep == 500.0 and model.lora_expert == "both"  # the default with two experts
    assert tiny_wan_adapter().lora_expert == "high"
    cond = model.encode_prompt(PROMPTS)
    x, sigma = _latents(model), torch.tensor([0.9, 0.3])
    with torch.no_grad():
        mixed = model.velocity(x, sigma, cond)
        high = model._run(
            pipe.transformer, x[:1], sigma[:1], {"encoder_hidden_states": cond["encoder_hidden_states"][:1]}
        )
        low = model._run(
            pipe.transformer_2, x[1:], sigma[1:], {"encoder_hidden_states": cond["encoder_hidden_states"][1:]}
        )
    torch.testing.assert_close(mixed, torch.cat([high, low]), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(
        low,
        model._run(pipe.transformer, x[1:], sigma[1:], {"encoder_hidden_states": cond["encoder_hidden_states"][1:]}),
    )
    # the pipeline's own two-stage CFG sampling agrees step for step
    ref = pipe(
        prompt=PROMPTS,
        negative_prompt=[NEGATIVE] * 2,
        height=16,
        width=16,
        num_frames=5,
        num_inference_steps=4,
        guidance_scale=3.0,
        latents=x.clone(),
        output_type="latent",
        max_sequence_length=8,
    ).frames
    sigmas = pipe.scheduler.sigmas.double()
    assert (sigmas[:-1] >= 0.5).any() and (sigmas[:-1] < 0.5).any()
    guided = GuidedAdapter(model, 3.0, NEGATIVE)
    gcond = guided.encode_prompt(PROMPTS)
    with torch.no_grad():
        ours = ode_solve(lambda z, s: guided.velocity(z, s, gcond), x, sigmas)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_the_boundary_timestep_itself_belongs_to_the_high_noise_expert() -> None:
    """As WanPipeline: ``transformer`` denoises where 1000 * sigma >= boundary_ratio * 1000, the boundary included."""
    model = tiny_wan_adapter(two_experts=True, boundary_ratio=0.5)
    sigma = torch.tensor([1.0, 0.5, 0.4999, 0.0])
    assert model.expert_for(sigma).tolist() == [True, True, False, False]
    assert tiny_wan_adapter().expert_for(sigma).tolist() == [True] * 4  # one expert: it takes every step


def test_a_mixed_batch_keeps_each_sample_s_velocity_in_its_row() -> None:
    """Interleaved high- and low-noise samples: row i of the velocity is its own expert's velocity for sample i."""
    model = tiny_wan_adapter(two_experts=True, boundary_ratio=0.5)
    prompts = ["a red fox", "a blue cat", "a green owl", "a fox"]
    cond = model.encode_prompt(prompts)
    x, sigma = _latents(model, n=4), torch.tensor([0.3, 0.9, 0.1, 0.2])
    with torch.no_grad():
        mixed = model.velocity(x, sigma, cond)
        rows = [
            model._run(
                model.pipe.transformer if s >= 0.5 else model.pipe.transformer_2,
                x[i : i + 1],
                sigma[i : i + 1],
                {"encoder_hidden_states": cond["encoder_hidden_states"][i : i + 1]},
            )
            for i, s in enumerate(sigma.tolist())
        ]
    torch.testing.assert_close(mixed, torch.cat(rows), rtol=1e-5, atol=1e-5)


def test_default_shift_is_the_scheduler_s_flow_shift_unless_the_card_says() -> None:
    """Wan2.1 folders ship UniPC with ``flow_shift``: it is the model's shift; an explicit shift (the card's) wins."""
    from diffusers import UniPCMultistepScheduler

    pipe = tiny_wan_pipeline()
    pipe.scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    assert WanAdapter(pipe, resolution=(16, 16), num_frames=5).default_shift == 5.0
    assert WanAdapter(pipe, resolution=(16, 16), num_frames=5, shift=7.0).default_shift == 7.0


def test_wan_experts_applies_memory_switches_to_both_experts() -> None:
    """Gradient checkpointing and the attention backend set on the container reach the high and the low expert."""
    experts = WanExperts(tiny_wan_transformer(), tiny_wan_transformer())
    experts.enable_gradient_checkpointing()
    experts.set_attention_backend("native")
    for expert in (experts.high, experts.low):
        assert expert.gradient_checkpointing
        backends = {str(m.processor._attention_backend) for m in expert.modules() if hasattr(m, "processor")}
        assert backends == {"AttentionBackendName.NATIVE"}


def test_split_expert_state_routes_keys_by_prefix_and_refuses_others() -> None:
    """``high.``/``low.`` keys go to their expert with the prefix removed; any other key is a ValueError."""
    a, b = torch.zeros(1), torch.ones(1)
    parts = split_expert_state({"high.blocks.0.to_q.lora_A.weight": a, "low.blocks.0.to_q.lora_B.weight": b})
    assert parts == {"high": {"blocks.0.to_q.lora_A.weight": a}, "low": {"blocks.0.to_q.lora_B.weight": b}}
    with pytest.raises(ValueError, match="'blocks.0.to_q.lora_A.weight' belongs to neither Wan expert"):
        split_expert_state({"high.x": a, "blocks.0.to_q.lora_A.weight": a})


def test_low_noise_expert_lora_loads_into_transformer_2(tmp_path):
    model = tiny_wan_adapter(two_experts=True, lora_expert="low")
    assert model.transformer is model.pipe.transformer_2
    add_lora(model.transformer, rank=4, alpha=8, targets=model.lora_target_modules)
    _randomize_lora(model.transformer)
    assert (
        model.save_lora(tmp_path, lora_state_dict(model.transformer)).name
        == "pytorch_lora_weights_transformer_2.safetensors"
    )
    fresh = tiny_wan_pipeline(two_experts=True)
    fresh.load_lora_weights(
        str(tmp_path), weight_name="pytorch_lora_weights_transformer_2.safetensors", load_into_transformer_2=True
    )
    loaded = WanAdapter(fresh, max_sequence_length=8, resolution=(16, 16), num_frames=5, lora_expert="low")
    cond = model.encode_prompt(PROMPTS)
    x, sigma = _latents(model), torch.tensor([0.95, 0.3])  # one sample per expert
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.velocity(x, sigma, cond), model.velocity(x, sigma, cond), rtol=1e-5, atol=1e-5
        )
    with pytest.raises(ValueError, match="no transformer_2"):
        tiny_wan_adapter(lora_expert="low")


def test_a_low_noise_expert_lora_file_loads_into_transformer_2(tmp_path):
    """The low expert's .safetensors file given alone (flowrl sample --lora FILE) goes to transformer_2, not the
    high-noise expert; a Wan2.1 pipeline (no transformer_2) refuses it in one line."""
    from flowrl.policy.lora import load_saved_lora

    model = tiny_wan_adapter(two_experts=True, lora_expert="low")
    add_lora(model.transformer, rank=4, alpha=8, targets=model.lora_target_modules)
    _randomize_lora(model.transformer)
    file = model.save_lora(tmp_path, lora_state_dict(model.transformer))
    fresh = tiny_wan_adapter(two_experts=True)
    load_saved_lora(fresh, file)
    assert hasattr(fresh.pipe.transformer_2, "peft_config") and not hasattr(fresh.pipe.transformer, "peft_config")
    cond, x, sigma = model.encode_prompt(PROMPTS), _latents(model), torch.tensor([0.95, 0.3])  # one per expert
    with torch.no_grad():
        torch.testing.assert_close(fresh.velocity(x, sigma, cond), model.velocity(x, sigma, cond), rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="low-noise-expert LoRA but this Wan pipeline has no transformer_2"):
        tiny_wan_adapter().load_lora(file)


def _two_expert_trainer(model, *extra):
    from flowrl.config import load_config
    from flowrl.prompts.files import Prompt
    from flowrl.rewards.combine import MultiReward
    from flowrl.trainer import Trainer

    cfg = load_config(
        None,
        [
            "model.resolution=16",
            "model.num_frames=5",
            "prompts.per_iteration=2",
            "prompts.group_size=2",
            "sampler.num_steps=4",
            "sampler.chunk_size=2",
            "sampler.guidance_scale=3.0",
            "objective.kl_beta=0.01",
            "objective.clip_range=0.001",
            "optim.lr=0.05",
            "lora.rank=4",
            "lora.alpha=4",
            "train.eval_seeds=1",
            *extra,
        ],
    )
    prompts = [Prompt(t, {}) for t in PROMPTS]
    return Trainer(
        cfg,
        build_policy(cfg, model=model, trainable=True),
        MultiReward({"brightness": (clip_brightness, 1.0)}),
        prompts,
        prompts,
    )


def test_one_lora_adapter_spans_both_experts(tmp_path):
    """lora_expert='both': one peft adapter over the two experts; disabling it disables both; saved
    as one diffusers file per expert that WanPipeline.load_lora_weights reads back."""
    model = tiny_wan_adapter(two_experts=True, boundary_ratio=0.6, lora_expert="both")
    trainer = _two_expert_trainer(model)
    n_high = sum(p.numel() for n, p in model.transformer.named_parameters() if "lora_" in n and n.startswith("high."))
    n_low = sum(p.numel() for n, p in model.transformer.named_parameters() if "lora_" in n and n.startswith("low."))
    assert n_high == n_low > 0 and sum(p.numel() for p in trainer.params) == n_high + n_low
    before = {n: p.detach().clone() for n, p in model.transformer.named_parameters() if "lora_B" in n}
    metrics = trainer.train_step()  # SDE steps at sigma 1, 0.75 (high expert) and 0.5 (low expert)
    assert metrics["train/first_ratio"] == 1.0
    for prefix in ("high.", "low."):
        assert any(
            not torch.equal(p, before[n])
            for n, p in model.transformer.named_parameters()
            if n in before and n.startswith(prefix)
        ), prefix
    cond = model.encode_prompt(PROMPTS)
    x, sigma = _latents(model), torch.tensor([0.9, 0.3])  # one sample per expert
    with torch.no_grad():
        trained = model.velocity(x, sigma, cond)
        with adapters_disabled(model.transformer):
            base = model.velocity(x, sigma, cond)
    assert ((trained - base).flatten(1).abs().amax(1) > 1e-4).all()  # both experts moved, both switch off

    written = model.save_lora(tmp_path, lora_state_dict(model.transformer))
    assert written == tmp_path / "pytorch_lora_weights.safetensors"  # the high expert's file is the one returned
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [
        "pytorch_lora_weights.safetensors",
        "pytorch_lora_weights_transformer_2.safetensors",
    ]
    fresh = tiny_wan_pipeline(two_experts=True, boundary_ratio=0.6)
    fresh.load_lora_weights(str(tmp_path))
    fresh.load_lora_weights(
        str(tmp_path), weight_name="pytorch_lora_weights_transformer_2.safetensors", load_into_transformer_2=True
    )
    loaded = WanAdapter(fresh, max_sequence_length=8, resolution=(16, 16), num_frames=5)
    via_adapter = WanAdapter(
        tiny_wan_pipeline(two_experts=True, boundary_ratio=0.6),
        max_sequence_length=8,
        resolution=(16, 16),
        num_frames=5,
    )
    via_adapter.load_lora(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded.velocity(x, sigma, cond), trained, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(via_adapter.velocity(x, sigma, cond), trained, rtol=1e-5, atol=1e-5)


def test_a_bf16_two_expert_lora_reloads_in_fp32_in_both_experts(tmp_path):
    """Both experts' files of a bf16 Wan2.2 reload with the fp32 weights trained (load_saved_lora), so the reloaded
    velocity is the trained one bit for bit, in each expert; diffusers alone makes both LoRAs bf16."""
    from flowrl.policy.lora import load_saved_lora

    def bf16_wan(**kwargs):
        pipe = tiny_wan_pipeline(two_experts=True, boundary_ratio=0.6).to(torch.bfloat16)
        return WanAdapter(pipe, max_sequence_length=8, resolution=(16, 16), num_frames=5, **kwargs)

    model = bf16_wan(lora_expert="both")
    add_lora(model.transformer, rank=4, alpha=8, targets=model.lora_target_modules)
    _randomize_lora(model.transformer)
    model.save_lora(tmp_path, lora_state_dict(model.transformer))
    fresh = bf16_wan()
    load_saved_lora(fresh, tmp_path)
    for expert in (fresh.pipe.transformer, fresh.pipe.transformer_2):
        assert {p.dtype for n, p in expert.named_parameters() if "lora_" in n} == {torch.float32}
    cond, x, sigma = model.encode_prompt(PROMPTS), _latents(model), torch.tensor([0.9, 0.3])  # one per expert
    with torch.no_grad():
        torch.testing.assert_close(fresh.velocity(x, sigma, cond), model.velocity(x, sigma, cond), rtol=0, atol=0)


def test_both_experts_state_round_trips_through_the_trainer():
    model = tiny_wan_adapter(two_experts=True, boundary_ratio=0.6, lora_expert="both")
    trainer = _two_expert_trainer(model)
    trainer.train_step()
    state = trainer.state_dict()
    expected = trainer.train_step()
    twin = _two_expert_trainer(tiny_wan_adapter(two_experts=True, boundary_ratio=0.6, lora_expert="both"))
    twin.load_state_dict(state)
    got = twin.train_step()
    for key in ("reward_mean", "train/loss", "train/grad_norm"):
        assert got[key] == expected[key], key


def test_non_square_resolution_from_the_config():
    from flowrl.models.adapter import output_resolution

    model = tiny_wan_adapter()
    assert output_resolution(None, model) == (16, 16) and output_resolution(32, model) == (32, 32)
    assert output_resolution([32, 16], model) == (32, 16)
    with pytest.raises(ValueError, match="model.resolution"):
        output_resolution([32, 16, 8], model)
    trainer = _two_expert_trainer(model, "model.resolution=[32, 16]")
    assert trainer.resolution == (32, 16) and trainer.latent_shape == (16, 2, 4, 2)
    assert trainer.sample(trainer.eval_prompts, [1, 2]).shape == (2, 5, 3, 32, 16)


@pytest.mark.parametrize("two_experts", [False, True])
def test_sol_rl_s_explore_copy_runs_in_place_of_the_trained_experts(two_experts):
    """Sol-RL swaps ``adapter.transformer`` for its explore copy; Wan's velocity must run the copy's experts."""
    from flowrl.policy.precision import build_explore
    from flowrl.solrl.explore import explore_transformer

    adapter = tiny_wan_adapter(two_experts=two_experts, boundary_ratio=0.5) if two_experts else tiny_wan_adapter()
    add_lora(adapter.transformer, rank=2, alpha=2, targets=adapter.lora_target_modules)
    explore = build_explore(adapter, "fp32")
    calls = {"explore": 0, "trained": 0}

    def counter(key):
        def hook(*_):
            calls[key] += 1

        return hook

    for key, module in (("explore", explore.module), ("trained", adapter.transformer)):
        for expert in (module.high, module.low) if two_experts else (module,):
            expert.register_forward_pre_hook(counter(key))
    x, sigma = torch.randn(2, 16, 2, 2, 2), torch.tensor([0.95, 0.3])  # one sample per expert
    cond = adapter.encode_prompt(["a cat", "a dog"])
    with explore_transformer(adapter, explore.module):
        adapter.velocity(x, sigma, cond)
    assert calls == {"explore": 2 if two_experts else 1, "trained": 0}
    adapter.velocity(x, sigma, cond)  # restored
    assert calls["trained"] == calls["explore"]
    if two_experts:
        with pytest.raises(TypeError, match="a two-expert Wan model's transformer is a WanExperts"):
            adapter.transformer = explore.module.high
