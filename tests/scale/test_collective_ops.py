"""What training does with the ranks' collectives (flowrl/distributed.py): gradient sums, agreed faults,
merged statistics, rows in global order, and the one line for a lost peer; the other ranks are scripted."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from flowrl.distributed import (
    Collective,
    agree_fault,
    derive_geometry,
    gather_rows,
    lost_peer_message,
    merge_totals,
    sum_gradients,
)


class ScriptedRanks(Collective):
    """A one-process Collective of rank 0 in ``world_size`` ranks whose peers' contributions are given.

    ``sum`` adds ``peer_sum`` to this rank's value; ``gather`` appends ``peer_rows``; ``gather_objects``
    returns this rank's value followed by ``peer_objects`` (rank order).
    """

    def __init__(
        self,
        world_size: int = 2,
        peer_sum: Tensor | None = None,
        peer_rows: Tensor | None = None,
        peer_objects: tuple[Any, ...] = (),
    ) -> None:
        super().__init__()
        self.world_size = world_size
        self.peer_sum, self.peer_rows, self.peer_objects = peer_sum, peer_rows, list(peer_objects)

    def sum(self, value: Tensor) -> Tensor:
        assert self.peer_sum is not None
        return value + self.peer_sum.to(value.dtype)

    def gather(self, local: Tensor) -> Tensor:
        assert self.peer_rows is not None
        return torch.cat([local, self.peer_rows])

    def gather_objects(self, value: Any) -> list[Any]:
        return [value, *self.peer_objects]


def test_sum_gradients_sums_over_ranks_and_keeps_none_only_where_every_rank_has_none() -> None:
    """Each gradient becomes its sum over the ranks in its own dtype; a gradient None here but set on a peer is
    that peer's; one None on every rank stays None."""
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(3))
    c = torch.nn.Parameter(torch.zeros(1))
    a.grad = torch.tensor([1.0, 2.0])
    # the peer's flat all-reduce input: has-gradient flags (a, b, c), then a's, b's and c's gradients
    peer = torch.tensor([1.0, 1.0, 0.0, 10.0, 20.0, 3.0, 4.0, 5.0, 0.0], dtype=torch.float64)
    sum_gradients([a, b, c], ScriptedRanks(peer_sum=peer))
    assert a.grad is not None and torch.equal(a.grad, torch.tensor([11.0, 22.0])) and a.grad.dtype == torch.float32
    assert b.grad is not None and torch.equal(b.grad, torch.tensor([3.0, 4.0, 5.0]))
    assert c.grad is None


def test_agree_fault_is_the_first_ranks_fault_on_every_rank() -> None:
    """The fault of the lowest rank that has one wins; no fault on any rank is None."""
    assert agree_fault(ScriptedRanks(3, peer_objects=("nan loss", "inf norm")), None) == "nan loss"
    assert agree_fault(ScriptedRanks(3, peer_objects=(None, "inf norm")), "bad weights") == "bad weights"
    assert agree_fault(ScriptedRanks(3, peer_objects=(None, None)), None) is None


def test_merge_totals_sums_statistics_and_keeps_the_first_in_plan_order() -> None:
    """Statistics are summed key by key over the ranks; the (plan position, ratio) with the lowest position is kept."""
    peers = (({"loss": 2.0, "kl": 1.0}, (1, 0.9)), ({}, None))
    merged, first = merge_totals(ScriptedRanks(3, peer_objects=peers), {"loss": 1.0, "ratio": 0.5}, (3, 0.5))
    assert merged == {"loss": 3.0, "ratio": 0.5, "kl": 1.0}
    assert first == (1, 0.9)
    assert merge_totals(ScriptedRanks(2, peer_objects=(({}, None),)), {}, None) == ({}, None)


def test_gather_rows_puts_spread_rows_back_in_global_order() -> None:
    """Under spread placement rank r holds samples [2r, 2r+2) of each group of 4; gathered rows come back as 0..B-1."""
    geometry = derive_geometry(3, 4, 2, 2, 0, "spread")
    mine, peer = geometry.indices(0), geometry.indices(1)
    assert mine.tolist() == [0, 1, 4, 5, 8, 9]
    out = gather_rows(ScriptedRanks(peer_rows=peer.float()[:, None]), geometry, mine.float()[:, None])
    assert torch.equal(out, torch.arange(12.0)[:, None])
    contiguous = derive_geometry(2, 3, 3, 2, 0, "contiguous")
    parts = gather_rows(ScriptedRanks(peer_rows=torch.tensor([3.0, 4.0, 5.0])), contiguous, torch.tensor([0.0, 1, 2]))
    assert torch.equal(parts, torch.arange(6.0))


@pytest.mark.parametrize(
    ("err", "fragment"),
    [
        (RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234"), "another process of the launch ended"),
        (RuntimeError("Connection reset by peer"), "another process of the launch ended"),
        (RuntimeError("[gloo] Timed out waiting 1800000ms for recv"), "waited longer than train.collective_timeout_s"),
        (RuntimeError("CUDA out of memory"), None),
        (ValueError("Connection closed by peer"), None),
    ],
)
def test_lost_peer_message_names_this_rank_for_a_lost_or_late_peer_only(err: BaseException, fragment: str) -> None:
    """gloo's lost-peer and timeout errors become one line naming RANK; other errors (or other types) get None."""
    line = lost_peer_message(err, {"RANK": "3"})
    if fragment is None:
        assert line is None
    else:
        assert line is not None and line.startswith("flowrl: error: rank 3 ") and fragment in line
