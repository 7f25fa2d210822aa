"""bench/flop_floor.py: FLOPs of a call, int8 dynamic Linear included, and the denoiser's share."""

from __future__ import annotations

import warnings

import torch

from bench.flop_floor import count_flops


def _int8(linear: torch.nn.Linear) -> torch.nn.Module:
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import default_dynamic_qconfig

    linear.qconfig = default_dynamic_qconfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DynamicLinear.from_float(linear)


def test_a_linear_counts_two_m_k_n_in_fp32_and_in_int8():
    linear = torch.nn.Linear(24, 40)
    x = torch.randn(3, 7, 24)
    expected = 2 * 3 * 7 * 24 * 40
    for module in (linear, _int8(linear)):
        with torch.no_grad():
            out, total, model = count_flops(lambda m=module: m(x), denoiser="Linear")
        assert out.shape == (3, 7, 40) and total == expected and model == expected


def test_only_the_named_module_counts_as_the_denoiser():
    class SD3Transformer2DModel(torch.nn.Module):  # the name count_flops attributes to the denoiser
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 16)

        def forward(self, x):
            return self.proj(x)

    denoiser, head = SD3Transformer2DModel(), torch.nn.Linear(16, 4)
    x = torch.randn(5, 8)
    with torch.no_grad():
        _, total, model = count_flops(lambda: head(denoiser(x)))
    assert model == 2 * 5 * 8 * 16 and total == model + 2 * 5 * 16 * 4
