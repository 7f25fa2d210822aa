"""``bench.gpu_measure``'s failure rows: an out-of-memory pass says what it asked for."""

import torch

from bench.gpu_measure import oom_reason


def test_an_out_of_memory_row_names_the_failed_allocation():
    err = torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 864.00 MiB. GPU 0 has a total capacity of 79.18 GiB"
    )
    assert oom_reason(err) == "out of memory (tried to allocate 864.00 MiB)"
    assert oom_reason(torch.cuda.OutOfMemoryError("CUDA out of memory.")) == "out of memory"


def test_mfu_is_over_the_dense_bf16_peak_of_the_gpu_it_ran_on():
    from bench.gpu_measure import mfu
    from flowrl.kernels.roofline import H200, peaks_for

    # Round 2's FLUX.1-dev rollout: 286 TFLOP/s on an H100 SXM is 28.9 %; an H200 has the same bf16 peak.
    assert mfu(286e12, peaks_for("NVIDIA H100 80GB HBM3")) == "28.9%" == mfu(286e12, H200)
    assert mfu(286e12, peaks_for("NVIDIA A100-SXM4-80GB")) == "-"
