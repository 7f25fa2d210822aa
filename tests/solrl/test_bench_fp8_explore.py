"""bench/fp8_explore.py: Sol-RL's stage 1 with explore copies, on tiny SD3 and FLUX pipelines on the CPU.

The full-size run needs CUDA (docs/gpu-session.md); here the same code path (build_explore, the
adapter swap, chunked_solve, decode, the jpeg reward, the agreement figures) runs on the tiny models.
"""

from __future__ import annotations

import pytest
import torch

from bench import fp8_explore
from flowrl.policy.memory import compile_denoiser, repeated_blocks


def _rows(out: str) -> dict[tuple[str, str], list[str]]:
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| tiny"):
            rows[(cells[0], cells[1])] = cells[2:]
    return rows


def test_tiny_explore_copies_print_speed_and_rank_agreement(capsys):
    fp8_explore.main(["--tiny", "--seeds", "4", "--repeats", "1", "--variants", "fp32", "fp8_e4m3:row", "int8_dynamic"])
    rows = _rows(capsys.readouterr().out)
    names = ["fp32", "fp8_e4m3:row", "int8_dynamic", "seed noise only (no denoiser)"]
    assert sorted(rows) == sorted((m, n) for m in ("tiny SD3", "tiny FLUX") for n in names)
    for model in ("tiny SD3", "tiny FLUX"):
        ref, fp8, noise = (
            rows[(model, "fp32")],
            rows[(model, "fp8_e4m3:row")],
            rows[(model, "seed noise only (no denoiser)")],
        )
        assert all(len(r) == 13 for r in (ref, fp8, noise))
        assert ref[1] == "0" and int(fp8[1]) > 0  # the fp32 copy quantises nothing; fp8 quantises Linear layers
        assert ref[8:12] == ["1.000"] * 4 and ref[12] == "0.000"  # the reference agrees with itself
        assert float(fp8[4]) > 0 and float(ref[5]) == 1.0
        assert -1 <= float(fp8[8]) <= 1 and 0 < float(fp8[12]) < 1  # fp8 moves the images, less than the model does
        assert noise[12] == "1.000" and noise[0] == "-"  # the floor: the model's own contribution, by definition


def test_sharing_quantised_inputs_leaves_every_candidate_as_it_was(capsys, monkeypatch):
    """``:unshared`` as the reference: the shared copy ranks and draws the same images (agreement 1, no difference).

    The NVFP4 activation quantiser runs its torch reference here (the Triton interpreter that the kernel tests
    turn on would take minutes for these calls; the kernels match it bit for bit, tests/kernels/test_nvfp4.py).
    """
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fp8_explore.main(["--tiny", "--seeds", "2", "--repeats", "1", "--variants", "nvfp4:act:unshared", "nvfp4:act"])
    rows = _rows(capsys.readouterr().out)
    for model in ("tiny SD3", "tiny FLUX"):
        shared = rows[(model, "nvfp4:act")]
        assert int(shared[1]) > 0 and shared[8:12] == ["1.000"] * 4 and shared[12] == "0.000"


def test_agreement_measures_against_the_reference_and_the_noise_floor():
    images = torch.zeros(4, 3, 2, 2)
    ref = fp8_explore.Explored(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), images + 1, 0, 0, 1, 0, 0)
    got = fp8_explore.Explored(torch.tensor([[2.0, 1.0], [3.0, 4.0]]), images + 1.5, 1, 0, 1, 0, 0)
    noise = fp8_explore.Explored(torch.zeros(2, 2), images, 0, 0, 0, 0, 0)
    agree = fp8_explore.agreement(got, ref, noise)
    assert agree["kendall"] == pytest.approx(4 / 6)  # one discordant pair of six
    assert agree["per_prompt"] == pytest.approx(0.0)  # prompt 0 reversed (-1), prompt 1 kept (+1)
    assert agree["image_diff"] == pytest.approx(0.5)  # |1.5 - 1| / |1 - 0|


def test_one_seed_per_prompt_is_refused_in_one_line():
    with pytest.raises(SystemExit, match="--seeds must be >= 2"):
        fp8_explore.main(["--tiny", "--seeds", "1"])


@pytest.mark.slow
def test_explore_copies_compile_block_by_block(capsys, monkeypatch):
    """``--compile default --compile-scope blocks``: each copy's repeated blocks compiled, rows as before."""
    compiled = []

    def compile_and_record(module, mode, scope):
        compile_denoiser(module, mode, scope)
        compiled.append(sum(m._compiled_call_impl is not None for m in module.modules()))
        assert module._compiled_call_impl is None and compiled[-1] == len(repeated_blocks(module)) > 0

    monkeypatch.setattr(fp8_explore, "compile_denoiser", compile_and_record)
    fp8_explore.main(
        ["--tiny", "--seeds", "2", "--repeats", "1", "--variants", "fp32", "--compile", "default"]
        + ["--compile-scope", "blocks"]
    )
    out = capsys.readouterr().out
    assert "memory.compile=default, memory.compile_scope=blocks" in out
    rows = _rows(out)
    assert rows[("tiny SD3", "fp32")][8:12] == ["1.000"] * 4 and ("tiny FLUX", "fp32") in rows
    assert len(compiled) == 2  # one fp32 copy per model, its blocks compiled
