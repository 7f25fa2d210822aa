"""True CFG (flowrl.policy.guidance): batched [uncond; cond] evaluation, parity with diffusers' SD3 pipeline,
the same guided velocity in rollout, training and the KL reference (ratio exactly 1), NFE counting."""

import pytest
import torch

from flowrl.models.adapter import select_cond
from flowrl.objectives import FlowGRPO, RolloutBatch
from flowrl.policy import build_policy
from flowrl.policy.counting import CountingAdapter
from flowrl.policy.guidance import GuidedAdapter, apply_guidance, encode_with_negative, split_cond, with_uncond
from flowrl.policy.lora import add_lora
from flowrl.prompts.cache import PromptCache, model_fingerprint
from flowrl.rollouts.chunked import chunked_rollout
from flowrl.samplers import linear_sigmas, sde_noise_levels
from flowrl.samplers.ode_solve import ode_solve

PROMPTS = ["a bold handwritten 3", "a thin handwritten 7"]


class ForwardCounter:
    """Counts transformer forward calls and the batch size of each (a forward hook)."""

    def __init__(self, module):
        self.batches = []
        self.handle = module.register_forward_hook(
            lambda mod, args, kwargs, out: self.batches.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
        )


def _nonzero_lora(model, std=0.05):
    add_lora(model.transformer, rank=4, alpha=4, targets=model.lora_target_modules)
    for name, p in model.transformer.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, std, generator=torch.Generator().manual_seed(3))


def test_cond_dict_round_trip_and_errors():
    cond = {"a": torch.zeros(2, 3), "b": torch.ones(2)}
    neg = {"a": torch.full((2, 3), 5.0), "b": torch.full((2,), 7.0)}
    both = with_uncond(cond, neg)
    assert sorted(both) == ["a", "b", "uncond.a", "uncond.b"]
    pos, back = split_cond(select_cond(both, slice(1, 2)))
    assert torch.equal(pos["a"], cond["a"][1:]) and torch.equal(back["b"], neg["b"][1:])
    with pytest.raises(ValueError, match="keys"):
        with_uncond(cond, {"a": neg["a"]})
    with pytest.raises(ValueError, match="batch sizes"):
        with_uncond(cond, {"a": neg["a"][:1], "b": neg["b"][:1]})
    with pytest.raises(ValueError, match="per-sample shape.*max_sequence_length"):
        with_uncond(cond, {"a": torch.zeros(2, 4), "b": neg["b"]})


def test_cfg_batching_is_one_call_equal_to_two_calls_float64(tiny_sd3):
    tiny_sd3.pipe.to(torch.float64)
    tiny_sd3.dtype = torch.float64
    guided = GuidedAdapter(tiny_sd3, 4.5, "a thin handwritten 0")
    cond = guided.encode_prompt(PROMPTS)
    x = torch.randn(2, *tiny_sd3.latent_shape(8, 8), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sigma = torch.tensor([0.9, 0.4], dtype=torch.float64)
    counter = ForwardCounter(tiny_sd3.transformer)
    v = guided.velocity(x, sigma, cond)
    assert counter.batches == [4]  # one transformer call on [uncond; cond]
    pos, neg = split_cond(cond)
    v_c, v_u = tiny_sd3.velocity(x, sigma, pos), tiny_sd3.velocity(x, sigma, neg)
    assert v.dtype == torch.float64
    torch.testing.assert_close(v, v_u + 4.5 * (v_c - v_u), rtol=1e-10, atol=1e-10)


def test_negative_is_encoded_once_and_batched(tiny_sd3):
    calls = []
    encode = tiny_sd3.encode_prompt
    cond = encode_with_negative(lambda texts: calls.append(list(texts)) or encode(texts), PROMPTS, "")
    assert calls == [PROMPTS, [""]]
    torch.testing.assert_close(cond["uncond.encoder_hidden_states"], encode(["", ""])["encoder_hidden_states"])
    assert encode_with_negative(encode, PROMPTS, None).keys() == encode(PROMPTS).keys()


def test_sd3_guided_euler_matches_the_diffusers_pipeline(tiny_sd3):
    """Same latents, same sigmas: our guided Euler ODE == StableDiffusion3Pipeline's CFG sampling."""
    pipe, negative, scale, steps = tiny_sd3.pipe, "a thin handwritten 0", 3.0, 3
    x = torch.randn(2, *tiny_sd3.latent_shape(8, 8), generator=torch.Generator().manual_seed(1))
    ref = pipe(
        prompt=PROMPTS,
        negative_prompt=[negative] * 2,
        height=8,
        width=8,
        num_inference_steps=steps,
        guidance_scale=scale,
        latents=x.clone(),
        output_type="latent",
        max_sequence_length=tiny_sd3.max_sequence_length,
    ).images
    sigmas = pipe.scheduler.sigmas.double()  # the grid the pipeline just used (ends at 0)
    guided = GuidedAdapter(tiny_sd3, scale, negative)
    cond = guided.encode_prompt(PROMPTS)
    with torch.no_grad():
        ours = ode_solve(lambda z, s: guided.velocity(z, s, cond), x, sigmas)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def _rollout_batch(model, prompts, chunk=2, steps=3, latent=(8, 8)):
    cond = model.encode_prompt(prompts)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(len(prompts), *model.latent_shape(*latent), generator=gen)
    traj = chunked_rollout(
        model, cond, x, linear_sigmas(steps), sde_noise_levels(steps, 0.7), chunk_size=chunk, generator=gen
    )
    adv = torch.randn(len(prompts), generator=gen)
    keep = torch.ones(len(prompts), dtype=torch.bool)
    ids = torch.arange(len(prompts))
    return RolloutBatch(
        prompts, ids, cond, traj.latents[:, -1], traj, traj.sigmas, traj.latents[:, -1], adv, adv, keep, chunk
    )


def assert_ratio_one_with_guided_reference(model, batch):
    """Every planned micro-batch: ratio exactly 1; policy and KL-reference passes both run guided (2b)."""
    counter = ForwardCounter(model.transformer)
    objective = FlowGRPO(clip_range=1e-4, kl_beta=0.1)
    for group in objective.plan(batch, torch.Generator().manual_seed(1)):
        for mb in group:
            counter.batches.clear()
            _, stats = objective.loss(model, batch, mb)
            assert stats["ratio"] == 1.0 and stats["approx_kl"] == 0.0, stats
            assert stats["kl"] > 0.0
            assert counter.batches == [2 * len(mb.index)] * 2, counter.batches


def test_sd3_ratio_is_exactly_one_with_cfg(tiny_sd3):
    _nonzero_lora(tiny_sd3)
    guided = CountingAdapter(GuidedAdapter(tiny_sd3, 4.5, "blurry"))
    batch = _rollout_batch(guided, PROMPTS * 2)
    assert guided.nfe == 4 * 3 * 2  # 4 samples x 3 steps x (cond + uncond)
    assert_ratio_one_with_guided_reference(guided, batch)


def test_apply_guidance_modes(tiny_sd3):
    assert apply_guidance(tiny_sd3, 1.0, "ignored") is tiny_sd3  # no-CFG mode: the adapter itself, one pass
    guided = apply_guidance(tiny_sd3, 5.0, "x")
    assert isinstance(guided, GuidedAdapter) and guided.scale == 5.0 and guided.negative_prompt == "x"

    class Distilled:
        guidance = "distilled"

    class Plain:
        guidance = "none"

    assert apply_guidance(Distilled(), 1.0) is not None
    with pytest.raises(ValueError, match="distilled"):
        apply_guidance(Distilled(), 3.5)
    with pytest.raises(ValueError, match="no guidance"):
        apply_guidance(Plain(), 2.0)
    with pytest.raises(ValueError, match="guidance='cfg'"):
        GuidedAdapter(Distilled(), 2.0)


def test_guided_velocity_needs_negative_conditioning(tiny_sd3):
    guided = GuidedAdapter(tiny_sd3, 2.0)
    x = torch.zeros(1, *tiny_sd3.latent_shape(8, 8))
    with pytest.raises(ValueError, match="uncond"):
        guided.velocity(x, torch.ones(1), tiny_sd3.encode_prompt(PROMPTS[:1]))


def test_prompt_cache_over_guided_adapter(tiny_sd3, tmp_path):
    guided = GuidedAdapter(tiny_sd3, 4.0, "blurry")
    cache = PromptCache(guided, tmp_path)
    first = cache.encode(PROMPTS + PROMPTS[:1])
    assert (cache.misses, cache.hits) == (2, 1)
    torch.testing.assert_close(
        first["uncond.encoder_hidden_states"][:2], guided.encode_prompt(PROMPTS)["uncond.encoder_hidden_states"]
    )
    warm = PromptCache(guided, tmp_path)  # a new run: served from disk
    again = warm.encode(PROMPTS)
    assert (warm.misses, warm.hits) == (0, 2)
    for key in first:
        assert torch.equal(again[key], first[key][:2]), key
    # another negative prompt never reuses the folder
    assert model_fingerprint(GuidedAdapter(tiny_sd3, 4.0, "ugly")) != cache.fingerprint


def test_trainer_default_is_unguided_and_cfg_trains_with_ratio_one(tiny_sd3):
    from flowrl.config import load_config
    from flowrl.prompts.sets import load_prompts
    from flowrl.rewards import build_multi_reward
    from flowrl.trainer import Trainer

    fast = [
        "prompts.per_iteration=2",
        "prompts.group_size=2",
        "sampler.num_steps=3",
        "sampler.chunk_size=2",
        "objective.kl_beta=0.01",
    ]
    prompts = load_prompts("digits-styles")
    cfg = load_config(None, fast)
    assert cfg.sampler.guidance_scale == 1.0 and cfg.prompts.negative == ""
    plain = Trainer(
        cfg, build_policy(cfg, model=tiny_sd3, trainable=True), build_multi_reward(cfg.rewards), prompts, prompts[:2]
    )
    assert not isinstance(plain.model._model, GuidedAdapter)

    from conftest import tiny_sd3_pipeline

    from flowrl.models.sd3 import SD3Adapter

    cfg = load_config(None, fast + ["sampler.guidance_scale=4.5", "prompts.negative=blurry"])
    trainer = Trainer(
        cfg,
        build_policy(
            cfg, model=SD3Adapter(tiny_sd3_pipeline(), max_sequence_length=2, resolution=(8, 8)), trainable=True
        ),
        build_multi_reward(cfg.rewards),
        prompts,
        prompts[:2],
    )
    metrics = trainer.train_step()
    assert metrics["train/first_ratio"] == 1.0
    # rollout 4 x 3 steps + policy and KL-reference passes on 2 SDE steps x 4 samples, each 2 evaluations
    assert metrics["nfe"] == 2 * (4 * 3 + 2 * (4 * 2))


def test_flowrl_sample_applies_the_configured_cfg(tmp_path, capsys):
    """`flowrl sample` guides exactly as training does: sampler.guidance_scale and prompts.negative."""
    import numpy as np
    from conftest import tiny_sd3_pipeline
    from PIL import Image

    from flowrl.cli import main

    folder = tmp_path / "tiny"
    tiny_sd3_pipeline().save_pretrained(str(folder))
    common = ["sample", f"model.path={folder}", "sampler.num_steps=2", "--prompt", PROMPTS[0], "--seeds", "2"]
    outs = {}
    for scale in (1.0, 4.0):
        out = tmp_path / f"cfg{scale}.png"
        assert (
            main(
                [
                    *common[:3],
                    f"sampler.guidance_scale={scale}",
                    "prompts.negative=blurry",
                    *common[3:],
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        outs[scale] = np.asarray(Image.open(out), dtype=np.float32)
    assert outs[1.0].shape == outs[4.0].shape and np.abs(outs[1.0] - outs[4.0]).max() > 1.0
    assert main([*common[:3], "sampler.guidance_scale=-1", *common[3:]]) == 2
    assert "guidance_scale" in capsys.readouterr().err


def test_an_unknown_guidance_kind_is_refused_even_without_cfg() -> None:
    """apply_guidance checks the adapter's guidance kind before anything else: at scale 1 too, one line."""

    class Classifier:
        guidance = "classifier"

    for scale in (1.0, 4.0):
        with pytest.raises(ValueError, match=r"^Classifier.guidance must be one of \('cfg', 'distilled', 'none'\)"):
            apply_guidance(Classifier(), scale)
