"""``chunk_noise``: a chunk's fresh noise comes from the plan's generator, all rows drawn, a rank keeping its own."""

import torch

from flowrl.objectives.base import RankRows, RolloutBatch
from flowrl.objectives.planning import chunk_noise


def _batch(rows=None, b=3):
    x = torch.zeros(b, 2, 3)
    return RolloutBatch(["p"] * b, torch.zeros(b), {}, x, None, None, x, torch.zeros(b), torch.zeros(b),
                        torch.ones(b, dtype=torch.bool), 2, rows=rows)  # fmt: skip


def test_chunk_noise_draws_every_row_from_the_generator_and_a_rank_keeps_its_rows_in_global_order():
    """One process: ``randn((len(idx), ...), generator)``; a rank: those rows' draws where it owns the row.

    Either way the generator advances by the whole chunk's draws, so every rank's plan stays in step.
    """
    idx = torch.tensor([2, 3, 4, 5])
    reference = torch.Generator().manual_seed(7)
    full = torch.randn((4, 2, 3), generator=reference)
    after = torch.randn(1, generator=reference)

    gen = torch.Generator().manual_seed(7)
    assert torch.equal(chunk_noise(_batch(), idx, gen), full)
    assert torch.equal(torch.randn(1, generator=gen), after)

    owned = torch.tensor([True, False, False, True, False, True])  # of the chunk's rows 2..5: 3 and 5
    rows = RankRows(owned, torch.ones(6, dtype=torch.bool), torch.zeros(6), torch.zeros(6))
    gen = torch.Generator().manual_seed(7)
    mine = chunk_noise(_batch(rows), idx, gen)
    assert torch.equal(mine, full[[1, 3]])
    assert torch.equal(torch.randn(1, generator=gen), after)
