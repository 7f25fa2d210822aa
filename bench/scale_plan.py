"""Scale-out on paper: placement, sharding and communication per iteration at 8, 32 and 64 GPUs.

Inputs are the figures of docs/gpu-plan.md (``python -m bench.gpu_plan``: parameters, LoRA
sizes, TFLOP per sample) and the shipped Flow-GRPO configs with their 80 GB presets (steps,
chunk, true CFG, KL). The workload grows with the GPUs: one prompt group per GPU per iteration
(24 samples for SD3.5-M and FLUX.1-dev, 8 clips for Wan), so 32 GPUs run 32 x 24 = 768 samples
(Flow-GRPO's reference runs 48 x 24 = 1,152 on 32 GPUs), and placement is group-contiguous (no
reward gather for group statistics).

Communication per GPU per iteration, ring collectives (each rank sends and receives
``(W - 1) / W`` of the buffer for an all-gather or reduce-scatter, twice that for an all-reduce):

- DDP: the LoRA gradients (fp32) are all-reduced once per optimizer step.
- FSDP2 over ``S`` GPUs: every forward call all-gathers the bf16 base (``(S - 1) / S`` of it);
  with ``reshard_after_forward`` the backward gathers it again; LoRA gradients are
  reduce-scattered. Rollouts call the model ``T x chunks`` times, so the base is gathered that
  often: the cost that makes cross-node FSDP a bad idea for rollouts.
- HSDP (shard inside a node of 8, replicate across nodes): the weight gathers stay on NVLink and
  only the LoRA gradients cross nodes.

Link speeds (assumptions, stated in the output): NVLink 4 on H100 SXM, ~370 GB/s per direction
achieved of 450 GB/s; one 400 Gb/s NDR InfiniBand NIC per GPU, ~45 GB/s achieved of 50 GB/s.
Compute at 400 TFLOP/s sustained per GPU, as in docs/gpu-plan.md.

Run: ``python -m bench.scale_plan`` (instant; pure arithmetic).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GB = 1e9
NVLINK_GBPS = 370.0
IB_GBPS = 45.0
TFLOPS = 400.0
NODE = 8


@dataclass(frozen=True)
class Model:
    """One model's figures (docs/gpu-plan.md) and its Flow-GRPO config on the 80 GB preset."""

    name: str
    base_params_m: float  # transformer parameters, millions (bf16 on the GPU)
    lora_params_m: float  # trainable LoRA parameters, millions (fp32)
    fwd_tflop: float  # one sample's forward, TFLOP
    bwd_tflop: float  # its backward with the base frozen
    decode_tflop: float
    group: int  # samples per prompt = samples per GPU per iteration
    steps: int
    chunk: int
    cfg: int  # 2 with true CFG (both branches in one call)
    kl: bool
    checkpointing: bool
    resident_gb: float  # weights resident per GPU unsharded (transformer + encoders + VAE), GB


MODELS = (
    Model("SD3.5-M", 2243, 23.9, 2.44, 2.79, 2.51, 24, 10, 8, 2, True, False, 15.8),
    Model("FLUX.1-dev", 11901, 261.5, 21.50, 23.11, 2.51, 24, 6, 8, 1, False, True, 33.7),
    Model("Wan2.1-1.3B", 1419, 23.6, 11.89, 14.12, 28.81, 8, 20, 8, 2, True, True, 14.4),
)


def forward_calls(m: Model) -> tuple[int, int]:
    """(rollout calls, training forward calls) per GPU per iteration; training also runs one backward per step."""
    chunks = -(-m.group // m.chunk)
    rollout = chunks * m.steps
    train_fwd = chunks * (m.steps - 1) * (1 + int(m.checkpointing) + int(m.kl))
    return rollout, train_fwd


def compute_s(m: Model) -> float:
    """Seconds of compute per GPU per iteration (rollout + decode + Flow-GRPO training)."""
    n = m.group
    rollout = n * m.steps * m.cfg * m.fwd_tflop
    train = n * (m.steps - 1) * m.cfg * ((1 + int(m.checkpointing) + int(m.kl)) * m.fwd_tflop + m.bwd_tflop)
    return (rollout + n * m.decode_tflop + train) / TFLOPS


def ddp_bytes(m: Model, world: int, steps: int = 2) -> float:
    """LoRA gradient all-reduce, ``steps`` optimizer steps per iteration (the reference does 2)."""
    return steps * 2 * (world - 1) / world * m.lora_params_m * 1e6 * 4


def fsdp_gather_bytes(m: Model, shard: int) -> float:
    """Base all-gathers per iteration when sharded over ``shard`` GPUs (rollout + train forward + backward)."""
    rollout, train_fwd = forward_calls(m)
    backward = -(-m.group // m.chunk) * (m.steps - 1)
    return (rollout + train_fwd + backward) * (shard - 1) / shard * m.base_params_m * 1e6 * 2


def plan_rows() -> list[tuple[str, ...]]:
    """One row per model, GPU count and strategy."""
    rows = []
    for m in MODELS:
        for world in (8, 32, 64):
            nodes = world // NODE
            comp = compute_s(m)
            for strategy in ("DDP", "FSDP2 (all GPUs)", "HSDP (8 per node)"):
                if strategy == "DDP":
                    intra, inter = (ddp_bytes(m, world), 0.0) if nodes == 1 else (0.0, ddp_bytes(m, world))
                elif strategy.startswith("FSDP2"):
                    gather = fsdp_gather_bytes(m, world)
                    grads = (world - 1) / world * m.lora_params_m * 1e6 * 4 * 2
                    intra, inter = (gather + grads, 0.0) if nodes == 1 else (0.0, gather + grads)
                else:
                    intra = fsdp_gather_bytes(m, NODE)
                    inter = 0.0 if nodes == 1 else ddp_bytes(m, nodes)
                comm = intra / (NVLINK_GBPS * GB) + inter / (IB_GBPS * GB)
                transformer = m.base_params_m * 2 / 1000  # GB of bf16; encoders and VAE stay replicated
                shard = 1 if strategy == "DDP" else world if "all" in strategy else NODE
                weights = m.resident_gb - transformer + transformer / shard
                rows.append(
                    (
                        m.name,
                        str(world),
                        str(world * m.group),
                        strategy,
                        f"{weights:.1f}",
                        f"{intra / GB:.1f}",
                        f"{inter / GB:.2f}",
                        f"{comp:.1f}",
                        f"{comm:.2f}",
                        f"{comm / comp * 100:.0f} %",
                    )
                )
    return rows


def main(argv: list[str] | None = None) -> None:
    """Print the table of docs/gpu-plan.md's multi-node section."""
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)  # --help; no options
    header = (
        "model",
        "GPUs",
        "samples/iter",
        "strategy",
        "weights GB/GPU",
        "NVLink GB/GPU",
        "IB GB/GPU",
        "compute s",
        "comm s",
        "comm/compute",
    )
    print(f"assumptions: {TFLOPS:g} TFLOP/s per GPU, NVLink {NVLINK_GBPS:g} GB/s, IB {IB_GBPS:g} GB/s per GPU")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in plan_rows():
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
