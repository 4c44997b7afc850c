"""``POST /jobs/plan``, worked out in a child process.

Tokenizing a dataset takes seconds to minutes of CPU and memory in proportion to the data;
in the API process it would hold the GIL and slow every other request. The child is started
on the first plan and kept (spawned, not forked: the API's threads and database connections
must not be copied into it). Plans run one at a time.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from sqlmodel import Session

from api.jobs_service import checked_request
from api.model_sources import plan_model
from shared.jobs.plan import JobPlan, PlanProblems, compute_plan
from shared.jobs.spec import JobCreate
from shared.jobs.validation import JobValidationError, Problem
from shared.settings import Settings

logger = logging.getLogger(__name__)

PLAN_TIMEOUT_SECONDS = 600.0

_lock = threading.Lock()
_executor: ProcessPoolExecutor | None = None


def _plan_executor() -> ProcessPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        return _executor


def _reset_executor(*, stop_child: bool = False) -> None:
    global _executor
    with _lock:
        if _executor is not None:
            # shutdown() alone lets a plan in flight run on, and its child (and the
            # multiprocessing resource tracker it holds open) outlive the server.
            children = list(_executor._processes.values()) if stop_child else []
            _executor.shutdown(wait=False, cancel_futures=True)
            for child in children:
                child.terminate()
            for child in children:
                child.join(timeout=5)
                if child.is_alive():
                    child.kill()
                    child.join()
        _executor = None


def shutdown_plan_executor() -> None:
    """At API shutdown: no child outlives the server, a plan in flight included."""
    _reset_executor(stop_child=True)


def _plan_in_child(job_json: str, deepspeed_config: dict[str, Any], settings_json: str) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO)
    job_in = JobCreate.model_validate_json(job_json)
    settings = Settings.model_validate_json(settings_json)
    try:
        return {"plan": compute_plan(job_in, deepspeed_config, settings).model_dump(mode="json")}
    except PlanProblems as e:
        return {"problems": [{"loc": list(p.loc), "message": p.message} for p in e.problems]}


def plan_job(*, session: Session, job_in: JobCreate, settings: Settings, owner: str) -> JobPlan:
    """Validate as ``POST /jobs`` does, then work the plan out. Raises JobValidationError.

    A model naming another job's output is planned from its config and tokenizer, fetched from
    the artifact store into this API's cache (``api.model_sources.plan_model``)."""
    validated, named = checked_request(session=session, job_in=job_in, settings=settings, owner=owner)
    planned = job_in
    if named is not None:
        model, revision = plan_model(session=session, settings=settings, resolved=named)
        planned = job_in.model_copy(update={"model": model, "revision": revision})
    future: Future[dict[str, Any]] = _plan_executor().submit(
        _plan_in_child, planned.model_dump_json(), validated.deepspeed_config, settings.model_dump_json()
    )
    try:
        answer = future.result(timeout=PLAN_TIMEOUT_SECONDS)
    except BrokenProcessPool:
        _reset_executor()  # the child died (e.g. out of memory); the next plan starts a new one
        raise
    if "problems" in answer:
        raise JobValidationError([Problem(tuple(p["loc"]), p["message"]) for p in answer["problems"]])
    plan = JobPlan.model_validate(answer["plan"])
    return plan.model_copy(update={"deepspeed_config_chosen": validated.deepspeed_config_chosen})
