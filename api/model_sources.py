"""The API's side of a ``model`` naming another job's output (``shared.jobs.model_source``): which
of the caller's jobs it names, what it names there, and that model's config.json, read from the
artifact store and checked against the SHA-256 recorded when it was published. No HTTP in here.

Only the caller's own jobs can be named: another owner's is not found, in the very words of a
missing one. The named job must have succeeded (its outputs are then final: retention deletes
checkpoints only while a job trains), and what is named must be committed: its exported model
or LoRA adapter, or a DeepSpeed checkpoint at the step named.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlmodel import Session, col, select

from api.artifact_download import artifact_store
from shared.artifacts.store import ArtifactIntegrityError, ArtifactStore, ArtifactStoreError, job_key, sha256_of
from shared.db.artifacts import get_artifact, list_artifacts
from shared.db.models import Artifact, ArtifactKind, Checkpoint, CheckpointKind, Job
from shared.jobs.model_source import (
    FINE_TUNED_ID_DIGITS,
    ModelReference,
    ModelSource,
    fine_tuned_name,
    names_a_job,
    parse_model_reference,
)
from shared.jobs.run_layout import write_json_atomic
from shared.jobs.spec import JobCreate
from shared.jobs.status import JobStatus
from shared.jobs.validation import JobValidationError, Problem, local_model_config
from shared.settings import Settings

MODEL_FIELD: tuple[str | int, ...] = ("body", "model")
# The files of an exported model or adapter the plan reads (config and tokenizer): not the weights.
_WEIGHTS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def base_model_of(job: Job) -> str:
    """The base model the chain of jobs ending with ``job`` started from."""
    return ModelSource.model_validate(job.model_source).base_model if job.model_source else job.model


def fine_tuned_model_name(job: Job) -> str:
    """The job's ``fine_tuned_model`` as OpenAI names it: after the base model its chain of jobs
    started from, whatever job's output it continued from."""
    suffix = (job.fine_tuning or {}).get("suffix") or ""
    return fine_tuned_name(base_model=base_model_of(job), owner=job.owner, suffix=suffix, job_id=job.id)


class ModelNotNamed(ValueError):
    """A ``job:``/``ft:`` model that names nothing the caller may continue from; ``str()`` says why."""


@dataclass(frozen=True)
class ResolvedModel:
    """What a ``job:``/``ft:`` model names, and that model's config.json (None when its chain
    started from a hub model and no job of it exported a whole model)."""

    source: ModelSource
    config: dict[str, Any] | None


def named_job(*, session: Session, reference: ModelReference, owner: str) -> Job | None:
    """``owner``'s job a parsed reference names; None for a missing job or another owner's."""
    if reference.job_id is not None:
        return session.exec(select(Job).where(col(Job.id) == reference.job_id, col(Job.owner) == owner)).first()
    assert reference.id_prefix is not None
    # An ft: name holds the id's first digits: the ids that start with them are one range, in
    # SQLite's hex text as in Postgres's uuid order.
    pad = 32 - FINE_TUNED_ID_DIGITS
    low, high = uuid.UUID(reference.id_prefix + "0" * pad), uuid.UUID(reference.id_prefix + "f" * pad)
    candidates = session.exec(select(Job).where(col(Job.owner) == owner, col(Job.id) >= low, col(Job.id) <= high)).all()
    return next((job for job in candidates if fine_tuned_model_name(job) == reference.fine_tuned_name), None)


def model_source(*, session: Session, model: str, owner: str) -> ModelSource:
    """What ``model`` (``job:``/``ft:``) names among ``owner``'s jobs. Raises ModelNotNamed."""
    try:
        reference = parse_model_reference(model)
    except ValueError as e:
        raise ModelNotNamed(str(e)) from None
    job = named_job(session=session, reference=reference, owner=owner)
    if job is None:
        if reference.job_id is not None:
            raise ModelNotNamed(f"job {reference.job_id} not found: name one of your jobs (GET /jobs lists them)")
        raise ModelNotNamed(
            f"fine-tuned model '{reference.fine_tuned_name}' not found: name one of yours (GET /v1/models lists them)"
        )
    if job.status != JobStatus.succeeded:
        raise ModelNotNamed(
            f"job {job.id} is {job.status.value}: a job's output can be continued from once the job has succeeded"
        )
    committed = session.exec(select(Checkpoint.step, Checkpoint.kind).where(Checkpoint.job_id == job.id)).all()
    steps = {kind: sorted(step for step, k in committed if k == kind) for kind in CheckpointKind}
    base = base_model_of(job)
    if reference.step is not None:
        if reference.step not in steps[CheckpointKind.deepspeed]:
            kept = ", ".join(map(str, steps[CheckpointKind.deepspeed])) or "none"
            raise ModelNotNamed(
                f"job {job.id} has no DeepSpeed checkpoint at step {reference.step} (it has {kept}): name one of "
                "its checkpoints, or job:<id> for its exported model"
            )
        return ModelSource(job_id=job.id, kind="deepspeed", step=reference.step, base_model=base)
    # A LoRA job that also exported its merged model is continued from that model.
    if steps[CheckpointKind.model]:
        return ModelSource(job_id=job.id, kind="model", step=steps[CheckpointKind.model][-1], base_model=base)
    if steps[CheckpointKind.adapter]:
        return ModelSource(job_id=job.id, kind="adapter", step=steps[CheckpointKind.adapter][-1], base_model=base)
    raise ModelNotNamed(
        f"job {job.id} has no exported model or adapter: name one of its DeepSpeed checkpoints "
        "(job:<id>@step-<n>) instead"
    )


def resolve_model(*, session: Session, settings: Settings, job_in: JobCreate, owner: str) -> ResolvedModel | None:
    """None for a base model; else what ``job_in.model`` names and its config. Raises
    JobValidationError naming ``model`` (and ``revision``: a job's output is used as it was
    saved), ArtifactStoreError when the store cannot be read now."""
    if not names_a_job(job_in.model):
        return None
    problems = []
    if job_in.revision is not None:
        problems.append(
            Problem(
                ("body", "revision"),
                "revision applies to hub models only; another job's output is used as that job saved it: drop revision",
            )
        )
    try:
        source = model_source(session=session, model=job_in.model, owner=owner)
    except ModelNotNamed as e:
        raise JobValidationError([Problem(MODEL_FIELD, str(e)), *problems]) from None
    if problems:
        raise JobValidationError(problems)
    job = session.get(Job, source.job_id)
    assert job is not None
    try:
        config = output_config(session=session, store=artifact_store(settings), job=job)
    except ArtifactIntegrityError as e:
        raise _changed_in_store(e) from None
    return ResolvedModel(source=source, config=config)


def _changed_in_store(error: ArtifactIntegrityError) -> JobValidationError:
    return JobValidationError([Problem(MODEL_FIELD, f"{error}: the job's output cannot be continued from")])


def output_config(*, session: Session, store: ArtifactStore, job: Job) -> dict[str, Any] | None:
    """config.json of the model ``job`` made: its exported model's or, for a LoRA job that
    exported its adapter alone, its base model's (the adapter changes no shape)."""
    artifact = get_artifact(session=session, job_id=job.id, path="model/config.json")
    if artifact is not None:
        config = json.loads(_read_checked(store, artifact))
        return config if isinstance(config, dict) else None
    if job.model_source is not None:
        source = session.get(Job, ModelSource.model_validate(job.model_source).job_id)
        return output_config(session=session, store=store, job=source) if source is not None else None
    return local_model_config(job.model)


def _read_checked(store: ArtifactStore, artifact: Artifact) -> bytes:
    key = job_key(artifact.job_id, artifact.path)
    try:
        data = store.read_bytes(key)
    except Exception as e:
        raise ArtifactStoreError(f"the artifact store {store} cannot be read now ({e})") from e
    found = hashlib.sha256(data).hexdigest()
    if found != artifact.sha256:
        raise ArtifactIntegrityError(
            f"{store.uri_of(key)} is not the file that was published (SHA-256 {found[:12]}…, recorded "
            f"{artifact.sha256[:12]}…)"
        )
    return data


def plan_model(*, session: Session, settings: Settings, resolved: ResolvedModel) -> tuple[str, str | None]:
    """What the plan loads for a named model (``model`` and ``revision``, as ``from_pretrained``
    takes them): a directory in this API's cache with its config and tokenizer, or, for a LoRA
    job's adapter on a chain that started from a hub model (whose config the API never fetches),
    that hub model: the adapter changes no shape, and the tokenizer is the base's. Raises
    JobValidationError naming ``model`` for a file changed in the store, ArtifactStoreError."""
    try:
        directory = plan_model_directory(session=session, settings=settings, resolved=resolved)
    except ArtifactIntegrityError as e:
        raise _changed_in_store(e) from None
    if (directory / "config.json").is_file():
        return str(directory), None
    job = session.get(Job, resolved.source.job_id)
    while job is not None and job.model_source is not None:
        job = session.get(Job, ModelSource.model_validate(job.model_source).job_id)
    return (job.model, job.revision) if job is not None else (resolved.source.base_model, None)


def plan_model_directory(*, session: Session, settings: Settings, resolved: ResolvedModel) -> Path:
    """A local directory with what the plan reads of a named model, its config and tokenizer
    (not its weights: the plan builds the model on the meta device), in this API's cache, every
    file checked. Raises ArtifactIntegrityError, ArtifactStoreError."""
    store = artifact_store(settings)
    target = settings.cache_dir / "named-models" / str(resolved.source.job_id)
    files = [
        a
        for a in list_artifacts(session=session, job_id=resolved.source.job_id)
        if a.kind in (ArtifactKind.model, ArtifactKind.adapter) and not a.path.endswith(_WEIGHTS_SUFFIXES)
    ]
    # From the exported model when there is one; else the adapter's tokenizer and the base's config.
    exported = [a for a in files if a.kind == ArtifactKind.model] or [
        a for a in files if not a.path.rsplit("/", 1)[-1].startswith("adapter_")
    ]
    for artifact in exported:
        local = target / artifact.path.split("/", 1)[1]
        if local.is_file() and sha256_of(local) == artifact.sha256:
            continue
        try:
            store.get_file(job_key(artifact.job_id, artifact.path), local, sha256=artifact.sha256)
        except ArtifactIntegrityError:
            raise
        except Exception as e:
            raise ArtifactStoreError(f"the artifact store {store} cannot be read now ({e})") from e
    if not (target / "config.json").is_file() and resolved.config is not None:
        write_json_atomic(target / "config.json", resolved.config)
    return target
