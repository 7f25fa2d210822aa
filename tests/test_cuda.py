"""Training on a CUDA device: every objective, async scoring in a process, autocast, tiny SD3 with CFG.

These need a GPU (`pytest -m cuda` on a GPU machine); without one they are skipped with that reason.
The RNG stays on the CPU, so a CUDA run draws the same noise as a CPU run and their first
rollouts agree to float32 kernel differences.
"""

from pathlib import Path

import pytest
import torch
from conftest import tiny_sd3_pipeline

from flowrl.config import load_config
from flowrl.models import load_adapter
from flowrl.models.sd3 import SD3Adapter
from flowrl.policy import build_policy
from flowrl.prompts.sets import load_prompts
from flowrl.recipe import build_reward
from flowrl.trainer import Trainer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "prompts.per_iteration=4",
    "prompts.group_size=4",
    "sampler.chunk_size=8",
    "train.eval_seeds=1",
    "train.progress=false",
]


def digits_trainer(device: str, *overrides: str, config: str | None = None) -> Trainer:
    cfg = load_config(config and str(ROOT / config), [*SMALL, f"model.device={device}", *overrides])
    prompts = load_prompts(cfg.prompts.train)
    return Trainer(
        cfg,
        build_policy(cfg, model=load_adapter(cfg.model.path, device=device), trainable=True),
        build_reward(cfg),
        prompts,
        prompts[:2],
    )


@pytest.mark.parametrize(
    "config",
    [
        None,
        "configs/nft/digits_fast.yaml",
        "configs/awm/digits_fast.yaml",
        "configs/branch/digits.yaml",
        "configs/sage/digits.yaml",
        "configs/grpo/digits_window.yaml",
    ],
)
def test_every_objective_trains_on_cuda(config):
    tree = config is not None and "branch" in config  # 2 trees of 16 leaves
    extra = ["prompts.per_iteration=2", "prompts.group_size=16"] if tree else []
    trainer = digits_trainer("cuda", *extra, config=config)
    before = {n: p.detach().clone() for n, p in trainer.model.transformer.named_parameters() if p.requires_grad}
    metrics = trainer.train_step()
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float))
    after = dict(trainer.model.transformer.named_parameters())
    assert all(after[n].device.type == "cuda" for n in before)
    assert any(not torch.equal(before[n], after[n]) for n in before)  # the LoRA moved
    assert torch.isfinite(torch.tensor(trainer.evaluate()["eval/reward_mean"]))
    trainer.close()


def test_step_noise_for_a_cuda_latent_is_the_cpu_draw_and_does_not_synchronise():
    """``standard_normal``: the CPU generator's draw, moved through pinned memory without a stream sync."""
    from flowrl.samplers import standard_normal

    x = torch.zeros(8, 4, 16, 16, device="cuda")
    expected = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising copy raises here
    try:
        noise = standard_normal(x, torch.Generator().manual_seed(3))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert noise.device == x.device and noise.dtype == torch.float32
    assert torch.equal(noise.cpu(), expected)


def test_cuda_rollout_matches_cpu_and_ratio_is_one():
    cpu, gpu = digits_trainer("cpu"), digits_trainer("cuda")
    a, _ = cpu.collect()
    b, _ = gpu.collect()
    assert b.samples.device.type == "cuda" and b.advantages.device.type == "cuda"
    torch.testing.assert_close(
        b.samples.cpu(), a.samples, atol=2e-3, rtol=0
    )  # same CPU-drawn noise, float32 kernels differ
    stats = gpu.update(b)
    assert stats["first_ratio"] == 1.0  # first micro-batch, before any update: recomputed == stored log-prob


def test_the_default_job_trains_under_cuda_graphs_with_its_kl_reference_intact():
    """memory.compile=reduce-overhead: two iterations, the first-update ratio exactly 1.

    Round 2 on an H100 (2026-11-27) stopped here: the KL's reference velocity was the CUDA graph's
    static output, overwritten by the policy's next replay (docs/gpu-runs/2026-11-27-h100-round2.log).
    """
    trainer = digits_trainer("cuda", "memory.compile=reduce-overhead")
    assert trainer.model.transformer._compiled_call_impl is not None
    for _ in range(2):
        batch, _ = trainer.collect()
        stats = trainer.update(batch)
        assert stats["first_ratio"] == 1.0 and torch.isfinite(torch.tensor(stats["loss"]))
    trainer.close()


def test_the_default_job_under_cudagraphs_replays_the_eager_kernels():
    """memory.compile=cudagraphs: the rollout equals eager's bit for bit, the ratio is 1, the KL reference intact."""
    from torch._dynamo.utils import counters

    counters.clear()
    eager, graphs = digits_trainer("cuda"), digits_trainer("cuda", "memory.compile=cudagraphs")
    assert graphs.model.transformer._compiled_call_impl is not None
    a, _ = eager.collect()
    b, _ = graphs.collect()  # the same seed, before any update
    assert torch.equal(a.samples, b.samples) and torch.equal(a.trajectory.log_probs, b.trajectory.log_probs)
    for i in range(2):
        if i:
            b, _ = graphs.collect()
        stats = graphs.update(b)
        assert stats["first_ratio"] == 1.0 and torch.isfinite(torch.tensor(stats["loss"]))
    assert counters["inductor"]["cudagraph_skips"] == 0  # every traced graph was captured, none fell back to eager
    eager.close()
    graphs.close()


def test_process_scoring_on_cuda_is_identical_to_inline():
    inline, proc = (
        digits_trainer("cuda"),
        digits_trainer("cuda", "train.rewards_async=process", "train.score_chunk_size=4"),
    )
    inline.cfg.train.score_chunk_size = 4
    try:
        a, _ = inline.collect()
        b, _ = proc.collect()
        assert (
            torch.equal(a.rewards, b.rewards)
            and torch.equal(a.images, b.images)
            and torch.equal(a.advantages, b.advantages)
        )
    finally:
        proc.close()


def test_bf16_autocast_on_cuda_keeps_log_probs_fp32_and_the_ratio_one():
    """In bf16 torch picks cuDNN SDPA for a no-grad forward on Hopper and flash for a differentiated one: the
    rollout runs under the training kernels (trainable_attention), so the recomputed log-prob is the stored one."""
    trainer = digits_trainer("cuda", "memory.autocast=bf16")
    batch, _ = trainer.collect()
    assert batch.trajectory.log_probs.dtype == torch.float32 and torch.isfinite(batch.trajectory.log_probs).all()
    assert trainer.update(batch)["first_ratio"] == 1.0


def test_bf16_tiny_sd3_with_sd35_head_width_keeps_the_ratio_one_on_cuda():
    """Heads of 64 (SD3.5-M's), 64 image + 2 text tokens, bf16 autocast: shapes cuDNN SDPA takes on an H100."""
    cfg = load_config(None, [*SMALL, "sampler.num_steps=3", "memory.autocast=bf16", "model.device=cuda"])
    pipe = tiny_sd3_pipeline(size=16, attention_head_dim=64, caption_projection_dim=128).to("cuda")
    model = SD3Adapter(pipe, max_sequence_length=2, resolution=(16, 16))
    prompts = load_prompts("digits-styles")
    trainer = Trainer(cfg, build_policy(cfg, model=model, trainable=True), build_reward(cfg), prompts, prompts[:2])
    batch, _ = trainer.collect()
    assert trainer.update(batch)["first_ratio"] == 1.0


def test_tiny_sd3_with_true_cfg_trains_on_cuda():
    cfg = load_config(None, [*SMALL, "sampler.num_steps=3", "sampler.guidance_scale=4.5", "model.device=cuda"])
    model = SD3Adapter(tiny_sd3_pipeline().to("cuda"), max_sequence_length=2, resolution=(8, 8))
    prompts = load_prompts("digits-styles")
    trainer = Trainer(cfg, build_policy(cfg, model=model, trainable=True), build_reward(cfg), prompts, prompts[:2])
    metrics = trainer.train_step()
    assert metrics["nfe"] > 0 and torch.isfinite(torch.tensor(metrics["reward_mean"]))


def _adapter_trainer(model, *overrides):
    from flowrl.rewards import build_multi_reward

    model.pipe.to("cuda")
    cfg = load_config(
        None,
        [
            "model.resolution=16",
            "prompts.per_iteration=2",
            "prompts.group_size=2",
            "sampler.num_steps=3",
            "sampler.chunk_size=2",
            "objective.kl_beta=0.01",
            "lora.rank=4",
            "lora.alpha=4",
            "train.eval_seeds=1",
            "train.progress=false",
            "model.device=cuda",
            *overrides,
        ],
    )
    prompts = load_prompts("digits-styles")
    return Trainer(
        cfg,
        build_policy(cfg, model=model, trainable=True),
        build_multi_reward({"ink": {"weight": 1.0, "video": "mean"}}),
        prompts[:4],
        prompts[:1],
    )


@pytest.mark.parametrize("family", ["flux", "qwen_image", "wan2.2"])
def test_real_adapter_families_train_on_cuda(family):
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "models"))  # the tiny pipeline builders the model tests use
    from tiny_flow_pipelines import tiny_flux, tiny_qwen_image
    from tiny_wan import tiny_wan_adapter

    if family == "flux":
        trainer = _adapter_trainer(tiny_flux())
    elif family == "qwen_image":
        trainer = _adapter_trainer(tiny_qwen_image(), "sampler.guidance_scale=4.0")
    else:
        trainer = _adapter_trainer(
            tiny_wan_adapter(two_experts=True, boundary_ratio=0.6, lora_expert="both"),
            "model.num_frames=5",
            "sampler.guidance_scale=5.0",
        )
    batch, _ = trainer.collect()
    assert batch.samples.device.type == "cuda"
    stats = trainer.update(batch)
    assert stats["first_ratio"] == 1.0
    assert torch.isfinite(torch.tensor(trainer.evaluate()["eval/reward_mean"]))


def test_trainable_attention_leaves_out_cudnn_and_flux_attention_backward_runs():
    """cuDNN SDPA's backward failed on FLUX.1's attention shape (24 heads x 128, 1536 tokens) on an H100."""
    from flowrl.policy.memory import trainable_attention

    q = torch.randn(1, 24, 1536, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with trainable_attention():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        torch.nn.functional.scaled_dot_product_attention(q, q, q).float().square().mean().backward()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before  # restored for code outside a training run
    assert torch.isfinite(q.grad).all()
