"""FLUX.1 adapter on tiny real diffusers/transformers models: pipeline parity, guidance, training, LoRA interop."""

import pytest
import torch
from tiny_flow_pipelines import tiny_flux, tiny_flux_pipeline

from flowrl.config import load_config
from flowrl.models.flux import FluxAdapter, flux_lora_targets
from flowrl.models.packing import latent_image_ids, pack_latents, unpack_latents
from flowrl.policy import build_policy
from flowrl.policy.lora import add_lora, lora_state_dict
from flowrl.prompts.cache import PromptCache
from flowrl.prompts.sets import load_prompts
from flowrl.rewards import build_multi_reward
from flowrl.rollouts.chunked import chunked_rollout
from flowrl.samplers import ode_solve, sde_noise_levels
from flowrl.trainer import Trainer

PROMPTS = ["a bold handwritten 3", "a thin handwritten 7"]


def _noise(model, n=2, seed=0):
    return torch.randn(n, *model.latent_shape(16, 16), generator=torch.Generator().manual_seed(seed))


def test_packing_round_trip_and_ids_match_diffusers():
    from diffusers import FluxPipeline

    x = torch.randn(2, 4, 6, 8)
    packed = pack_latents(x)
    torch.testing.assert_close(packed, FluxPipeline._pack_latents(x, 2, 4, 6, 8), rtol=0, atol=0)
    torch.testing.assert_close(unpack_latents(packed, 6, 8), x, rtol=0, atol=0)
    ids = FluxPipeline._prepare_latent_image_ids(2, 3, 4, "cpu", torch.float32)
    torch.testing.assert_close(latent_image_ids(6, 8), ids, rtol=0, atol=0)
    with pytest.raises(ValueError, match="even"):
        pack_latents(torch.zeros(1, 4, 5, 8))


def test_unpacking_refuses_tokens_that_do_not_tile_the_latent() -> None:
    """A token count other than (h/2)(w/2), or features not a multiple of 4, is a ValueError naming the shapes."""
    with pytest.raises(ValueError, match=r"cannot unpack \(1, 8, 16\) tokens to a 4x4 latent"):
        unpack_latents(torch.zeros(1, 8, 16), 4, 4)
    with pytest.raises(ValueError, match="cannot unpack"):
        unpack_latents(torch.zeros(1, 4, 6), 4, 4)
    assert unpack_latents(torch.zeros(1, 4, 16), 4, 4).shape == (1, 4, 4, 4)


@pytest.mark.parametrize("guidance_embeds,steps", [(True, 3), (False, 2)])
def test_euler_ode_reproduces_flux_pipeline(guidance_embeds, steps):
    """Same initial latents, sigmas and guidance: our Euler ODE == FluxPipeline (dev and schnell)."""
    model = tiny_flux(guidance_embeds=guidance_embeds)
    cond = model.encode_prompt(PROMPTS)
    x_init = _noise(model)
    sigmas = model.sigmas(steps, 16, 16)
    ours = ode_solve(lambda x, s: model.velocity(x, s, cond), x_init, sigmas, method="euler")
    out = model.pipe(
        prompt_embeds=cond["encoder_hidden_states"],
        pooled_prompt_embeds=cond["pooled_projections"],
        latents=pack_latents(x_init),
        height=16,
        width=16,
        num_inference_steps=steps,
        guidance_scale=3.5,
        output_type="latent",
        max_sequence_length=8,
    ).images
    torch.testing.assert_close(model.pipe.scheduler.sigmas.double(), sigmas, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours, unpack_latents(out, 8, 8), rtol=1e-4, atol=1e-5)
    images = model.pipe(
        prompt_embeds=cond["encoder_hidden_states"],
        pooled_prompt_embeds=cond["pooled_projections"],
        latents=pack_latents(x_init),
        height=16,
        width=16,
        num_inference_steps=steps,
        guidance_scale=3.5,
        output_type="pt",
        max_sequence_length=8,
    ).images
    torch.testing.assert_close(model.decode(ours), images, rtol=1e-4, atol=1e-4)


def test_sigma_convention_and_velocity_sign():
    """FLUX predicts eps - x0: one Euler step from sigma to 0 lands on x - sigma * v = x0-hat, and
    the transformer gets timestep = sigma (it scales by 1000 itself)."""
    model = tiny_flux()
    seen = {}

    def grab(_, args, kwargs):
        seen.update(timestep=kwargs["timestep"].clone())

    handle = model.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    cond = model.encode_prompt(PROMPTS)
    x = _noise(model)
    sigma = torch.tensor([0.75, 0.25])
    v = model.velocity(x, sigma, cond)
    handle.remove()
    torch.testing.assert_close(seen["timestep"], sigma)
    out = model.pipe(
        prompt_embeds=cond["encoder_hidden_states"],
        pooled_prompt_embeds=cond["pooled_projections"],
        latents=pack_latents(x),
        height=16,
        width=16,
        sigmas=[1.0],
        num_inference_steps=1,
        output_type="latent",
        max_sequence_length=8,
    ).images
    # a 1-step pipeline call from sigma 1 to 0 is x - v(x, 1)
    v1 = model.velocity(x, torch.ones(2), cond)
    torch.testing.assert_close(unpack_latents(out, 8, 8), x - v1, rtol=1e-4, atol=1e-5)
    assert v.shape == x.shape and v.dtype == model.dtype


def test_distilled_guidance_reaches_the_transformer():
    model = tiny_flux()
    assert model.guidance_scale == 3.5 and model.has_guidance_embeds and model.guidance == "distilled"
    seen = []
    handle = model.transformer.register_forward_pre_hook(
        lambda _, args, kw: seen.append(kw["guidance"].clone()), with_kwargs=True
    )
    cond, x, sigma = model.encode_prompt(PROMPTS), _noise(model), torch.tensor([0.6, 0.6])
    v_default = model.velocity(x, sigma, cond)
    model.set_guidance_scale(7.0)
    v_strong = model.velocity(x, sigma, cond)
    handle.remove()
    assert seen[0].tolist() == [3.5, 3.5] and seen[1].tolist() == [7.0, 7.0]
    assert not torch.allclose(v_default, v_strong)
    with pytest.raises(ValueError, match="finite"):
        model.set_guidance_scale(float("nan"))


def test_schnell_has_no_guidance_and_rejects_one():
    model = tiny_flux(guidance_embeds=False)
    assert model.guidance_scale is None and not model.has_guidance_embeds
    seen = []
    handle = model.transformer.register_forward_pre_hook(
        lambda _, args, kw: seen.append(kw["guidance"]), with_kwargs=True
    )
    model.velocity(_noise(model), torch.tensor([0.5, 0.5]), model.encode_prompt(PROMPTS))
    handle.remove()
    assert seen == [None]
    assert model.guidance == "none"
    with pytest.raises(ValueError, match="no guidance embedding.*remove model.distilled_guidance"):
        model.set_guidance_scale(3.5)
    with pytest.raises(ValueError, match="guidance_embeds=False"):
        FluxAdapter(tiny_flux_pipeline(guidance_embeds=False), guidance_scale=2.0)


def test_batched_encoding_matches_single_prompts_and_shapes():
    from flowrl.models import ModelAdapter

    model = tiny_flux()
    assert isinstance(model, ModelAdapter) and isinstance(tiny_flux(guidance_embeds=False), ModelAdapter)
    both = model.encode_prompt(PROMPTS)
    assert both["encoder_hidden_states"].shape == (2, 8, 16) and both["pooled_projections"].shape == (2, 16)
    for i, prompt in enumerate(PROMPTS):
        one = model.encode_prompt([prompt])
        for key in both:
            torch.testing.assert_close(one[key][0], both[key][i], rtol=1e-5, atol=1e-6)
    assert model.latent_shape(32, 16) == (4, 16, 8)
    with pytest.raises(ValueError, match="multiple of 4"):
        model.latent_shape(18, 16)


def test_two_step_rollout_with_log_probs():
    model = tiny_flux()
    cond = model.encode_prompt(PROMPTS * 2)
    sigmas = model.sigmas(2, 16, 16)
    traj = chunked_rollout(
        model,
        cond,
        _noise(model, 4),
        sigmas,
        sde_noise_levels(2, 0.7),
        chunk_size=2,
        generator=torch.Generator().manual_seed(1),
    )
    assert traj.latents.shape == (4, 3, 4, 8, 8) and traj.log_probs.shape == (4, 2)
    assert traj.log_probs.dtype == torch.float32 and torch.isfinite(traj.log_probs).all()
    assert (traj.log_probs[:, 0] != 0).all() and (traj.log_probs[:, 1] == 0).all()  # last step is ODE
    images = model.decode(traj.latents[:, -1])
    assert images.shape == (4, 3, 16, 16) and images.min() >= 0 and images.max() <= 1


def test_prompt_cache_hits_reuse_flux_embeddings(tmp_path):
    model = tiny_flux()
    cache = PromptCache(model, tmp_path)
    first = cache.encode(PROMPTS + PROMPTS[:1])
    assert (cache.misses, cache.hits) == (2, 1)
    again = cache.encode(PROMPTS)
    assert (cache.misses, cache.hits) == (2, 3)
    direct = model.encode_prompt(PROMPTS)
    for key in direct:
        torch.testing.assert_close(again[key], direct[key], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(first[key][2], first[key][0], rtol=0, atol=0)
    warm = PromptCache(tiny_flux(), tmp_path)  # same weights and configs -> same fingerprint -> disk hits
    warm.encode(PROMPTS)
    assert (warm.misses, warm.hits) == (0, 2)
    assert PromptCache(tiny_flux(seed=1), tmp_path).fingerprint != cache.fingerprint


def test_default_lora_targets_cover_attention_mlps_and_single_blocks_only():
    model = tiny_flux()
    add_lora(model.transformer, rank=2, alpha=4, targets=model.lora_target_modules)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.transformer.named_parameters() if ".lora_A" in n}
    assert "proj_out" not in adapted  # the final output layer is not adapted
    assert {
        "single_transformer_blocks.0.proj_out",
        "single_transformer_blocks.1.proj_mlp",
        "transformer_blocks.0.attn.to_add_out",
        "transformer_blocks.0.ff_context.net.2",
        "single_transformer_blocks.1.attn.to_q",
    } <= adapted
    assert flux_lora_targets(2)[-1] == "single_transformer_blocks.1.proj_out"


def test_saved_lora_loads_into_flux_pipeline(tmp_path):
    model = tiny_flux()
    add_lora(model.transformer, rank=4, alpha=8, targets=model.lora_target_modules)
    for name, p in model.transformer.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.1)
    cond, x, sigma = model.encode_prompt(PROMPTS), _noise(model), torch.tensor([0.9, 0.4])
    trained = model.velocity(x, sigma, cond)
    path = model.save_lora(tmp_path, lora_state_dict(model.transformer))
    assert path.name == "pytorch_lora_weights.safetensors" and path.is_file()
    fresh = tiny_flux()
    base = fresh.velocity(x, sigma, cond)
    fresh.pipe.load_lora_weights(str(tmp_path))
    assert not torch.allclose(base, trained)
    torch.testing.assert_close(fresh.velocity(x, sigma, cond), trained, rtol=1e-5, atol=1e-6)


def test_a_bf16_flux_samples_the_same_images_after_its_lora_is_saved_and_reloaded(tmp_path):
    """`flowrl sample` / `flowrl eval` reload the LoRA through diffusers; on a bf16 FLUX they now draw the images
    the run evaluated (fp32 LoRA), bit for bit; diffusers alone was up to 0.0098 off per pixel here."""
    from flowrl.policy.lora import load_saved_lora
    from flowrl.rollouts.chunked import sample_images

    def bf16_flux():
        pipe = tiny_flux_pipeline().to(torch.bfloat16)
        return FluxAdapter(pipe, max_sequence_length=8, resolution=(16, 16), model_id="tiny-flux")

    model = bf16_flux()
    params = add_lora(model.transformer, rank=4, alpha=8, targets=model.lora_target_modules)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in params:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_lora(tmp_path, lora_state_dict(model.transformer))
    fresh = bf16_flux()
    load_saved_lora(fresh, tmp_path)
    prompts, sigmas = ["a 3", "a bold 7", "a thin 1", "a 0"], model.sigmas(10, 16, 16)
    with torch.no_grad():
        trained = sample_images(model, prompts, [0, 1, 2, 3], sigmas, resolution=(16, 16))
        reloaded = sample_images(fresh, prompts, [0, 1, 2, 3], sigmas, resolution=(16, 16))
    torch.testing.assert_close(reloaded, trained, rtol=0, atol=0)


FAST = [
    "prompts.per_iteration=2",
    "prompts.group_size=2",
    "sampler.num_steps=2",
    "sampler.chunk_size=2",
    "sampler.schedule=dynamic_shift",
    "model.resolution=16",
    "train.eval_seeds=1",
    "objective.kl_beta=0.01",
    "optim.lr=0.05",
    "lora.rank=4",
    "lora.alpha=8",
]


def test_flow_grpo_update_through_the_trainer(tmp_path):
    """One Flow-GRPO iteration: first ratio exactly 1, only LoRA moves, the saved LoRA reloads in diffusers."""
    model = tiny_flux()
    cfg = load_config(None, FAST)
    prompts = load_prompts("digits-styles")
    reward = build_multi_reward({"ink": {"weight": 1.0}, "jpeg_compressibility": {"weight": 0.1}})
    trainer = Trainer(cfg, build_policy(cfg, model=model, trainable=True), reward, prompts, prompts[:2])
    torch.testing.assert_close(trainer.sigmas, model.sigmas(2, 16, 16), rtol=0, atol=1e-12)
    frozen = {n: p.clone() for n, p in model.transformer.named_parameters() if "lora_" not in n}
    lora_b = {n: p.clone() for n, p in model.transformer.named_parameters() if "lora_B" in n}
    metrics = trainer.train_step()
    assert metrics["train/first_ratio"] == 1.0
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert all(torch.equal(p, frozen[n]) for n, p in model.transformer.named_parameters() if n in frozen)
    assert any(not torch.equal(p, lora_b[n]) for n, p in model.transformer.named_parameters() if n in lora_b)
    model.save_lora(tmp_path, lora_state_dict(model.transformer))
    cond, x, sigma = model.encode_prompt(PROMPTS), _noise(model), torch.tensor([0.8, 0.3])
    fresh = tiny_flux()
    fresh.pipe.load_lora_weights(str(tmp_path))
    torch.testing.assert_close(fresh.velocity(x, sigma, cond), model.velocity(x, sigma, cond), rtol=1e-5, atol=1e-6)


def test_run_sigmas_model_schedule(tiny_sd3):
    from flowrl.models.pipeline_schedule import run_sigmas
    from flowrl.samplers import make_sigmas

    dev, schnell = tiny_flux(), tiny_flux(guidance_embeds=False)
    latent = dev.latent_shape(32, 32)
    grid = run_sigmas(dev, "model", 4, shift=1.0, resolution=(32, 32), latent=latent)
    torch.testing.assert_close(grid, dev.sigmas(4, 32, 32), rtol=0, atol=0)
    # FLUX.1-dev's scheduler config is the generic dynamic shift; schnell's is the plain linear grid
    torch.testing.assert_close(grid, make_sigmas("dynamic_shift", 4, image_seq_len=64), rtol=0, atol=1e-12)
    torch.testing.assert_close(schnell.sigmas(4, 32, 32), make_sigmas("linear", 4), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="schedule='model'.*sd3 has none"):  # named by its model_id
        run_sigmas(tiny_sd3, "model", 4, shift=1.0, resolution=(8, 8), latent=(4, 4, 4))
