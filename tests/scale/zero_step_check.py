"""Run under ``accelerate launch`` (2 gloo processes): ZeroEngine undoes a bad step exactly.

Used by tests/scale/test_deepspeed.py. A small module (frozen first layer, trained second layer)
takes one good step, then a step whose new weights fail the weight check and one whose gradient
is not finite: both must leave the weights, the fp32 masters and the AdamW moments as they were,
and the next good step must equal the one a run without the bad steps takes.
"""

from __future__ import annotations

import sys

import torch
from accelerate import Accelerator
from torch import nn

from flowrl.distributed import Collective, exit_launched_process
from flowrl.zero import ZeroEngine, gathered


def build(stage: int, collective: Collective) -> tuple[nn.Module, ZeroEngine]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model[0].requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, ZeroEngine.start(model, torch.optim.AdamW(params, lr=1e-2), stage, 1.0, collective)


def step(model: nn.Module, zero: ZeroEngine, seed: int, max_weight: float = 1e3, scale: float = 1.0):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed + zero.collective.rank))
    zero.backward(model(x).pow(2).mean() * scale / zero.collective.world_size)
    return zero.step(max_weight)


def snapshot(model: nn.Module, zero: ZeroEngine) -> list[torch.Tensor]:
    with gathered(list(model.parameters())):
        weights = [p.detach().clone() for p in model.parameters()]
    moments = [t for s in zero.optimizer_state()["state"].values() for t in s.values()]
    masters = [p.detach().clone() for p in zero._masters()]
    return weights + moments + masters


def main() -> None:
    stage = int(sys.argv[1])
    collective = Collective(Accelerator())
    model, zero = build(stage, collective)
    _, fault = step(model, zero, 1)
    assert fault is None, fault
    before = snapshot(model, zero)
    _, fault = step(model, zero, 2, max_weight=1e-3)
    assert fault is not None and "train.max_lora_weight" in fault, fault
    _, fault = step(model, zero, 2, scale=float("nan"))
    assert fault is not None and "gradient norm" in fault, fault
    after = snapshot(model, zero)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a bad step was not undone"
    step(model, zero, 3)
    clean_model, clean = build(stage, collective)
    step(clean_model, clean, 1)
    step(clean_model, clean, 3)
    assert all(torch.equal(a, b) for a, b in zip(snapshot(model, zero), snapshot(clean_model, clean)))
    if collective.is_main:
        print(f"zero{stage}: bad steps undone")
    collective.close()


if __name__ == "__main__":
    main()
    exit_launched_process(0)  # as flowrl's command line: gloo threads may outlive the process group
