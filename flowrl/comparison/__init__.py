"""Checkpoints of run folders side by side: loading them as named adapters, and ``flowrl eval``.

:mod:`~flowrl.comparison.checkpoints` finds a run's checkpoints and loads each base model once
with every checkpoint attached as a named LoRA adapter; :mod:`~flowrl.comparison.evaluate` scores
them on a prompt set into the table of :mod:`flowrl.evaluation.table`. The demo and the gallery
(:mod:`flowrl.demo`) sample through the same code. It sits above :mod:`flowrl.evaluation` (plain
metrics, which the models import) and beside the CLI.
"""
