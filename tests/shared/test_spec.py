from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from shared.spec import JobCreate, TrainingOptions


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
