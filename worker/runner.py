"""Running one job attempt: claim it, launch the ranks, watch them, record the outcome.

While the ranks run, the worker ingests their events, renews the job's lease, and watches
the job row for a cancel or a pause; it ends the attempt on a cancel, a timeout, or a lost
lease, and asks the ranks to checkpoint and leave on a pause.

A node of a multi-node job (``run_node``) is the same attempt seen from one of its workers:
it claims its node instead of the job, renews its node's lease beside node 0's job lease,
launches its ranks into the gang's world, and records its own ranks' log and checkpoint
shares. Node 0 decides the job's outcome; a failure on any node fails the whole gang
(shared.db.gangs.release_gang), which requeues it.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shared.artifacts.store import ArtifactIntegrityError, ArtifactStore, ArtifactStoreError
from shared.db.artifacts import newest_checkpoint
from shared.db.engine import is_transient_database_error, session_scope
from shared.db.gangs import claim_node, finish_node, open_nodes, release_attempt, renew_node_lease
from shared.db.lifecycle import (
    ACTIVE,
    claim_job,
    finish_job,
    finish_pause,
    job_status,
    mark_unpublished,
    record_event,
    renew_lease,
    rewind_job,
)
from shared.db.models import EventType, Job
from shared.deepspeed.config import missing_packages
from shared.deepspeed.safety import sanitize_deepspeed_config
from shared.jobs.events import RankError
from shared.jobs.hardware import hardware_problems
from shared.jobs.model_source import ModelSource
from shared.jobs.run_layout import RunLayout, read_from, tail_lines, write_json_atomic
from shared.jobs.spec import ResumePoint, TrainingOptions, TrainingSpec
from shared.jobs.status import ErrorCode, JobStatus
from shared.settings import Settings
from worker.base_model import BaseModelMaker
from worker.checkpoint_fetch import drop_local_checkpoints_after, fetch_checkpoint
from worker.disk_space import disk_problem, full_disk_failure, note_full_disk
from worker.ingest import EventIngestor
from worker.job_inputs import DownloadProgress, InputProblem, local_dataset
from worker.launcher import ONE_NODE, Launcher, NodePlacement, RankGroup
from worker.publisher import ArtifactPublisher, GangNode
from worker.results_file import publish_results_file
from worker.start_from import ConversionFailed, start_point

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.5
STOP_GRACE_SECONDS = 10.0
# How long a node other than node 0 whose ranks failed leaves the others' workers to end the
# attempt (with their reason) before ending it itself; node 0 waits half as long.
GANG_DECISION_SECONDS = 10.0
DB_RETRY_MAX_SECONDS = 5.0  # the longest wait between polls while the database is unreachable
OOM_PATTERN = re.compile(r"out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED", re.IGNORECASE)
OOM_ADVICE = (
    " — the devices ran out of memory: try a higher ZeRO stage (zero_optimization.stage 3), "
    "offloading (zero_optimization.offload_optimizer / offload_param with device 'cpu'), or a smaller "
    "train_micro_batch_size_per_gpu with more gradient_accumulation_steps"
)


class WorkerStopping(Exception):
    """The worker process was asked to stop while a job ran: raised at the attempt's own check
    points (``LeaseKeeper.check_stop``), never from the signal handler, which only notes the
    stop. An exception raised in a handler lands wherever the process happens to be: inside a
    database driver's I/O, it left the connection mid-query, and the attempt failed on that
    instead of handing the job back."""


# How a rank's exit reaches the job log: the warm start's line, or DeepSpeed's launch.py's
# (which names only the first failure it saw).
_RANK_EXIT = re.compile(
    r"rank (?P<rank>\d+) \(pid (?P<pid>\d+)\) exited with status (?P<code>-?\d+)"
    r"|--local_rank=(?P<launched>\d+).*exits with return code = (?P<launched_code>-?\d+)"
)


@dataclass(frozen=True)
class KilledRank:
    """A rank of an attempt that ended by a signal, as its job log says."""

    rank: int
    signal: signal.Signals

    def describe(self) -> str:
        return f"rank {self.rank} was killed by {self.signal.name} (signal {self.signal.value})"


def killed_rank(log_text: str, *, killed_by_tuneq: frozenset[int] = frozenset()) -> KilledRank | None:
    """The rank of an attempt that tells most about its end, when a signal ended one: a rank
    SIGKILLed by someone other than tuneq (``killed_by_tuneq``: the pids it SIGKILLed itself,
    stopping the others after a failure) wherever it stands, since the peers of a rank that
    vanishes fail at once on the broken connection and may be reaped before it; else the
    first failing rank, if a signal ended it."""
    first: KilledRank | None = None
    first_seen = False
    for match in _RANK_EXIT.finditer(log_text):
        code = int(match["code"] if match["code"] is not None else match["launched_code"])
        if code == 0:
            continue
        rank = int(match["rank"] if match["rank"] is not None else match["launched"])
        pid = int(match["pid"]) if match["pid"] is not None else None
        try:
            ended = KilledRank(rank, signal.Signals(-code)) if code < 0 else None
        except ValueError:
            ended = None
        if ended is not None and ended.signal == signal.SIGKILL and pid not in killed_by_tuneq:
            return ended
        if not first_seen:
            first, first_seen = ended, True
    return first


def host_failure(*, killed: KilledRank | None, full_disk: str | None) -> str | None:
    """Why an attempt failed for reasons of its host rather than of the job, or None.

    A rank SIGKILLed while tuneq sent no kill (this path is not a cancel, a timeout or a stop)
    was killed by the kernel: on a training host, its out-of-memory killer. A write that found
    the disk full (``full_disk``: worker.disk_space.full_disk_failure) is the disk's fault too.
    Either way the job deserves another host, not a failure."""
    if killed is not None and killed.signal == signal.SIGKILL:
        return (
            f"{killed.describe()}, which tuneq did not send: the host most likely ran out of memory "
            "(the kernel's OOM killer; see `dmesg` on the worker's host). The job is retried from its "
            "newest checkpoint; if it fails this way again, give it more host memory or offload less "
            "to the CPU (zero_optimization.offload_optimizer / offload_param)"
        )
    if full_disk is not None:
        return (
            f"the worker's disk filled up while the job wrote to it ({full_disk}); "
            "what it was writing was removed, and the job is retried from its newest checkpoint "
            "on a worker with room"
        )
    return None


def rank_errors(layout: RunLayout) -> list[RankError]:
    """The errors the attempt's failed ranks wrote (one file each)."""
    errors = []
    for path in sorted(layout.errors_dir.glob("rank-*.json")):
        try:
            errors.append(RankError.model_validate_json(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return errors


def failure_from_ranks(layout: RunLayout, *, killed: KilledRank | None = None) -> tuple[ErrorCode, str]:
    """Why the ranks failed: a rank a signal ended (``killed``: its peers' errors, a broken
    connection, are only the consequence), else the first rank error by time, else the last
    exception-looking line of the log."""
    errors = rank_errors(layout)
    if killed is not None:
        code, message = ErrorCode.training_error, f"{killed.describe()} (full log: {layout.log})"
    elif errors:
        first = min(errors, key=lambda e: e.time)
        code, message = first.code, first.message
    else:
        lines = tail_lines(layout.log, 200)
        meaningful = [ln for ln in lines if "Error" in ln or "Exception" in ln]
        message = meaningful[-1].strip() if meaningful else "the training processes exited with an error"
        code, message = ErrorCode.training_error, f"{message} (full log: {layout.log})"
    if code == ErrorCode.training_error and OOM_PATTERN.search(message):
        message += OOM_ADVICE
    return code, message


@dataclass(frozen=True)
class Ending:
    """How an attempt ends: its ranks exited (or paused), or the worker stopped them (cancel,
    timeout)."""

    status: JobStatus  # queued: the host failed the attempt, and the job goes back to the queue
    code: ErrorCode | None  # None: succeeded, or paused
    message: str | None
    paused_at: int | None = None  # paused: the step of the ranks' pause checkpoint (node 0's worker knows it)


PAUSED = Ending(JobStatus.paused, None, None)  # another node of a gang: node 0's worker records the pause


class AttemptEnded(Exception):
    """The attempt lost its lease (``status`` None), or its job was cancelled or paused, before
    its ranks started."""

    def __init__(self, status: JobStatus | None) -> None:
        super().__init__(status.value if status is not None else "lost its lease")
        self.status = status


class LeaseKeeper:
    """Renews an attempt's lease every third of its lifetime; in between, reads the status.

    On a node of a multi-node job (``node_rank``) it renews the node's lease, and node 0 also
    the job's; a node whose gang was released has lost the job."""

    def __init__(
        self,
        *,
        job_id: uuid.UUID,
        worker_id: str,
        attempt: int,
        settings: Settings,
        node_rank: int | None = None,
        stopping: threading.Event | None = None,
    ) -> None:
        self.job_id, self.worker_id, self.attempt, self.node_rank = job_id, worker_id, attempt, node_rank
        self.ttl = settings.lease_ttl_seconds
        self.last_renewal = time.monotonic()
        # Set by the SIGTERM handler (_run_attempt); only read here, at the attempt's check points.
        self.stopping = stopping if stopping is not None else threading.Event()

    def check_stop(self) -> None:
        """Raise WorkerStopping if the worker was asked to stop: called between the attempt's
        steps (each poll, each keep-alive), where no I/O is halfway done."""
        if self.stopping.is_set():
            raise WorkerStopping(signal.SIGTERM.name)

    @property
    def first_node(self) -> bool:
        """Node 0 of a gang, or a one-node job: the worker that decides the job's outcome."""
        return not self.node_rank

    def status(self, session: Any) -> JobStatus | None:
        """The job's status; None once this attempt has lost the job."""
        if time.monotonic() - self.last_renewal < self.ttl / 3:
            status = job_status(session=session, job_id=self.job_id)
            return status if status in ACTIVE or self.node_rank is None else None
        self.last_renewal = time.monotonic()
        if self.node_rank is not None and not renew_node_lease(
            session=session,
            job_id=self.job_id,
            attempt=self.attempt,
            node_rank=self.node_rank,
            worker_id=self.worker_id,
            lease_ttl=self.ttl,
        ):
            return None
        if self.node_rank:  # another node: node 0's worker holds the job's lease
            status = job_status(session=session, job_id=self.job_id)
            return status if status in ACTIVE else None
        return renew_lease(
            session=session, job_id=self.job_id, worker_id=self.worker_id, attempt=self.attempt, lease_ttl=self.ttl
        )

    def hold(self) -> None:
        """Keep the attempt while its worker finishes it after the ranks are gone (the final
        uploads, a gang's decision): they can outlast the lease, and the reconciler would then
        requeue a job that is about to end, with the wrong reason. A database blip is left to
        the outcome's own retries. A stop of the worker ends the wait (WorkerStopping)."""
        self.check_stop()
        try:
            with session_scope() as session:
                self.status(session)
        except Exception as e:
            logger.warning("job %s: could not renew its lease (%s); trying again", self.job_id, e)


@dataclass
class Attempt:
    """One claimed attempt of a job, and what it needs to run."""

    job_id: uuid.UUID
    number: int
    worker_id: str
    spec: TrainingSpec
    layout: RunLayout
    max_duration_seconds: int | None
    log_offset: int  # where ingestion of train.log stopped (a lost attempt's last lines come next)
    store: ArtifactStore  # where its checkpoints came from and its saves go
    placement: NodePlacement = ONE_NODE  # this worker's node of the job (the only one, mostly)

    @property
    def node(self) -> GangNode | None:
        """This worker's node of a multi-node job; None for a one-node job."""
        if self.placement.num_nodes == 1:
            return None
        return GangNode(self.number, self.placement.node_rank, self.placement.num_nodes)

    @property
    def first_node(self) -> bool:
        """Node 0 (of a one-node job, the only one): it reports and decides the job."""
        return self.placement.node_rank == 0


def take_over(
    job: Job,
    layout: RunLayout,
    store: ArtifactStore,
    *,
    keep_alive: Callable[[], None] = lambda: None,
    deadline_seconds: float = 0.0,
    records: bool = True,
) -> ResumePoint | None:
    """Before attempt n > 1: finish ingesting what attempt n-1 wrote up to the newest
    checkpoint committed to the artifact store (its worker may have died before reading it),
    drop what it recorded after that step (this attempt trains those steps again), and make
    that checkpoint a checked local copy. Raises ArtifactIntegrityError when it is not what
    was published. ``records=False`` (a node other than node 0 of a multi-node job) only makes
    the local copy: node 0's worker does the job's bookkeeping."""
    with session_scope() as session:
        newest = newest_checkpoint(session=session, job_id=job.id)
    from_step = newest.step if newest is not None else 0
    tag = layout.checkpoint_tag(from_step) if newest is not None else None
    if records:
        with session_scope() as session:
            leftovers = EventIngestor(
                events_path=layout.events(job.attempts - 1),
                log_path=None,
                job_id=job.id,
                events_offset=job.events_offset,
                up_to_step=from_step,
            )
            leftovers.poll(session)
            rewind_job(session=session, job_id=job.id, to_step=from_step, attempt=job.attempts, checkpoint=tag)
            session.commit()
    for dropped in drop_local_checkpoints_after(layout, from_step):
        logger.info("job %s: removed %s, saved by a lost attempt but never published", job.id, dropped)
    if newest is None or tag is None:
        logger.info("job %s attempt %d starts over: no committed checkpoint", job.id, job.attempts)
        return None
    fetch_checkpoint(
        store=store,
        job_id=job.id,
        layout=layout,
        step=from_step,
        keep_alive=keep_alive,
        deadline_seconds=deadline_seconds,
    )
    logger.info("job %s attempt %d resumes from %s", job.id, job.attempts, tag)
    return ResumePoint(checkpoints_dir=str(layout.checkpoints_dir), tag=tag, step=from_step)


def _keep_alive(lease: LeaseKeeper) -> None:
    """Renew the lease (or read the status); AttemptEnded once lost or cancelled, or paused
    (decided by node 0's worker: the other nodes of a gang see it as a lost job once it is);
    WorkerStopping once the worker was asked to stop."""
    lease.check_stop()
    with session_scope() as session:
        status = lease.status(session)
    if status is None or status == JobStatus.cancelling or (status == JobStatus.pausing and lease.first_node):
        raise AttemptEnded(status)


def fetch_inputs(job: Job, *, settings: Settings, lease: LeaseKeeper) -> dict[str, str | None]:
    """Local paths for the job's datasets, downloading remote ones while keeping the lease
    and recording progress events. Raises InputProblem, or AttemptEnded on a cancel or pause."""

    def report(progress: DownloadProgress) -> None:
        with session_scope() as session:
            record_event(
                session,
                job_id=job.id,
                type=EventType.download,
                data={
                    "field": progress.field,
                    "uri": progress.uri,
                    "bytes_done": progress.bytes_done,
                    "bytes_total": progress.bytes_total,
                    "finished": progress.finished,
                },
            )
            session.commit()
        _keep_alive(lease)

    training = TrainingOptions.model_validate(job.training)
    paths: dict[str, str | None] = {"dataset": job.dataset, "validation_dataset": job.validation_dataset}
    for field, value in paths.items():
        if value is not None:
            paths[field] = local_dataset(
                field,
                value,
                dataset_format=training.dataset_format,
                method=training.method,
                settings=settings,
                report=report,
            )
    return paths


def prepare_attempt(
    job: Job,
    *,
    deepspeed_config: dict[str, Any],
    datasets: dict[str, str | None],
    settings: Settings,
    worker_id: str,
    lease: LeaseKeeper | None = None,
    placement: NodePlacement = ONE_NODE,
) -> Attempt:
    """Write spec.json with the config as it will run; on a restart, resume from the newest
    complete checkpoint."""
    layout = RunLayout.for_job(settings, job.id)
    layout.root.mkdir(parents=True, exist_ok=True)
    for stale in layout.errors_dir.glob("rank-*.json"):
        stale.unlink()  # a lost attempt's errors say nothing about this one
    layout.remove_incomplete_saves()  # what a lost attempt's ranks were writing when they died
    store = ArtifactStore.from_settings(settings)
    # Fetching and converting may take long: the lease is kept, and a cancel or pause ends the attempt.
    keep_alive = (lambda: _keep_alive(lease)) if lease is not None else (lambda: None)
    deadline = settings.artifact_upload_deadline_seconds
    resume = None
    if job.attempts > 1:
        resume = take_over(
            job, layout, store, keep_alive=keep_alive, deadline_seconds=deadline, records=placement.node_rank == 0
        )
    start = None
    if resume is None and job.resume_from is not None:
        start = start_point(
            job.resume_from,
            num_gpus=job.num_nodes * job.num_gpus,
            layout=layout,
            settings=settings,
            store=store,
            keep_alive=keep_alive,
        )
    model, revision = job.model, job.revision
    if job.model_source is not None:  # another job's output: made a local directory the ranks load
        maker = BaseModelMaker(settings=settings, store=store, keep_alive=keep_alive, log=layout.log)
        model, revision = str(maker.local_model(ModelSource.model_validate(job.model_source))), None
    training = TrainingOptions.model_validate(job.training)
    spec = TrainingSpec(
        job_id=job.id,
        attempt=job.attempts,
        resume_from=resume,
        start_from=start,
        model=model,
        revision=revision,
        dataset=datasets["dataset"] or job.dataset,
        validation_dataset=datasets["validation_dataset"],
        deepspeed_config=deepspeed_config,
        num_gpus=job.num_gpus,
        num_nodes=job.num_nodes,
        training=training,
        run_dir=str(layout.root),
        cache_dir=str(settings.cache_dir),
        dist_timeout_minutes=settings.dist_timeout_minutes,
        max_line_bytes=settings.max_line_bytes,
    )
    write_json_atomic(layout.spec, json.loads(spec.model_dump_json()))
    # A node other than node 0 reads the log from where this attempt's lines begin: the
    # job's offset is node 0's.
    log_offset = (
        job.log_offset if placement.node_rank == 0 else (layout.log.stat().st_size if layout.log.exists() else 0)
    )
    return Attempt(
        job.id, job.attempts, worker_id, spec, layout, training.max_duration_seconds, log_offset, store, placement
    )


def run_job(
    job_id: uuid.UUID, *, settings: Settings, launcher: Launcher, worker_id: str, stopping: threading.Event
) -> None:
    """A one-node job's message: claim the job and run the attempt. ``stopping``: set when the
    worker was asked to stop (worker/tasks.py), checked once this attempt handles SIGTERM itself."""
    with session_scope() as session:
        job = claim_job(session=session, job_id=job_id, worker_id=worker_id, lease_ttl=settings.lease_ttl_seconds)
        if job is None:
            if job_status(session=session, job_id=job_id) == JobStatus.queued:
                # Not claimed although queued: this worker is kept for a multi-node job. A
                # reconciler publishes it again, for another worker.
                mark_unpublished(session=session, job_id=job_id)
            logger.info("job %s is not for this worker now; this delivery does nothing", job_id)
            return
    _run_attempt(job, settings=settings, launcher=launcher, worker_id=worker_id, placement=ONE_NODE, stopping=stopping)


def run_node(
    job_id: uuid.UUID,
    *,
    attempt: int,
    node_rank: int,
    settings: Settings,
    launcher: Launcher,
    worker_id: str,
    stopping: threading.Event,
) -> None:
    """A multi-node job's message for this worker's node: claim the node (once, for this
    attempt only) and run it in the gang's world; the node is finished whatever happens."""
    with session_scope() as session:
        claimed = claim_node(
            session=session,
            job_id=job_id,
            attempt=attempt,
            node_rank=node_rank,
            worker_id=worker_id,
            lease_ttl=settings.lease_ttl_seconds,
        )
    if claimed is None:
        logger.info(
            "job %s node %d of attempt %d is not this worker's to start; nothing to do", job_id, node_rank, attempt
        )
        return
    job, nodes = claimed
    master = nodes[0]
    placement = NodePlacement(
        node_rank=node_rank, num_nodes=job.num_nodes, master_addr=master.address, master_port=master.port
    )
    logger.info(
        "job %s attempt %d: node %d of %d, master %s:%s",
        job.id,
        attempt,
        node_rank,
        job.num_nodes,
        master.address,
        master.port,
    )
    try:
        _run_attempt(
            job, settings=settings, launcher=launcher, worker_id=worker_id, placement=placement, stopping=stopping
        )
    finally:
        with session_scope() as session:
            finish_node(session=session, job_id=job.id, attempt=attempt, node_rank=node_rank, worker_id=worker_id)


def _worker_checks(
    job: Job, *, layout: RunLayout, launcher: Launcher
) -> tuple[dict[str, Any], tuple[ErrorCode, str] | None]:
    """The DeepSpeed config as it will run here, and why this worker cannot run the job, if it
    cannot. The API checked the same in its own environment; this worker's image and hardware
    may differ."""
    config, unsafe = sanitize_deepspeed_config(
        job.resolved_deepspeed_config or job.deepspeed_config, run_dir=str(layout.root)
    )
    missing = missing_packages(config)
    if problem := "; ".join([u.message for u in unsafe] + [m.message for m in missing]):
        return config, (ErrorCode.invalid_input, problem)
    hardware = hardware_problems(
        num_gpus=job.num_gpus, deepspeed_config=config, hardware=launcher.hardware, whose="this worker"
    )
    if problem := "; ".join(p.message for p in hardware):
        return config, (ErrorCode.unsupported_hardware, problem)
    return config, None


def _run_attempt(
    job: Job,
    *,
    settings: Settings,
    launcher: Launcher,
    worker_id: str,
    placement: NodePlacement,
    stopping: threading.Event,
) -> None:
    """One claimed attempt (or one node of it), from the worker's own checks to the outcome."""
    job_id = job.id
    layout = RunLayout.for_job(settings, job.id)
    config, refusal = _worker_checks(job, layout=layout, launcher=launcher)
    if refusal is not None:
        _finish(job_id, JobStatus.failed, *refusal)
        return
    # A SIGTERM is only noted (the handler sets ``stopping``; nothing in this process waits on
    # that event, so setting it from a handler cannot block): the attempt acts on it at its
    # own check points, and hands the job back.
    previous = signal.signal(signal.SIGTERM, lambda _signum, _frame: stopping.set())
    try:
        node_rank = placement.node_rank if placement.num_nodes > 1 else None
        lease = LeaseKeeper(
            job_id=job.id,
            worker_id=worker_id,
            attempt=job.attempts,
            settings=settings,
            node_rank=node_rank,
            stopping=stopping,
        )
        try:
            lease.check_stop()  # a SIGTERM that came before the handler above was noted all the same
            datasets = fetch_inputs(job, settings=settings, lease=lease)
            attempt = prepare_attempt(
                job,
                deepspeed_config=config,
                datasets=datasets,
                settings=settings,
                worker_id=worker_id,
                lease=lease,
                placement=placement,
            )
            launcher.wait_until_warm(keep_alive=lambda: _keep_alive(lease))
        except InputProblem as e:
            _finish(job.id, JobStatus.failed, ErrorCode.invalid_input, str(e))
            return
        except AttemptEnded as e:
            logger.info("job %s attempt %d %s while preparing its inputs", job.id, job.attempts, e)
            if e.status == JobStatus.cancelling:
                _finish(job.id, JobStatus.cancelled, ErrorCode.cancelled, "cancelled while preparing its inputs")
            elif e.status == JobStatus.pausing:
                _pause(job.id, job.attempts, layout=layout, paused_at=None)
            return
        except ConversionFailed as e:
            _finish(job.id, JobStatus.failed, ErrorCode.training_error, str(e))
            return
        except ArtifactIntegrityError as e:
            logger.error("job %s: %s", job.id, e)
            _finish(job.id, JobStatus.failed, ErrorCode.artifact_integrity, str(e))  # names the file
            return
        except ArtifactStoreError as e:
            logger.error("job %s: %s", job.id, e)
            _finish(job.id, JobStatus.failed, ErrorCode.artifact_store_unavailable, str(e))
            return
        except WorkerStopping:
            _hand_back(job.id, job.attempts)
            raise SystemExit(0) from None
        except Exception as e:
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                reason = f"the worker's disk is full ({disk_problem(settings) or e}): the job goes to another worker"
                logger.warning("job %s: %s", job.id, reason)
                _release(job.id, job.attempts, reason=reason, code=ErrorCode.host_error)
                return
            logger.exception("job %s: preparing its inputs failed", job.id)
            message = (
                "the job's inputs could not be prepared (a dataset download or a checkpoint conversion failed); "
                "the worker log has details"
            )
            _finish(job.id, JobStatus.failed, ErrorCode.internal_error, message)
            return
        _supervise(attempt, settings=settings, launcher=launcher, lease=lease)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _finish(job_id: uuid.UUID, status: JobStatus, code: ErrorCode, message: str) -> None:
    with session_scope() as session:
        finish_job(session=session, job_id=job_id, status=status, error_code=code, error_message=message)


class DatabaseOutage:
    """A run of polls that found the database unreachable (a restart, a network blip): they
    are retried with backoff while the ranks keep training. The attempt ends only once the
    lease has run out meanwhile: by then the reconciler may have given the job to another
    worker, so this one stops its ranks and records nothing (the job is requeued as a lost
    worker's, never failed for it)."""

    def __init__(self, *, job_id: uuid.UUID, lease: LeaseKeeper) -> None:
        self.job_id, self.lease = job_id, lease
        self.since: float | None = None
        self.delay = POLL_SECONDS

    def failed(self, error: Exception) -> bool:
        """Note a poll that failed on an unreachable database and wait before the next; False
        once the lease has run out. Any other error is raised again: it is no outage. A stop of
        the worker ends the wait (WorkerStopping)."""
        if not is_transient_database_error(error):
            raise error
        self.lease.check_stop()
        now = time.monotonic()
        if self.since is None:
            self.since = now
            logger.warning("job %s: the database is unreachable (%s); retrying as the ranks train", self.job_id, error)
        if now - self.lease.last_renewal > self.lease.ttl:
            logger.error(
                "job %s: the database was unreachable for %.0fs, past the job's lease (%ds): stopping its "
                "ranks; the job is requeued and resumes from its newest checkpoint",
                self.job_id,
                now - self.since,
                self.lease.ttl,
            )
            return False
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, DB_RETRY_MAX_SECONDS)
        return True

    def recovered(self) -> None:
        if self.since is not None:
            logger.info("job %s: the database is back after %.1fs", self.job_id, time.monotonic() - self.since)
        self.since, self.delay = None, POLL_SECONDS


def _supervise(attempt: Attempt, *, settings: Settings, launcher: Launcher, lease: LeaseKeeper) -> None:
    job_id, layout = attempt.job_id, attempt.layout
    logger.info(
        "job %s attempt %d: starting %d ranks on %s",
        job_id,
        attempt.number,
        attempt.spec.num_gpus,
        launcher.hardware.accelerator,
    )
    publisher = ArtifactPublisher(
        job_id=job_id,
        layout=layout,
        store=attempt.store,
        deadline_seconds=settings.artifact_upload_deadline_seconds,
        keep_checkpoints=attempt.spec.training.keep_checkpoints,
        node=attempt.node,
    )
    ingestor = EventIngestor(
        events_path=layout.events(attempt.number),
        log_path=layout.log,
        job_id=job_id,
        log_offset=attempt.log_offset,
        on_checkpoint=publisher.submit,
        training_events=attempt.first_node,
    )
    outage = DatabaseOutage(job_id=job_id, lease=lease)
    process: RankGroup | None = None
    try:
        process = launcher.launch_ranks(
            spec_path=layout.spec,
            num_ranks=attempt.spec.num_gpus,
            log_path=layout.log,
            cwd=layout.root,
            placement=attempt.placement,
        )
        started = time.monotonic()
        launched_at = time.time()
        first_rank = attempt.placement.global_rank(0, attempt.spec.num_gpus)
        ranks = range(first_rank, first_rank + attempt.spec.num_gpus)
        log_start = layout.log.stat().st_size if layout.log.exists() else 0  # where this attempt's lines begin
        ending: Ending | None = None
        full_disk: str | None = None  # the ranks failed for want of disk (worker.disk_space)
        pause_requested = False
        # One session per poll: a pooled connection a database restart killed is replaced at
        # the next checkout (pool_pre_ping) instead of failing every poll after it.
        while ending is None and process.poll() is None:
            lease.check_stop()
            try:
                with session_scope() as session:
                    ingestor.poll(session)
                    status = lease.status(session)
            except Exception as e:
                if outage.failed(e):
                    continue
                process.stop(grace_seconds=0)
                publisher.abandon()
                return
            outage.recovered()
            if status is None:
                logger.warning("job %s attempt %d lost its lease; stopping its ranks", job_id, attempt.number)
                process.stop(grace_seconds=0)
                publisher.abandon()
                return
            if status == JobStatus.cancelling:
                ending = Ending(JobStatus.cancelled, ErrorCode.cancelled, "cancelled while running")
                logger.info("job %s: %s; stopping its ranks", job_id, ending.message)
                process.stop(grace_seconds=settings.cancel_grace_seconds)
                break
            if status == JobStatus.pausing and attempt.first_node and not pause_requested:
                # Node 0 decides; the ranks agree on it after their next step (on every node),
                # save a checkpoint there and exit 0. The loop goes on meanwhile: uploads, the
                # lease, stalls and a cancel are watched as ever.
                request = layout.pause_request(attempt.number)
                request.parent.mkdir(parents=True, exist_ok=True)
                request.touch()
                pause_requested = True
                logger.info("job %s: pausing; its ranks save a checkpoint after their next step and exit", job_id)
            if publisher.gave_up:  # the ranks would wait for it at their next save forever
                ending = _publishing_failed(attempt, publisher, settings)
                process.stop(grace_seconds=STOP_GRACE_SECONDS)
                break
            if (
                stalled := stalled_rank(layout, ranks, since=launched_at, limit=settings.rank_stall_seconds)
            ) is not None:
                # Stopped (SIGSTOP), or stuck with the GIL held: its peers would wait in their next
                # collective for the whole collective timeout. The host's failure, not the job's.
                ending = Ending(JobStatus.queued, ErrorCode.host_error, stalled)
                logger.warning("job %s attempt %d: %s; killing its ranks", job_id, attempt.number, stalled)
                process.stop(grace_seconds=0)
                break
            # Node 0 keeps the job's time (another node stopping first would look like its failure).
            limit = attempt.max_duration_seconds if attempt.first_node else None
            if limit is not None and time.monotonic() - started > limit:
                message = f"the job ran longer than training.max_duration_seconds ({limit}s)"
                ending = Ending(JobStatus.failed, ErrorCode.timeout, message)
                logger.info("job %s: %s; stopping its ranks", job_id, ending.message)
                process.stop(grace_seconds=STOP_GRACE_SECONDS)
                break
            time.sleep(POLL_SECONDS)
        if ending is None:
            # Ranks that exited as the worker was asked to stop (a SIGTERM to a whole container
            # reaches them as well) ended because of the stop, not of the job.
            lease.check_stop()
            if process.returncode == 0:
                ending = _clean_exit(attempt)
            else:
                ending, full_disk = _failed_ranks_ending(attempt, process, log_start=log_start, settings=settings)
        for removed in layout.remove_incomplete_saves():  # the ranks are gone: nothing finishes these
            logger.info("job %s: removed %s, a save that never finished", job_id, removed)
        _record_outcome(attempt, ingestor, publisher, ending, outage, lease=lease, settings=settings)
        if full_disk is not None:
            if dropped := publisher.drop_local_copies():
                logger.info(
                    "job %s: removed this host's copies of its checkpoints %s, held by the store", job_id, dropped
                )
            note_full_disk(settings, job_id=str(job_id))
    except WorkerStopping:
        logger.warning("job %s: worker stopping; stopping its ranks and handing the job back", job_id)
        publisher.abandon()
        if process is not None:
            process.stop(grace_seconds=STOP_GRACE_SECONDS)
        _hand_back(attempt.job_id, attempt.number, node_rank=attempt.placement.node_rank if attempt.node else None)
        raise SystemExit(0) from None
    except Exception:
        logger.exception("job %s: the worker failed while running it", job_id)
        publisher.abandon()
        if process is not None:
            process.stop(grace_seconds=STOP_GRACE_SECONDS)
        with session_scope() as session:
            finish_job(
                session=session,
                job_id=job_id,
                status=JobStatus.failed,
                error_code=ErrorCode.internal_error,
                error_message="tuneq failed while running this job; the worker log has the details",
            )


def _failed_ranks_ending(
    attempt: Attempt, process: RankGroup, *, log_start: int, settings: Settings
) -> tuple[Ending, str | None]:
    """How an attempt whose ranks exited non-zero ends, and why the disk was full if it was:
    the host's failure (a rank the kernel killed, a full disk: requeued), a gang's (requeued),
    or the job's own. Judged before the cleanup frees what an unfinished save took."""
    layout = attempt.layout
    log_text = read_from(layout.log, log_start)
    killed = killed_rank(log_text, killed_by_tuneq=process.killed_pids)
    code, message = failure_from_ranks(layout, killed=killed)
    full_disk = full_disk_failure(
        settings,
        evidence=[log_text, *(e.message for e in rank_errors(layout))],
        unfinished_save=bool(layout.incomplete_saves()),
    )
    if (host_problem := host_failure(killed=killed, full_disk=full_disk)) is not None:
        logger.warning("job %s attempt %d: %s", attempt.job_id, attempt.number, host_problem)
        return Ending(JobStatus.queued, ErrorCode.host_error, host_problem), full_disk
    if attempt.node is not None and code != ErrorCode.invalid_input:
        # Any node's failure is the gang's: a rank that lost a peer fails as well, so which node
        # failed first is not known here. The whole job goes back to the queue.
        message = f"node {attempt.placement.node_rank} (worker {attempt.worker_id}): {message}"
        logger.warning("job %s attempt %d: %s", attempt.job_id, attempt.number, message)
        return Ending(JobStatus.queued, code, message), full_disk
    logger.warning("job %s failed (exit %s): %s", attempt.job_id, process.returncode, message)
    return Ending(JobStatus.failed, code, message), full_disk


def _record_outcome(
    attempt: Attempt,
    ingestor: EventIngestor,
    publisher: ArtifactPublisher,
    ending: Ending,
    outage: DatabaseOutage,
    *,
    lease: LeaseKeeper,
    settings: Settings,
) -> None:
    """What the ranks wrote last (the final step's metrics, the export's checkpoint), then
    their uploads and the training log's, then the attempt's outcome; the database retried
    like a poll while it is away. An attempt its host failed (``queued``) goes back to the
    queue for any worker to resume from what is in the store."""
    while True:
        try:
            with session_scope() as session:
                ingestor.poll(session)
            break
        except Exception as e:
            if outage.failed(e):
                continue
            publisher.abandon()
            return  # the lease ran out: the reconciler requeues the job
    gang_failed = attempt.node is not None and ending.status == JobStatus.queued
    if gang_failed and ending.code == ErrorCode.host_error:
        # A stopped or killed rank, a full disk: this node knows the cause, and the other nodes'
        # ranks fail because of it. It ends the gang first, with its reason, then publishes.
        _release(
            attempt.job_id,
            attempt.number,
            reason=ending.message or "",
            code=ErrorCode.host_error,
            node_rank=attempt.placement.node_rank,
        )
    log = attempt.layout.log if attempt.first_node else None  # the job's log is node 0's
    ranks_done = ending.status in (JobStatus.succeeded, JobStatus.paused)
    if publisher.finish(log=log, while_waiting=lease.hold) is not None and ranks_done:
        ending = _publishing_failed(attempt, publisher, settings)
    if attempt.node is not None and (gang_failed or not attempt.first_node):
        # Any node's ranks fail when another's do, so who failed first is not known here: a
        # node that knows its host failed has ended the gang above; node 0 waits a moment for
        # that, another node longer (node 0's ranks fail too and its worker decides).
        if ending.status not in (JobStatus.succeeded, JobStatus.paused):
            wait = GANG_DECISION_SECONDS / (2 if attempt.first_node else 1)
            _end_gang_unless_decided(attempt, ending, lease=lease, wait_seconds=wait)
        return
    if ending.status in (JobStatus.succeeded, JobStatus.paused) and attempt.node is not None:
        # Their shares complete the last checkpoint (the pause's, or the final step's): a job
        # seen succeeded or paused can be resumed from it at once.
        _wait_for_other_nodes(attempt, lease=lease)
    while True:
        try:
            if ending.status == JobStatus.paused:
                _pause(attempt.job_id, attempt.number, layout=attempt.layout, paused_at=ending.paused_at)
                return
            if ending.status == JobStatus.queued:
                _release(
                    attempt.job_id,
                    attempt.number,
                    reason=ending.message or "",
                    code=ending.code or ErrorCode.host_error,
                    node_rank=attempt.placement.node_rank if attempt.node is not None else None,
                )
                return
            if ending.status == JobStatus.succeeded:
                _publish_results(attempt)
            with session_scope() as session:
                finish_job(
                    session=session,
                    job_id=attempt.job_id,
                    status=ending.status,
                    error_code=ending.code,
                    error_message=ending.message,
                    attempt=attempt.number,
                )
        except Exception as e:
            if outage.failed(e):
                continue
            return  # the lease ran out: the reconciler requeues the job
        outage.recovered()
        if ending.status == JobStatus.succeeded:
            logger.info("job %s succeeded", attempt.job_id)
        return


def _publish_results(attempt: Attempt) -> None:
    """The job's results file, before it is marked succeeded (a client that sees it succeed finds
    it). The store failing here costs the file, not the job: its metrics stay in SQL."""
    try:
        publish_results_file(job_id=attempt.job_id, store=attempt.store)
    except ArtifactStoreError as e:
        logger.warning("job %s: no results file (the artifact store: %s)", attempt.job_id, e)


def _clean_exit(attempt: Attempt) -> Ending:
    """The ranks exited 0: they finished the job, or left after a step as asked."""
    try:
        with session_scope() as session:
            status = job_status(session=session, job_id=attempt.job_id)
    except Exception as e:  # the database is away: the outcome's own retries deal with it
        logger.warning("job %s: could not read its status (%s)", attempt.job_id, e)
        status = None
    if status == JobStatus.cancelling:
        # The ranks agreed on a stop after a step: another node's worker (of a multi-node
        # job) saw the cancel first and signalled its own ranks, or the cancel came as they paused.
        return Ending(JobStatus.cancelled, ErrorCode.cancelled, "cancelled while running")
    if (paused_at := attempt.layout.paused_at(attempt.number)) is not None:  # node 0's disk has it
        return Ending(JobStatus.paused, None, None, paused_at=paused_at)
    if status == JobStatus.pausing and not attempt.first_node:
        return Ending(JobStatus.paused, None, None)  # node 0's worker records the pause
    return Ending(JobStatus.succeeded, None, None)


def _pause(job_id: uuid.UUID, number: int, *, layout: RunLayout, paused_at: int | None) -> None:
    """The attempt ends in a pause (its ranks are gone, their checkpoint committed): the job
    keeps its place, holds no worker, and resumes from its newest committed checkpoint, the
    ranks' pause checkpoint (at ``paused_at``) when they got that far. A job cancelled in the
    meantime is cancelled now."""
    with session_scope() as session:
        newest = newest_checkpoint(session=session, job_id=job_id)
        step = newest.step if newest is not None else 0
        if paused_at is not None and step != paused_at:
            logger.warning(
                "job %s: its ranks paused at step %d, but its newest committed checkpoint is step %d: "
                "it resumes from there",
                job_id,
                paused_at,
                step,
            )
        tag = layout.checkpoint_tag(step) if newest is not None else None
        if finish_pause(session=session, job_id=job_id, attempt=number, step=step, checkpoint=tag):
            logger.info("job %s paused at step %d; its worker is free", job_id, step)
        elif job_status(session=session, job_id=job_id) == JobStatus.cancelling:
            finish_job(
                session=session,
                job_id=job_id,
                status=JobStatus.cancelled,
                error_code=ErrorCode.cancelled,
                error_message="cancelled while pausing",
                attempt=number,
            )


def _wait_for_other_nodes(attempt: Attempt, *, lease: LeaseKeeper) -> None:
    """Node 0 of a gang whose ranks finished or paused, its own ranks gone and share uploaded:
    wait until every other node has finished too (its share of the last checkpoint uploaded,
    which commits it), or the attempt ended some other way (a node lost: a reconciler released
    the gang). Node 0's lease is held meanwhile."""
    while True:
        lease.hold()
        with session_scope() as session:
            job = session.get(Job, attempt.job_id)
            if job is None or job.attempts != attempt.number or job.status not in ACTIVE:
                return
            if not [n for n in open_nodes(session=session, job_id=job.id, attempt=attempt.number) if n != 0]:
                return
        time.sleep(POLL_SECONDS)


def _end_gang_unless_decided(attempt: Attempt, ending: Ending, *, lease: LeaseKeeper, wait_seconds: float) -> None:
    """This node's ranks failed: give the other nodes' workers ``wait_seconds`` to end the
    attempt (with the cause, if theirs), then end it from here with this node's reason. Its
    own lease is held meanwhile: a node whose worker died is then the one whose lease expires."""
    deadline = time.monotonic() + wait_seconds
    while time.monotonic() < deadline:
        lease.hold()
        with session_scope() as session:
            job = session.get(Job, attempt.job_id)
            if job is None or job.attempts != attempt.number or job.status not in ACTIVE:
                return
        time.sleep(POLL_SECONDS)
    code = ending.code if ending.status == JobStatus.queued else ErrorCode.training_error
    _release(
        attempt.job_id,
        attempt.number,
        reason=ending.message or "",
        code=code or ErrorCode.host_error,
        node_rank=attempt.placement.node_rank,
    )


def stalled_rank(layout: RunLayout, ranks: range, *, since: float, limit: float) -> str | None:
    """Why one of ``ranks`` counts as stopped or hung: its heartbeat (``RunLayout.heartbeat``),
    written since ``since`` (this launch), is older than ``limit`` seconds. A rank still starting
    (importing, under DeepSpeed's launcher) has written none yet and is not judged. None while
    every rank shows life."""
    now = time.time()
    for rank in ranks:
        try:
            seen = layout.heartbeat(rank).stat().st_mtime
        except FileNotFoundError:
            continue
        if seen >= since and now - seen > limit:
            return (
                f"rank {rank} showed no sign of life for {now - seen:.0f}s (TUNEQ_RANK_STALL_SECONDS {limit:.0f}): "
                "its process was stopped or hung"
            )
    return None


def _publishing_failed(attempt: Attempt, publisher: ArtifactPublisher, settings: Settings) -> Ending:
    if publisher.internal:
        logger.error("job %s: publishing its files failed: %s", attempt.job_id, publisher.problem)
        message = "tuneq failed while publishing the job's files to the artifact store; the worker log has the details"
        return Ending(JobStatus.failed, ErrorCode.internal_error, message)
    message = (
        f"the artifact store {publisher.store} stayed unreachable for more than "
        f"{settings.artifact_upload_deadline_seconds:.0f}s (TUNEQ_ARTIFACT_UPLOAD_DEADLINE_SECONDS): "
        f"{publisher.problem}; the job's files are kept on worker {attempt.worker_id} in {attempt.layout.root}"
    )
    logger.error("job %s: %s", attempt.job_id, message)
    return Ending(JobStatus.failed, ErrorCode.artifact_store_unavailable, message)


def _release(
    job_id: uuid.UUID,
    number: int,
    *,
    reason: str,
    code: ErrorCode = ErrorCode.worker_lost,
    node_rank: int | None = None,
    handed_back: bool = False,
) -> None:
    """The attempt ends without an outcome of its own: requeue the job (or fail it, out of
    restarts); for a multi-node job, on every node (``node_rank``: the node that failed)."""
    with session_scope() as session:
        job = session.get(Job, job_id, populate_existing=True)
        if job is None or job.attempts != number or job.status not in ACTIVE:
            return
        release_attempt(
            session=session, job=job, reason=reason, code=code, failed_node=node_rank, handed_back=handed_back
        )


def _hand_back(job_id: uuid.UUID, number: int, *, node_rank: int | None = None) -> None:
    """The worker was asked to stop (a deploy, a scale-down): the job goes back to the queue
    and resumes from its newest checkpoint, and the attempt is not counted against its
    max_restarts (the job did nothing to end it)."""
    _release(job_id, number, reason="the worker running this job was stopped", node_rank=node_rank, handed_back=True)
