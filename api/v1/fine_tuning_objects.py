"""OpenAI's fine-tuning objects as ``/v1/fine_tuning/jobs`` takes and answers them.

The shapes follow the official SDK's types (``openai.types.fine_tuning``): the request of
``client.fine_tuning.jobs.create``, the ``fine_tuning.job``, ``fine_tuning.job.event`` and
``fine_tuning.job.checkpoint`` objects, and their list pages. They are views of tuneq's own
rows (``jobs``, ``job_events``, ``checkpoints``); ``api.v1.fine_tuning_service`` makes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, StrictInt, WithJsonSchema

Auto = Literal["auto"]
# OpenAI's bounds for metadata: at most 16 pairs, keys of 64 characters, values of 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_SUFFIX_CHARS = 64

# Answers carry every field, null or not, as OpenAI's do (the SDK's models expect them).
_ANSWER = ConfigDict(json_schema_serialization_defaults_required=True)
_REQUEST = ConfigDict(extra="forbid", allow_inf_nan=False)


def _left_out_when_none() -> Any:
    """A field OpenAI's schema gives a value or leaves out, never null."""
    return Field(default=None, exclude_if=lambda value: value is None)


# ---- the request -------------------------------------------------------------------------


def _auto_or(kind: type[int] | type[float]) -> Callable[[object], object]:
    """A validator of ``"auto"`` or a number of ``kind`` (an int for a float too, never a bool or
    a numeric string), refusing as one problem at the field: a plain union reports each member."""
    name = "an integer" if kind is int else "a number"

    def validate(value: object) -> object:
        if value == "auto" or (isinstance(value, (int, kind)) and not isinstance(value, bool)):
            return value
        raise ValueError(f"must be 'auto' or {name}")

    return validate


AutoOrInt = Annotated[
    Auto | int, PlainValidator(_auto_or(int)), WithJsonSchema({"anyOf": [{"const": "auto"}, {"type": "integer"}]})
]
AutoOrFloat = Annotated[
    Auto | float, PlainValidator(_auto_or(float)), WithJsonSchema({"anyOf": [{"const": "auto"}, {"type": "number"}]})
]


class SupervisedHyperparameters(BaseModel):
    """Each a number or ``"auto"`` (resolved from the training file, as OpenAI documents)."""

    model_config = _REQUEST

    n_epochs: AutoOrInt = Field(default="auto", description="Passes over the training file (1-50).")
    batch_size: AutoOrInt = Field(default="auto", description="Examples in each optimizer step (1-256).")
    learning_rate_multiplier: AutoOrFloat = Field(
        default="auto", description="Scales the learning rate the base model was pretrained with (0 to 10)."
    )


class DpoHyperparameters(SupervisedHyperparameters):
    """The supervised ones, and DPO's ``beta`` ("auto": 0.1)."""

    beta: AutoOrFloat = Field(
        default="auto",
        description="How far the model may move from the reference (more than 0, at most 2): a higher beta keeps "
        "it closer.",
    )


class SupervisedMethod(BaseModel):
    model_config = _REQUEST

    hyperparameters: SupervisedHyperparameters = Field(default_factory=SupervisedHyperparameters)


class DpoMethod(BaseModel):
    model_config = _REQUEST

    hyperparameters: DpoHyperparameters = Field(default_factory=DpoHyperparameters)


MethodType = Literal["supervised", "dpo", "reinforcement"]


class FineTuningMethod(BaseModel):
    model_config = _REQUEST

    type: MethodType
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None
    # Named so the SDK's requests for it parse; refused with a message until tuneq runs it.
    reinforcement: dict[str, Any] | None = None


class FineTuningJobCreate(BaseModel):
    """Body of ``POST /v1/fine_tuning/jobs``, as ``client.fine_tuning.jobs.create`` sends it."""

    model_config = _REQUEST

    model: str = Field(min_length=1, max_length=1000, description="The base model: a hub id or a local directory.")
    training_file: str = Field(min_length=1, max_length=200, description="The id of an uploaded file (file-...).")
    validation_file: str | None = Field(default=None, min_length=1, max_length=200)
    hyperparameters: SupervisedHyperparameters | None = Field(
        default=None,
        description="Deprecated by OpenAI in favour of method.supervised.hyperparameters; supervised jobs only.",
    )
    method: FineTuningMethod | None = None
    suffix: str | None = Field(
        default=None,
        max_length=MAX_SUFFIX_CHARS,
        pattern=r"^[A-Za-z0-9._-]*$",
        description="Part of fine_tuned_model's name: letters, digits, '.', '_' and '-'.",
    )
    seed: StrictInt | None = Field(default=None, ge=0, le=2**31 - 1, description="Chosen at random when left out.")
    metadata: dict[str, str] | None = Field(default=None, description="Up to 16 pairs, to find the job by later.")
    integrations: list[dict[str, Any]] | None = Field(default=None, description="Not supported yet: leave it out.")


# ---- the answers -------------------------------------------------------------------------


class FineTuningJobError(BaseModel):
    code: str
    message: str
    param: str | None


class ResolvedHyperparameters(BaseModel):
    """The numbers a job trains with ("auto" resolved)."""

    model_config = _ANSWER

    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float


class ResolvedDpoHyperparameters(ResolvedHyperparameters):
    beta: float


class ResolvedSupervisedMethod(BaseModel):
    model_config = _ANSWER

    hyperparameters: ResolvedHyperparameters


class ResolvedDpoMethod(BaseModel):
    model_config = _ANSWER

    hyperparameters: ResolvedDpoHyperparameters


class SupervisedJobMethod(BaseModel):
    """A supervised job's ``method``, as OpenAI shows it: ``{"type": "supervised", "supervised": {...}}``."""

    model_config = _ANSWER

    type: Literal["supervised"] = "supervised"
    supervised: ResolvedSupervisedMethod


class DpoJobMethod(BaseModel):
    """A DPO job's ``method``, as OpenAI shows it: ``{"type": "dpo", "dpo": {"hyperparameters": {...}}}``."""

    model_config = _ANSWER

    type: Literal["dpo"] = "dpo"
    dpo: ResolvedDpoMethod


# Each job's method shows its own member only, as OpenAI's do (no ``"dpo": null`` on a supervised job).
ResolvedMethod = Annotated[SupervisedJobMethod | DpoJobMethod, Field(discriminator="type")]


# validating_files: the worker is reading and tokenizing the files (no plan yet); paused is
# OpenAI's too (jobs.pause).
FineTuningStatus = Literal["validating_files", "queued", "running", "paused", "succeeded", "failed", "cancelled"]


class FineTuningJobPublic(BaseModel):
    """OpenAI's ``fine_tuning.job`` (the SDK's ``FineTuningJob``): a view of one ``jobs`` row."""

    model_config = _ANSWER

    id: str  # ftjob-<the job's uuid, hex>: the native /jobs/{uuid} is the same job
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    finished_at: int | None
    model: str
    fine_tuned_model: str | None  # set once it succeeded: its model export's name
    organization_id: str  # the owner
    status: FineTuningStatus
    training_file: str
    validation_file: str | None
    # OpenAI's deprecated place: the method's batch size, epochs and multiplier (a DPO job's too).
    hyperparameters: ResolvedHyperparameters
    method: ResolvedMethod
    result_files: list[str]  # file ids: the job's per-step metrics as CSV, once it succeeded
    trained_tokens: int | None
    error: FineTuningJobError | None
    seed: int
    estimated_finish: int | None
    metadata: dict[str, str] | None
    user_provided_suffix: str | None
    integrations: list[dict[str, Any]] | None = None


class FineTuningJobListPublic(BaseModel):
    model_config = _ANSWER

    object: Literal["list"] = "list"
    data: list[FineTuningJobPublic]
    has_more: bool


class FineTuningJobEventPublic(BaseModel):
    """OpenAI's ``fine_tuning.job.event``: one of the job's events, as a sentence and its data."""

    model_config = _ANSWER

    id: str  # ftevent-<the job_events row's id>
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    type: Literal["message", "metrics"]
    data: dict[str, Any] | None = _left_out_when_none()


class FineTuningJobEventListPublic(BaseModel):
    model_config = _ANSWER

    object: Literal["list"] = "list"
    data: list[FineTuningJobEventPublic]
    has_more: bool


class CheckpointMetrics(BaseModel):
    model_config = _ANSWER

    step: float | None = _left_out_when_none()
    train_loss: float | None = _left_out_when_none()
    valid_loss: float | None = _left_out_when_none()


class FineTuningJobCheckpointPublic(BaseModel):
    """OpenAI's ``fine_tuning.job.checkpoint``: one of the job's resumable DeepSpeed checkpoints."""

    model_config = _ANSWER

    id: str  # ftckpt-<the checkpoints row's id>
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuning_job_id: str
    fine_tuned_model_checkpoint: str
    step_number: int
    metrics: CheckpointMetrics


class FineTuningJobCheckpointListPublic(BaseModel):
    model_config = _ANSWER

    object: Literal["list"] = "list"
    data: list[FineTuningJobCheckpointPublic]
    first_id: str | None
    last_id: str | None
    has_more: bool


# ---- models ------------------------------------------------------------------------------


class ModelPublic(BaseModel):
    """OpenAI's ``model`` (the SDK's ``openai.types.Model``): a base model the deployment offers,
    or a model one of the caller's jobs fine-tuned."""

    model_config = _ANSWER

    id: str  # what a job's ``model`` names; a fine-tuned one's ``fine_tuned_model``
    object: Literal["model"] = "model"
    created: int  # Unix seconds: when it was saved (a local base model), or its job finished
    owned_by: str  # "system" for a base model, the owner for a fine-tuned one


class ModelDeletedPublic(BaseModel):
    """OpenAI's answer to a model's delete (the SDK's ``openai.types.ModelDeleted``)."""

    model_config = _ANSWER

    id: str
    object: Literal["model"] = "model"
    deleted: bool


class ModelListPublic(BaseModel):
    model_config = _ANSWER

    object: Literal["list"] = "list"
    data: list[ModelPublic]
