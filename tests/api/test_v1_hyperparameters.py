"""OpenAI's "auto" hyperparameters resolved as OpenAI documents them, and a batch laid out on a worker."""

from __future__ import annotations

import pytest

from api.v1.fine_tuning_objects import DpoHyperparameters, SupervisedHyperparameters
from api.v1.hyperparameters import (
    DEFAULT_PRETRAINING_LEARNING_RATE,
    HyperparameterError,
    auto_batch_size,
    auto_epochs,
    auto_learning_rate_multiplier,
    batch_layout,
    pretraining_learning_rate,
    resolve_dpo_hyperparameters,
    resolve_hyperparameters,
)


@pytest.mark.parametrize(
    ("examples", "epochs"),
    [(1, 25), (10, 10), (33, 4), (34, 3), (8333, 3), (8334, 2), (25_000, 1), (1_000_000, 1)],
)
def test_auto_epochs_see_between_100_and_25000_examples_within_1_to_25_epochs(examples: int, epochs: int) -> None:
    assert auto_epochs(examples) == epochs


@pytest.mark.parametrize(("examples", "batch"), [(1, 1), (500, 1), (1000, 2), (10_000, 20), (10**6, 256)])
def test_auto_batch_is_a_fifth_of_a_percent_of_the_examples_at_most_256(examples: int, batch: int) -> None:
    assert auto_batch_size(examples) == batch


def test_auto_multiplier_grows_with_the_batch() -> None:
    assert [auto_learning_rate_multiplier(b) for b in (1, 8, 9, 32, 33, 256)] == [0.05, 0.05, 0.1, 0.1, 0.2, 0.2]


def test_given_values_are_kept_and_checked_against_the_file() -> None:
    given = SupervisedHyperparameters(n_epochs=2, batch_size=4, learning_rate_multiplier=1)
    resolved = resolve_hyperparameters(given, examples=10, param_prefix="hyperparameters")
    assert (resolved.n_epochs, resolved.batch_size, resolved.learning_rate_multiplier) == (2, 4, 1.0)
    with pytest.raises(HyperparameterError) as refused:
        resolve_hyperparameters(given, examples=3, param_prefix="hyperparameters")
    assert refused.value.param == "hyperparameters.batch_size"


def test_dpo_resolves_as_supervised_over_pairs_and_beta_auto_is_a_tenth() -> None:
    prefix = "method.dpo.hyperparameters"
    resolved = resolve_dpo_hyperparameters(DpoHyperparameters(), examples=40, param_prefix=prefix)
    supervised = resolve_hyperparameters(SupervisedHyperparameters(), examples=40, param_prefix=prefix)
    assert resolved.model_dump() == {**supervised.model_dump(), "beta": 0.1}
    assert resolve_dpo_hyperparameters(DpoHyperparameters(beta=2), examples=40, param_prefix=prefix).beta == 2.0
    for beta in (0, -0.1, 2.01):
        with pytest.raises(HyperparameterError) as refused:
            resolve_dpo_hyperparameters(DpoHyperparameters(beta=beta), examples=40, param_prefix=prefix)
        assert refused.value.param == "method.dpo.hyperparameters.beta"
        assert str(refused.value) == "beta must be more than 0 and at most 2, or 'auto' (0.1)"


def test_the_pretraining_rate_is_the_family_s_and_ten_times_it_for_lora() -> None:
    assert pretraining_learning_rate({"model_type": "llama"}) == 3e-4
    assert pretraining_learning_rate({"model_type": "gpt_neo"}) == 6e-4
    assert pretraining_learning_rate(None) == DEFAULT_PRETRAINING_LEARNING_RATE
    assert pretraining_learning_rate({"model_type": "llama"}, lora=True) == pytest.approx(3e-3)


@pytest.mark.parametrize(
    ("batch", "devices", "layout"),
    [
        (1, 8, (1, 1, 1)),
        (12, 1, (1, 6, 2)),
        (12, 8, (6, 2, 1)),
        (64, 8, (8, 8, 1)),
        (256, 8, (8, 8, 4)),
        (7, 4, (1, 7, 1)),
    ],
)
def test_a_batch_uses_the_most_devices_that_split_it_and_the_largest_micro_batch(
    batch: int, devices: int, layout: tuple[int, int, int]
) -> None:
    found = batch_layout(batch, devices=devices)
    assert (found.num_gpus, found.micro_batch_size, found.gradient_accumulation_steps) == layout
