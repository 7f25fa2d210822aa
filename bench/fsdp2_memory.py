"""FSDP2 on one process: peak memory and time of a full-size LoRA training step, sharded against unsharded.

Issue 12's GPU target: "FSDP2 with one process runs the full-size SD3.5-M and FLUX.1-dev training
step (random weights), with the memory peak reported against the unsharded run". Each transformer is
built as ``bench.gpu_measure`` builds it (published config, random bf16 weights on the GPU, the shipped
LoRA through ``flowrl.policy.lora.add_lora``). One training step is what ``Trainer.update`` does per
micro-batch: forward under bf16 autocast and ``trainable_attention``, backward of a squared-velocity
loss into the fp32 LoRA, AdamW step. It runs first on the plain model, then on the same model after
flowrl's own :func:`flowrl.sharding.shard_transformer` (every block, then the transformer, through
``fully_shard``) over a one-process group: gloo on the CPU, NCCL on a GPU, joined by accelerate's
``Accelerator`` as ``accelerate launch`` would join it.

``--via mesh`` shards on a device mesh of the group (flowrl's path for gloo launches); ``--via
accelerate`` gives the ``Accelerator`` the FSDP2 plugin of ``configs/accelerate/fsdp2.yaml``, so
accelerate's ``fsdp2_prepare_model`` shards, as on a GPU launch with that config (CUDA only). With
one process FSDP2 shards nothing away: the table shows what its all-gather and reduce-scatter
buffers and DTensor bookkeeping cost over the unsharded step, the floor that W ranks divide the
weights above.

Printed per model, batch and run: parameters held by this rank, resident GiB after building /
sharding, the step's median milliseconds (after one warm-up step that also creates the AdamW
state), its peak GiB (``torch.cuda.max_memory_allocated``) and the peak over the unsharded one.

Usage::

    python -m bench.fsdp2_memory [--models SD3.5-M FLUX.1-dev] [--batch 1 4] [--checkpointing] [--via mesh]
    python -m bench.fsdp2_memory --tiny     # CPU, gloo: a tiny SD3 transformer (no memory figures)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import yaml

from flowrl.distributed import Collective, exit_launched_process
from flowrl.local_launch import free_port
from flowrl.policy.memory import trainable_attention
from flowrl.sharding import local_numel, shard_transformer

GIB = 1024**3
ROOT = Path(__file__).resolve().parents[1]


def join_one_process(device: str, via: str) -> Collective:
    """A one-process group (gloo on the CPU, NCCL on CUDA) joined through ``accelerate.Accelerator``.

    The launcher's variables are set as ``accelerate launch`` / ``torchrun`` set them for rank 0 of 1.
    """
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    from accelerate import Accelerator

    if via == "mesh":
        return Collective(Accelerator(cpu=device == "cpu"))
    from accelerate import FullyShardedDataParallelPlugin

    fsdp = yaml.safe_load((ROOT / "configs/accelerate/fsdp2.yaml").read_text())["fsdp_config"]
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=fsdp["fsdp_transformer_layer_cls_to_wrap"].split(","),
        reshard_after_forward=fsdp["fsdp_reshard_after_forward"],
        cpu_ram_efficient_loading=fsdp["fsdp_cpu_ram_efficient_loading"],
    )
    return Collective(Accelerator(fsdp_plugin=plugin))


def tiny_model() -> tuple[Callable[[], torch.nn.Module], Callable[[int], dict]]:
    """A tiny SD3 transformer of the test suite (2 blocks, 16 x 16 latents, LoRA r4) and its inputs, on the CPU."""
    from flowrl.models.sd3 import SD3_LORA_TARGETS
    from flowrl.policy.lora import add_lora

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import tiny_sd3_pipeline

    def build() -> torch.nn.Module:
        pipe = tiny_sd3_pipeline(0, size=16, num_layers=2, attention_head_dim=16, caption_projection_dim=32)
        add_lora(pipe.transformer, rank=4, alpha=4, targets=SD3_LORA_TARGETS)
        return pipe.transformer

    def inputs(b: int) -> dict:
        gen = torch.Generator().manual_seed(0)
        return dict(
            hidden_states=torch.randn(b, 4, 16, 16, generator=gen),
            encoder_hidden_states=torch.randn(b, 6, 32, generator=gen),
            pooled_projections=torch.randn(b, 32, generator=gen),
            timestep=torch.full((b,), 500.0),
        )

    return build, inputs


def full_model(name: str) -> tuple[Callable[[], torch.nn.Module], Callable[[int], dict]]:
    """``bench.gpu_measure``'s builder (random bf16 weights on CUDA + the shipped LoRA) and its 512² inputs."""
    from bench.gpu_measure import _build, _models

    builder, inputs, targets, rank = _models()[name]
    return (lambda: _build(builder, targets, rank)), inputs


def train_step(model: torch.nn.Module, x: dict, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """One micro-batch as ``Trainer.update`` runs it: autocast forward, backward into the LoRA, AdamW step."""
    with trainable_attention():  # around forward and backward: a checkpointed block recomputes alike
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(**x, return_dict=False)[0]
        out.float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def allocated(device: torch.device) -> float | None:
    return torch.cuda.memory_allocated() / GIB if device.type == "cuda" else None


def timed_peak(fn: Callable[[], None], device: torch.device, repeats: int) -> tuple[float, float | None]:
    """(median seconds of ``repeats`` calls after one warm-up, peak GiB over them; None on the CPU)."""
    cuda = device.type == "cuda"
    fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), (torch.cuda.max_memory_allocated() / GIB if cuda else None)


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def measure(
    name: str,
    build: Callable[[], torch.nn.Module],
    inputs: Callable[[int], dict],
    batch: int,
    checkpointing: bool,
    collective: Collective,
    repeats: int,
) -> list[str]:
    """Rows "unsharded" and "FSDP2 (1 process)" of one model and batch: the same model, sharded in between."""
    device = torch.device(collective.accelerator.device)
    model = build()
    if checkpointing:
        model.enable_gradient_checkpointing()
    x = inputs(batch)
    rows, base_peak = [], None
    for run in ("unsharded", "FSDP2 (1 process)"):
        if run != "unsharded":
            params = optimizer = None  # drop the unsharded parameters' references before fully_shard replaces them
            model.zero_grad(set_to_none=True)
            params = shard_transformer(model, collective)
        else:
            params = [p for p in model.parameters() if p.requires_grad]
        resident = allocated(device)
        optimizer = torch.optim.AdamW(params, lr=1e-5)
        held, full = local_numel(model)
        label = f"{run}, checkpointing" if checkpointing else run
        try:
            seconds, peak = timed_peak(lambda: train_step(model, x, optimizer, device), device, repeats)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as err:  # cuBLAS reports some OOMs as internal errors
            why = "out of memory" if isinstance(err, torch.cuda.OutOfMemoryError) else str(err).splitlines()[0][:80]
            rows.append(f"| {name} | {batch} | {label} | {held:,} of {full:,} | {gib(resident)} | {why} | | |")
            break
        base_peak = peak if run == "unsharded" else base_peak
        versus = "-" if peak is None or base_peak is None else f"{peak - base_peak:+.2f} ({peak / base_peak:.3f}x)"
        rows.append(
            f"| {name} | {batch} | {label} | {held:,} of {full:,} | {gib(resident)} | {seconds * 1e3:,.1f} "
            f"| {gib(peak)} | {versus} |"
        )
    model = params = optimizer = None  # free before the next model is built
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


HEADER = (
    "| model | batch | run | parameters held | resident GiB | step ms | peak GiB | peak vs unsharded |\n"
    "|---|---:|---|---:|---:|---:|---:|---:|"
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["SD3.5-M", "FLUX.1-dev"], choices=["SD3.5-M", "FLUX.1-dev"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--checkpointing", action="store_true", help="per-block gradient checkpointing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--via", default="mesh", choices=["mesh", "accelerate"], help="who calls fully_shard")
    parser.add_argument("--tiny", action="store_true", help="a tiny SD3 transformer on the CPU (gloo)")
    args = parser.parse_args(argv)
    if args.tiny and args.via != "mesh":
        raise SystemExit("--via accelerate needs CUDA (accelerate's FSDP plugin); use --via mesh with --tiny")
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("bench.fsdp2_memory needs a CUDA GPU for the full-size models; --tiny runs on the CPU")
    collective = join_one_process("cpu" if args.tiny else "cuda", args.via)
    where = "cpu (gloo)" if args.tiny else f"{torch.cuda.get_device_name()} (NCCL)"
    print(
        f"# {where}, torch {torch.__version__}, one process, sharded via {args.via}, random weights, LoRA as shipped, "
        f"median of {args.repeats} steps after one warm-up"
    )
    print(HEADER)
    models = {"tiny SD3": tiny_model()} if args.tiny else {name: full_model(name) for name in args.models}
    for name, (build, inputs) in models.items():
        for batch in args.batch:
            for row in measure(name, build, inputs, batch, args.checkpointing, collective, args.repeats):
                print(row, flush=True)
    collective.close()


if __name__ == "__main__":
    main()
    exit_launched_process(0)  # its gloo / NCCL threads may outlive the group (flowrl.distributed)
