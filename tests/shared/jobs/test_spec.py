from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from shared.jobs.spec import JobCreate, TrainingOptions


def body(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": "EleutherAI/gpt-neo-125m", "dataset": "/data/x.jsonl", "deepspeed_config": {}}
    base.update(overrides)
    return base


def test_defaults() -> None:
    job = JobCreate.model_validate(body())
    assert job.num_gpus == 1
    assert job.training == TrainingOptions(epochs=1, log_every_steps=1)
    assert job.training.max_steps is None


def test_unknown_top_level_field_is_refused() -> None:
    with pytest.raises(ValidationError) as e:
        JobCreate.model_validate(body(deepspeed={}))
    assert e.value.errors()[0]["loc"] == ("deepspeed",)
    assert e.value.errors()[0]["type"] == "extra_forbidden"


def test_unknown_training_field_is_refused() -> None:
    with pytest.raises(ValidationError) as e:
        JobCreate.model_validate(body(training={"max_step": 3}))
    assert e.value.errors()[0]["loc"] == ("training", "max_step")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_steps", 0),
        ("max_steps", -1),
        ("epochs", 0),
        ("max_seq_length", 4),
        ("checkpoint_every_steps", 0),
        ("log_every_steps", 0),
        ("seed", -1),
    ],
)
def test_training_numbers_out_of_range(field: str, value: int) -> None:
    with pytest.raises(ValidationError) as e:
        JobCreate.model_validate(body(training={field: value}))
    assert e.value.errors()[0]["loc"] == ("training", field)


@pytest.mark.parametrize("num_gpus", [0, -2])
def test_num_gpus_must_be_positive(num_gpus: int) -> None:
    with pytest.raises(ValidationError) as e:
        JobCreate.model_validate(body(num_gpus=num_gpus))
    assert e.value.errors()[0]["loc"] == ("num_gpus",)


def test_deepspeed_config_must_be_an_object() -> None:
    with pytest.raises(ValidationError):
        JobCreate.model_validate(body(deepspeed_config=[1, 2]))


def test_max_seq_length_left_out_follows_the_model() -> None:
    """A default the user never set must not fail a model with fewer positions (a 128-position
    model used to fail at step 0 on the default 512)."""
    options = TrainingOptions()
    assert options.max_seq_length is None
    assert options.for_model(128).max_seq_length == 128
    assert options.for_model(2048).max_seq_length == 512
    assert options.for_model(None).max_seq_length == 512
    assert TrainingOptions(max_seq_length=64).for_model(128).max_seq_length == 64
    with pytest.raises(ValueError, match="max_seq_length 256 exceeds the model's 128 positions: set it to 128"):
        TrainingOptions(max_seq_length=256).for_model(128)


def test_a_models_positions_come_from_its_config() -> None:
    from shared.jobs.spec import max_positions_of

    assert max_positions_of({"max_position_embeddings": 2048}) == 2048
    assert max_positions_of({"n_positions": 1024}) == 1024  # GPT-2's name
    assert max_positions_of({"text_config": {"max_position_embeddings": 4096}}) == 4096
    assert max_positions_of({}) is None


def test_max_steps_is_the_number_of_steps_the_data_repeating_as_needed() -> None:
    """As the Hugging Face Trainer's max_steps: 1000 steps on 50 steps an epoch is 1000 steps
    (20 passes), not a cap that a one-epoch run never reaches."""
    from shared.data.prepared import count_epochs, count_total_steps

    assert count_total_steps(50, TrainingOptions(max_steps=1000)) == 1000
    assert count_total_steps(50, TrainingOptions(max_steps=10, epochs=3)) == 10  # overrides epochs both ways
    assert count_total_steps(50, TrainingOptions(epochs=3)) == 150
    assert count_epochs(50, 1000) == 20
    assert count_epochs(50, 1001) == 21  # the last pass is partial
    assert count_epochs(50, 10) == 1
