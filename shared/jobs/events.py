"""The events rank 0 writes for the worker, one JSON object per line of ``events.jsonl``.

The file is the only channel from the training processes to the worker, so training never
waits on the database: rank 0 appends and flushes a line, the worker tails and batches.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, TypeAdapter

from shared.jobs.status import ErrorCode


def _finite_or_none(value: float | None) -> float | None:
    # A diverged loss (NaN, inf) is reported as null: JSON has no NaN (a Postgres json column
    # refuses it, and so do the API's answers). The ranks' writer already writes null; this
    # holds for any line that reads NaN too.
    return value if value is None or math.isfinite(value) else None


Measure = Annotated[float | None, AfterValidator(_finite_or_none)]


class MetricFields(BaseModel):
    """The measures of one optimizer step, in one place for the three shapes that carry them.

    Rank 0's line in events.jsonl (``MetricEvent`` below), the ``job_metrics`` row
    (``shared.db.models.JobMetric``) and the API's answer (``MetricPublic``, beside it) all
    derive from this: a new measure is a line here (plus its migration). ``time`` is not here
    because each shape holds it as something else: an ISO string in the file, a timezone-aware
    column, a UTC datetime out.
    A plain pydantic model, not an SQLModel: the event must stay one, since SQLModel's
    ``__init__`` validates each object a second time and the worker parses every line.
    """

    step: int
    loss: Measure = None
    learning_rate: Measure = None
    grad_norm: Measure = None
    epoch: Measure = None
    tokens_per_second: Measure = None
    samples_per_second: Measure = None
    # Share of the step's token slots that held real tokens (the rest is padding).
    real_token_share: Measure = None
    eval_loss: Measure = None
    # Preference tuning (DPO) only, TRL's DPOTrainer's measures under TRL's names with "_" for
    # "/" (rewards/chosen is rewards_chosen): the means over the step's pairs of beta times the
    # policy's log-ratio to the reference for each answer, the share of pairs whose chosen
    # reward is the higher, and the mean margin; the answers' summed log-probabilities; their
    # tokens' mean logit. eval_rewards_accuracies: rewards_accuracies on the validation pairs.
    rewards_chosen: Measure = None
    rewards_rejected: Measure = None
    rewards_accuracies: Measure = None
    rewards_margins: Measure = None
    logps_chosen: Measure = None
    logps_rejected: Measure = None
    logits_chosen: Measure = None
    logits_rejected: Measure = None
    eval_rewards_accuracies: Measure = None


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


class PhaseEvent(BaseModel):
    """Work of the ranks before the first step that takes a while, with its progress: today
    the reference model's log-probabilities of a DPO job's answers (``reference_logps``),
    ``done`` of ``total`` pairs; ``cached``: found computed (this job's checkpoint, or the
    host's cache), nothing to compute."""

    type: Literal["phase"] = "phase"
    name: Literal["reference_logps"]
    done: int
    total: int
    cached: bool = False
    time: str


TrainingEvent = Annotated[
    PlanEvent | MetricEvent | CheckpointEvent | UploadWaitEvent | WarningEvent | PhaseEvent,
    Field(discriminator="type"),
]
training_event_adapter: TypeAdapter[
    PlanEvent | MetricEvent | CheckpointEvent | UploadWaitEvent | WarningEvent | PhaseEvent
] = TypeAdapter(TrainingEvent)
