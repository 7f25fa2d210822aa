"""GPU plan on paper: parameter counts, FLOPs and activation memory of the published models.

Every model is built on the ``meta`` device from its published config (the numbers below), so
nothing is downloaded and no memory is used; ``torch.utils.flop_counter.FlopCounterMode`` counts
the FLOPs of one forward pass (and of the backward pass with the base weights frozen, as under
LoRA), and a saved-tensor hook adds up what autograd keeps for the backward pass. Attention
probability matrices (S x S) are left out of that sum, because flash / memory-efficient SDPA
kernels do not store them. Results feed docs/gpu-plan.md.

Run: ``python -m bench.gpu_plan`` (about a minute on a CPU).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

GB = 1e9
EFFECTIVE_TFLOPS = 400.0  # assumed sustained bf16 throughput: ~40 % of an H100 SXM's 989 TFLOP/s dense peak


def _meta(build):
    with torch.device("meta"):
        return build()


def sd3_transformer(large: bool = False):
    """SD3.5-Medium / -Large ``transformer/config.json`` values (stabilityai repos)."""
    from diffusers import SD3Transformer2DModel

    if large:
        kw = dict(
            num_layers=38,
            num_attention_heads=38,
            caption_projection_dim=2432,
            pos_embed_max_size=192,
            dual_attention_layers=(),
        )
    else:
        kw = dict(
            num_layers=24,
            num_attention_heads=24,
            caption_projection_dim=1536,
            pos_embed_max_size=384,
            dual_attention_layers=tuple(range(13)),
        )
    return SD3Transformer2DModel(
        sample_size=128,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        attention_head_dim=64,
        joint_attention_dim=4096,
        pooled_projection_dim=2048,
        qk_norm="rms_norm",
        **kw,
    )


def flux_transformer():
    """FLUX.1-dev ``transformer/config.json`` (schnell: the same without guidance_embeds)."""
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=19,
        num_single_layers=38,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=4096,
        pooled_projection_dim=768,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    )


def wan_transformer():
    """Wan2.1-T2V-1.3B-Diffusers ``transformer/config.json``."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=12,
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        ffn_dim=8960,
        num_layers=30,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    )


def clip_text(hidden: int, layers: int, heads: int, inter: int, projection: bool):
    """CLIP ViT-L/14 (768, 12, 12, 3072) and OpenCLIP bigG/14 (1280, 32, 20, 5120) text towers."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(
        vocab_size=49408,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=inter,
        projection_dim=hidden,
        max_position_embeddings=77,
    )
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(cfg)


def t5_encoder(vocab: int):
    """T5-v1.1-XXL encoder (vocab 32128; SD3, FLUX) or UMT5-XXL encoder (vocab 256384; Wan)."""
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(
        vocab_size=vocab, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, feed_forward_proj="gated-gelu"
    )
    return T5EncoderModel(cfg)


def image_vae():
    """The 16-channel AutoencoderKL of SD3 and FLUX (4 levels 128/256/512/512, 2 resnets per level)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=16,
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=2,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def wan_vae():
    """AutoencoderKLWan with diffusers' defaults, which are Wan2.1's VAE (base 96, z 16, mult 1/2/4/4)."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan()


def params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def lora_params(module: nn.Module, targets: tuple[str, ...], rank: int) -> int:
    """R (in + out) summed over the Linear layers whose name ends with a target (peft's matching)."""
    total = 0
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            total += rank * (sub.in_features + sub.out_features)
    return total


@dataclass
class Pass:
    """One denoiser evaluation for one sample."""

    forward_tflop: float
    backward_tflop: float  # input gradients only (frozen base weights, as under LoRA)
    saved_gb: float  # activations autograd keeps for the backward pass (no S x S attention matrices)
    blocks: int
    block_input_gb: float  # one block's input (what per-block checkpointing keeps)

    @property
    def checkpointed_gb(self) -> float:
        """Per-block checkpointing: every block input plus one block's activations at a time."""
        return self.blocks * self.block_input_gb + self.saved_gb / self.blocks


def measure(model: nn.Module, inputs: dict, seq_lens: set[int], blocks: int, block_input_numel: int) -> Pass:
    """FLOPs and saved-activation bytes of one forward + backward on the meta device (bf16)."""
    model.requires_grad_(False)
    weights = {p.untyped_storage()._cdata for p in model.parameters()}  # kept anyway; not activations
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 2 and t.shape[-1] == t.shape[-2] and t.shape[-1] in seq_lens:
            return t  # attention probabilities: not stored by flash / efficient SDPA
        if t.untyped_storage()._cdata in weights:
            return t
        saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FlopCounterMode(display=False) as fwd:
        out = model(**inputs, return_dict=False)[0]
    with FlopCounterMode(display=False) as bwd:
        out.float().square().mean().backward()
    return Pass(
        fwd.get_total_flops() / 1e12,
        bwd.get_total_flops() / 1e12,
        sum(saved.values()) / GB,
        blocks,
        block_input_numel * 2 / GB,
    )


def decode_tflop(vae: nn.Module, latents: torch.Tensor) -> float:
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        vae.decode(latents, return_dict=False)
    return fc.get_total_flops() / 1e12


def _bf16(*shape: int, grad: bool = False) -> torch.Tensor:
    with torch.device("meta"):
        return torch.randn(*shape, dtype=torch.bfloat16, requires_grad=grad)


def sd3_inputs(side: int = 64) -> dict:
    """One SD3 sample on meta: a (16, side, side) latent (side x 8 px) -> (side/2)^2 image + 333 text tokens."""
    return dict(
        hidden_states=_bf16(1, 16, side, side, grad=True),
        encoder_hidden_states=_bf16(1, 333, 4096),
        pooled_projections=_bf16(1, 2048),
        timestep=_meta(lambda: torch.tensor([500.0])),
    )


def flux_inputs(side: int = 64) -> dict:
    """One FLUX sample on meta: a (16, side, side) latent packed 2x2 -> (side/2)^2 tokens of 64 + 512 T5 tokens."""
    tokens = (side // 2) ** 2
    return dict(
        hidden_states=_bf16(1, tokens, 64, grad=True),
        encoder_hidden_states=_bf16(1, 512, 4096),
        pooled_projections=_bf16(1, 768),
        timestep=_meta(lambda: torch.tensor([0.5])),
        guidance=_meta(lambda: torch.tensor([3.5])),
        img_ids=_meta(lambda: torch.zeros(tokens, 3)),
        txt_ids=_meta(lambda: torch.zeros(512, 3)),
    )


def sd3_medium_pass(model: nn.Module, side: int = 64) -> Pass:
    """SD3.5-M (24 blocks, hidden 1536) at side x 8 px; the image-only sequence is the dual-attention one."""
    n = (side // 2) ** 2
    return measure(model, sd3_inputs(side), {n + 333, n}, 24, (n + 333) * 1536)


def flux_dev_pass(model: nn.Module, side: int = 64) -> Pass:
    """FLUX.1-dev (19 + 38 blocks, hidden 3072) at side x 8 px."""
    n = (side // 2) ** 2
    return measure(model, flux_inputs(side), {n + 512}, 57, (n + 512) * 3072)


def main(argv: list[str] | None = None) -> None:
    """Print the tables of docs/gpu-plan.md (parameters, FLOPs, memory per model)."""
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)  # --help; no options
    from flowrl.models.flux import flux_lora_targets
    from flowrl.models.sd3 import SD3_LORA_TARGETS
    from flowrl.models.wan import WAN_LORA_TARGETS

    ts = _meta(lambda: torch.tensor([500.0]))
    rows = []
    # SD3.5-M at 512^2: 64x64x16 latent -> 32x32 = 1024 image tokens; text 77 (CLIP) + 256 (T5) = 333 tokens
    sd3 = _meta(sd3_transformer).to(torch.bfloat16)
    sd3_pass = sd3_medium_pass(sd3)
    rows.append(("SD3.5-M", sd3, sd3_pass, lora_params(sd3, SD3_LORA_TARGETS, 32), "r32 attention"))
    # FLUX.1-dev at 512^2: 64x64x16 latent packed 2x2 -> 1024 tokens of 64 channels; T5 512 tokens
    flux = _meta(flux_transformer).to(torch.bfloat16)
    flux_pass = flux_dev_pass(flux)
    rows.append(("FLUX.1-dev", flux, flux_pass, lora_params(flux, flux_lora_targets(38), 64), "r64 attention + MLP"))
    # Wan2.1-1.3B, 33 frames at 320^2: latent 16 x 9 x 40 x 40 -> 9 x 20 x 20 = 3600 tokens; UMT5 512 tokens
    wan = _meta(wan_transformer).to(torch.bfloat16)
    wan_pass = measure(
        wan,
        dict(hidden_states=_bf16(1, 16, 9, 40, 40, grad=True), encoder_hidden_states=_bf16(1, 512, 4096), timestep=ts),
        {3600},
        30,
        3600 * 1536,
    )
    rows.append(("Wan2.1-1.3B", wan, wan_pass, lora_params(wan, WAN_LORA_TARGETS, 32), "r32 attention"))

    print("## Components (parameters counted on the meta device from the published configs)\n")
    print("| component | parameters | bf16 GB | fp32 GB |\n|---|---:|---:|---:|")
    parts = [
        ("SD3.5-M transformer", sd3),
        ("SD3.5-L transformer", _meta(lambda: sd3_transformer(large=True))),
        ("FLUX.1-dev transformer", flux),
        ("Wan2.1-1.3B transformer", wan),
        ("CLIP ViT-L/14 text (with projection)", _meta(lambda: clip_text(768, 12, 12, 3072, True))),
        ("OpenCLIP bigG/14 text (with projection)", _meta(lambda: clip_text(1280, 32, 20, 5120, True))),
        ("T5-v1.1-XXL encoder", _meta(lambda: t5_encoder(32128))),
        ("UMT5-XXL encoder", _meta(lambda: t5_encoder(256384))),
        ("AutoencoderKL 16-ch (SD3, FLUX)", _meta(image_vae)),
        ("AutoencoderKLWan (Wan2.1)", _meta(wan_vae)),
    ]
    for name, module in parts:
        n = params(module)
        print(f"| {name} | {n / 1e6:,.0f} M | {2 * n / GB:.2f} | {4 * n / GB:.2f} |")

    # SD3.5-L at 512^2 (1024 + 333 tokens) and 1024^2 (4096 + 333 tokens), for its own configs
    sd3l = _meta(lambda: sd3_transformer(large=True)).to(torch.bfloat16)
    for side in (64, 128):
        n = (side // 2) ** 2
        lp = measure(
            sd3l,
            dict(
                hidden_states=_bf16(1, 16, side, side, grad=True),
                encoder_hidden_states=_bf16(1, 333, 4096),
                pooled_projections=_bf16(1, 2048),
                timestep=ts,
            ),
            {n + 333},
            38,
            (n + 333) * 2432,
        )
        rows.append((f"SD3.5-L {side * 8}²", sd3l, lp, lora_params(sd3l, SD3_LORA_TARGETS, 32), "r32 attention"))

    print("\n## One denoiser pass per sample (training geometry), bf16, flash-style attention\n")
    print(
        "| model | tokens | forward TFLOP | backward TFLOP (frozen base) | saved activations GB "
        "| with per-block checkpointing GB | LoRA params | LoRA + grad + AdamW GB |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    tokens = {
        "SD3.5-M": "1024 img + 333 txt",
        "FLUX.1-dev": "1024 img + 512 txt",
        "Wan2.1-1.3B": "3600 video + 512 txt (cross)",
        "SD3.5-L 512²": "1024 img + 333 txt",
        "SD3.5-L 1024²": "4096 img + 333 txt",
    }
    for name, _, p, lora, kind in rows:
        print(
            f"| {name} | {tokens[name]} | {p.forward_tflop:.2f} | {p.backward_tflop:.2f} | {p.saved_gb:.2f} | "
            f"{p.checkpointed_gb:.2f} | "
            f"{lora / 1e6:.1f} M ({kind}) | {16 * lora / GB:.2f} |"
        )

    vae_img = _meta(image_vae).to(torch.bfloat16)
    dec_img = decode_tflop(vae_img, _bf16(1, 16, 64, 64))
    try:
        dec_wan = decode_tflop(_meta(wan_vae).to(torch.bfloat16), _bf16(1, 16, 9, 40, 40))
    except Exception as err:  # noqa: BLE001 - report, do not hide
        dec_wan = math.nan
        print(f"\n(Wan VAE decode could not be counted on meta: {type(err).__name__}: {err})")
    print(f"\nVAE decode per sample: SD3/FLUX 512^2 {dec_img:.2f} TFLOP; Wan 33 x 320^2 {dec_wan:.2f} TFLOP")
    passes = {
        "sd3.5m": (sd3_pass, dec_img, rows[0][3]),
        "flux1dev": (flux_pass, dec_img, rows[1][3]),
        "wan2.1-1.3b": (wan_pass, dec_wan, rows[2][3]),
    }
    iteration_table(passes)
    fit_table(passes)


# resident weights in bf16 (GB, from the component table): denoiser + text encoders + VAE
WEIGHTS_GB = {
    "sd3.5m": (4.49, 0.25 + 1.39 + 9.52, 0.17),
    "flux1dev": (23.80, 0.25 + 9.52, 0.17),
    "wan2.1-1.3b": (2.84, 11.36, 0.25),
}
REWARD_GB = 2.0  # PickScore (CLIP-H, ~0.99 B parameters) in bf16 on the same GPU
OVERHEAD_GB = 2.5  # CUDA context, allocator fragmentation, cuBLAS workspaces (estimate)
DECODE_PEAK_GB = {"sd3.5m": 1.0, "flux1dev": 1.0, "wan2.1-1.3b": 4.0}  # one sample's VAE decode (sliced), estimate


def train_passes(objective: dict, num_steps: int, ckpt: bool) -> tuple[int, float]:
    """(trained (sample, step) pairs per sample, forward-equivalents per pair besides fwd + bwd)."""
    extra = 1.0 if ckpt else 0.0  # checkpointing recomputes the forward once
    if objective["name"] == "flow_grpo":
        return num_steps - 1, extra + (1.0 if objective["kl_beta"] > 0 else 0.0)
    if objective["name"] == "diffusion_nft":
        return max(1, int(num_steps * objective["train_fraction"])), extra + 1.0 + (
            1.0 if objective["kl_beta"] > 0 else 0.0
        )
    return objective["num_timesteps"], extra + (1.0 if objective["kl_beta"] > 0 else 0.0) + (
        1.0 if objective["ema_beta"] > 0 else 0.0
    )


def iteration_table(passes: dict) -> None:
    """Per-iteration FLOPs of each shipped config stacked on its 80 GB preset."""
    from flowrl.config import load_config

    print(
        f"\n## One iteration of each config (+ its gpu80 preset); seconds at {EFFECTIVE_TFLOPS:.0f} TFLOP/s sustained\n"
    )
    print(
        "| config | samples | CFG x | rollout TFLOP | decode TFLOP | train TFLOP | total s (estimate) |\n"
        "|---|---:|---:|---:|---:|---:|---:|"
    )
    for model, (p, dec, _) in passes.items():
        for algo in ("grpo", "nft", "awm"):
            cfg = load_config([f"configs/{algo}/{model}_pickscore.yaml", f"configs/presets/{model}/gpu80.yaml"])
            n = cfg.prompts.per_iteration * cfg.prompts.group_size
            g = 2 if cfg.sampler.guidance_scale != 1.0 else 1
            rollout = n * cfg.sampler.num_steps * g * p.forward_tflop
            pairs, extra = train_passes(cfg.objective, cfg.sampler.num_steps, cfg.memory.gradient_checkpointing)
            train = n * pairs * g * (p.forward_tflop * (1 + extra) + p.backward_tflop)
            total = rollout + n * dec + train
            print(
                f"| {algo}/{model} | {n} | {g} | {rollout:,.0f} | {n * dec:,.0f} | {train:,.0f} "
                f"| {total / EFFECTIVE_TFLOPS:,.0f} |"
            )


def fit_table(passes: dict) -> None:
    """Peak GPU memory of each preset with the Flow-GRPO config (estimate)."""
    from flowrl.config import load_config

    print(
        "\n## Presets: estimated peak GB "
        "(Flow-GRPO config; NFT/AWM add 2 or 1 frozen LoRA copies, < 1 GB except FLUX)\n"
    )
    print(
        "| preset | weights resident | LoRA + AdamW | train activations | reward + decode + overhead | total | fits |\n"
        "|---|---:|---:|---:|---:|---:|---|"
    )
    for model, (p, _, lora) in passes.items():
        for gb in (24, 48, 80):
            preset = f"configs/presets/{model}/gpu{gb}.yaml"
            try:
                cfg = load_config([f"configs/grpo/{model}_pickscore.yaml", preset])
            except ValueError:
                denoiser, enc, vae = WEIGHTS_GB[model]
                print(
                    f"| {model} gpu{gb} (no preset) | {denoiser + vae:.1f} (encoders off) | — | — | — | > {gb} | no |"
                )
                continue
            denoiser, enc, vae = WEIGHTS_GB[model]
            m = cfg.memory
            weights = denoiser + vae + (0.0 if m.offload_encoders or m.free_encoders_when_cached else enc)
            g = 2 if cfg.sampler.guidance_scale != 1.0 else 1
            act = cfg.sampler.chunk_size * g * (p.checkpointed_gb if m.gradient_checkpointing else p.saved_gb)
            other = REWARD_GB + DECODE_PEAK_GB[model] + OVERHEAD_GB
            total = weights + 16 * lora / GB + act + other
            print(
                f"| {model} gpu{gb} | {weights:.1f} | {16 * lora / GB:.2f} | {act:.1f} | {other:.1f} | {total:.1f} "
                f"| {'yes' if total <= gb else 'NO'} |"
            )


if __name__ == "__main__":
    main()
