"""What the fine-tuning routes (``/v1/fine_tuning/jobs``) do, as keyword-only functions over a
session. No HTTP in here.

``/v1`` is a second door onto the very jobs ``/jobs`` serves, not a second system: a request is
translated into a native ``JobCreate`` (an uploaded file as the dataset, "auto" hyperparameters
resolved, a DeepSpeed config chosen by tuneq) and created by ``api.jobs_service.create_job``,
which validates, stores and enqueues it as it does every job. Every ``jobs`` row of the owner is
then a ``fine_tuning.job``, native ones included; ``fine_tuning_job_public`` makes the view.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import re
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from sqlmodel import Session, col, select

from api.auth import Caller
from api.jobs_service import create_job, deployment_hardware, get_job
from api.model_sources import ModelNotNamed, base_model_of, fine_tuned_model_name, model_source
from api.v1.errors import OpenAIRequestError
from api.v1.files_service import get_file, not_training_data
from api.v1.fine_tuning_objects import (
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_CHARS,
    CheckpointMetrics,
    DpoHyperparameters,
    DpoJobMethod,
    FineTuningJobCheckpointListPublic,
    FineTuningJobCheckpointPublic,
    FineTuningJobCreate,
    FineTuningJobError,
    FineTuningJobEventListPublic,
    FineTuningJobEventPublic,
    FineTuningJobListPublic,
    FineTuningJobPublic,
    FineTuningMethod,
    FineTuningStatus,
    ResolvedDpoHyperparameters,
    ResolvedDpoMethod,
    ResolvedHyperparameters,
    ResolvedSupervisedMethod,
    SupervisedHyperparameters,
    SupervisedJobMethod,
)
from api.v1.hyperparameters import (
    BatchLayout,
    HyperparameterError,
    batch_layout,
    pretraining_learning_rate,
    resolve_dpo_hyperparameters,
    resolve_hyperparameters,
)
from api.v1.pages import past_cursor
from shared.data.preference import EXAMPLES as PREFERENCE_EXAMPLES
from shared.data.uploaded_files import check_uploaded_file, uploaded_file_path
from shared.db.job_events import newest_events
from shared.db.models import Checkpoint, CheckpointKind, EventType, File, Job, JobEvent, JobMetric, as_utc
from shared.jobs.model_source import checkpoint_name, names_a_job
from shared.jobs.spec import DpoOptions, JobCreate, TrainingOptions
from shared.jobs.status import JobStatus
from shared.jobs.validation import JobValidationError, local_model_config
from shared.settings import Settings

logger = logging.getLogger(__name__)

JOB_ID_PREFIX, EVENT_ID_PREFIX, CHECKPOINT_ID_PREFIX = "ftjob-", "ftevent-", "ftckpt-"
_JOB_ID = re.compile(r"ftjob-([0-9a-f]{32})")
# OpenAI's defaults for one page of each list.
DEFAULT_JOBS_LIMIT, DEFAULT_EVENTS_LIMIT, DEFAULT_CHECKPOINTS_LIMIT = 20, 20, 10
MAX_LIST_LIMIT = 100
# OpenAI keeps the checkpoints of a job's last three epochs.
KEPT_CHECKPOINTS = 3
# The native fields a validation problem names, as the OpenAI request names them.
_PARAMS = {"model": "model", "dataset": "training_file", "validation_dataset": "validation_file"}
# The events a fine_tuning.job lists: what happened to the job, not its training log's lines or
# the transfers of its files (the native /jobs/{id}/events has those).
LISTED_EVENTS = (
    EventType.status,
    EventType.plan,
    EventType.metric,
    EventType.checkpoint,
    EventType.resumed,
    EventType.phase,
    EventType.warning,
)


class FineTuningRequestError(OpenAIRequestError):
    """A fine-tuning request the caller must change (see OpenAIRequestError)."""


# ---- ids ---------------------------------------------------------------------------------


def public_job_id(job_id: uuid.UUID) -> str:
    return f"{JOB_ID_PREFIX}{job_id.hex}"


def native_job_id(fine_tuning_job_id: str) -> uuid.UUID | None:
    """The job's uuid from its ``ftjob-`` id; None for anything else (not found, no query)."""
    match = _JOB_ID.fullmatch(fine_tuning_job_id)
    return uuid.UUID(match.group(1)) if match else None


def _cursor(value: str | None, prefix: str, param: str) -> int | None:
    """The row id of an ``after`` cursor (``ftevent-12``): None when not given."""
    if value is None:
        return None
    number = value.removeprefix(prefix)
    if not value.startswith(prefix) or not number.isdecimal() or len(number) > 18:
        raise FineTuningRequestError(f"after: {value!r} is not an id this list gave (like {prefix}123)", param=param)
    return int(number)


def get_fine_tuning_job(*, session: Session, fine_tuning_job_id: str, owner: str) -> Job | None:
    """``owner``'s job by its ``ftjob-`` id; another owner's is not found, like a missing one."""
    job_id = native_job_id(fine_tuning_job_id)
    return get_job(session=session, job_id=job_id, caller=Caller(owner=owner)) if job_id is not None else None


# ---- creating ------------------------------------------------------------------------------


# The methods tuneq runs, as OpenAI names them (a native job's training.method: sft, dpo).
JobMethod = Literal["supervised", "dpo"]
METHOD_MEMBERS = ("supervised", "dpo", "reinforcement")


@dataclass(frozen=True)
class RequestedHyperparameters:
    """The method a request asks for, its hyperparameters as given ("auto" or numbers), and
    where it gave them (OpenAI's param name, for errors)."""

    method: JobMethod
    values: SupervisedHyperparameters | DpoHyperparameters
    where: str


def _check_method_members(method: FineTuningMethod) -> None:
    """Only the member of the method's own type: ``method.dpo`` on a supervised job is a mistake."""
    for member in METHOD_MEMBERS:
        if member != method.type and getattr(method, member) is not None:
            raise FineTuningRequestError(
                f"method.{member} is for method.type '{member}', not {method.type!r}: leave it out, or set "
                f"method.type to '{member}'",
                param=f"method.{member}",
            )


def _requested_hyperparameters(request: FineTuningJobCreate) -> RequestedHyperparameters:
    """The method and hyperparameters the request gave. Raises FineTuningRequestError for a
    method tuneq does not run, or hyperparameters given twice or in another method's place."""
    method = request.method
    if method is None:
        return RequestedHyperparameters(
            "supervised", request.hyperparameters or SupervisedHyperparameters(), "hyperparameters"
        )
    if method.type == "reinforcement":
        raise FineTuningRequestError(
            "method.type 'reinforcement' is not one tuneq runs yet: use 'supervised' or 'dpo'", param="method.type"
        )
    _check_method_members(method)
    if request.hyperparameters is not None and (method.type == "dpo" or method.supervised is not None):
        raise FineTuningRequestError(
            f"give the hyperparameters once, under method.{method.type}.hyperparameters (the top-level "
            "hyperparameters is OpenAI's deprecated place for a supervised job's)",
            param="hyperparameters",
        )
    if method.type == "dpo":
        values = method.dpo.hyperparameters if method.dpo is not None else DpoHyperparameters()
        return RequestedHyperparameters("dpo", values, "method.dpo.hyperparameters")
    if method.supervised is not None:
        return RequestedHyperparameters(
            "supervised", method.supervised.hyperparameters, "method.supervised.hyperparameters"
        )
    return RequestedHyperparameters(
        "supervised", request.hyperparameters or SupervisedHyperparameters(), "hyperparameters"
    )


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise FineTuningRequestError(
            f"metadata has {len(metadata)} pairs: give at most {MAX_METADATA_PAIRS}", param="metadata"
        )
    for key, value in metadata.items():
        if not 0 < len(key) <= MAX_METADATA_KEY_CHARS:
            raise FineTuningRequestError(
                f"metadata key {key[:80]!r} must be 1 to {MAX_METADATA_KEY_CHARS} characters", param="metadata"
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise FineTuningRequestError(
                f"metadata[{key}] is {len(value)} characters long: give at most {MAX_METADATA_VALUE_CHARS}",
                param="metadata",
            )


def _owners_file(session: Session, file_id: str, owner: str, param: str) -> File:
    """The owner's uploaded file to train on; a results file (a job's ``result_files``), as
    OpenAI does, is refused here rather than failing the job at its first line."""
    file = get_file(session=session, file_id=file_id, owner=owner)
    if file is None:
        raise FineTuningRequestError(
            f"{param}: no file {file_id!r} of yours: upload it with POST /v1/files (purpose 'fine-tune') and "
            "give its id",
            param=param,
            code="file_not_found",
        )
    if (refusal := not_training_data(file)) is not None:
        raise FineTuningRequestError(f"{param}: {refusal}", param=param, code="invalid_file_purpose")
    return file


# OpenAI refuses a job on fewer training examples; the native API trains on any number.
MIN_TRAINING_EXAMPLES = 10


def training_examples(*, session: Session, settings: Settings, file: File) -> int:
    """The records of an uploaded file, counted at upload (or now, once, for a file uploaded
    before tuneq counted them)."""
    if file.records is None:
        # This host's checked copy, the one the plan reads too.
        checked = check_uploaded_file(
            uploaded_file_path(file.id, settings=settings), max_line_bytes=settings.max_line_bytes
        )
        file.records, file.dataset_format = checked.records, checked.dataset_format
        session.add(file)
        session.commit()
    return file.records


def _check_method_takes(file: File, param: str, method: JobMethod) -> None:
    """A supervised job trains on chat records, a DPO job on DPO records (each accepted at upload,
    as OpenAI accepts them; ``File.dataset_format`` None: chat, uploaded before tuneq took DPO
    files): a file of the other kind is refused, naming the method."""
    if method == "dpo" and file.dataset_format != "preference":
        raise FineTuningRequestError(
            f"{param} {file.id} holds chat records (OpenAI's chat format: messages), which method 'dpo' cannot "
            f"train on: a DPO job trains on preference records like {PREFERENCE_EXAMPLES['openai']}; upload such a "
            "file, or train this one with method 'supervised'",
            param=param,
        )
    if method == "supervised" and file.dataset_format == "preference":
        raise FineTuningRequestError(
            f"{param} {file.id} holds preference records (OpenAI's DPO format: input, preferred_output, "
            "non_preferred_output), which method 'supervised' cannot train on: a supervised job trains on chat "
            'records like {"messages": [...]}; upload such a file, or train this one with method {"type": "dpo"}',
            param=param,
        )


def _base_model(session: Session, model: str, owner: str) -> str:
    """The base model ``model`` starts from: itself, or where the chain of jobs whose output it
    names (an ``ft:`` name, ``job:<id>``) started. Raises FineTuningRequestError for such a name
    that names nothing the owner may continue from."""
    if not names_a_job(model):
        return model
    try:
        return model_source(session=session, model=model, owner=owner).base_model
    except ModelNotNamed as e:
        raise FineTuningRequestError(str(e), param="model", code="model_not_found") from None


def _gpus_per_job(*, session: Session, settings: Settings) -> int:
    """The GPUs an OpenAI-style job may spread its batch over: the largest live worker's. One
    on CPU workers, whose "devices" are cores: ranks there share the host's memory and cores,
    and one rank with all of them runs a small model fastest."""
    hardware = deployment_hardware(session=session, settings=settings)
    if hardware is None or hardware.accelerator == "cpu":
        return 1
    return hardware.device_count


def request_fingerprint(request: FineTuningJobCreate) -> str:
    """Of the request as sent: the job it makes holds values chosen per request (a random seed)."""
    canonical = request.model_dump_json(exclude_unset=True)
    return "v1:" + hashlib.sha256(canonical.encode()).hexdigest()


def create_fine_tuning_job(
    *,
    session: Session,
    settings: Settings,
    owner: str,
    request: FineTuningJobCreate,
    idempotency_key: str | None = None,
) -> Job:
    """Translate an OpenAI request into a native job and create it through ``create_job``.

    The job trains ``n_epochs`` over the training file in batches of ``batch_size`` examples
    split over as many of a GPU worker's devices as divide it (one rank on CPU workers), at
    ``learning_rate_multiplier`` x the model family's pretraining rate, with a DeepSpeed config tuneq chooses, saving a
    checkpoint every epoch and keeping the last three (as OpenAI does), and measuring the
    validation file's loss every epoch. Method ``dpo`` makes a native ``training.method: "dpo"``
    job with ``training.dpo.beta`` (an example being a pair). Raises
    FineTuningRequestError, or create_job's errors."""
    requested = _requested_hyperparameters(request)
    _check_request(request)
    examples = _checked_training_examples(
        session=session, settings=settings, owner=owner, request=request, method=requested.method
    )
    resolved = _resolved_hyperparameters(requested, examples=examples)
    layout = batch_layout(resolved.batch_size, devices=_gpus_per_job(session=session, settings=settings))
    base_rate = pretraining_learning_rate(local_model_config(_base_model(session, request.model, owner)))
    job_in = JobCreate(
        model=request.model,
        dataset=request.training_file,
        validation_dataset=request.validation_file,
        num_gpus=layout.num_gpus,
        name=request.suffix or None,
        training=_training_options(
            resolved,
            layout=layout,
            examples=examples,
            learning_rate=resolved.learning_rate_multiplier * base_rate,
            seed=request.seed if request.seed is not None else secrets.randbelow(2**31),
            validated=request.validation_file is not None,
        ),
    )
    job, created = _create_native_job(
        session=session,
        settings=settings,
        owner=owner,
        request=request,
        job_in=job_in,
        resolved=resolved,
        idempotency_key=idempotency_key,
    )
    if created:
        logger.info(
            "fine-tuning job %s (%s): %d epochs of %d examples in batches of %d on %d ranks, lr %.3g",
            public_job_id(job.id),
            requested.method,
            resolved.n_epochs,
            examples,
            resolved.batch_size,
            layout.num_gpus,
            job_in.training.learning_rate,
        )
    return job


def _check_request(request: FineTuningJobCreate) -> None:
    """What the request names that tuneq refuses whatever its files: integrations, bad metadata."""
    if request.integrations:
        raise FineTuningRequestError(
            "integrations are not supported yet: leave them out (metrics are on GET /v1/fine_tuning/jobs/{id}/events)",
            param="integrations",
        )
    _check_metadata(request.metadata)


def _checked_training_examples(
    *, session: Session, settings: Settings, owner: str, request: FineTuningJobCreate, method: JobMethod
) -> int:
    """The training file's examples, once both files are the owner's, data to train on, of the
    kind ``method`` trains on, and the training file holds at least MIN_TRAINING_EXAMPLES."""
    training_file = _owners_file(session, request.training_file, owner, "training_file")
    validation_file = None
    if request.validation_file is not None:
        validation_file = _owners_file(session, request.validation_file, owner, "validation_file")
    examples = training_examples(session=session, settings=settings, file=training_file)
    _check_method_takes(training_file, "training_file", method)
    if validation_file is not None:
        _check_method_takes(validation_file, "validation_file", method)
    if examples < MIN_TRAINING_EXAMPLES:
        raise FineTuningRequestError(
            f"training_file {training_file.id} has {examples} example(s): a fine-tuning job needs at least "
            f"{MIN_TRAINING_EXAMPLES}, as OpenAI's does (the native POST /jobs takes fewer)",
            param="training_file",
            code="invalid_training_file",
        )
    return examples


def _create_native_job(
    *,
    session: Session,
    settings: Settings,
    owner: str,
    request: FineTuningJobCreate,
    job_in: JobCreate,
    resolved: ResolvedHyperparameters | ResolvedDpoHyperparameters,
    idempotency_key: str | None,
) -> tuple[Job, bool]:
    """``create_job`` with what /v1 keeps beside the native job (suffix, metadata, the method's
    hyperparameters); a native refusal as /v1's, naming OpenAI's parameter."""
    fine_tuning = {
        "suffix": request.suffix,
        "metadata": request.metadata,
        # The method's batch size, epochs and multiplier; a DPO job's beta is its training.dpo.beta.
        "hyperparameters": ResolvedHyperparameters.model_validate(resolved.model_dump()).model_dump(),
    }
    try:
        return create_job(
            session=session,
            job_in=job_in,
            settings=settings,
            owner=owner,
            idempotency_key=idempotency_key,
            fine_tuning=fine_tuning,
            fingerprint=request_fingerprint(request),
        )
    except JobValidationError as e:
        first = e.problems[0]
        field = str(first.loc[1]) if len(first.loc) > 1 else ""
        raise FineTuningRequestError(first.message, param=_PARAMS.get(field)) from None


def _resolved_hyperparameters(
    requested: RequestedHyperparameters, *, examples: int
) -> ResolvedHyperparameters | ResolvedDpoHyperparameters:
    """The requested hyperparameters as numbers, for a training file of ``examples`` records
    (pairs, for DPO). Raises FineTuningRequestError naming the one out of bounds."""
    try:
        if isinstance(requested.values, DpoHyperparameters):
            return resolve_dpo_hyperparameters(requested.values, examples=examples, param_prefix=requested.where)
        return resolve_hyperparameters(requested.values, examples=examples, param_prefix=requested.where)
    except HyperparameterError as e:
        raise FineTuningRequestError(str(e), param=e.param) from None


def _training_options(
    resolved: ResolvedHyperparameters | ResolvedDpoHyperparameters,
    *,
    layout: BatchLayout,
    examples: int,
    learning_rate: float,
    seed: int,
    validated: bool,
) -> TrainingOptions:
    """The native job's training: a checkpoint an epoch, the last three kept, and the validation
    file's loss at each epoch's end (OpenAI's full_valid_loss) when there is one (``validated``).
    DPO's hyperparameters make a ``training.method: "dpo"`` job with their beta, DPO's other
    options at their defaults."""
    steps_per_epoch = max(1, examples // resolved.batch_size)
    dpo = DpoOptions(beta=resolved.beta) if isinstance(resolved, ResolvedDpoHyperparameters) else None
    return TrainingOptions(
        method="sft" if dpo is None else "dpo",
        dpo=dpo,
        epochs=resolved.n_epochs,
        seed=seed,
        micro_batch_size=layout.micro_batch_size,
        gradient_accumulation_steps=layout.gradient_accumulation_steps,
        learning_rate=learning_rate,
        checkpoint_every_steps=steps_per_epoch,
        keep_checkpoints=KEPT_CHECKPOINTS,
        eval_every_steps=steps_per_epoch if validated else None,
    )


# ---- the job as OpenAI shows it ------------------------------------------------------------


def unix_seconds(value: datetime | None) -> int | None:
    if value is None:
        return None
    return int(as_utc(value).timestamp())


def fine_tuning_status(job: Job) -> FineTuningStatus:
    """OpenAI's status for a job's. A running job that has not planned its training yet is
    reading, checking and tokenizing its files: ``validating_files``. A cancel or pause asked of
    a running job is answered as done (the ranks stop within the grace period, and the job never
    runs again until resumed)."""
    status = job.status.value
    if status == "running" and job.total_steps is None:
        return "validating_files"
    if status == "cancelling":
        return "cancelled"
    if status == "pausing":
        return "paused"
    assert status in ("queued", "running", "paused", "succeeded", "failed", "cancelled"), status
    return status  # type: ignore[return-value]


def job_hyperparameters(job: Job, training: TrainingOptions) -> ResolvedHyperparameters:
    """As resolved at creation; for a native job, read back from its training options."""
    if job.fine_tuning is not None:
        return ResolvedHyperparameters.model_validate(job.fine_tuning["hyperparameters"])
    config = job.resolved_deepspeed_config or {}
    batch = config.get("train_batch_size")
    if not isinstance(batch, int):
        batch = training.micro_batch_size * training.gradient_accumulation_steps * job.num_gpus * job.num_nodes
    multiplier = training.learning_rate / _model_learning_rate(base_model_of(job), lora=training.lora is not None)
    return ResolvedHyperparameters(
        n_epochs=training.epochs, batch_size=batch, learning_rate_multiplier=round(multiplier, 6)
    )


@functools.lru_cache(maxsize=256)
def _model_learning_rate(model: str, *, lora: bool) -> float:
    """``pretraining_learning_rate`` of a native job's model, its config.json read once per model
    (not once per job shown: it depends on the model's family only)."""
    return pretraining_learning_rate(local_model_config(model), lora=lora)


def job_method(
    training: TrainingOptions, hyperparameters: ResolvedHyperparameters
) -> SupervisedJobMethod | DpoJobMethod:
    """The job's ``method`` as OpenAI shows it: a DPO job's (``training.method: "dpo"``, made on
    either API) with its beta, every other one supervised."""
    if training.method == "dpo" and training.dpo is not None:
        dpo = ResolvedDpoHyperparameters(**hyperparameters.model_dump(), beta=training.dpo.beta)
        return DpoJobMethod(dpo=ResolvedDpoMethod(hyperparameters=dpo))
    return SupervisedJobMethod(supervised=ResolvedSupervisedMethod(hyperparameters=hyperparameters))


def results_files(*, session: Session, jobs: Sequence[Job]) -> dict[uuid.UUID, list[str]]:
    """The results files of each of ``jobs`` (one query): OpenAI's ``result_files``."""
    found: dict[uuid.UUID, list[str]] = {job.id: [] for job in jobs}
    query = select(File.job_id, File.id).where(col(File.job_id).in_(list(found))).order_by(col(File.created_at))
    for job_id, file_id in session.exec(query):
        if job_id is not None:
            found[job_id].append(file_id)
    return found


def fine_tuning_job_public(job: Job, *, session: Session) -> FineTuningJobPublic:
    return fine_tuning_jobs_public([job], session=session)[0]


def fine_tuning_jobs_public(jobs: Sequence[Job], *, session: Session) -> list[FineTuningJobPublic]:
    files = results_files(session=session, jobs=jobs)
    return [_job_public(job, result_files=files[job.id]) for job in jobs]


def _job_public(job: Job, *, result_files: list[str]) -> FineTuningJobPublic:
    training = TrainingOptions.model_validate(job.training)
    hyperparameters = job_hyperparameters(job, training)
    succeeded = job.status == JobStatus.succeeded
    estimated_finish = None
    if job.status == JobStatus.running and job.eta_seconds is not None:
        estimated_finish = unix_seconds(datetime.now(UTC) + timedelta(seconds=job.eta_seconds))
    error = None
    if job.status == JobStatus.failed:
        error = FineTuningJobError(
            code=job.error_code or "internal_error", message=job.error_message or "the job failed", param=None
        )
    fine_tuning = job.fine_tuning or {}
    return FineTuningJobPublic(
        id=public_job_id(job.id),
        created_at=unix_seconds(job.created_at) or 0,
        finished_at=unix_seconds(job.finished_at),
        model=job.model,
        fine_tuned_model=fine_tuned_model_name(job) if succeeded else None,
        organization_id=job.owner,
        status=fine_tuning_status(job),
        training_file=job.dataset,
        validation_file=job.validation_dataset,
        hyperparameters=hyperparameters,
        method=job_method(training, hyperparameters),
        result_files=result_files,
        trained_tokens=job.tokens_seen if succeeded else None,
        error=error,
        seed=training.seed,
        estimated_finish=estimated_finish,
        metadata=fine_tuning.get("metadata"),
        user_provided_suffix=fine_tuning.get("suffix"),
    )


# ---- lists -------------------------------------------------------------------------------


def list_fine_tuning_jobs(
    *, session: Session, owner: str, after: str | None, limit: int, metadata: dict[str, str] | None
) -> FineTuningJobListPublic:
    """``owner``'s jobs, newest first, a page at a time (``after``: the last id of the page
    before). ``metadata``: only jobs whose metadata holds every pair ({}: no filter)."""
    created, ident = col(Job.created_at), col(Job.id)
    query = select(Job).where(Job.owner == owner)
    for key, value in (metadata or {}).items():
        query = query.where(col(Job.fine_tuning)[("metadata", key)].as_string() == value)
    if after is not None:
        cursor = get_fine_tuning_job(session=session, fine_tuning_job_id=after, owner=owner)
        if cursor is None:
            raise FineTuningRequestError(
                f"after: no job {after!r} of yours to continue from: pass the id of the last job of the page before",
                param="after",
            )
        query = query.where(
            past_cursor(created, ident, cursor_created=cursor.created_at, cursor_id=cursor.id, newest_first=True)
        )
    rows = session.exec(query.order_by(created.desc(), ident.desc()).limit(limit + 1)).all()
    page = fine_tuning_jobs_public(rows[:limit], session=session)
    return FineTuningJobListPublic(data=page, has_more=len(rows) > limit)


def _metric_text(data: dict[str, Any], total_steps: int | None) -> str:
    step = f"Step {data['step']}" + (f"/{total_steps}" if total_steps else "")
    parts = []
    if data.get("loss") is not None:
        parts.append(f"training loss={data['loss']:.4f}")
    if data.get("eval_loss") is not None:
        parts.append(f"validation loss={data['eval_loss']:.4f}")
    return f"{step}: {', '.join(parts) or 'no loss reported'}"


def _event_public(event: JobEvent, job: Job) -> FineTuningJobEventPublic:
    """One native event as OpenAI words it."""
    data, level, kind = event.data, "info", "message"
    payload: dict[str, Any] | None = None
    if event.type == EventType.metric:
        kind = "metrics"
        message = _metric_text(data, job.total_steps)
        payload = {"step": data["step"], "train_loss": data.get("loss"), "total_steps": job.total_steps}
        if data.get("eval_loss") is not None:
            payload["valid_loss"] = data["eval_loss"]
        if data.get("learning_rate") is not None:
            payload["learning_rate"] = data["learning_rate"]
    elif event.type == EventType.status:
        message, level = _status_text(data, job)
    elif event.type == EventType.plan:
        message = f"Training plan: {data.get('total_steps')} steps"
        payload = {"total_steps": data.get("total_steps")}
        if dropped := _dropped_text(data.get("dataset_stats") or {}):
            message, level = f"{message}. {dropped}", "warn"
    elif event.type == EventType.checkpoint:
        kind_name = data.get("kind")
        message = (
            f"Checkpoint created at step {data.get('step')}"
            if kind_name == CheckpointKind.deepspeed
            else f"Fine-tuned model exported at step {data.get('step')}"
        )
        payload = {"step": data.get("step")}
    elif event.type == EventType.resumed:
        message = f"Resumed from the checkpoint at step {data.get('from_step')}"
    elif event.type == EventType.phase:
        message = _phase_text(data)
        payload = {"done": data.get("done"), "total": data.get("total")}
    else:  # a warning
        message, level = str(data.get("message", "")), "warn"
    return FineTuningJobEventPublic(
        id=f"{EVENT_ID_PREFIX}{event.id}",
        created_at=unix_seconds(event.created_at) or 0,
        level=level,
        message=message,
        type=kind,
        data=payload,
    )


def _dropped_text(dataset_stats: dict[str, Any]) -> str | None:
    """What the plan's dataset statistics say was left out: the examples with nothing to train
    on once cut to max_seq_length (the native API shows them in ``dataset_stats`` only)."""
    parts = []
    for split, name in (("train", "training"), ("validation", "validation")):
        stats = dataset_stats.get(split) or {}
        if stats.get("dropped"):
            parts.append(
                f"{stats['dropped']} of {stats.get('records', '?')} {name} examples were left out: nothing in them "
                f"to train on once cut to {stats.get('max_seq_length', '?')} tokens"
            )
    hint = " (shorten them, or submit through the native API with a larger training.max_seq_length)"
    return "; ".join(parts) + hint if parts else None


def _phase_text(data: dict[str, Any]) -> str:
    """A DPO job's reference pass (the only phase today), as a message."""
    if data.get("cached"):
        return f"Reference log-probabilities found computed ({data.get('total')} pairs)"
    return f"Computing reference log-probabilities: {data.get('done')}/{data.get('total')} pairs"


def _status_text(data: dict[str, Any], job: Job) -> tuple[str, str]:
    status = data.get("status")
    error = data.get("error") or {}
    texts = {
        "queued": "Job queued",
        "running": f"Fine-tuning job started (attempt {data.get('attempt', 1)})",
        "cancelling": "Cancel requested: stopping the job",
        "cancelled": "Fine-tuning job cancelled",
        "pausing": "Pause requested: saving a checkpoint",
        "paused": "Fine-tuning job paused"
        + (f" at step {data['step']}: resume continues from its checkpoint" if data.get("checkpoint") else ""),
        "succeeded": f"The job has successfully completed: {fine_tuned_model_name(job)}",
        "failed": f"Fine-tuning job failed: {error.get('message', 'see the job error')}",
    }
    return texts.get(str(status), f"Job {status}"), "error" if status == "failed" else "info"


def list_fine_tuning_events(
    *, session: Session, job: Job, after: str | None, limit: int
) -> FineTuningJobEventListPublic:
    """The job's events newest first, as OpenAI lists them (``after``: the last id of the page
    before, so the next page is older)."""
    before = _cursor(after, EVENT_ID_PREFIX, "after")
    rows = newest_events(session=session, job_id=job.id, types=LISTED_EVENTS, before=before, limit=limit + 1)
    return FineTuningJobEventListPublic(data=[_event_public(e, job) for e in rows[:limit]], has_more=len(rows) > limit)


def list_fine_tuning_checkpoints(
    *, session: Session, job: Job, after: str | None, limit: int
) -> FineTuningJobCheckpointListPublic:
    """The job's resumable checkpoints newest first, with the metrics of their step."""
    before = _cursor(after, CHECKPOINT_ID_PREFIX, "after")
    query = select(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.kind == CheckpointKind.deepspeed)
    if before is not None:
        query = query.where(col(Checkpoint.id) < before)
    rows: Sequence[Checkpoint] = session.exec(query.order_by(col(Checkpoint.id).desc()).limit(limit + 1)).all()
    page = rows[:limit]
    steps = [c.step for c in page]
    metrics = {
        m.step: m
        for m in session.exec(select(JobMetric).where(JobMetric.job_id == job.id, col(JobMetric.step).in_(steps)))
    }
    name = fine_tuned_model_name(job)
    data = []
    for checkpoint in page:
        measured = metrics.get(checkpoint.step)
        data.append(
            FineTuningJobCheckpointPublic(
                id=f"{CHECKPOINT_ID_PREFIX}{checkpoint.id}",
                created_at=unix_seconds(checkpoint.created_at) or 0,
                fine_tuning_job_id=public_job_id(job.id),
                fine_tuned_model_checkpoint=checkpoint_name(name, checkpoint.step),
                step_number=checkpoint.step,
                metrics=CheckpointMetrics(
                    step=checkpoint.step,
                    train_loss=measured.loss if measured else None,
                    valid_loss=measured.eval_loss if measured else None,
                ),
            )
        )
    return FineTuningJobCheckpointListPublic(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=len(rows) > limit,
    )
