"""Faults injected on ONE rank of a launch: what every rank must do about them.

Used by tests/scale/test_launch.py and tests/scale/test_sharding.py.
``python fault_on_one_rank.py OUT RANK FAULT [overrides...]``, alone or under ``accelerate launch``
(2 gloo processes), trains the embedded model with a fault on rank RANK:

- ``nan_loss``: the objective returns a NaN loss for the first micro-batch it computes in
  iteration 2 (as a bad sample or an overflow would cause). That micro-batch belongs to the
  iteration's first update in both launches, so a 2-process run must skip that update on every
  rank (the guard's ``skipped_updates``) and end with the LoRA of the one-process run, which skips
  the same update. A rank that left the step while the others still backwarded through a sharded
  model's collectives would hang them, or pair their collectives wrongly from then on.
- ``slow_start``: rank 0's start (base grid, start evaluation) takes 12 s longer, as a large model's
  does. ``train.time_budget_s`` counts training time: the other ranks, waiting for rank 0, must
  not count that wait.
- ``eval_error``: the held-out evaluation after iteration 1 raises (a reward that breaks). Under a
  sharded model the other ranks are then waiting in rank 0's lockstep calls; the launch must end
  at once with the error, not wait for the process group's timeout.
"""

from __future__ import annotations

import math
import sys
import time

from flowrl.config import load_config
from flowrl.distributed import exit_launched_process
from flowrl.recipe import Run

EVAL_ERROR = "the reward broke during the evaluation (injected)"
SLOW_START_S = 12.0


def nan_loss(run: Run) -> None:
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


def eval_error(run: Run) -> None:
    """This rank: the second held-out evaluation (the one after iteration 1) raises."""
    trainer = run.trainer
    real_evaluate, calls = trainer.evaluate_heldout, []

    def evaluate():
        calls.append(True)
        if len(calls) == 2:
            raise ValueError(EVAL_ERROR)
        return real_evaluate()

    trainer.evaluate_heldout = evaluate


def slow_start(run: Run) -> None:
    """This rank: its start (rank 0: the base grid and the start evaluation) takes SLOW_START_S more."""
    real_start = run._start

    def start():
        time.sleep(SLOW_START_S)
        return real_start()

    run._start = start


FAULTS = {"nan_loss": nan_loss, "eval_error": eval_error, "slow_start": slow_start}


def main() -> None:
    out, rank, fault, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    cfg = load_config(None, [*overrides, f"output.dir={out}"])
    run = Run(cfg)
    if run.collective.rank == rank:
        FAULTS[fault](run)
    run.execute()
    print(f"rank {run.collective.rank}: finished", flush=True)


if __name__ == "__main__":
    main()
    exit_launched_process(0)
