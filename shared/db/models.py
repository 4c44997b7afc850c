"""SQL tables (SQLModel) and the public shapes the API returns for them."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AliasGenerator, ConfigDict
from sqlalchemy import JSON, BigInteger, Column, DateTime, Index, UniqueConstraint, false
from sqlmodel import Field, SQLModel

from shared.jobs.events import MetricFields
from shared.jobs.status import JobStatus


def utcnow() -> datetime:
    return datetime.now(UTC)


def _timestamp(*, nullable: bool = True, index: bool = False) -> Any:
    return Field(default=None, sa_column=Column(DateTime(timezone=True), nullable=nullable, index=index))


# The owner of every job while the API runs without keys (TUNEQ_AUTH=off), and of the jobs
# created before tuneq had keys.
LOCAL_OWNER = "local"


class Job(SQLModel, table=True):
    __tablename__ = "jobs"
    # Idempotency keys are the client's, so unique per owner: two teams may pick the same one.
    __table_args__ = (
        UniqueConstraint("owner", "idempotency_key", name="uq_jobs_owner_idempotency_key"),
        # GET /jobs's pages and counts (api.jobs_service.list_jobs): an owner's jobs newest first
        # (with id, the order's tie-break: a page's ids from the index alone), of one status, or by name.
        Index("ix_jobs_owner_created_at_id", "owner", "created_at", "id"),
        Index("ix_jobs_owner_status_created_at", "owner", "status", "created_at"),
        Index("ix_jobs_owner_name", "owner", "name"),
        # Its model and name filters, part-of matches (ILIKE '%…%'): trigram indexes on Postgres
        # (pg_trgm; migration 0023 names the operator class with the extension's schema). SQLite
        # cannot use an index for them: there each is empty (WHERE false), so the schema is the
        # same on both and SQLite's writes do not pay for it.
        *(
            Index(
                name,
                column,
                postgresql_using="gin",
                postgresql_ops={column: "gin_trgm_ops"},
                sqlite_where=false(),
            )
            for name, column in (("ix_jobs_model_trgm", "model"), ("ix_jobs_name_trgm", "name"))
        ),
    )

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    # Who submitted it (an API key's owner): other owners' requests never see it.
    owner: str = Field(
        default=LOCAL_OWNER, max_length=200, index=True, sa_column_kwargs={"server_default": LOCAL_OWNER}
    )
    name: str | None = Field(default=None, max_length=200)
    status: JobStatus = Field(default=JobStatus.queued, index=True)
    model: str
    revision: str | None = None  # of a hub model
    dataset: str
    validation_dataset: str | None = None
    # Another job's DeepSpeed checkpoint this job starts from: {"job_id", "step"}.
    resume_from: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    # What ``model`` names when it is another job's output (job:<id>, an ft: name), as resolved at
    # submit: shared.jobs.model_source.ModelSource. None for a base model.
    model_source: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    # What the validation pass found: {"train": DatasetStats, "validation": DatasetStats | None}.
    dataset_stats: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    deepspeed_config: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    # The request named no DeepSpeed config: deepspeed_config is the one tuneq chose for it
    # (shared.deepspeed.chosen).
    deepspeed_config_chosen: bool = Field(default=False, sa_column_kwargs={"server_default": false()})
    # The config as run: "auto" values filled (at submit, then by the worker).
    resolved_deepspeed_config: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    num_gpus: int  # per node
    # Hosts the job spans, each running num_gpus ranks (world size = num_nodes x num_gpus); more
    # than one makes it a gang, placed on that many workers at once (shared.db.gangs).
    num_nodes: int = Field(default=1, sa_column_kwargs={"server_default": "1"})
    training: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    created_at: datetime = Field(
        default_factory=utcnow, sa_column=Column(DateTime(timezone=True), nullable=False, index=True)
    )
    started_at: datetime | None = _timestamp()
    finished_at: datetime | None = _timestamp()
    step: int = 0
    total_steps: int | None = None
    latest_metrics: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    epoch: float | None = None
    tokens_seen: int = Field(default=0, sa_type=BigInteger)
    eta_seconds: float | None = None
    # The latest phase event's progress (work before the first step, e.g. a DPO job's reference
    # log-probabilities): {"name", "done", "total", "cached", "time"}. None before any.
    phase: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    error_code: str | None = None
    error_message: str | None = None
    # Who runs it: the database decides, not the broker (see ARCHITECTURE.md, "Leases").
    worker_id: str | None = None
    lease_expires_at: datetime | None = _timestamp(index=True)
    enqueued_at: datetime | None = _timestamp()
    # The Celery queue it was last published to: that of the smallest live worker size that
    # fits num_gpus (shared.db.lifecycle.route_job). None until published.
    queue: str | None = Field(default=None, max_length=200)
    attempts: int = 0
    # Attempts that ended in a pause: counted in attempts, never against max_restarts.
    pauses: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    # Attempts handed back by a worker that was asked to stop (a deploy, a scale-down): counted
    # in attempts, never against max_restarts, since the job did nothing to end them.
    handbacks: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    max_restarts: int = 2
    # How far the worker has ingested the current attempt's events file and the training log,
    # committed with the rows they produced: a resumed attempt picks up exactly there.
    events_offset: int = Field(default=0, sa_type=BigInteger)
    log_offset: int = Field(default=0, sa_type=BigInteger)
    idempotency_key: str | None = Field(default=None, max_length=200)
    request_fingerprint: str | None = None
    # A job created through OpenAI's door (POST /v1/fine_tuning/jobs): what that request said
    # that the native fields do not hold (suffix, metadata, method) and the hyperparameters as
    # resolved (api.v1.fine_tuning_service). None for a native job.
    fine_tuning: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))


class EventType(StrEnum):
    status = "status"
    metric = "metric"
    checkpoint = "checkpoint"
    resumed = "resumed"
    warning = "warning"
    log = "log"
    download = "download"  # a remote dataset's download progress
    plan = "plan"  # what the ranks found once model and data were loaded: steps, rows, model load
    artifact = "artifact"  # publishing to the artifact store: waits, retries, deletions by retention
    # Work of the ranks before the first step, with its progress: a DPO job's reference
    # log-probabilities (shared.jobs.events.PhaseEvent).
    phase = "phase"


class JobEvent(SQLModel, table=True):
    """Everything that happened to a job, in order. ``id`` is the stream cursor."""

    __tablename__ = "job_events"
    # (job_id, id): a job's events in cursor order, and its newest ones (a log tail), are one
    # index range however many events later jobs added.
    __table_args__ = (Index("ix_job_events_job_id_id", "job_id", "id"),)

    id: int | None = Field(default=None, primary_key=True)
    job_id: uuid.UUID = Field(foreign_key="jobs.id")
    type: EventType
    data: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(DateTime(timezone=True), nullable=False))


class JobMetric(SQLModel, MetricFields, table=True):
    """One row per optimizer step that rank 0 reported."""

    __tablename__ = "job_metrics"
    __table_args__ = (UniqueConstraint("job_id", "step"),)

    id: int | None = Field(default=None, primary_key=True)
    # No index of its own: the unique (job_id, step) index leads with it (migration 0007).
    job_id: uuid.UUID = Field(foreign_key="jobs.id")
    time: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))


class CheckpointKind(StrEnum):
    deepspeed = "deepspeed"  # the engine's own checkpoint (resumable)
    model = "model"  # a Hugging Face model directory (safetensors + tokenizer)
    adapter = "adapter"  # a peft LoRA adapter directory (adapter_model.safetensors + tokenizer)


class Checkpoint(SQLModel, table=True):
    """A checkpoint is recorded only once its manifest is complete."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step", "kind"),)

    id: int | None = Field(default=None, primary_key=True)
    job_id: uuid.UUID = Field(foreign_key="jobs.id", index=True)
    step: int
    kind: CheckpointKind
    uri: str
    bytes: int = Field(sa_type=BigInteger)  # checkpoints of large models pass 2 GiB
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(DateTime(timezone=True), nullable=False))


class ArtifactKind(StrEnum):
    """What a file of a job's artifacts belongs to: a checkpoint of one of CheckpointKind's kinds, or the log."""

    deepspeed = "deepspeed"
    model = "model"
    adapter = "adapter"
    log = "log"


class ArtifactBase(SQLModel):
    path: str = Field(max_length=1000)  # relative to the job's artifacts: "model/model.safetensors"
    kind: ArtifactKind
    step: int | None = None  # the checkpoint's step (None for the log)
    size: int = Field(sa_type=BigInteger)
    sha256: str = Field(max_length=64)


class Artifact(ArtifactBase, table=True):
    """A file published to the artifact store (shared.artifacts): listed here only once it is
    complete there, with the SHA-256 every later read is checked against. A checkpoint's files
    are listed in the transaction that records its Checkpoint row."""

    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("job_id", "path"),)

    id: int | None = Field(default=None, primary_key=True)
    job_id: uuid.UUID = Field(foreign_key="jobs.id", index=True)
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(DateTime(timezone=True), nullable=False))


class Worker(SQLModel, table=True):
    """A worker's hardware, so the API can refuse what no worker can run (fp16 without CUDA) and
    choose a DeepSpeed config that fits the workers that could run a job."""

    __tablename__ = "workers"

    id: str = Field(primary_key=True)
    hostname: str
    accelerator: str  # "cuda" or "cpu"
    device_count: int
    # Its smallest device's total memory (on a CPU worker the host's, its ranks' to share), and
    # whether every device computes in bf16 natively: the DeepSpeed config tuneq chooses fits
    # them (shared.deepspeed.chosen). None in rows of workers from before they were recorded.
    device_memory_bytes: int | None = Field(default=None, sa_type=BigInteger)
    bf16_supported: bool | None = None
    # The queue it consumes: one per worker size (shared.queue.size_queue).
    queue: str | None = Field(default=None, max_length=200)
    # Set while the worker runs no job: a queued job waiting longer than an idle worker has
    # been idle was lost by the broker (the reconciler publishes it again).
    idle_since: datetime | None = _timestamp()
    started_at: datetime = Field(default_factory=utcnow, sa_column=Column(DateTime(timezone=True), nullable=False))
    last_seen_at: datetime = Field(
        default_factory=utcnow, sa_column=Column(DateTime(timezone=True), nullable=False, index=True)
    )
    # Set when the worker stops cleanly: it consumes no queue from then on, whatever last_seen_at says.
    stopped_at: datetime | None = _timestamp()
    # Why the worker takes no job now (its disk is below TUNEQ_MIN_FREE_DISK_MB), or None.
    unavailable: str | None = Field(default=None, max_length=500)
    # Where the other nodes of a multi-node job reach its ranks (TUNEQ_WORKER_ADDRESS).
    address: str | None = Field(default=None, max_length=200)
    # The multi-node job this worker is kept for: held while that gang waits for enough idle
    # workers, then reserved for (or running) one of its nodes. Such a worker takes no other job.
    gang_job_id: uuid.UUID | None = Field(default=None, index=True)


class CheckpointUpload(SQLModel, table=True):
    """One node's share of a multi-node job's checkpoint, uploaded to the artifact store: the
    checkpoint is committed (shared.db.artifacts.commit_node_share) once every node's is in."""

    __tablename__ = "checkpoint_uploads"

    job_id: uuid.UUID = Field(foreign_key="jobs.id", primary_key=True)
    attempt: int = Field(primary_key=True)
    step: int = Field(primary_key=True)
    node_rank: int = Field(primary_key=True)
    uri: str
    # [{"path", "key", "size", "sha256"}, ...]: the node's files, as the store has them.
    files: list[dict[str, Any]] = Field(sa_column=Column(JSON, nullable=False))
    created_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))


class NodeState(StrEnum):
    """One node of a multi-node job's attempt (ARCHITECTURE.md, "Gang state machine")."""

    reserved = "reserved"  # placed on its worker, which was told to start it
    running = "running"  # its worker claimed it and started (or is starting) its ranks
    finished = "finished"  # its ranks exited and its worker recorded the outcome
    released = "released"  # the gang ended before this node finished: another node failed, a deadline passed


class JobNode(SQLModel, table=True):
    """One node of one attempt of a multi-node job: which worker runs global ranks
    ``node_rank * num_gpus ...`` and where it is reached. Node 0 is the rendezvous master."""

    __tablename__ = "job_nodes"

    job_id: uuid.UUID = Field(foreign_key="jobs.id", primary_key=True)
    attempt: int = Field(primary_key=True)
    node_rank: int = Field(primary_key=True)
    worker_id: str = Field(max_length=200)
    address: str = Field(max_length=200)
    # The rendezvous port (MASTER_PORT), on node 0's row; None on the others.
    port: int | None = None
    state: NodeState = NodeState.reserved
    # Renewed by the node's worker while it runs; past it (or, while reserved, past the start
    # deadline) the node is lost and its gang is released whole.
    lease_expires_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))
    started_at: datetime | None = _timestamp()
    finished_at: datetime | None = _timestamp()
    # Why a node ended the gang (its ranks failed, it was lost), for the job's events and errors.
    error_message: str | None = None


class ApiKey(SQLModel, table=True):
    """An API key: only its SHA-256 is stored; the key itself is shown once, at creation."""

    __tablename__ = "api_keys"

    id: str = Field(primary_key=True, max_length=32)  # public, also inside the key: tq_<id>_<secret>
    owner: str = Field(max_length=200, index=True)
    key_hash: str = Field(unique=True, max_length=64)  # sha256 hex of the whole key
    # An admin's key sees and changes every owner's jobs (api.auth.Caller); its own jobs are its owner's.
    admin: bool = Field(default=False, sa_column_kwargs={"server_default": false()})
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(DateTime(timezone=True), nullable=False))
    last_used_at: datetime | None = _timestamp()
    revoked_at: datetime | None = _timestamp()


class DownloadLink(SQLModel, table=True):
    """A short-lived link to one of a job's artifacts (``POST /jobs/{id}/downloads``), for a
    client that cannot send ``Authorization`` with a download; only the token's SHA-256 is kept."""

    __tablename__ = "download_links"

    token_hash: str = Field(primary_key=True, max_length=64)
    job_id: uuid.UUID = Field(foreign_key="jobs.id", index=True)
    path: str = Field(max_length=1000)
    owner: str = Field(max_length=200)  # who made it (an admin's link names the admin)
    expires_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False, index=True))


class DownloadLinkCreate(SQLModel):
    path: str = Field(min_length=1, max_length=1000, description="The file, as GET /jobs/{id}/artifacts lists it")


class DownloadLinkPublic(SQLModel):
    url: str  # relative to the API: GET it without a key, Range included, until expires_at
    expires_at: datetime


class FileBase(SQLModel):
    filename: str = Field(max_length=255)  # as the client named it; never a path anywhere
    purpose: str = Field(max_length=40)  # OpenAI's purpose; tuneq takes "fine-tune" only
    bytes: int = Field(sa_type=BigInteger)  # fine-tuning files reach 512 MiB, past a 32-bit int


class File(FileBase, table=True):
    """A file uploaded through the OpenAI-compatible API (``POST /v1/files``), checked as
    OpenAI's chat or DPO fine-tuning format on the way in. Its bytes are in the artifact store under
    ``files/<id>`` (``shared.artifacts.store.file_key``), put there before this row is committed:
    a row always has its bytes, and bytes without a row are an upload that never finished."""

    __tablename__ = "files"

    id: str = Field(primary_key=True, max_length=64)  # "file-<random>", OpenAI's form of id
    # Who uploaded it (an API key's owner): other owners' requests never see it.
    owner: str = Field(max_length=200, index=True)
    sha256: str = Field(max_length=64)
    # The job whose results it is (purpose "fine-tune-results": its per-step metrics as CSV, made
    # by the worker as the job succeeds); None for an upload.
    job_id: uuid.UUID | None = Field(default=None, index=True)
    # Its records, counted as they were checked: what "auto" hyperparameters are resolved from.
    # None for a file uploaded before tuneq counted them (counted when a job first needs it).
    records: int | None = None
    # What its records are, as the check at upload found (shared.data.uploaded_files): "messages"
    # (OpenAI's chat format) or "preference" (its DPO format). None for a file uploaded before
    # tuneq took DPO files: chat records, the only kind taken then.
    dataset_format: str | None = Field(default=None, max_length=40)
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(DateTime(timezone=True), nullable=False))


class ArtifactStoreRecord(SQLModel, table=True):
    """The artifact store every process of this deployment must name (shared.db.store_identity):
    the first ``tuneq serve``, ``worker`` or ``dev`` to start wrote a marker object with
    ``store_id`` in its name into its store, then this row. One row at most."""

    __tablename__ = "artifact_store"

    # Always 1: the one row's fixed key is what makes two first starts' inserts conflict.
    id: int = Field(default=1, primary_key=True, sa_column_kwargs={"autoincrement": False})
    store_id: str = Field(max_length=32)  # the marker's random id (uuid4 hex)
    uri: str = Field(max_length=2000)  # TUNEQ_ARTIFACTS_URI as that first process had it, for messages
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(DateTime(timezone=True), nullable=False))


# ---- public shapes ---------------------------------------------------------------------


def as_utc(value: datetime) -> datetime:
    """A timestamp read back from SQL, with its zone: SQLite hands timestamps back without one,
    and every timestamp tuneq writes is UTC."""
    return value if value.tzinfo else value.replace(tzinfo=UTC)


UTCDateTime = Annotated[datetime, AfterValidator(as_utc)]


class JobError(SQLModel):
    code: str
    message: str


class JobNodePublic(SQLModel):
    node_rank: int
    worker_id: str
    address: str
    # The global ranks this node runs: [first, last].
    ranks: list[int]
    state: NodeState
    error_message: str | None


class JobPhasePublic(SQLModel):
    """Work before the first step (``name``: ``reference_logps``, a DPO job's reference
    log-probabilities): ``done`` of ``total`` pairs, or ``cached``: found computed."""

    name: str
    done: int
    total: int
    cached: bool
    time: UTCDateTime  # of the report


class JobPublic(SQLModel):
    id: uuid.UUID
    owner: str
    name: str | None
    status: JobStatus
    model: str
    revision: str | None
    dataset: str
    validation_dataset: str | None
    resume_from: dict[str, Any] | None
    # Where a model naming another job's output (job:<id>, an ft: name) was resolved to: that job,
    # its output's kind (model, adapter or deepspeed), step and the base model it started from.
    model_source: dict[str, Any] | None
    dataset_stats: dict[str, Any] | None
    deepspeed_config: dict[str, Any]
    deepspeed_config_chosen: bool
    resolved_deepspeed_config: dict[str, Any] | None
    num_gpus: int
    num_nodes: int
    # The nodes of the current attempt of a multi-node job (empty for a one-node job).
    nodes: list[JobNodePublic] = []
    training: dict[str, Any]
    created_at: UTCDateTime
    started_at: UTCDateTime | None
    finished_at: UTCDateTime | None
    step: int
    total_steps: int | None
    epoch: float | None
    tokens_seen: int
    eta_seconds: float | None
    phase: JobPhasePublic | None  # the latest phase's progress; None before any (an SFT job: always)
    latest_metrics: dict[str, Any] | None
    error: JobError | None
    attempts: int
    pauses: int  # attempts that ended in a pause (not restarts: max_restarts counts the others)
    handbacks: int  # attempts a stopping worker handed back (not restarts either)
    max_restarts: int

    @classmethod
    def from_job(cls, job: Job, nodes: Sequence[JobNode] = ()) -> JobPublic:
        """``nodes``: the current attempt's, for a multi-node job (shared.db.gangs.current_nodes)."""
        error = JobError(code=job.error_code, message=job.error_message or "") if job.error_code else None
        first = [n.node_rank * job.num_gpus for n in nodes]
        public_nodes = [
            JobNodePublic(
                node_rank=n.node_rank,
                worker_id=n.worker_id,
                address=n.address,
                ranks=[start, start + job.num_gpus - 1],
                state=n.state,
                error_message=n.error_message,
            )
            for n, start in zip(nodes, first, strict=True)
        ]
        return cls.model_validate(job, update={"error": error, "nodes": public_nodes})


class JobsPublic(SQLModel):
    data: list[JobPublic]
    # How many jobs match in all; with a part-of filter (model, name), which reads each match,
    # counted up to api.jobs_service.PART_OF_COUNT_CAP, and count_capped says more match.
    count: int
    count_capped: bool = False


# The DPO measures under the names TRL's DPOTrainer logs them by, which the API answers:
# MetricFields (a column, a Python name) spells each "/" as "_".
TRL_METRIC_NAMES: dict[str, str] = {
    "rewards_chosen": "rewards/chosen",
    "rewards_rejected": "rewards/rejected",
    "rewards_accuracies": "rewards/accuracies",
    "rewards_margins": "rewards/margins",
    "logps_chosen": "logps/chosen",
    "logps_rejected": "logps/rejected",
    "logits_chosen": "logits/chosen",
    "logits_rejected": "logits/rejected",
    "eval_rewards_accuracies": "eval_rewards/accuracies",
}


def _answered_name(field: str) -> str:
    return TRL_METRIC_NAMES.get(field, field)


class MetricPublic(SQLModel, MetricFields):
    # Every measure is in every answer (null when not measured), and the schema says so; the DPO
    # measures under TRL's names (rewards/chosen), read from the row's columns (rewards_chosen).
    # The ignore: SQLModel types model_config as its own TypedDict, a superset of pydantic's.
    model_config = ConfigDict(  # type: ignore[assignment]
        json_schema_serialization_defaults_required=True,
        alias_generator=AliasGenerator(serialization_alias=_answered_name),
    )

    time: UTCDateTime


class MetricsPublic(SQLModel):
    """One page of a job's metrics, in step order."""

    data: list[MetricPublic]
    has_more: bool  # more steps follow: ask again with after=next_after
    next_after: int | None  # the last step of this page
    # The job's newest event id when the page was read: an event stream from here continues
    # the series without a gap (a step both in the page and in the stream is the same row).
    event_cursor: int


class CheckpointPublic(SQLModel):
    step: int
    kind: CheckpointKind
    uri: str
    created_at: UTCDateTime
    bytes: int


class CheckpointsPublic(SQLModel):
    data: list[CheckpointPublic]


class ArtifactPublic(ArtifactBase):
    created_at: UTCDateTime


class ArtifactsPublic(SQLModel):
    data: list[ArtifactPublic]


class LogsPublic(SQLModel):
    lines: list[str]


class EventPublic(SQLModel):
    id: int
    type: EventType
    data: dict[str, Any]
    created_at: UTCDateTime


class EventsPublic(SQLModel):
    data: list[EventPublic]
    next_cursor: int | None


# ---- public shapes of the OpenAI-compatible API (/v1): OpenAI's own, field for field ----


class FilePublic(FileBase):
    """OpenAI's File object (the SDK's ``openai.types.FileObject``)."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=True)  # type: ignore[assignment]

    id: str
    object: Literal["file"] = "file"
    created_at: int  # Unix seconds, as OpenAI gives every time
    # Deprecated by OpenAI; a file tuneq keeps was checked whole at upload, so always "processed".
    status: Literal["processed"] = "processed"
    # No expires_at (tuneq's files do not expire) nor status_details: OpenAI's schema lets a
    # file leave them out, and has no null for them.

    @classmethod
    def from_file(cls, file: File) -> FilePublic:
        created = int(as_utc(file.created_at).timestamp())
        return cls(id=file.id, filename=file.filename, purpose=file.purpose, bytes=file.bytes, created_at=created)


class FileListPublic(SQLModel):
    """One page of files, as OpenAI lists them: ask again with ``after=last_id`` while ``has_more``."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=True)  # type: ignore[assignment]

    object: Literal["list"] = "list"
    data: list[FilePublic]
    # The page's first and last ids; "" on an empty page: OpenAI's schema has a string, never null.
    first_id: str
    last_id: str
    has_more: bool


class FileDeletedPublic(SQLModel):
    """OpenAI's answer to a delete (the SDK's ``openai.types.FileDeleted``)."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=True)  # type: ignore[assignment]

    id: str
    object: Literal["file"] = "file"
    deleted: bool
