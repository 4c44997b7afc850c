"""A job's ``model`` naming another job's output instead of a base model: continuing from a
fine-tuned model.

Two spellings name the same things:

- tuneq's own: ``job:<id>`` (the job's exported model) and ``job:<id>@step-<n>`` (its DeepSpeed
  checkpoint at step n);
- OpenAI's: the job's ``fine_tuned_model`` (``ft:<base>:<owner>:<suffix>:<12 hex digits of the
  job id>``) and a checkpoint's ``fine_tuned_model_checkpoint`` (the same, then ``:ckpt-step-<n>``).

The API resolves either at submit (``api.model_sources``): the named job must be the caller's and
have succeeded, and what it names must be committed to the artifact store. What it found is
recorded on the job as a :class:`ModelSource`; the worker makes it a local model directory
(``worker.base_model``) that the ranks load as they load any other.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

JOB_PREFIX, FINE_TUNED_PREFIX = "job:", "ft:"
_JOB = re.compile(
    r"job:(?P<id>[0-9A-Fa-f]{8}(?:-?[0-9A-Fa-f]{4}){3}-?[0-9A-Fa-f]{12})(?:@step-(?P<step>[1-9]\d{0,17}))?"
)
# The owner and suffix parts are what an owner name and a suffix may hold (api_keys, /v1's suffix),
# neither of which has a ':'; the base model's part may (a local directory's name).
_FINE_TUNED = re.compile(
    r"(?P<name>ft:.+:[A-Za-z0-9._@+-]+:[A-Za-z0-9._-]*:(?P<job>[0-9a-f]{12}))(?::ckpt-step-(?P<step>[1-9]\d{0,17}))?"
)
# How many hex digits of the job id an ``ft:`` name holds.
FINE_TUNED_ID_DIGITS = 12

SourceKind = Literal["model", "adapter", "deepspeed"]


def names_a_job(model: str) -> bool:
    """Whether ``model`` names another job's output rather than a base model."""
    return model.startswith((JOB_PREFIX, FINE_TUNED_PREFIX))


@dataclass(frozen=True)
class ModelReference:
    """A parsed ``job:``/``ft:`` model: the job by its id (``job:``) or by its ``ft:`` name (the
    name without the checkpoint part, and the job id's first digits, which the name holds), and
    the checkpoint's step when one is named (None: the exported model)."""

    job_id: uuid.UUID | None
    fine_tuned_name: str | None
    id_prefix: str | None
    step: int | None


def parse_model_reference(model: str) -> ModelReference:
    """Raise ValueError, saying what the forms are, for a ``job:``/``ft:`` model that is neither."""
    if model.startswith(JOB_PREFIX):
        match = _JOB.fullmatch(model)
        if match is None:
            raise ValueError(
                f"'{model[:120]}' is not a job's output: name a job's exported model as job:<job id> or one of "
                "its DeepSpeed checkpoints as job:<job id>@step-<n>"
            )
        step = match.group("step")
        return ModelReference(uuid.UUID(match.group("id")), None, None, int(step) if step else None)
    match = _FINE_TUNED.fullmatch(model)
    if match is None:
        raise ValueError(
            f"'{model[:120]}' is not a fine-tuned model's name: give a job's fine_tuned_model "
            "(ft:<base>:<owner>:<suffix>:<id>) or a checkpoint's fine_tuned_model_checkpoint (…:ckpt-step-<n>)"
        )
    step = match.group("step")
    return ModelReference(None, match.group("name"), match.group("job"), int(step) if step else None)


def fine_tuned_name(*, base_model: str, owner: str, suffix: str, job_id: uuid.UUID) -> str:
    """``ft:<base model>:<owner>:<suffix>:<job>``, OpenAI's form. A local model directory is
    named by its last part."""
    base = base_model.rstrip("/").rsplit("/", 1)[-1] if base_model.startswith("/") else base_model
    return f"ft:{base}:{owner}:{suffix}:{job_id.hex[:FINE_TUNED_ID_DIGITS]}"


def checkpoint_name(fine_tuned: str, step: int) -> str:
    """A checkpoint's ``fine_tuned_model_checkpoint``: its job's ``fine_tuned_model`` and the step."""
    return f"{fine_tuned}:ckpt-step-{step}"


class ModelSource(BaseModel):
    """What a job's ``model`` naming another job was resolved to at submit (``jobs.model_source``).

    ``kind``: ``model``, the job's exported Hugging Face model (a full fine-tune's, or a LoRA
    job's merged one); ``adapter``, a LoRA job's adapter, which the worker merges into that
    job's own base; ``deepspeed``, its DeepSpeed checkpoint at ``step``, whose weights the worker
    puts into that job's model (and merges, for a LoRA job's). ``step`` is the export's step for
    the first two. ``base_model``: the base model the chain of jobs started from, which names the
    job's own fine-tuned model as OpenAI names it (``ft:<base model>:…``)."""

    model_config = ConfigDict(extra="forbid")

    job_id: uuid.UUID
    kind: SourceKind
    step: int
    base_model: str
