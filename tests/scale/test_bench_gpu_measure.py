"""``bench.gpu_measure``'s failure rows: an out-of-memory pass says what it asked for."""

import torch

from bench.gpu_measure import oom_reason


def test_an_out_of_memory_row_names_the_failed_allocation():
    err = torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 864.00 MiB. GPU 0 has a total capacity of 79.18 GiB"
    )
    assert oom_reason(err) == "out of memory (tried to allocate 864.00 MiB)"
    assert oom_reason(torch.cuda.OutOfMemoryError("CUDA out of memory.")) == "out of memory"
