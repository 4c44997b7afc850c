"""The events rank 0 writes for the worker, one JSON object per line of ``events.jsonl``.

The file is the only channel from the training processes to the worker, so training never
waits on the database: rank 0 appends and flushes a line, the worker tails and batches.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter

from shared.db.models import ErrorCode, MetricFields


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
    attention: str | None = None  # the attention implementation the model ran (training.attention settled)
    # Fused kernels applied to the model (training.kernels), e.g. ["rms_norm", "swiglu", "rope",
    # "fused_linear_cross_entropy"]; and whether DeepSpeed's engine.compile() ran (training.compile).
    kernels: list[str] = []
    compiled: bool = False
    dataset_stats: dict[str, Any] | None = None  # {"train": DatasetStats, "validation": ...}


class MetricEvent(MetricFields):
    """One optimizer step's measures (``MetricFields``), as rank 0 reports them."""

    type: Literal["metric"] = "metric"
    tokens_seen: int = 0  # real (unpadded) tokens trained on so far, across ranks and attempts
    time: str  # ISO 8601, UTC, the moment the step finished


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


class UploadWaitEvent(BaseModel):
    """Training stopped before saving ``step``: the checkpoint of ``waiting_for`` is still
    being published to the artifact store (one upload at a time)."""

    type: Literal["upload_wait"] = "upload_wait"
    step: int
    waiting_for: int
    time: str


class WarningEvent(BaseModel):
    """Something the user asked for that the run does otherwise, and why (e.g. a kernel not
    applied under ZeRO-3): the job's ``warning`` event."""

    type: Literal["warning"] = "warning"
    message: str


TrainingEvent = Annotated[
    PlanEvent | MetricEvent | CheckpointEvent | UploadWaitEvent | WarningEvent, Field(discriminator="type")
]
training_event_adapter: TypeAdapter[PlanEvent | MetricEvent | CheckpointEvent | UploadWaitEvent | WarningEvent] = (
    TypeAdapter(TrainingEvent)
)
