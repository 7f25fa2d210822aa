"""A non-finite loss on ONE rank skips that update on every rank, and the run goes on in step.

Used by tests/scale/test_launch.py. ``python nan_on_one_rank.py OUT RANK [overrides...]``, alone or under
``accelerate launch`` (2 gloo processes), trains the embedded model; rank RANK's objective
returns a NaN loss for the first micro-batch it computes in iteration 2 (a fault injected on that
rank only, as a bad sample or an overflow would cause). That micro-batch belongs to the
iteration's first update in both launches, so a 2-process run must skip that update on every rank
(the guard's ``skipped_updates``) and end with the LoRA of the one-process run, which skips the
same update. A rank that left the step while the others still backwarded through a sharded
model's collectives would hang them, or pair their collectives wrongly from then on.
"""

from __future__ import annotations

import math
import sys

from flowrl.config import load_config
from flowrl.distributed import exit_launched_process
from flowrl.recipe import Run


def poison(run: Run) -> None:
    """This rank: a NaN loss for the first micro-batch its objective computes in iteration 2."""
    trainer, objective = run.trainer, run.trainer.objective
    real_loss, fired = objective.loss, []

    def loss(model, batch, mb):
        value, stats = real_loss(model, batch, mb)
        if trainer.iteration == 1 and not fired:  # iteration 2 is being trained
            fired.append(True)
            return value * math.nan, stats
        return value, stats

    objective.loss = loss


def main() -> None:
    out, rank, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    cfg = load_config(None, [*overrides, f"output.dir={out}"])
    run = Run(cfg)
    if run.collective.rank == rank:
        poison(run)
    run.execute()
    print(f"rank {run.collective.rank}: finished", flush=True)


if __name__ == "__main__":
    main()
    exit_launched_process(0)
