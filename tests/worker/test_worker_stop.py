"""A worker asked to stop (SIGTERM: a deploy, a scale-down) hands its job back, whatever the
instant: during a database call too. The job is requeued, never failed, and the hand-back is
not counted against its max_restarts."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import psycopg.waiting
import pytest
from sqlmodel import Session, select

from shared.db.engine import get_engine
from shared.db.models import Job, JobMetric
from shared.jobs.status import JobStatus
from tests.worker.conftest import queued_training_job, run_as_a_pool_process
from worker.launcher import Launcher

STEPS = 12


class DriverInterrupter:
    """Sends this process a SIGTERM in the middle of the ``at``-th wait of psycopg's I/O (counted
    from ``arm``): after the generator's first step, with the query sent and its answer not yet
    read, where a handler that raised left the connection mid-query."""

    def __init__(self, original: Callable[..., Any]) -> None:
        self.original = original
        self.at: int | None = None
        self.seen = 0
        self.sent = False

    def arm(self, at: int) -> None:
        self.at, self.seen, self.sent = at, 0, False

    def disarm(self) -> None:
        """No SIGTERM after the attempt: this process's own handler is back, and a SIGTERM now
        would end the test process (an attempt that finished before its ``at``-th wait left it armed)."""
        self.at = None

    def wait(self, gen: Generator[Any, Any, Any], *args: Any, **kwargs: Any) -> Any:
        self.seen += 1
        if self.seen == self.at:
            gen = self._interrupting(gen)
        return self.original(gen, *args, **kwargs)

    def _interrupting(self, gen: Generator[Any, Any, Any]) -> Generator[Any, Any, Any]:
        try:
            waiting = next(gen)
        except StopIteration as done:  # no wait after all: the next call's
            self.at = self.seen + 1
            return done.value
        ready = yield waiting
        self.sent = True
        os.kill(os.getpid(), signal.SIGTERM)  # its handler runs here, between the protocol's steps
        while True:
            try:
                ready = yield gen.send(ready)
            except StopIteration as done:
                return done.value


@pytest.fixture
def interrupter(monkeypatch: pytest.MonkeyPatch) -> DriverInterrupter:
    interrupter = DriverInterrupter(psycopg.waiting.wait)
    monkeypatch.setattr(psycopg.waiting, "wait", interrupter.wait)
    return interrupter


@pytest.mark.slow
@pytest.mark.parametrize("empty_database_url", ["postgres"], indirect=True)
def test_a_sigterm_in_the_middle_of_any_database_call_hands_the_job_back_never_fails_it(
    database_url: str,
    tiny_model: Path,
    text_dataset: Path,
    interrupter: DriverInterrupter,
    warm_launcher: Launcher,
) -> None:
    """Each attempt gets a SIGTERM inside one of its database calls, each later than the last
    (the claim, the inputs, the launch, the polls while the ranks train, the checkpoints'
    records, the outcome), until one attempt finishes first. Every stopped attempt hands the job
    back; none of them counts against max_restarts (0 here), and the job ends succeeded with
    each step recorded once. A handler that raised failed it on a connection left mid-query."""
    training = {"max_steps": STEPS, "checkpoint_every_steps": 3}
    job = queued_training_job(tiny_model, text_dataset, training, max_restarts=0)
    stops = 0
    at = 1
    while True:
        interrupter.arm(at)
        try:
            handed_back = run_as_a_pool_process(job, warm_launcher)
        finally:
            interrupter.disarm()
        with Session(get_engine()) as session:
            seen = session.get(Job, job.id)
        assert seen is not None
        if not handed_back:  # the attempt finished first, or was recording its outcome
            break
        assert interrupter.sent
        stops += 1
        assert seen.status == JobStatus.queued, (at, seen.status, seen.error_code, seen.error_message)
        assert seen.handbacks == stops and seen.attempts == stops
        at += max(1, at // 2)  # 1, 2, 3, 4, 6, 9, 13, 19, 28, 42, 63, 94, ...: from the claim to the outcome
    assert stops >= 4
    assert seen.status == JobStatus.succeeded, (seen.error_code, seen.error_message)
    assert seen.attempts == stops + 1 and seen.handbacks == stops
    with Session(get_engine()) as session:
        steps = session.exec(select(JobMetric.step).where(JobMetric.job_id == job.id)).all()
    assert sorted(steps) == list(range(1, STEPS + 1))
