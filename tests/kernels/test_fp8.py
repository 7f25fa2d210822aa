"""FP8 E4M3 row / tensor quantisation: the Triton kernel against the torch reference
(:func:`flowrl.policy.fp8.fp8_quantize`) bit for bit, ties, zeros, subnormals, saturation, non-finite
values and odd K included; and ScaledMMLinear's fused forward against the computation it replaced.

Format: flowrl.kernels.fp8 module docstring.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES, cpu_scaled_mm_supports
from torch import nn

from flowrl.kernels.fp8 import fp8_bytes, fp8_quantize_rows, fp8_quantize_tensor
from flowrl.policy.fp8 import ScaledMMLinear, fp8_quantize

QUANTIZE = {"row": fp8_quantize_rows, "tensor": fp8_quantize_tensor}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
E4M3_GRID = sorted({float(torch.tensor(b, dtype=torch.uint8).view(torch.float8_e4m3fn)) for b in range(0, 0x7F)})


def codes(q: torch.Tensor) -> torch.Tensor:
    """The E4M3 bit patterns (uint8, on CPU); NaN codes lose their sign bit, which is not specified."""
    bits = q.view(torch.uint8).cpu()
    return torch.where((bits & 0x7F) == 0x7F, torch.full_like(bits, 0x7F), bits)


def assert_matches_reference(x: torch.Tensor, scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel and the reference on ``x``; assert equal codes, scale bits and shapes; return the kernel's."""
    q, scale = QUANTIZE[scaling](x, backend="triton")
    ref_q, ref_scale = fp8_quantize(x, scaling)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.device == x.device
    assert scale.dtype == torch.float32 and scale.shape == ref_scale.shape
    assert torch.equal(codes(q), codes(ref_q))
    assert torch.equal(scale.cpu().view(torch.int32), ref_scale.cpu().view(torch.int32))
    return q, scale


def probe_rows(values: torch.Tensor, width: int = 64) -> torch.Tensor:
    """Rows of ``width``: 448 first (so the row scale is exactly 1 on CPU and CUDA), then the probes."""
    per_row = width - 1
    padded = torch.cat([values, values.new_zeros((-len(values)) % per_row)]).reshape(-1, per_row)
    return torch.cat([padded.new_full((len(padded), 1), 448.0), padded], dim=1)


def tie_probes() -> torch.Tensor:
    """Every E4M3 value, every midpoint between neighbours (ties), the fp32 neighbours of each, and negatives."""
    grid = torch.tensor(E4M3_GRID, dtype=torch.float64)
    mids = ((grid[1:] + grid[:-1]) / 2).float()  # exact in fp32
    below = torch.tensor([2.0**-10, 2.0**-11, 1e-30, 1e-40])  # half the smallest subnormal and less: round to 0
    values = torch.cat([grid.float(), mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1), below])
    return torch.cat([values, -values])


# --------------------------------------------------------------------------- Triton vs reference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", ["row", "tensor"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K", [1, 3, 17, 100, 1536, 2432, 6144, 8195])
def test_kernel_matches_reference_bit_for_bit(device, scaling, dtype, K):
    g = torch.Generator().manual_seed(K)
    magnitudes = torch.logspace(-4, 4, 6)[:, None]  # rows of very different scale (one scale per tensor sees them all)
    x = (torch.randn(6, K, generator=g) * magnitudes).to(dtype).to(device)
    assert_matches_reference(x, scaling)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_strided_rows_and_fp64_match_the_reference(device, scaling):
    wide = torch.randn(9, 80, generator=torch.Generator().manual_seed(1)).to(device)
    assert_matches_reference(wide[:, 5:69], scaling)  # row stride 80, K 64
    assert_matches_reference(wide.double() * 3, scaling)  # fp64 rounds to fp32 first, as the reference's x.float()
    assert_matches_reference(wide[:, :40].t(), scaling)  # column stride 80 (a transposed view): read as its values


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_rounds_ties_to_even_at_every_e4m3_value(device, dtype):
    x = probe_rows(tie_probes()).to(dtype)
    q, scale = assert_matches_reference(x.to(device), "row")
    assert (scale == 1).all()
    assert torch.equal(codes(q), x.to(torch.float8_e4m3fn).view(torch.uint8))  # scale 1: q is the plain cast
    ties = torch.tensor([1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10, 416.0, -1.0625])
    expected = [1.0, 1.25, 0.0, 2.0**-8, 2.0**-8, 416.0, -1.0]  # ties go to the even mantissa (0 at 2^-10)
    assert fp8_quantize_rows(probe_rows(ties).to(device), backend="triton")[0][0, 1:8].float().tolist() == expected


@pytest.mark.filterwarnings("ignore:.*encountered in divide:RuntimeWarning")  # numpy, in the interpreter
@pytest.mark.parametrize("device", DEVICES)
def test_zero_rows_signed_zeros_and_subnormals(device):
    x = torch.zeros(6, 40)
    x[1, :3] = torch.tensor([-0.0, 0.0, -0.0])
    x[2] = torch.linspace(-1, 1, 40) * 2.0**-140  # fp32 subnormals only: the scale is subnormal too
    x[3, :2] = torch.tensor([1e30, -1e-30])  # the small one rounds to -0
    x[4] = torch.linspace(-1, 1, 40) * 2.0**-126
    x[5, 0] = 2.0**-149  # amax / 448 underflows to a zero scale: the reference then gives inf (448) and NaN codes
    for scaling in ("row", "tensor"):
        q, scale = assert_matches_reference(x.to(device), scaling)
    q, scale = fp8_quantize_rows(x.to(device), backend="triton")
    assert scale[0].item() == 1.0 and codes(q)[1, :3].tolist() == [0x80, 0, 0x80] and codes(q)[3, 1] == 0x80
    for dtype, tiny in ((torch.bfloat16, 2.0**-133), (torch.float16, 2.0**-24)):  # the dtypes' subnormals
        y = (torch.arange(-20, 21).float() * tiny).to(dtype).reshape(1, -1).repeat(2, 1)
        y[1, 0] = 1.0
        assert_matches_reference(y.to(device), "row")
        assert_matches_reference(y.to(device), "tensor")


@pytest.mark.filterwarnings("ignore:.*encountered in divide:RuntimeWarning")  # numpy, in the interpreter
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_nan_and_inf_give_the_reference_scales_and_codes(device, scaling):
    """NaN rows get scale 1 (so 1000 saturates to 448), inf rows scale inf (finite values -> +-0, inf -> NaN)."""
    nan, inf = float("nan"), float("inf")
    x = torch.tensor(
        [[nan, 1000.0, -1000.0, 1.0], [inf, 3.0, -3.0, -inf], [nan, inf, -inf, 0.5], [1.0, 2.0, -4.0, 0.0]]
    )
    for dtype in DTYPES:
        q, scale = assert_matches_reference(x.to(dtype).to(device), scaling)
    if scaling == "row":
        assert scale.cpu().flatten()[:3].tolist() == [1.0, inf, 1.0]
        assert codes(q)[0].tolist() == [0x7F, 0x7E, 0xFE, 0x38] and codes(q)[2, 1:3].tolist() == [0x7E, 0xFE]


def test_cuda_scale_rule_emulated_on_cpu():
    """The CUDA branch (amax * fp32(1/448)) checked on CPU, where torch itself divides: about half the scales differ."""
    pytest.importorskip("triton")
    from flowrl.kernels import interpreting

    if not interpreting():
        pytest.skip("set TRITON_INTERPRET=1 for the interpreter")
    from flowrl.kernels.fp8_triton import quantize_triton

    x = torch.randn(256, 48, generator=torch.Generator().manual_seed(2)) * 7
    _, scale = quantize_triton(x, None, reciprocal=True)
    amax = x.abs().amax(dim=-1, keepdim=True)
    expected = amax * (torch.tensor(1.0) / torch.tensor(448.0))
    assert torch.equal(scale, expected)
    assert not torch.equal(scale, fp8_quantize(x, "row")[1])  # the rule matters: CPU's division gives other bits


@pytest.mark.parametrize("device", DEVICES)
def test_empty_rows_and_launch_shapes(device):
    q, scale = fp8_quantize_rows(torch.ones(0, 32, device=device), backend="triton")
    assert q.shape == (0, 32) and scale.shape == (0, 1)
    assert_matches_reference(torch.randn(1, 8192, generator=torch.Generator().manual_seed(3)).to(device), "row")
    assert_matches_reference(torch.randn(33, 5, generator=torch.Generator().manual_seed(4)).to(device), "row")


# --------------------------------------------------------------------------- errors and dispatch


@pytest.mark.parametrize(
    ("x", "error", "match"),
    [
        (torch.ones(16), ValueError, "2-D"),
        (torch.ones(2, 3, 16), ValueError, "2-D"),
        (torch.ones(4, 0), ValueError, "K > 0"),
        (torch.ones(2, 16, dtype=torch.int32), TypeError, "fp16 / bf16"),
    ],
)
def test_bad_inputs_are_one_line_errors(x, error, match):
    for quantize in QUANTIZE.values():
        with pytest.raises(error, match=match):
            quantize(x)


def test_empty_tensor_scaling_and_bad_backend_are_errors():
    with pytest.raises(ValueError, match="non-empty"):
        fp8_quantize_tensor(torch.ones(0, 16))
    with pytest.raises(ValueError, match="backend must be one of"):
        fp8_quantize_rows(torch.ones(2, 16), backend="cuda")


def test_torch_backend_is_the_reference_and_bytes_are_counted():
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(5)).bfloat16()
    for scaling, quantize in QUANTIZE.items():
        q, scale = quantize(x, backend="torch")
        ref_q, ref_scale = fp8_quantize(x, scaling)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)
    assert fp8_bytes(21712, 1536, 2) == 21712 * 1536 * 3 + 21712 * 4
    assert fp8_bytes(10, 16, 2, "tensor") == 10 * 16 * 5 + 4


# --------------------------------------------------------------------------- ScaledMMLinear


SCALED_MM_DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(
                not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs cc >= 8.9"
            ),
        ],
    ),
]


def old_forward(layer: ScaledMMLinear, x: torch.Tensor) -> torch.Tensor:
    """ScaledMMLinear.forward before the fused quantiser: rows padded to 16, eager quantisation, bias added after."""
    rows = x.reshape(-1, layer.in_features)
    pad = (-rows.shape[0]) % 16
    q, scale = fp8_quantize(torch.nn.functional.pad(rows, (0, 0, 0, pad)), layer.scaling)
    out = torch._scaled_mm(q, layer.weight.t(), scale_a=scale, scale_b=layer.weight_scale, out_dtype=torch.bfloat16)
    out = out[: rows.shape[0]].to(x.dtype)
    out = out if layer.bias is None else out + layer.bias.to(x.dtype)
    return out.reshape(*x.shape[:-1], layer.out_features)


@pytest.mark.parametrize("device", SCALED_MM_DEVICES)
@pytest.mark.parametrize("scaling", ["row", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("tokens", [32, 37])
def test_scaled_mm_linear_matches_the_old_forward(device, scaling, dtype, bias, tokens):
    """Same codes, scales and GEMM; a bf16 bias now goes through _scaled_mm's epilogue (one rounding instead of two).

    Without that bias the output equals the old one bit for bit where M needed no padding (32 x 3 rows);
    otherwise it may differ by the final bf16 rounding: |new - old| <= 2^-7 (|old product| + |bias|).
    """
    if device == "cpu" and not cpu_scaled_mm_supports(scaling):
        pytest.skip(f"this torch's CPU _scaled_mm has no {scaling} scaling")
    g = torch.Generator().manual_seed(tokens)
    linear = nn.Linear(256, 96, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 256, generator=g) / 16)
        if bias:
            linear.bias.copy_(torch.randn(96, generator=g))
    layer = ScaledMMLinear(linear.to(dtype), scaling).to(device)
    x = torch.randn(3, tokens, 256, generator=g).to(dtype).to(device)
    new, old = layer(x), old_forward(layer, x)
    assert new.dtype == dtype and new.shape == (3, tokens, 96)
    fused = bias and dtype == torch.bfloat16
    if not fused and tokens % 16 == 0:
        assert torch.equal(new, old)
    product = old.float() - (layer.bias.float() if bias else 0.0)
    bound = 2.0**-7 * (product.abs() + (layer.bias.float().abs() if bias else 0.0))
    assert ((new.float() - old.float()).abs() <= bound).all()


@pytest.mark.parametrize("device", SCALED_MM_DEVICES)
@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_fast_accum_is_passed_to_scaled_mm_and_changes_only_the_accumulation(device, scaling, monkeypatch):
    """``fast_accum`` reaches ``torch._scaled_mm`` (``use_fast_accum``); same codes and scales, so the output
    is the default layer's but for the sum's rounding: within 2^-7 of |x| |W| per entry (K = 256)."""
    if device == "cpu" and not cpu_scaled_mm_supports(scaling):
        pytest.skip(f"this torch's CPU _scaled_mm has no {scaling} scaling")
    seen = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: seen.append(kw["use_fast_accum"]) or real(*a, **kw))
    g = torch.Generator().manual_seed(8)
    linear = nn.Linear(256, 96).bfloat16()
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 256, generator=g) / 16)
    fast, precise = (ScaledMMLinear(linear, scaling, fast_accum=f).to(device) for f in (True, False))
    x = torch.randn(2, 40, 256, generator=g).bfloat16().to(device)
    with torch.no_grad():
        a, b = fast(x).float(), precise(x).float()
    assert seen == [True, False]
    bound = 2.0**-7 * (
        x.float().abs() @ linear.weight.float().abs().t().to(device)
    ) + 2.0**-7 * linear.bias.float().abs().to(device)
    assert ((a - b).abs() <= bound).all()


@pytest.mark.parametrize("device", SCALED_MM_DEVICES)
@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_fp8_layers_sharing_an_input_quantise_it_once(device, scaling, monkeypatch):
    """q / k / v on one tensor: one quantiser call, outputs equal to unshared layers; a write in between requantises."""
    if device == "cpu" and not cpu_scaled_mm_supports(scaling):
        pytest.skip(f"this torch's CPU _scaled_mm has no {scaling} scaling")
    import flowrl.policy.fp8 as fp8_module
    from flowrl.policy.shared_input import SharedInput

    calls = []
    name = "fp8_quantize_rows" if scaling == "row" else "fp8_quantize_tensor"
    real = getattr(fp8_module, name)
    monkeypatch.setattr(fp8_module, name, lambda x: calls.append(x.shape) or real(x))
    torch.manual_seed(4)
    linears = [nn.Linear(64, 48).bfloat16() for _ in range(3)]
    memo = SharedInput()
    shared = [ScaledMMLinear(lin, scaling, shared_input=memo).to(device) for lin in linears]
    plain = [ScaledMMLinear(lin, scaling).to(device) for lin in linears]
    x = torch.randn(2, 37, 64, device=device).bfloat16()
    with torch.no_grad():
        outs = [layer(x) for layer in shared]
        assert len(calls) == 1 and (memo.hits, memo.misses) == (2, 1)
        assert all(torch.equal(a, layer(x)) for a, layer in zip(outs, plain, strict=True))
        calls.clear()
        x.mul_(3.0)  # an in-place write between two readers
        assert torch.equal(shared[0](x), plain[0](x)) and len(calls) == 2


# --------------------------------------------------------------------------- the operator under torch.compile


@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_the_quantiser_operator_passes_torchs_operator_checks(scaling):
    x = torch.randn(7, 48, generator=torch.Generator().manual_seed(3)).bfloat16()
    torch.library.opcheck(torch.ops.flowrl.fp8_quantize.default, (x, scaling))
    q, scale = torch.ops.flowrl.fp8_quantize(x, scaling)
    ref_q, ref_scale = fp8_quantize(x, scaling)
    assert torch.equal(codes(q), codes(ref_q)) and torch.equal(scale, ref_scale)
    with pytest.raises(ValueError, match="'row' or 'tensor'"):
        torch.ops.flowrl.fp8_quantize(x, "block")


@pytest.mark.parametrize("device", SCALED_MM_DEVICES)
@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_the_fp8_linear_compiles_into_one_graph_with_the_quantiser_as_one_node(device, scaling):
    """The dispatcher and the Triton launch (the interpreter on CPU) stay inside one traced node."""
    if device == "cpu" and not cpu_scaled_mm_supports(scaling):
        pytest.skip(f"this torch's CPU _scaled_mm does not take {scaling} scales")
    torch._dynamo.reset()
    layer = ScaledMMLinear(nn.Linear(64, 48).to(device), scaling)
    x = torch.randn(2, 37, 64, device=device).bfloat16()
    explain = torch._dynamo.explain(layer)(x)
    assert explain.graph_count == 1 and explain.graph_break_count == 0
    nodes = [str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op == "call_function"]
    # by name: transformers' probe may import this folder a second time as a top-level ``kernels``, which
    # registers the operator again (harmless: the same code) under a new OpOverload object
    assert nodes.count("flowrl.fp8_quantize.default") == 1
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x), layer(x))
    torch._dynamo.reset()


@pytest.mark.parametrize("scaling", ["row", "tensor"])
def test_fuse_under_compile_traces_the_reference_operators_and_keeps_eager_on_the_kernel(scaling):
    """``fuse_under_compile``: no opaque quantiser node in the graph (the compiler may fuse it); eager unchanged."""
    if not cpu_scaled_mm_supports(scaling):
        pytest.skip(f"this torch's CPU _scaled_mm does not take {scaling} scales")
    torch._dynamo.reset()
    plain = ScaledMMLinear(nn.Linear(64, 48), scaling)
    fused = ScaledMMLinear(nn.Linear(64, 48), scaling, fuse_under_compile=True)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(2, 37, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    assert torch.equal(fused(x), plain(x))  # eager: the same kernel operator
    explain = torch._dynamo.explain(fused)(x)
    assert explain.graph_count == 1 and explain.graph_break_count == 0
    nodes = [str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op in ("call_function", "call_method")]
    assert "flowrl.fp8_quantize.default" not in nodes and {"amax", "clamp", "to"} <= set(nodes)
    compiled = torch.compile(fused, fullgraph=True)  # inductor: the reference's operators, generated code
    torch.testing.assert_close(compiled(x), plain(x), rtol=0, atol=0)
    torch._dynamo.reset()
