"""Advantages: group-relative normalisers (GRPO, GDPO, MC-GRPO) and the per-prompt history tracker."""
