"""The "did you mean" of refusals (shared.spelling)."""

from __future__ import annotations

from shared.spelling import closest_name, did_you_mean


def test_the_closest_name() -> None:
    assert closest_name("max_step", ["epochs", "max_steps", "seed"]) == "max_steps"
    assert closest_name("colour", ["epochs", "max_steps"]) is None
    assert did_you_mean("zero_optimizaton", ["zero_optimization", "fp16"]) == "did you mean 'zero_optimization'?"
    assert did_you_mean("xyz", ["fp16"]) is None


def test_ignoring_case_answers_the_first_known_spelling() -> None:
    known = ["adam", "adamw", "Adam", "AdamW", "SGD"]
    assert closest_name("Adamm", known, ignore_case=True) == "adam"
    assert closest_name("sgd", known, ignore_case=True) == "SGD"
    assert closest_name("sgd", known) is None
