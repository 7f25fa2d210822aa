"""The embedded flowrl-digits model: pipeline, pretraining, evaluation and its style report."""
