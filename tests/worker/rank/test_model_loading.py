"""What the ranks settle from the model's own config before they read any data."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from cli.samples import build_tiny_model
from shared.jobs.spec import TrainingOptions, TrainingSpec
from worker.errors import InvalidInputError
from worker.rank.model_loading import load_config, settle_training


def spec(model: Path, training: TrainingOptions) -> TrainingSpec:
    return TrainingSpec(
        job_id=uuid.uuid4(),
        attempt=1,
        model=str(model),
        dataset="/data/train.jsonl",
        deepspeed_config={},
        num_gpus=1,
        training=training,
        run_dir="/runs/x",
        cache_dir="/cache",
    )


def test_the_ranks_settle_max_seq_length_from_the_models_config(tmp_path: Path) -> None:
    """What a hub model gets (the API cannot read its config): the default follows the model,
    and a value past its positions fails the attempt as the user's input, before any data."""
    model = build_tiny_model(tmp_path / "model", max_positions=128)
    config = load_config(spec(model, TrainingOptions()))
    assert settle_training(spec(model, TrainingOptions()), config).max_seq_length == 128
    with pytest.raises(InvalidInputError, match="max_seq_length 4096 exceeds the model's 128 positions"):
        settle_training(spec(model, TrainingOptions(max_seq_length=4096)), config)
    with pytest.raises(InvalidInputError, match="cannot load its config"):
        load_config(spec(tmp_path / "missing", TrainingOptions()))
