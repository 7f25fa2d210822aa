"""bench.solrl_projection's arithmetic, checked by hand on one case, and its counting on a small module."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from bench.solrl_projection import (
    H100,
    PassFlops,
    Workload,
    explore_copy_bytes,
    explore_forward_speedup,
    load,
    low_mfu_needed,
    paper_learning_gain,
    project,
    quantised_layers,
    quantised_share,
    single_stage_tflop,
    stage_tflop,
    throughput,
    workload,
)
from flowrl.policy.precision import QuantRule

W = Workload(
    candidates=96, kept=24, explore_steps=6, steps=10, pairs=9, train_forwards=3.0, guidance=1, min_features=1000
)
F = PassFlops(forward=2.0, backward=3.0, quantised=0.75, decode=0.5)


def test_workloads_are_read_from_the_shipped_configs():
    assert workload(load("sd3.5m", 64)) == W  # 9 of 10 trained, trained + old + KL forwards, no checkpointing
    flux = workload(load("flux1dev", 64))
    assert (flux.pairs, flux.train_forwards) == (4, 4.0)  # train_fraction 0.4; gpu80 checkpoints: + 1 recompute


def test_stage_flops_by_hand():
    assert stage_tflop(W, F) == {
        "explore": 96 * 6 * 2.0,  # N x explore steps x forward
        "explore_decode": 96 * 0.5,
        "regenerate": 24 * 10 * 2.0,  # K x steps x forward
        "regenerate_decode": 24 * 0.5,
        "train": 24 * 9 * (3 * 2.0 + 3.0),  # K x pairs x (3 forwards + backward)
    }
    assert stage_tflop(W, F, explore_steps=2)["explore"] == 96 * 2 * 2.0
    assert single_stage_tflop(W, F, 96) == {"rollout": 96 * 10 * 2.0, "decode": 48.0, "train": 1944.0}


def test_seconds_by_hand_on_an_h100_with_fp8_explore():
    tp = throughput(H100, "sd3.5m", "fp8", 0.5)
    mfu = 183.0 / 989.0  # the measured bf16 rollout MFU of SD3.5-M
    assert (tp.rollout, tp.train, tp.explore) == pytest.approx((183.0, 168.0, 1979.0 * mfu * 0.5))
    p = project(W, F, tp)
    explore = 1152.0 * (0.25 / 183.0 + 0.75 / (1979.0 * mfu * 0.5))  # attention etc. stays bf16
    assert p.solrl["explore"] == pytest.approx(explore)
    assert p.total == pytest.approx(explore + 48 / 183 + (480 + 12) / 183 + 1944 / 168)
    assert p.same_k == pytest.approx((480 + 12) / 183 + 1944 / 168)
    assert p.all_n == pytest.approx((1920 + 48) / 183 + 1944 / 168)
    assert throughput(H100, "sd3.5m", "bf16", 0.5).explore == pytest.approx(183.0)  # bf16 takes no MFU cut


def test_paper_learning_gain():
    ratio, gain = paper_learning_gain()
    assert ratio == pytest.approx((451 / 4 + 240) / (184 + 240))
    assert gain == pytest.approx(4.64 * (184 + 240) / (451 / 4 + 240))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.x_embedder = nn.Linear(32, 2048)  # skipped by name
        self.body = nn.Linear(2048, 1024)  # quantised
        self.head = nn.Linear(1024, 16)  # max(in, out) <= min_features
        self.odd = nn.Linear(16, 2002)  # selected by the rule, but 2002 is not a multiple of 16

    def forward(self, hidden_states):
        return self.odd(self.head(self.body(self.x_embedder(hidden_states))))


def test_quantised_share_and_copy_bytes_by_hand():
    model, rule = Tiny(), QuantRule(min_features=2000)
    assert list(quantised_layers(model, rule)) == ["body"]
    per_token = {"x_embedder": 32 * 2048, "body": 2048 * 1024, "head": 1024 * 16, "odd": 16 * 2002}
    share = quantised_share(model, {"hidden_states": torch.zeros(2, 5, 32)}, rule)
    assert share == pytest.approx(per_token["body"] / sum(per_token.values()))
    n = sum(p.numel() for p in model.parameters())
    rest = 2 * (n - 2048 * 1024)  # everything else in bf16
    assert explore_copy_bytes(model, rule, "bf16") == 2 * n
    assert explore_copy_bytes(model, rule, "fp8") == 2048 * 1024 + 4 + rest
    assert explore_copy_bytes(model, rule, "fp4") == 2048 * 1024 / 2 + 1024 * 2048 / 16 + 4 + rest
    with pytest.raises(ValueError, match="unknown explore format 'int4'"):
        explore_copy_bytes(model, rule, "int4")


def test_explore_forward_speedup_and_the_mfu_it_needs():
    # 80 % of the forward at twice the bf16 rate, the rest at bf16: 1 / (0.2 + 0.8 / 2) = 1.667x
    assert explore_forward_speedup(0.8, 2.0, 1.0) == pytest.approx(1 / 0.6)
    assert explore_forward_speedup(0.8, 2.0, 0.5) == pytest.approx(1.0)
    f = low_mfu_needed(0.8, 2.0, 1.5)
    assert explore_forward_speedup(0.8, 2.0, f) == pytest.approx(1.5)
    assert low_mfu_needed(0.8, 4.0, 6.0) == math.inf  # above the 1 / 0.2 = 5x ceiling
