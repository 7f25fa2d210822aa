"""Rollouts with a model adapter: chunked sampling, the rollout kinds, scoring of finished chunks."""
