"""NVFP4 emulation: the torch reference against independent rounding rules, and the Triton kernel
against the reference bit for bit (codes, scales, dequantised values), ties and odd shapes included.

Format: flowrl.kernels.nvfp4 module docstring; shared/reference/nft-awm-solrl-sage.md §6.
"""

from __future__ import annotations

import pytest
import torch
from kernel_devices import DEVICES

from flowrl.kernels import (
    NVFP4Tensor,
    interpreting,
    nvfp4_dequantize,
    nvfp4_fake_quantize,
    nvfp4_quantize,
    nvfp4_tensor_scale,
    pack_fp4,
    resolve_backend,
    triton_installed,
    unpack_fp4,
)
from flowrl.kernels.nvfp4 import E2M1_VALUES, e2m1_codes, e2m1_values, e4m3_bits, e4m3_round

SHAPES = [(1,), (5,), (16,), (3, 16), (7, 33), (2, 3, 50), (4, 64), (2, 1000), (65, 17)]
E4M3_GRID = sorted({float(torch.tensor(b, dtype=torch.uint8).view(torch.float8_e4m3fn)) for b in range(1, 0x7F)})


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern, so -0.0 != +0.0 and NaNs compare."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(a: NVFP4Tensor, b: NVFP4Tensor) -> None:
    assert a.shape == b.shape
    assert torch.equal(a.codes.cpu(), b.codes.cpu())
    assert torch.equal(bits(a.scales).cpu(), bits(b.scales).cpu())
    assert torch.equal(bits(a.tensor_scale).cpu(), bits(b.tensor_scale).cpu())


def nearest_e2m1_even(y: torch.Tensor) -> torch.Tensor:
    """Brute force in float64: the nearest E2M1 magnitude, ties to the even code, saturating at 6."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    dist = (y.double().abs().clamp(max=6).unsqueeze(-1) - values).abs()
    best = dist.min(dim=-1, keepdim=True).values
    candidates = dist == best
    even = candidates & (torch.arange(8) % 2 == 0)
    index = torch.where(even.any(-1), even.int().argmax(-1), candidates.int().argmax(-1))
    return values[index].float() * torch.where(y < 0, -1.0, 1.0)


def tie_tensor() -> torch.Tensor:
    """Blocks scaled exactly 1: the tensor amax 2688 makes s = 1, and each later block's amax of 6 makes q = 1.

    The last block's amax 6.375 gives r = 1.0625, an E4M3 tie that rounds down to q = 1, so its
    6.375 and 6.2 saturate to 6.
    """
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    up = [torch.nextafter(torch.tensor(t), torch.tensor(9.0)).item() for t in ties]
    down = [torch.nextafter(torch.tensor(t), torch.tensor(0.0)).item() for t in ties]
    rows = [
        [2688.0] + [0.0] * 15,
        ties + [-t for t in ties] + [6.0, -6.0],
        up + [-t for t in up] + [6.0, 0.0],
        down + list(E2M1_VALUES) + [-0.1],
        [6.375, -6.375, 6.2, 1.0] + [0.0] * 12,
    ]
    return torch.tensor(rows)


# --------------------------------------------------------------------------- reference rounding


def test_e2m1_ties_round_to_even():
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0])
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    assert e2m1_values(e2m1_codes(y)).tolist() == expected
    assert e2m1_codes(torch.tensor([-0.1, -0.25]).float()).tolist() == [0, 0]  # never -0
    assert e2m1_values(e2m1_codes(torch.tensor([6.0, 7.0, 1e9, -8.0]))).tolist() == [6.0, 6.0, 6.0, -6.0]


def test_e2m1_rounding_matches_brute_force_on_a_dense_grid():
    grid = torch.linspace(-7, 7, 56001)  # step 2.5e-4: hits every tie exactly, and both sides of it
    assert torch.equal(e2m1_values(e2m1_codes(grid)), nearest_e2m1_even(grid))


def test_e4m3_round_matches_torch_float8_at_values_ties_and_neighbours():
    grid = torch.tensor(E4M3_GRID, dtype=torch.float64)
    mids = ((grid[1:] + grid[:-1]) / 2).float()  # exact in fp32: the ties
    probes = torch.cat([grid.float(), mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    probes = torch.cat([probes, torch.empty(20000).uniform_(2**-9, 448, generator=torch.Generator().manual_seed(0))])
    probes = probes[(probes >= 2**-9) & (probes <= 448)]
    assert torch.equal(e4m3_round(probes), probes.to(torch.float8_e4m3fn).float())


def test_e4m3_bits_match_torch_float8_encoding():
    q = torch.tensor(E4M3_GRID)
    assert torch.equal(e4m3_bits(q), q.to(torch.float8_e4m3fn).view(torch.uint8))


def test_pack_and_unpack_are_inverse_with_even_element_low():
    codes = torch.randint(0, 16, (3, 10), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_fp4(pack_fp4(codes)), codes)
    assert pack_fp4(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21
    with pytest.raises(ValueError, match="even last dim"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


def test_reference_dequantises_ties_exactly():
    out = nvfp4_dequantize(nvfp4_quantize(tie_tensor(), backend="torch"), backend="torch")
    x = tie_tensor()
    assert nvfp4_tensor_scale(x).item() == 1.0
    torch.testing.assert_close(out[1:], nearest_e2m1_even(x[1:]), rtol=0, atol=0)


def test_zero_blocks_zero_tensor_and_padding():
    x = torch.zeros(3, 20)
    x[0, :3] = torch.tensor([1.0, -2.0, 3.0])
    x[2, 0] = 2688.0  # s = 1
    q = nvfp4_quantize(x, backend="torch")
    assert q.codes.shape == (3, 16) and q.scales.shape == (3, 2)
    assert bits(q.scales)[0, 1].item() == 1 and bits(q.scales)[1].tolist() == [1, 1]  # zero blocks: q = 2^-9
    assert q.scales[0, 0].item() == 0.5
    assert torch.equal(nvfp4_dequantize(q), x)  # 1, -2, 3 are exact at scale 0.5
    zero = nvfp4_quantize(torch.zeros(3, 16), backend="torch")
    assert zero.tensor_scale.item() == 2.0**-117 and not zero.codes.any()


def test_relative_error_on_gaussian_data_is_about_nine_percent():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    err = (nvfp4_fake_quantize(x, backend="torch") - x).norm() / x.norm()
    assert 0.08 < err.item() < 0.10


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_an_error(bad):
    x = torch.ones(2, 16)
    x[1, 3] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        nvfp4_quantize(x, backend="torch")


def test_bad_inputs_are_errors():
    with pytest.raises(TypeError, match="floating"):
        nvfp4_quantize(torch.ones(16, dtype=torch.int32))
    with pytest.raises(ValueError, match="non-empty"):
        nvfp4_quantize(torch.ones(0, 16))
    with pytest.raises(ValueError, match="backend must be one of"):
        nvfp4_quantize(torch.ones(16), backend="cuda")


@pytest.mark.skipif(not triton_installed(), reason="without triton the error names the install instead")
def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_backend("auto", torch.ones(2)) == "torch"
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.ones(2))


@pytest.mark.parametrize(
    ("value", "on"),
    [(v, True) for v in ("1", "true", "TRUE", "yes", "on", "y", "Y")]
    + [(v, False) for v in ("0", "false", "no", "off", "", "2", "n")],
)
def test_the_interpreter_switch_reads_the_usual_truthy_spellings(monkeypatch, value, on):
    """``TRITON_INTERPRET`` is on for 1 / true / yes / on / y in any case, else off, as Triton reads it.

    Triton's own reading is checked too where it is installed: a spelling it took as on and the dispatcher as off
    ran the torch reference on CPU while the tests believed they ran the kernel in the interpreter ("y" did).
    """
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() is on
    libtriton = pytest.importorskip("triton._C.libtriton")
    assert libtriton.getenv_bool("TRITON_INTERPRET", False) is on


@pytest.mark.skipif(not triton_installed(), reason="without triton every call runs the reference")
def test_auto_picks_triton_only_when_every_input_can_run_it(monkeypatch):
    """Without the interpreter, "auto" is Triton only if all inputs are CUDA tensors: one CPU input means torch.

    (A CUDA-looking stand-in, as this check reads ``is_cuda`` only, so it runs without a GPU.)
    """
    from types import SimpleNamespace

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda_like = SimpleNamespace(is_cuda=True)
    assert resolve_backend("auto", cuda_like, cuda_like) == "triton"
    assert resolve_backend("auto", cuda_like, torch.ones(2)) == "torch"
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.ones(2), cuda_like)


# --------------------------------------------------------------------------- Triton vs reference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_reference_bit_for_bit(device, shape, dtype):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * 3).to(dtype).to(device)
    ref = nvfp4_quantize(x, backend="torch")
    got = nvfp4_quantize(x, backend="triton")
    assert_same(got, ref)
    expected = nvfp4_dequantize(ref, backend="torch")
    assert torch.equal(bits(nvfp4_dequantize(ref, backend="triton")), bits(expected))
    fake = nvfp4_fake_quantize(x, backend="triton")
    assert fake.dtype == dtype and torch.equal(bits(fake), bits(expected.to(dtype)))


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_rounds_ties_and_saturates_like_the_reference(device):
    x = tie_tensor().to(device)
    assert_same(nvfp4_quantize(x, backend="triton"), nvfp4_quantize(x, backend="torch"))
    out = nvfp4_fake_quantize(x, backend="triton").cpu()
    torch.testing.assert_close(out[1:], nearest_e2m1_even(tie_tensor()[1:]), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_rounds_block_scales_at_e4m3_ties(device):
    """Block amax 6 t with s = 1 gives r = t exactly; t runs over E4M3 midpoints and their neighbours."""
    grid = torch.tensor(E4M3_GRID, dtype=torch.float64)
    mids = ((grid[1:] + grid[:-1]) / 2).float()
    targets = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1), grid.float()])
    targets = targets[(targets >= 2**-9) & (targets <= 448)]
    x = torch.zeros(len(targets) + 1, 16)
    x[0, 0] = 2688.0
    x[1:, 0] = 6 * targets
    x[1:, 1] = -3 * targets
    got = nvfp4_quantize(x.to(device), backend="triton")
    assert_same(got, nvfp4_quantize(x, backend="torch"))
    assert torch.equal(bits(got.scales).cpu()[1:, 0], bits(targets.to(torch.float8_e4m3fn)))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
        ),
    ],
)
def test_block_scale_divides_rather_than_multiplies_by_a_reciprocal(device):
    """amax 0.11132812 over 6 is just below an E4M3 midpoint; times fp32(1 / 6) it is the midpoint.

    torch's CUDA kernel divides by a Python number as a multiplication by its reciprocal, so a
    reference written ``amax / 6`` rounded this block's scale up on CUDA (0x0A) and not on CPU.
    """
    x = torch.zeros(2, 16)
    x[0, 0] = 2688.0  # tensor scale exactly 1
    x[1, 0] = 0.1113281175494194
    amax = x[1, 0]
    by_reciprocal = (amax * torch.tensor(1 / 6, dtype=torch.float32)).to(torch.float8_e4m3fn)
    assert bits(by_reciprocal).item() == 0x0A  # the input separates the two ways of dividing
    backends = ["torch", "triton"] if device == "cuda" else ["torch"]
    for backend in backends:
        q = nvfp4_quantize(x.to(device), backend=backend)
        assert bits(q.tensor_scale).item() == bits(torch.tensor(1.0)).item()
        assert bits(q.scales).cpu()[1, 0].item() == 0x09, backend


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_small_and_zero_blocks(device):
    x = torch.zeros(3, 48)
    x[0, 0] = 1000.0
    x[0, 16:32] = 1e-7  # r below 2^-9: clamped up to the smallest subnormal scale
    x[2, 40] = -1e-30
    x = x.to(device)
    got = nvfp4_quantize(x, backend="triton")
    assert_same(got, nvfp4_quantize(x, backend="torch"))
    assert bits(got.scales).cpu()[1].tolist() == [1, 1, 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("dtype", "scale"), [(torch.bfloat16, 1e-38), (torch.float16, 5e-6), (torch.float32, 1e-39)], ids=str
)
def test_kernel_matches_reference_on_subnormal_inputs(device, dtype, scale):
    """Inputs in their dtype's subnormal range (bf16 ones made the interpreter's bf16 cast flush to 0)."""
    x = (torch.linspace(-1, 1, 64).reshape(2, 32) * scale).to(dtype)
    x[1, 16:] *= 2.0**-5  # deeper subnormals, a smaller block amax
    assert (x.abs() < torch.finfo(dtype).tiny).all() and x.count_nonzero() > 50
    x = x.to(device)
    assert_same(nvfp4_quantize(x, backend="triton"), nvfp4_quantize(x, backend="torch"))
    fake = nvfp4_fake_quantize(x, backend="triton")
    assert torch.equal(bits(fake), bits(nvfp4_fake_quantize(x, backend="torch")))


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_dequantises_subnormal_block_scales(device):
    """Blocks whose E4M3 scale is subnormal (k * 2^-9, codes 1..7) dequantise as the reference, bit for bit.

    Block 0 holds 2688 (tensor scale exactly 1); block k holds 6 k 2^-9 and -3 k 2^-9, so its scale is k 2^-9.
    """
    x = torch.zeros(2, 16 * 8)
    x[:, 0] = 2688.0
    for k in range(1, 8):
        x[:, 16 * k] = 6 * k * 2.0**-9
        x[:, 16 * k + 1] = -3 * k * 2.0**-9
    q = nvfp4_quantize(x, backend="torch")
    assert bits(q.scales)[0, 1:].tolist() == list(range(1, 8))  # the subnormal E4M3 codes
    q = NVFP4Tensor(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in q))
    got = nvfp4_dequantize(q, backend="triton").cpu()
    assert torch.equal(bits(got), bits(nvfp4_dequantize(q, backend="torch").cpu()))
    assert torch.equal(got[:, 16::16], x[:, 16::16]) and torch.equal(got[:, 17::16], x[:, 17::16])  # exact values


@pytest.mark.parametrize("backend", [pytest.param("torch", id="torch"), pytest.param("triton", id="triton")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_dequantize_returns_the_requested_dtype(backend, dtype):
    """``nvfp4_dequantize(q, dtype=...)`` is the fp32 dequantisation cast to ``dtype``, on either backend."""
    if backend == "triton" and not (triton_installed() and interpreting()):
        pytest.skip("the Triton backend on CPU needs triton and TRITON_INTERPRET=1")
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(21)) * 3
    q = nvfp4_quantize(x, backend="torch")
    fp32 = nvfp4_dequantize(q, backend=backend)
    out = nvfp4_dequantize(q, dtype=dtype, backend=backend)
    assert fp32.dtype == torch.float32 and out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, fp32.to(dtype))
