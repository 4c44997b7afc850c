"""Artifacts: the store they live in, and what SQL says is in it."""
