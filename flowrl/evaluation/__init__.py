"""Evaluation that does not train: sample diversity, drift from the base model, confidence intervals.

These figures make mode collapse and reward hacking visible. They are shared by the training
loop's held-out evaluation, the reward-hacking guards, ``flowrl eval`` and the demo.
"""

from .metrics import MeanCI, mean_ci, prompt_diversity, sample_drift

__all__ = ["MeanCI", "mean_ci", "prompt_diversity", "sample_drift"]
