"""A verified local copy of a committed checkpoint (or a job's exported model or adapter), for
ranks to load.

The store is the truth and the worker's disk a cache: a checkpoint is copied from the store
unless the local copy's files are already the published ones. Either way every file is
checked against the SHA-256 recorded in SQL when the checkpoint was committed before any
rank sees it: DeepSpeed loads checkpoint state with pickle, so a file changed in the store
(or on a shared disk) must never reach a rank.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from pathlib import Path

from shared.artifacts.store import (
    ArtifactIntegrityError,
    ArtifactStore,
    ArtifactStoreError,
    StoreOutage,
    job_key,
    sha256_of,
)
from shared.db.artifacts import checkpoint_files
from shared.db.engine import session_scope
from shared.db.models import ArtifactKind
from shared.db.store_identity import ArtifactStoreMismatch, mismatch_now
from shared.jobs.run_layout import RunLayout

logger = logging.getLogger(__name__)


def fetch_checkpoint(
    *,
    store: ArtifactStore,
    job_id: uuid.UUID,
    layout: RunLayout,
    step: int,
    keep_alive: Callable[[], None] = lambda: None,
    deadline_seconds: float = 0.0,
) -> Path:
    """The directory of ``job_id``'s committed DeepSpeed checkpoint at ``step`` under
    ``layout`` (that job's run directory on this host), every file checked. A store that fails
    is retried with backoff for up to ``deadline_seconds`` (``keep_alive`` is called every
    second meanwhile, whatever the backoff: it keeps the job's lease, and may raise to end the
    wait). Raises ArtifactIntegrityError when a file is not the one that was published,
    ArtifactStoreMismatch at the first failure when ``store`` is not the deployment's store
    (a retry would never find the file), ArtifactStoreError when the store stayed unreachable."""
    directory = layout.checkpoints_dir / layout.checkpoint_tag(step)
    fetch_published(
        store=store,
        job_id=job_id,
        layout=layout,
        kind=ArtifactKind.deepspeed,
        step=step,
        keep_alive=keep_alive,
        deadline_seconds=deadline_seconds,
        what="the checkpoint",
    )
    return directory


def fetch_export(
    *,
    store: ArtifactStore,
    job_id: uuid.UUID,
    layout: RunLayout,
    kind: ArtifactKind,
    step: int,
    keep_alive: Callable[[], None] = lambda: None,
    deadline_seconds: float = 0.0,
) -> Path:
    """The directory of ``job_id``'s exported model or LoRA adapter (``kind``; at ``step``, its
    last) under ``layout``, every file checked, as :func:`fetch_checkpoint` fetches a checkpoint."""
    directory = {ArtifactKind.model: layout.model_dir, ArtifactKind.adapter: layout.adapter_dir}[kind]
    fetch_published(
        store=store,
        job_id=job_id,
        layout=layout,
        kind=kind,
        step=step,
        keep_alive=keep_alive,
        deadline_seconds=deadline_seconds,
        what=f"the exported {kind.value}",
    )
    return directory


def fetch_published(
    *,
    store: ArtifactStore,
    job_id: uuid.UUID,
    layout: RunLayout,
    kind: ArtifactKind,
    step: int,
    keep_alive: Callable[[], None],
    deadline_seconds: float,
    what: str,
) -> None:
    """Make the local copies of the files SQL lists for one of ``job_id``'s checkpoints (a
    DeepSpeed checkpoint, an exported model or adapter) the published ones: each copied from the
    store unless the local file already has the recorded size and SHA-256 (it may be the store's
    own file, on a local store), and checked against that SHA-256 before it takes its name."""
    with session_scope() as session:
        files = checkpoint_files(session=session, job_id=job_id, kind=kind, step=step)
    if not files:
        raise ArtifactIntegrityError(f"job {job_id} has no published files for {what} at step {step}")
    fetched = 0
    for artifact in files:
        local = layout.root / artifact.path
        if local.is_file() and local.stat().st_size == artifact.size and sha256_of(local) == artifact.sha256:
            continue
        key = job_key(job_id, artifact.path)
        _retrying(
            lambda: store.get_file(key, local, sha256=artifact.sha256),  # noqa: B023 (called at once)
            store=store,
            keep_alive=keep_alive,
            deadline_seconds=deadline_seconds,
            what=what,
        )
        fetched += 1
    if fetched:
        logger.info("job %s: fetched %d of %d files of %s from %s", job_id, fetched, len(files), what, store)


def _retrying(
    action: Callable[[], None],
    *,
    store: ArtifactStore,
    keep_alive: Callable[[], None],
    deadline_seconds: float,
    what: str,
) -> None:
    outage = StoreOutage()
    while True:
        try:
            action()
            return
        except ArtifactIntegrityError:
            raise
        except Exception as e:
            if outage.failed() and (problem := mismatch_now(store)) is not None:
                missing = f"{what} is not in this worker's artifact store ({e})"
                raise ArtifactStoreMismatch(f"{missing}: {problem}") from e
            if outage.would_outlast(deadline_seconds):
                raise ArtifactStoreError(
                    f"the artifact store {store} stayed unreachable for more than {deadline_seconds:.0f}s "
                    f"(TUNEQ_ARTIFACT_UPLOAD_DEADLINE_SECONDS) while fetching {what}: {e}"
                ) from e
            logger.warning("fetching from the artifact store %s failed (%s); retrying in %.0fs", store, e, outage.delay)
            outage.wait(keep_alive)


def drop_local_checkpoints_after(layout: RunLayout, step: int) -> list[Path]:
    """Remove local checkpoints past ``step``: saved by a lost attempt but never committed,
    they are trained again (and would otherwise mix stale files into the new saves)."""
    later = {saved: directory for saved, directory in layout.local_checkpoints().items() if saved > step}
    for saved in later:
        layout.remove_local_checkpoint(saved)
    return list(later.values())
