"""Submit-time checks that need the filesystem, DeepSpeed's parser or the deployment's hardware.

Each problem names the field (as FastAPI's 422 ``loc`` does) and says how to fix it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.data.preference import read_preference_records
from shared.data.records import DatasetError, read_records
from shared.data.remote import local_path, parse_dataset_uri
from shared.data.uploaded_files import is_file_id
from shared.deepspeed.auto_values import FILLABLE, AutoInputs, auto_keys, fill_auto, hidden_size_of, without_auto
from shared.deepspeed.chosen import DeepSpeedChoiceError, choose_deepspeed_config
from shared.deepspeed.config import DeepSpeedConfigError, missing_packages, resolve_deepspeed_config
from shared.deepspeed.safety import sanitize_deepspeed_config
from shared.jobs.attention import submit_attention_problem
from shared.jobs.hardware import Hardware, hardware_problems
from shared.jobs.model_source import names_a_job
from shared.jobs.spec import JobCreate, TrainingOptions, max_positions_of
from shared.settings import Settings

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Problem:
    loc: tuple[str | int, ...]
    message: str


class JobValidationError(ValueError):
    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(f"{'.'.join(map(str, p.loc))}: {p.message}" for p in problems))
        self.problems = problems


def is_local_reference(value: str) -> bool:
    """Absolute paths, ``~`` paths and ``file://`` URIs are local; anything else is a hub id or URI."""
    return value.startswith(("/", "~", "file://")) or value.startswith(("./", "../"))


def resolve_in_allowed_roots(value: str, settings: Settings, *, what: str) -> Path:
    """Resolve symlinks and ``..`` first, then require the result inside an allowed root."""
    path = local_path(value)
    if not path.is_absolute():
        raise ValueError(f"{what} path must be absolute, got '{value}'")
    resolved = path.resolve()
    roots = settings.allowed_root_paths
    if not any(resolved.is_relative_to(root) for root in roots):
        shown = os.pathsep.join(str(r) for r in roots)
        raise ValueError(
            f"{what} '{value}' is outside the allowed roots ({shown}): move it there, or add its "
            "directory to TUNEQ_ALLOWED_ROOTS"
        )
    return resolved


def check_model(value: str, settings: Settings) -> None:
    offered = settings.base_model_list
    if offered and value not in offered:
        raise ValueError(
            f"'{value}' is not a model this deployment offers: use one of {', '.join(offered)} "
            "(GET /v1/models lists them; TUNEQ_BASE_MODELS)"
        )
    if not is_local_reference(value):
        if not HUB_ID.match(value):
            raise ValueError(
                f"'{value}' is neither a hub id like 'EleutherAI/gpt-neo-125m' nor an absolute path "
                "to a local model directory"
            )
        return
    path = resolve_in_allowed_roots(value, settings, what="model")
    if not path.is_dir():
        raise ValueError(f"model directory '{value}' does not exist")
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory '{value}' has no config.json: save the model with save_pretrained")
    if not any(path.glob("*.safetensors")):
        raise ValueError(
            f"model directory '{value}' has no .safetensors weights: tuneq loads safetensors only "
            "(save with save_pretrained(..., safe_serialization=True))"
        )


def base_model_problems(job_in: JobCreate, settings: Settings) -> list[Problem]:
    """What is wrong with ``model`` and ``revision`` naming a base model."""
    problems = []
    try:
        check_model(job_in.model, settings)
    except ValueError as e:
        problems.append(Problem(("body", "model"), str(e)))
    if job_in.revision is not None and is_local_reference(job_in.model):
        problems.append(
            Problem(
                ("body", "revision"),
                "revision applies to hub models only; a local directory is used as it is: drop revision",
            )
        )
    return problems


def check_dataset(value: str, settings: Settings) -> Path | None:
    """A local dataset's resolved path; None for a remote URI that passed its checks (its
    records are checked by the worker once downloaded)."""
    if parse_dataset_uri(value, settings) is not None:
        return None
    path = resolve_in_allowed_roots(value, settings, what="dataset")
    if not path.is_file():
        raise ValueError(f"dataset file '{value}' does not exist")
    return path


def dataset_problems(value: str, job_in: JobCreate, settings: Settings, *, field: str) -> list[Problem]:
    """Read a local dataset's records now, so a bad record fails the submit, not the run: a DPO
    job's as preference records (``read_preference_records``), which refuses supervised ones
    whole, an SFT job's as SFT records (``read_records``), which refuses preference ones whole.
    An uploaded file's were read at upload (that it is the caller's, and holds what the job's
    method trains on, is the API's check: ``api.jobs_service.uploaded_file_problems``)."""
    if is_file_id(value):
        if job_in.training.dataset_format not in (None, "messages"):
            return [
                Problem(
                    ("body", "training", "dataset_format"),
                    f"{field} {value} is an uploaded file, which holds OpenAI chat records: leave "
                    "training.dataset_format out, or give 'messages'",
                )
            ]
        return []
    try:
        path = check_dataset(value, settings)
        if path is not None and job_in.training.method == "dpo":
            read_preference_records(path, max_line_bytes=settings.max_line_bytes)
        elif path is not None:
            read_records(path, dataset_format=job_in.training.dataset_format, max_line_bytes=settings.max_line_bytes)
    except (DatasetError, ValueError) as e:
        return [Problem(("body", field), str(e))]
    except OSError as e:
        return [Problem(("body", field), f"dataset '{value}' cannot be read: {e.strerror}")]
    return []


def local_model_config(model: str) -> dict[str, Any] | None:
    """A local model's config.json; None for hub models (or one that cannot be read)."""
    if not is_local_reference(model):
        return None
    try:
        config = json.loads((local_path(model).resolve() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def settled_training(job_in: JobCreate, model_config: dict[str, Any] | None) -> TrainingOptions:
    """The job's training options with what the API can settle now: for a local model (its
    ``model_config``), a ``max_seq_length`` left out follows the model's limit (the ranks
    settle a hub model's). Raises ValueError for an explicit one past a local model's limit."""
    if model_config is None:
        return job_in.training
    return job_in.training.for_model(max_positions_of(model_config))


def resolve_auto_at_submit(
    job_in: JobCreate, deepspeed_config: dict[str, Any], model_config: dict[str, Any] | None
) -> tuple[dict[str, Any], list[Problem]]:
    """Fill the "auto" values of the job's ``deepspeed_config`` the API can know now; the rest
    wait for the worker."""
    problems = [
        Problem(
            ("body", "deepspeed_config", *key.split(".")),
            f"'auto' is not supported for {key}: tuneq fills 'auto' only for "
            f"{', '.join(sorted(FILLABLE))}; give a value",
        )
        for key in auto_keys(deepspeed_config)
        if key not in FILLABLE
    ]
    hidden_size = hidden_size_of(model_config) if model_config is not None else None
    inputs = AutoInputs(job_in.training, job_in.world_size, hidden_size=hidden_size)
    return fill_auto(deepspeed_config, inputs), problems


def submitted_deepspeed_config(
    job_in: JobCreate, *, model_config: dict[str, Any] | None, settings: Settings, hardware: Hardware | None
) -> dict[str, Any]:
    """The request's DeepSpeed config, or the one tuneq chooses when it names none. Raises
    DeepSpeedChoiceError when no choice fits."""
    if job_in.deepspeed_config is not None:
        return job_in.deepspeed_config
    return choose_deepspeed_config(
        model_config=model_config,
        hardware=hardware,
        num_gpus=job_in.num_gpus,
        num_nodes=job_in.num_nodes,
        training=job_in.training,
        assumed_device_memory_bytes=settings.device_memory_bytes,
    ).config


@dataclass(frozen=True)
class ValidatedRequest:
    """What submit settles about a valid request: the DeepSpeed config as the request gave it
    or as tuneq chose it (``deepspeed_config_chosen``), that config with "auto" filled as far as
    the API can (the worker fills the rest: total steps, a hub model's hidden size), and the
    training options with a local model's limits applied."""

    submitted_deepspeed_config: dict[str, Any]
    deepspeed_config: dict[str, Any]
    training: TrainingOptions
    deepspeed_config_chosen: bool


def validate_job_request(
    job_in: JobCreate,
    *,
    settings: Settings,
    hardware: Hardware | None,
    source_config: dict[str, Any] | None = None,
) -> ValidatedRequest:
    """Raise JobValidationError with every problem found; else what submit settled.

    A ``model`` naming another job's output (``job:<id>``, an ``ft:`` name) is the API's to check
    against the database (``api.model_sources``), which gives that model's config.json here as
    ``source_config`` (None when not known, as for a hub model)."""
    problems: list[Problem] = []
    if names_a_job(job_in.model):
        model_config = source_config
    else:
        problems += base_model_problems(job_in, settings)
        model_config = local_model_config(job_in.model)  # read once: limits and "auto" values
    training = job_in.training
    try:
        training = settled_training(job_in, model_config)
    except ValueError as e:
        problems.append(Problem(("body", "training", "max_seq_length"), str(e)))
    attention_problem = submit_attention_problem(
        job_in.training.attention,
        model_config=model_config,
        accelerator=hardware.accelerator if hardware is not None else None,
    )
    if attention_problem is not None:
        problems.append(Problem(("body", "training", "attention"), attention_problem))
    problems += dataset_problems(job_in.dataset, job_in, settings, field="dataset")
    if job_in.validation_dataset is not None:
        problems += dataset_problems(job_in.validation_dataset, job_in, settings, field="validation_dataset")
    try:
        submitted = submitted_deepspeed_config(job_in, model_config=model_config, settings=settings, hardware=hardware)
    except DeepSpeedChoiceError as e:
        raise JobValidationError([*problems, Problem(("body", "deepspeed_config"), str(e))]) from None
    resolved, auto_problems = resolve_auto_at_submit(job_in, submitted, model_config)
    problems += auto_problems
    # Keys that would read or write files, import modules or call out: refused here; the ones
    # tuneq rewrites under the run directory are rewritten by the worker, which knows it.
    _, unsafe = sanitize_deepspeed_config(resolved, run_dir=str(settings.runs_dir / "pending"))
    problems += [Problem(("body", "deepspeed_config", *u.loc), u.message) for u in unsafe]
    try:
        resolve_deepspeed_config(without_auto(resolved), world_size=job_in.world_size)
    except DeepSpeedConfigError as e:
        problems.append(Problem(("body", "deepspeed_config", *e.loc), e.message))
    problems += [Problem(("body", "deepspeed_config", *e.loc), e.message) for e in missing_packages(resolved)]
    problems += [
        Problem(("body", *p.loc), p.message)
        for p in hardware_problems(
            num_gpus=job_in.num_gpus, deepspeed_config=resolved, hardware=hardware, num_nodes=job_in.num_nodes
        )
    ]
    if job_in.num_nodes > 1 and settings.artifacts_uri == str(settings.runs_dir):
        problems.append(
            Problem(
                ("body", "num_nodes"),
                "a job on several nodes needs an artifact store every worker shares (its nodes share no "
                "disk, and each uploads its own checkpoint shards): set TUNEQ_ARTIFACTS_URI to s3://bucket/prefix "
                "(or a directory all hosts mount) on the API and the workers, or use num_nodes 1",
            )
        )
    if problems:
        raise JobValidationError(problems)
    return ValidatedRequest(
        submitted_deepspeed_config=submitted,
        deepspeed_config=resolved,
        training=training,
        deepspeed_config_chosen=job_in.deepspeed_config is None,
    )
