"""What the job routes do, as keyword-only functions over a session. No HTTP in here."""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy
from sqlalchemy import func, text
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from api.auth import Caller
from api.model_sources import ResolvedModel, resolve_model
from api.v1.files_service import get_file, not_training_data
from shared.data.preference import supervised_refusal
from shared.data.records import preference_refusal
from shared.data.uploaded_files import is_file_id
from shared.db.engine import get_read_engine
from shared.db.gangs import current_nodes, place_and_start
from shared.db.job_events import last_log_events, list_events
from shared.db.lifecycle import (
    ACTIVE,
    live_since,
    live_worker,
    mark_committed_job_published,
    mark_published,
    record_event,
    request_cancel,
    request_pause,
    request_resume,
    route_job,
    smallest_fitting_queue,
)
from shared.db.models import (
    Checkpoint,
    CheckpointKind,
    EventType,
    Job,
    JobEvent,
    JobMetric,
    JobPublic,
    MetricPublic,
    MetricsPublic,
    Worker,
)
from shared.jobs.hardware import Hardware
from shared.jobs.spec import JobCreate, TrainingOptions
from shared.jobs.status import JobStatus
from shared.jobs.validation import JobValidationError, Problem, ValidatedRequest, validate_job_request
from shared.queue import enqueue_job
from shared.settings import Settings

logger = logging.getLogger(__name__)


def deployment_hardware(*, session: Session, settings: Settings) -> Hardware | None:
    """The most the workers seen lately offer, and each of them with its memory and bf16
    support (what a chosen DeepSpeed config must fit); None when none has been seen."""
    return Hardware.most_of(worker.hardware for worker in _live_workers(session=session, settings=settings))


@dataclass(frozen=True, slots=True)
class _LiveWorker:
    hardware: Hardware
    queue: str | None  # the size queue it consumes; None for a row from before queues


def _live_workers(*, session: Session, settings: Settings) -> list[_LiveWorker]:
    """The workers seen lately, read once per session (a request's): a request that asks again
    (OpenAI's door lays out the batch, then ``create_job`` chooses the config, then routes the
    job) gets one answer from one read."""
    if _LIVE_WORKERS_KEY not in session.info:
        query = sqlalchemy.select(
            col(Worker.accelerator),
            col(Worker.device_count),
            col(Worker.device_memory_bytes),
            col(Worker.bf16_supported),
            col(Worker.queue),
        ).where(live_worker(live_since(settings)))
        session.info[_LIVE_WORKERS_KEY] = [
            _LiveWorker(Hardware(accelerator, count, device_memory_bytes=memory, bf16_supported=bf16), queue)
            for accelerator, count, memory, bf16, queue in session.execute(query).all()
        ]
    workers: list[_LiveWorker] = session.info[_LIVE_WORKERS_KEY]
    return workers


_LIVE_WORKERS_KEY = "tuneq.live_workers"


class IdempotencyConflictError(Exception):
    """The Idempotency-Key was used before with a different body."""


def request_fingerprint(job_in: JobCreate) -> str:
    canonical = json.dumps(job_in.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _job_for_key(session: Session, key: str, fingerprint: str, owner: str) -> Job | None:
    job = session.exec(select(Job).where(Job.owner == owner, Job.idempotency_key == key)).first()
    if job is not None and job.request_fingerprint != fingerprint:
        raise IdempotencyConflictError(
            f"Idempotency-Key '{key}' was already used for job {job.id} with a different body: "
            "use a new key for a new job"
        )
    return job


def resume_from_problems(*, session: Session, job_in: JobCreate, owner: str) -> list[Problem]:
    """Check ``resume_from``, and pin its step (the newest checkpoint, when not given).

    The other job must have a complete DeepSpeed checkpoint there, and train the same model
    the same way (full or LoRA with the same adapters): a checkpoint holds that model's
    weights (or adapters) and optimizer state, nothing else.
    """
    start = job_in.resume_from
    if start is None:
        return []
    loc: tuple[str | int, ...] = ("body", "resume_from")
    source = get_job(session=session, job_id=start.job_id, caller=Caller(owner=owner))  # another owner's: not found
    if source is None:
        return [Problem((*loc, "job_id"), f"job {start.job_id} not found")]
    # A checkpoints row exists once every file of it is in the artifact store.
    steps = list(
        session.exec(
            select(Checkpoint.step).where(Checkpoint.job_id == source.id, Checkpoint.kind == CheckpointKind.deepspeed)
        ).all()
    )
    if not steps:
        return [Problem((*loc, "job_id"), f"job {source.id} has no complete DeepSpeed checkpoint to start from")]
    if start.step is None:
        start.step = max(steps)
    elif start.step not in steps:
        shown = ", ".join(map(str, sorted(steps)))
        return [
            Problem((*loc, "step"), f"job {source.id} has no DeepSpeed checkpoint at step {start.step}: it has {shown}")
        ]
    problems = []
    if (source.model, source.revision) != (job_in.model, job_in.revision):
        problems.append(
            Problem(
                ("body", "model"),
                f"resume_from job {source.id} trained '{source.model}'"
                + (f" at revision {source.revision}" if source.revision else "")
                + ": a checkpoint holds that model's weights, so give the same model and revision",
            )
        )
    source_lora = TrainingOptions.model_validate(source.training).lora
    if source_lora != job_in.training.lora:
        problems.append(
            Problem(
                ("body", "training", "lora"),
                f"resume_from job {source.id} trained "
                + (f"LoRA adapters {source_lora.model_dump()}" if source_lora else "every weight (no LoRA)")
                + ": give the same training.lora so its checkpoint fits this model",
            )
        )
    return problems


def uploaded_file_problems(*, session: Session, job_in: JobCreate, owner: str) -> list[Problem]:
    """A dataset given as an uploaded file's id (``file-...``) must be one of ``owner``'s files:
    another owner's is not found, exactly like a missing one. And it must hold what the job's
    method trains on, as the check at upload found (``File.dataset_format``): OpenAI's DPO
    records for a DPO job, its chat records (None: a file uploaded before tuneq took DPO files)
    for a supervised one. Either refusal names the method, as a local file's does."""
    problems = []
    dpo = job_in.training.method == "dpo"
    for field, value in (("dataset", job_in.dataset), ("validation_dataset", job_in.validation_dataset)):
        if value is None or not is_file_id(value):
            continue
        file = get_file(session=session, file_id=value, owner=owner)
        if file is None:
            problems.append(
                Problem(("body", field), f"file {value} not found: upload it with POST /v1/files and give its id")
            )
        elif (refusal := not_training_data(file)) is not None:
            problems.append(Problem(("body", field), refusal))
        elif dpo and file.dataset_format != "preference":
            evidence = "uploaded in OpenAI's chat format: messages"
            problems.append(Problem(("body", field), supervised_refusal(f"file {value}", evidence)))
        elif not dpo and file.dataset_format == "preference":
            evidence = "uploaded in OpenAI's DPO format: input, preferred_output, non_preferred_output"
            problems.append(Problem(("body", field), preference_refusal(f"file {value}", evidence)))
    return problems


def reference_problems(*, session: Session, job_in: JobCreate, owner: str) -> list[Problem]:
    """What a request names that only the database can check for its owner: the job it resumes
    from, the files it trains on."""
    return resume_from_problems(session=session, job_in=job_in, owner=owner) + uploaded_file_problems(
        session=session, job_in=job_in, owner=owner
    )


class ActiveJobLimitError(Exception):
    """The owner already has as many queued and running (or cancelling, pausing) jobs as allowed.
    Both APIs answer it 429 with ``Retry-After: RETRY_AFTER_SECONDS``."""

    RETRY_AFTER_SECONDS = 30

    def __init__(self, *, owner: str, active: int, limit: int) -> None:
        super().__init__(
            f"owner '{owner}' has {active} active jobs (queued, running, pausing or cancelling) and may have at "
            f"most {limit} (TUNEQ_MAX_ACTIVE_JOBS_PER_OWNER): wait for one to end, or cancel or pause one"
        )
        self.active = active
        self.limit = limit


# What counts against TUNEQ_MAX_ACTIVE_JOBS_PER_OWNER: jobs waiting for a worker or holding one.
# A paused job holds neither (no worker, no place in a queue), so it does not count; resuming
# it makes it queued again, and is refused past the limit like a submit.
ACTIVE_STATUSES = (JobStatus.queued, *ACTIVE)


def active_job_count(*, session: Session, owner: str) -> int:
    query = select(func.count()).select_from(Job).where(Job.owner == owner, col(Job.status).in_(ACTIVE_STATUSES))
    return int(session.exec(query).one())


def _serialize_owner_submits(session: Session, owner: str) -> None:
    """Make one owner's concurrent submits (and resumes) count active jobs one after another.

    Otherwise two submits at the limit both count N-1 and both insert. On Postgres a
    transaction-scoped advisory lock per owner (released at commit or rollback) orders them:
    each holder counts after every earlier holder committed, and commits before the next one
    counts. SQLite allows one writer at a time, and the embedded default serves one user; there
    a race can at worst let a burst of concurrent submits past the limit by a few jobs.
    """
    if session.get_bind().dialect.name == "postgresql":
        digest = hashlib.sha256(f"tuneq-owner:{owner}".encode()).digest()
        session.execute(
            text("SELECT pg_advisory_xact_lock(:key)"), {"key": int.from_bytes(digest[:8], "big", signed=True)}
        )


def _check_active_job_limit(*, session: Session, settings: Settings, owner: str, own: int = 0) -> None:
    """Take the owner's lock (held until the transaction ends) and raise ActiveJobLimitError
    when, besides the ``own`` active jobs this transaction has already written, the owner has
    TUNEQ_MAX_ACTIVE_JOBS_PER_OWNER active jobs."""
    limit = settings.max_active_jobs_per_owner
    if not limit:
        return
    _serialize_owner_submits(session, owner)
    if (active := active_job_count(session=session, owner=owner) - own) >= limit:
        raise ActiveJobLimitError(owner=owner, active=active, limit=limit)


def checked_request(
    *, session: Session, job_in: JobCreate, settings: Settings, owner: str
) -> tuple[ValidatedRequest, ResolvedModel | None]:
    """What submit (and a plan) settles about ``owner``'s request: the request as validated, and
    what its ``model`` names when that is another job's output (``job:<id>``, an ``ft:`` name).
    Raises JobValidationError with its problems; ArtifactStoreError when the named model's config
    cannot be read from the store now."""
    named = resolve_model(session=session, settings=settings, job_in=job_in, owner=owner)
    hardware = deployment_hardware(session=session, settings=settings)
    validated = validate_job_request(
        job_in, settings=settings, hardware=hardware, source_config=named.config if named else None
    )
    if problems := reference_problems(session=session, job_in=job_in, owner=owner):
        raise JobValidationError(problems)
    return validated, named


def create_job(
    *,
    session: Session,
    job_in: JobCreate,
    settings: Settings,
    owner: str,
    idempotency_key: str | None = None,
    fine_tuning: dict[str, Any] | None = None,
    fingerprint: str | None = None,
) -> tuple[Job, bool]:
    """Validate, store and enqueue ``owner``'s job; ``(job, created)``.

    Raises JobValidationError (no row is created), IdempotencyConflictError or
    ActiveJobLimitError. The same key and body return the job created the first time.
    Idempotency keys are per owner: another owner's key is a new job.

    ``fine_tuning`` and ``fingerprint`` come from OpenAI's door (``api.v1.fine_tuning_service``):
    what its request said beyond ``job_in``, and the fingerprint of that request as sent (its
    job_in holds values chosen per request, such as a random seed).
    """
    fingerprint = fingerprint or request_fingerprint(job_in)
    if idempotency_key is not None and (existing := _job_for_key(session, idempotency_key, fingerprint, owner)):
        return existing, False
    validated, named = checked_request(session=session, job_in=job_in, settings=settings, owner=owner)
    job = Job(
        owner=owner,
        name=job_in.name,
        model=job_in.model,
        revision=job_in.revision,
        dataset=job_in.dataset,
        validation_dataset=job_in.validation_dataset,
        resume_from=job_in.resume_from.model_dump(mode="json") if job_in.resume_from else None,
        model_source=named.source.model_dump(mode="json") if named else None,
        deepspeed_config=validated.submitted_deepspeed_config,
        deepspeed_config_chosen=validated.deepspeed_config_chosen,
        resolved_deepspeed_config=validated.deepspeed_config,
        num_gpus=job_in.num_gpus,
        num_nodes=job_in.num_nodes,
        training=validated.training.model_dump(),
        max_restarts=job_in.max_restarts,
        idempotency_key=idempotency_key,
        request_fingerprint=fingerprint,
        fine_tuning=fine_tuning,
    )
    session.add(job)
    record_event(session, job_id=job.id, type=EventType.status, data={"status": JobStatus.queued.value})
    try:
        # The owner's lock last, around the count and the commit alone (~2 round trips): one
        # owner's concurrent submits validate and insert side by side, and take turns only to
        # count (B9: the lock held across the whole submit capped an owner at ~105 submits/s).
        session.flush()
        _check_active_job_limit(session=session, settings=settings, owner=owner, own=1)
        session.commit()
    except ActiveJobLimitError:
        session.rollback()
        raise
    except IntegrityError:
        # Two requests with one key raced; the other one created the job.
        session.rollback()
        if idempotency_key is not None and (existing := _job_for_key(session, idempotency_key, fingerprint, owner)):
            return existing, False
        raise
    # Not read back: every column of the row was set here (the ORM's defaults included), and the
    # object keeps its values past the commit (the sessions' expire_on_commit=False).
    publish_job(session=session, settings=settings, job=job)
    return job, True


def publish_job(*, session: Session, settings: Settings, job: Job) -> None:
    """Hand a queued job to the workers: a one-node job's id to the queue of the smallest live
    worker size that fits it, a gang placed on enough idle workers. Nothing here is needed for
    the job to run eventually: a job no worker can take yet, or that the broker did not take,
    stays queued and a reconciler publishes it (or places it) later."""
    if job.num_nodes > 1:
        # A gang is placed, not published: on enough idle workers now, or by a later pass.
        place_and_start(session=session, settings=settings)
        return
    queue = _route(session=session, settings=settings, num_gpus=job.num_gpus)
    if queue is None:
        # No worker has been seen yet (a fresh deployment): the first one's reconciler publishes it.
        logger.info("job %s: no live worker yet; it is published when one starts", job.id)
        return
    try:
        enqueue_job(job.id, queue=queue)
        if session.in_transaction():
            mark_published(session=session, job_id=job.id, queue=queue)
        else:  # after a submit's commit (its route read no more): the UPDATE alone, in autocommit
            mark_committed_job_published(engine=get_read_engine(), job=job, queue=queue)
    except Exception as e:
        # The row is the source of truth: the reconciler publishes it once the broker is back.
        logger.warning("could not publish job %s (broker: %s); it stays queued until the broker is back", job.id, e)


def _route(*, session: Session, settings: Settings, num_gpus: int) -> str | None:
    """``route_job``'s queue, from the live workers this session read already when it did (a
    submit's validation did), else read now."""
    workers: list[_LiveWorker] | None = session.info.get(_LIVE_WORKERS_KEY)
    if workers is None:
        return route_job(session=session, settings=settings, num_gpus=num_gpus)
    sizes = [w.hardware.device_count for w in workers if w.queue is not None]
    return smallest_fitting_queue(settings, sizes=sizes, num_gpus=num_gpus)


def cancel_job(*, session: Session, job_id: uuid.UUID) -> Job:
    """Raises JobFinishedError for a job that already succeeded or failed."""
    return request_cancel(session=session, job_id=job_id)


def pause_job(*, session: Session, job_id: uuid.UUID) -> Job:
    """Pause a job: a running one goes through ``pausing`` (its ranks checkpoint at their next
    step and exit, freeing the worker), a queued one is paused at once; pausing a paused job
    changes nothing. Raises JobStateError (JobFinishedError for a job that ended) otherwise."""
    return request_pause(session=session, job_id=job_id)


def resume_job(*, session: Session, job_id: uuid.UUID, settings: Settings) -> Job:
    """Queue a paused job again, published as a submit is; its next attempt continues from its
    newest checkpoint (the pause's). Raises JobStateError for a job that is not paused, and
    ActiveJobLimitError when its owner already has TUNEQ_MAX_ACTIVE_JOBS_PER_OWNER active jobs
    (a paused job does not count; a resumed one does)."""
    job = session.get(Job, job_id)
    assert job is not None
    if job.status == JobStatus.paused:
        _check_active_job_limit(session=session, settings=settings, owner=job.owner)
    resumed = request_resume(session=session, job_id=job_id)
    publish_job(session=session, settings=settings, job=resumed)
    return resumed


def list_job_events(
    *, session: Session, job_id: uuid.UUID, after: int, limit: int, types: Sequence[EventType] | None = None
) -> list[JobEvent]:
    return list_events(session=session, job_id=job_id, after=after, limit=limit, types=types)


def get_job(*, session: Session, job_id: uuid.UUID, caller: Caller) -> Job | None:
    """A job ``caller`` sees (its owner's; an admin's key: any), or None: another owner's job
    is not found, exactly like a missing one.

    Every lookup of a job on a caller's behalf goes through here, except ``GET /jobs/{id}``'s
    read (``job_answers``), which every caller shares and whose route checks the owner."""
    job = session.get(Job, job_id)
    return job if job is not None and caller.sees(job.owner) else None


def jobs_with_id_prefix(*, session: Session, owner: str | None, prefix: str, limit: int) -> tuple[list[Job], int]:
    """``owner``'s jobs (None: every owner's) whose id starts with ``prefix`` (1 to 32 lower-case hex digits, no
    dashes: a short id as the dashboard and ``tuneq`` show it), newest first, at most ``limit``
    of them, and how many there are. The ids of a prefix are one range of the primary key."""
    low, high = uuid.UUID(prefix.ljust(32, "0")), uuid.UUID(prefix.ljust(32, "f"))
    conditions = [col(Job.id) >= low, col(Job.id) <= high, *([col(Job.owner) == owner] if owner is not None else [])]
    count = session.exec(select(func.count()).select_from(Job).where(*conditions)).one()
    page = select(Job).where(*conditions).order_by(col(Job.created_at).desc()).limit(limit)
    return list(session.exec(page).all()), int(count)


@dataclass(frozen=True, slots=True)
class JobAnswer:
    """What ``GET /jobs/{id}`` answers for one job: its owner (to answer another owner 404) and
    the JSON body."""

    owner: str
    body: bytes


def job_public(*, session: Session, job: Job) -> JobPublic:
    """The public shape of a job, with the nodes of a multi-node job's current attempt."""
    return JobPublic.from_job(job, current_nodes(session=session, job=job))


def job_answers(*, session: Session, job_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, JobAnswer]:
    """What ``GET /jobs/{id}`` answers for each job, whoever asks: its owner, to compare with the
    caller's, and its public JSON body, encoded once for all the requests that share it. One
    query for all of them (api.read_cache's batched read); a job that does not exist is left out."""
    jobs = session.exec(select(Job).where(col(Job.id).in_(job_ids))).all()
    return {
        job.id: JobAnswer(owner=job.owner, body=job_public(session=session, job=job).model_dump_json().encode())
        for job in jobs
    }


# What GET /jobs sorts by: a column, then the id, so that pages never share or skip a row.
# Each has an index that starts (owner, column): see shared.db.models.Job.
JOB_SORT_COLUMNS: dict[str, Any] = {
    "created_at": col(Job.created_at),
    "name": col(Job.name),
    "status": col(Job.status),
}


@dataclass(frozen=True, slots=True)
class JobListQuery:
    """What ``GET /jobs`` asks for: its filters (None: any), its order and its page.

    ``model`` and ``name`` match a part of the job's, ignoring case; ``sort`` is a key of
    ``JOB_SORT_COLUMNS``, newest or largest first when ``descending``."""

    status: JobStatus | None = None
    model: str | None = None
    name: str | None = None
    created_after: datetime | None = None
    sort: str = "created_at"
    descending: bool = True
    skip: int = 0
    limit: int = 50


# A part-of filter's count reads each matching row (a trigram index only narrows them down), so
# it stops here: "1,000+ jobs" says as much as 25,014 does, in a tenth of the time (B11a).
PART_OF_COUNT_CAP = 1_000


def list_jobs(*, session: Session, owner: str | None, query: JobListQuery) -> tuple[list[Job], int, bool]:
    """One page of ``owner``'s jobs (None: every owner's, for an admin), how many match in all,
    and whether that count stopped at PART_OF_COUNT_CAP. The page's ids come first, alone, then
    its rows: a deep page skips index entries rather than rows (shared.db.models.Job's indexes);
    ``model`` and ``name`` part-of matches use trigram indexes on Postgres (migrations 0023, 0024;
    BENCHMARKS.md, B11a)."""
    conditions: list[Any] = [col(Job.owner) == owner] if owner is not None else []
    if query.status is not None:
        conditions.append(col(Job.status) == query.status)
    if query.model:
        conditions.append(col(Job.model).icontains(query.model, autoescape=True))
    if query.name:
        conditions.append(col(Job.name).icontains(query.name, autoescape=True))
    if query.created_after is not None:
        conditions.append(col(Job.created_at) > query.created_after)
    matches = select(Job.id).where(*conditions)
    cap = PART_OF_COUNT_CAP if query.model or query.name else None
    counted = matches.limit(cap + 1) if cap is not None else matches
    count = int(session.exec(select(func.count()).select_from(counted.subquery())).one())
    # Ties broken by age, then id: the same order on every page, so pages never share a row.
    keys = [query.sort, *(["created_at"] if query.sort != "created_at" else []), "id"]
    columns = [JOB_SORT_COLUMNS.get(key, col(Job.id)) for key in keys]
    order = [c.desc() if query.descending else c.asc() for c in columns]
    page_ids = matches.order_by(*order).offset(query.skip).limit(query.limit).subquery()
    page = select(Job).join(page_ids, col(Job.id) == page_ids.c.id).order_by(*order)
    rows = list(session.exec(page).all())
    if cap is not None and count > cap:
        return rows, cap, True
    return rows, count, False


def list_metrics(
    *, session: Session, job_id: uuid.UUID, after: int, limit: int, points: int | None = None
) -> MetricsPublic:
    """The job's metrics after step ``after``, at most ``limit`` rows. With ``points``, the
    steps after ``after`` are cut into ``points`` equal stretches and the last row of each is
    returned (SQL picks them: a 200 000-step run charts from a few hundred rows)."""
    # Read first: events after it reach a stream that starts there, so nothing falls between.
    newest_event = session.exec(select(func.max(JobEvent.id)).where(col(JobEvent.job_id) == job_id)).one()
    of_job = (col(JobMetric.job_id) == job_id, col(JobMetric.step) > after)
    query = select(JobMetric).where(*of_job)
    if points is not None:
        last = session.exec(select(func.max(JobMetric.step)).where(*of_job)).one()
        if last is not None:
            width = max(1, -(-(last - after) // points))
            stretch = (col(JobMetric.step) - after - 1) // width
            query = query.where(
                col(JobMetric.step).in_(select(func.max(JobMetric.step)).where(*of_job).group_by(stretch))
            )
    rows = session.exec(query.order_by(col(JobMetric.step)).limit(limit + 1)).all()
    page = [MetricPublic.model_validate(r) for r in rows[:limit]]
    return MetricsPublic(
        data=page,
        has_more=len(rows) > limit,
        next_after=page[-1].step if page else None,
        event_cursor=newest_event or 0,
    )


def list_checkpoints(*, session: Session, job_id: uuid.UUID) -> list[Checkpoint]:
    query = select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(col(Checkpoint.step), col(Checkpoint.kind))
    return list(session.exec(query).all())


def read_log_tail(*, session: Session, settings: Settings, job_id: uuid.UUID, tail: int) -> list[str]:
    """The job's last ``tail`` log lines (at most ``max_log_tail``), as the worker recorded them in SQL."""
    events = last_log_events(session=session, job_id=job_id, limit=min(tail, settings.max_log_tail))
    return [e.data["line"] for e in events]
