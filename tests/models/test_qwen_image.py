"""Qwen-Image adapter on tiny real diffusers/transformers models (Qwen2.5-VL encoder built from config)."""

import json
import shutil

import pytest
import torch
from tiny_flow_pipelines import tiny_qwen_image, tiny_qwen_image_pipeline

from flowrl.config import load_config
from flowrl.models import load_adapter
from flowrl.models.packing import pack_latents, unpack_latents
from flowrl.models.qwen_image import QwenImageAdapter, qwen_true_cfg
from flowrl.policy import build_policy
from flowrl.policy.lora import add_lora, lora_state_dict
from flowrl.prompts.cache import PromptCache
from flowrl.prompts.sets import load_prompts
from flowrl.rewards import build_multi_reward
from flowrl.rollouts.chunked import chunked_rollout
from flowrl.samplers import ode_solve, sde_noise_levels
from flowrl.trainer import Trainer

PROMPTS = ["a bold handwritten 3", "a thin digit 7 on paper"]


def _noise(model, n=2, seed=0):
    return torch.randn(n, *model.latent_shape(16, 16), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen_image()


def test_prompts_are_padded_to_one_length_with_a_mask(qwen):
    from flowrl.models import ModelAdapter

    assert isinstance(qwen, ModelAdapter) and qwen.guidance == "cfg"
    cond = qwen.encode_prompt(PROMPTS)
    assert cond["encoder_hidden_states"].shape == (2, 24, 16) and cond["encoder_hidden_states_mask"].shape == (2, 24)
    lengths = cond["encoder_hidden_states_mask"].sum(1).tolist()
    # prompt tokens after the 34-token system prefix: words + "<|im_end|>\n<|im_start|>assistant\n"
    assert lengths[0] < lengths[1] <= 24
    assert (cond["encoder_hidden_states"][0, lengths[0] :] == 0).all()
    embeds, mask = qwen.pipe.encode_prompt(PROMPTS, device="cpu")
    valid = int(mask[0].sum())
    torch.testing.assert_close(cond["encoder_hidden_states"][0, :valid], embeds[0, :valid])
    for i, prompt in enumerate(PROMPTS):  # batched == one prompt at a time (what the prompt cache does)
        torch.testing.assert_close(
            qwen.encode_prompt([prompt])["encoder_hidden_states"][0],
            cond["encoder_hidden_states"][i],
            rtol=1e-5,
            atol=1e-6,
        )


def test_padding_does_not_change_the_velocity(qwen):
    x, sigma = _noise(qwen), torch.tensor([0.8, 0.3])
    padded = qwen.encode_prompt(PROMPTS[:1] * 2)
    embeds, _ = qwen.pipe.encode_prompt(PROMPTS[:1] * 2, device="cpu")  # unpadded, no mask
    direct = qwen.transformer(
        hidden_states=pack_latents(x),
        encoder_hidden_states=embeds,
        timestep=sigma,
        img_shapes=[[(1, 4, 4)]] * 2,
        return_dict=False,
    )[0]
    torch.testing.assert_close(qwen.velocity(x, sigma, padded), unpack_latents(direct, 8, 8), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        qwen.velocity(x, sigma, {k: v[:, :20] for k, v in padded.items()}),
        qwen.velocity(x, sigma, padded),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("true_cfg", [1.0, 4.0])
def test_euler_ode_reproduces_qwen_image_pipeline(qwen, true_cfg):
    """Same initial latents and sigmas (dynamic shift + terminal stretch): our Euler ODE == QwenImagePipeline,
    without CFG and with the pipeline's norm-rescaled true CFG."""
    steps, x_init = 3, _noise(qwen)
    cond = qwen.encode_prompt(PROMPTS)
    sigmas = qwen.sigmas(steps, 16, 16)
    if true_cfg == 1.0:
        velocity = lambda x, s: qwen.velocity(x, s, cond)  # noqa: E731
    else:
        neg = qwen.encode_prompt([" "] * 2)
        velocity = lambda x, s: qwen_true_cfg(qwen.velocity(x, s, neg), qwen.velocity(x, s, cond), true_cfg)  # noqa: E731
    ours = ode_solve(velocity, x_init, sigmas, method="euler")
    kwargs = dict(
        prompt=PROMPTS,
        latents=pack_latents(x_init),
        height=16,
        width=16,
        num_inference_steps=steps,
        true_cfg_scale=true_cfg,
    )
    if true_cfg > 1:
        kwargs["negative_prompt"] = [" "] * 2
    out = qwen.pipe(**kwargs, output_type="latent").images
    torch.testing.assert_close(qwen.pipe.scheduler.sigmas.double(), sigmas, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours, unpack_latents(out, 8, 8), rtol=1e-4, atol=1e-5)
    images = qwen.pipe(**kwargs, output_type="pt").images
    torch.testing.assert_close(qwen.decode(ours), images, rtol=1e-4, atol=1e-4)


def test_a_non_square_image_reproduces_the_pipeline(qwen) -> None:
    """Height != width: the RoPE shape (1, h/2, w/2) the adapter passes gives the pipeline's Euler ODE at 16x32."""
    steps = 2
    x_init = torch.randn(2, *qwen.latent_shape(16, 32), generator=torch.Generator().manual_seed(1))
    assert x_init.shape[2:] == (8, 16)
    cond = qwen.encode_prompt(PROMPTS)
    ours = ode_solve(lambda x, s: qwen.velocity(x, s, cond), x_init, qwen.sigmas(steps, 16, 32), method="euler")
    out = qwen.pipe(
        prompt=PROMPTS,
        latents=pack_latents(x_init),
        height=16,
        width=32,
        num_inference_steps=steps,
        true_cfg_scale=1.0,
        output_type="latent",
    ).images
    torch.testing.assert_close(ours, unpack_latents(out, 8, 16), rtol=1e-4, atol=1e-5)


def test_a_guidance_embedding_transformer_is_refused() -> None:
    """The adapter never feeds a guidance embedding, so a transformer that has one is refused by name."""
    pipe = tiny_qwen_image_pipeline()
    pipe.transformer.register_to_config(guidance_embeds=True)
    with pytest.raises(ValueError, match="tiny-qwen: guidance-embedding Qwen-Image transformers are not supported"):
        QwenImageAdapter(pipe, model_id="tiny-qwen")


def test_two_step_rollout_with_log_probs(qwen):
    cond = qwen.encode_prompt(PROMPTS * 2)
    traj = chunked_rollout(
        qwen,
        cond,
        _noise(qwen, 4),
        qwen.sigmas(2, 16, 16),
        sde_noise_levels(2, 0.7),
        chunk_size=2,
        generator=torch.Generator().manual_seed(1),
    )
    assert traj.latents.shape == (4, 3, 4, 8, 8) and traj.log_probs.shape == (4, 2)
    assert traj.log_probs.dtype == torch.float32 and torch.isfinite(traj.log_probs).all()
    assert (traj.log_probs[:, 0] != 0).all() and (traj.log_probs[:, 1] == 0).all()
    images = qwen.decode(traj.latents[:, -1])
    assert images.shape == (4, 3, 16, 16) and images.min() >= 0 and images.max() <= 1


def test_prompt_cache_hits(qwen, tmp_path):
    cache = PromptCache(qwen, tmp_path)
    cache.encode(PROMPTS)
    again = cache.encode(PROMPTS[::-1])
    assert (cache.misses, cache.hits) == (2, 2)
    direct = qwen.encode_prompt(PROMPTS[::-1])
    for key in direct:
        torch.testing.assert_close(again[key], direct[key], rtol=1e-5, atol=1e-6)
    warm = PromptCache(qwen, tmp_path)
    warm.encode(PROMPTS)
    assert (warm.misses, warm.hits) == (0, 2) and warm.fingerprint == cache.fingerprint


def test_saved_lora_loads_into_qwen_image_pipeline(tmp_path):
    model = tiny_qwen_image()
    add_lora(model.transformer, rank=4, alpha=8, targets=model.lora_target_modules)
    adapted = {n for n, _ in model.transformer.named_parameters() if ".lora_A" in n}
    assert any("img_mlp.net.2" in n for n in adapted) and any("attn.add_k_proj" in n for n in adapted)
    for name, p in model.transformer.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.1)
    cond, x, sigma = model.encode_prompt(PROMPTS), _noise(model), torch.tensor([0.9, 0.4])
    trained = model.velocity(x, sigma, cond)
    path = model.save_lora(tmp_path, lora_state_dict(model.transformer))
    assert path.name == "pytorch_lora_weights.safetensors" and path.is_file()
    fresh = tiny_qwen_image()
    base = fresh.velocity(x, sigma, cond)
    fresh.pipe.load_lora_weights(str(tmp_path))
    assert not torch.allclose(base, trained)
    torch.testing.assert_close(fresh.velocity(x, sigma, cond), trained, rtol=1e-5, atol=1e-6)


def test_guided_adapter_uses_qwen_norm_rescaled_cfg(qwen):
    """flowrl's true-CFG wrapper (one batched [uncond; cond] call) reproduces QwenImagePipeline's CFG sampling."""
    from flowrl.policy.guidance import GuidedAdapter

    guided = GuidedAdapter(qwen, 4.0, negative_prompt=" ")
    cond, x_init, sigmas = guided.encode_prompt(PROMPTS), _noise(qwen), qwen.sigmas(2, 16, 16)
    ours = ode_solve(lambda x, s: guided.velocity(x, s, cond), x_init, sigmas, method="euler")
    out = qwen.pipe(
        prompt=PROMPTS,
        negative_prompt=[" "] * 2,
        true_cfg_scale=4.0,
        latents=pack_latents(x_init),
        height=16,
        width=16,
        num_inference_steps=2,
        output_type="latent",
    ).images
    torch.testing.assert_close(ours, unpack_latents(out, 8, 8), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_flow_grpo_update_through_the_trainer(guidance_scale):
    """First ratio exactly 1 without CFG and with true CFG (guided rollout and guided training)."""
    model = tiny_qwen_image()
    cfg = load_config(
        None,
        [
            "prompts.per_iteration=2",
            "prompts.group_size=2",
            "sampler.num_steps=2",
            "sampler.chunk_size=2",
            "model.resolution=16",
            "train.eval_seeds=1",
            "objective.kl_beta=0.01",
            "optim.lr=0.05",
            "lora.rank=4",
            "lora.alpha=8",
            f"sampler.guidance_scale={guidance_scale}",
            "prompts.negative=' '",
            "sampler.schedule=model",
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
    torch.testing.assert_close(trainer.sigmas, model.sigmas(2, 16, 16), rtol=0, atol=0)  # the pipeline's own grid
    lora_b = {n: p.clone() for n, p in model.transformer.named_parameters() if "lora_B" in n}
    metrics = trainer.train_step()
    assert metrics["train/first_ratio"] == 1.0 and torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert any(not torch.equal(p, lora_b[n]) for n, p in model.transformer.named_parameters() if n in lora_b)
    # NFE: rollout 4 samples x 2 steps + policy and KL-reference passes on 1 SDE step, x2 branches under CFG
    assert metrics["nfe"] == (4 * 2 + 2 * 4) * (2 if guidance_scale > 1 else 1)


def test_folder_loads_through_load_adapter_and_missing_weights_are_named(tmp_path):
    folder = tmp_path / "qwen"
    pipe = tiny_qwen_image_pipeline()
    pipe.save_pretrained(str(folder))
    (folder / "flowrl.json").write_text(json.dumps({"resolution": 16, "max_sequence_length": 24}))
    model = load_adapter(str(folder))
    assert isinstance(model, QwenImageAdapter) and model.default_resolution == (16, 16)
    reference = tiny_qwen_image()
    cond = reference.encode_prompt(PROMPTS)
    torch.testing.assert_close(model.encode_prompt(PROMPTS), cond, rtol=1e-4, atol=1e-5)
    x, sigma = _noise(model), torch.tensor([0.6, 0.1])
    torch.testing.assert_close(model.velocity(x, sigma, cond), reference.velocity(x, sigma, cond), rtol=1e-4, atol=1e-5)
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    for f in (broken / "text_encoder").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(
        FileNotFoundError, match=r"text_encoder holds no weight files.*hf download Qwen/Qwen-Image .*model\.path="
    ):
        load_adapter(str(broken))


def test_true_cfg_formula_by_hand():
    u = torch.randn(1, 4, 2, 2, dtype=torch.float64)
    c = torch.randn(1, 4, 2, 2, dtype=torch.float64)
    out = qwen_true_cfg(u, c, 3.0)
    assert out.dtype == torch.float64
    combined = (u + 3.0 * (c - u)).flatten()  # a single 2x2 patch -> one token of all 16 features
    expected = combined / combined.norm() * c.flatten().norm()
    torch.testing.assert_close(out.flatten().sort().values, expected.sort().values, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        pack_latents(out), pack_latents(u + 3.0 * (c - u)) * (c.norm() / (u + 3.0 * (c - u)).norm())
    )
    torch.testing.assert_close(qwen_true_cfg(u, c, 1.0), c, rtol=1e-12, atol=1e-12)
    assert qwen_true_cfg(u.float(), c.half(), 2.0).dtype == torch.float32
