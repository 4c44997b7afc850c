"""The events rank 0 writes for the worker, one JSON object per line of ``events.jsonl``.

The file is the only channel from the training processes to the worker, so training never
waits on the database: rank 0 appends and flushes a line, the worker tails and batches.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter, field_validator

from shared.db.models import ErrorCode


class PlanEvent(BaseModel):
    """Sent once the data is loaded: how many optimizer steps this run will take."""

    type: Literal["plan"] = "plan"
    total_steps: int
    steps_per_epoch: int
    num_samples: int
    num_rows: int | None = None  # rows per epoch: fewer than samples when packing
    packing: bool = False
    world_size: int
    deepspeed_config: dict[str, Any] | None = None  # as run, every "auto" filled
    # "partitioned": built under ZeRO-3's zero.Init, no rank ever held the whole model.
    model_load: Literal["full", "partitioned"] = "full"
    dataset_stats: dict[str, Any] | None = None  # {"train": DatasetStats, "validation": ...}


class MetricEvent(BaseModel):
    type: Literal["metric"] = "metric"
    step: int
    loss: float | None = None
    learning_rate: float | None = None
    grad_norm: float | None = None
    epoch: float | None = None
    tokens_per_second: float | None = None
    samples_per_second: float | None = None
    real_token_share: float | None = None  # real tokens / (rows x padded width) in the step
    eval_loss: float | None = None
    tokens_seen: int = 0  # real (unpadded) tokens trained on so far, across ranks and attempts
    time: str  # ISO 8601, UTC, the moment the step finished

    @field_validator(
        "loss",
        "learning_rate",
        "grad_norm",
        "epoch",
        "tokens_per_second",
        "samples_per_second",
        "real_token_share",
        "eval_loss",
    )
    @classmethod
    def _finite_or_none(cls, value: float | None) -> float | None:
        # A diverged loss (NaN, inf) is reported as null: JSON has no NaN (a Postgres json
        # column refuses it, and so do the API's answers). The ranks' writer already writes
        # null; this holds for any line that reads NaN too.
        return value if value is None or math.isfinite(value) else None


class CheckpointEvent(BaseModel):
    """Written only after the checkpoint's manifest is complete."""

    type: Literal["checkpoint"] = "checkpoint"
    step: int
    kind: Literal["deepspeed", "model", "adapter"]
    uri: str
    bytes: int
    time: str


class RankError(BaseModel):
    """What a rank writes to ``errors/rank-<n>.json`` before it exits non-zero."""

    rank: int
    code: ErrorCode
    message: str
    time: str


TrainingEvent = Annotated[PlanEvent | MetricEvent | CheckpointEvent, Field(discriminator="type")]
training_event_adapter: TypeAdapter[PlanEvent | MetricEvent | CheckpointEvent] = TypeAdapter(TrainingEvent)
