"""Following a job (cli.live): the lines a plain follow prints, its rate and ETA across a pause,
and the progress bar on a terminal."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from cli.api_client import EXIT_CANCELLED, EXIT_FAILED, JobEvent
from cli.commands import exit_code_for
from cli.live import FollowState, JobProgressBar, StepOrderedLines, due_checkpoints, follow_job, format_duration
from tests.cli.fake_api import JOB_ID, STREAM, FakeApi, Handler, client_for, invoke, job, metric, send_json, sse


def _event(event_id: int, type: str, data: dict[str, Any]) -> JobEvent:
    return JobEvent(id=event_id, type=type, data=data)


def test_follow_state_lines_and_eta() -> None:
    state = FollowState.from_job(job("queued"))
    lines = [
        state.apply(_event(1, "status", {"status": "running", "attempt": 1})),
        state.apply(_event(2, "plan", {"total_steps": 4, "world_size": 2})),
        state.apply(_event(2, "plan", {"total_steps": 4, "world_size": 2, "kernels": ["rope"], "compiled": True})),
        state.apply(_event(3, "metric", metric(1, 10, loss=3.0))),
        state.apply(_event(4, "metric", metric(2, 12, loss=2.0))),
        state.apply(_event(5, "log", {"line": "rank 0 says hi"})),
        state.apply(_event(6, "checkpoint", {"kind": "model", "step": 2, "uri": "/runs/x/model"})),
        state.apply(_event(7, "status", {"status": "succeeded", "error": None})),
    ]
    assert lines == [
        "running (attempt 1)",
        "plan: 4 steps on 2 rank(s)",
        "plan: 4 steps on 2 rank(s); kernels: rope; compiled",
        "step 1/4 loss 3.0000 1500 tok/s eta ?",
        "step 2/4 loss 2.0000 1500 tok/s eta 4s",  # 2 s per step, 2 steps to go
        None,
        "checkpoint model at step 2: /runs/x/model",
        None,
    ]
    assert state.outcome_line() == f"job {JOB_ID} succeeded at step 2/4 (loss 2.0000)"


def test_a_dpo_jobs_follow_shows_the_reference_pass_and_the_rewards() -> None:
    state = FollowState.from_job(job("running", total_steps=4))
    phase = {"name": "reference_logps", "done": 120, "total": 400, "cached": False, "time": "2026-12-02T10:00:00Z"}
    dpo = {**metric(1, 10, loss=0.69), "rewards_accuracies": 0.75, "rewards_margins": 0.3125, "rewards_chosen": 0.1}
    lines = [
        state.apply(_event(1, "phase", phase)),
        state.apply(_event(2, "phase", {**phase, "done": 400, "cached": True})),
        state.apply(_event(3, "metric", dpo)),
        state.apply(_event(4, "metric", metric(2, 12, loss=0.6))),  # a step without them keeps the last
    ]
    assert lines == [
        "reference log-probabilities: 120/400 pairs",
        "reference log-probabilities: found cached (400 pairs)",
        "step 1/4 loss 0.6900 1500 tok/s eta ? rewards/accuracies 0.7500 rewards/margins 0.3125",
        "step 2/4 loss 0.6000 1500 tok/s eta 4s rewards/accuracies 0.7500 rewards/margins 0.3125",
    ]
    # An SFT job's line is as it was.
    assert FollowState.from_job(job("running", latest_metrics=metric(1, 10))).progress_text.endswith("eta ?")


def test_outcomes_and_exit_codes() -> None:
    failed = FollowState.from_job(
        job("failed", step=3, total_steps=8, error={"code": "training_error", "message": "OOM"})
    )
    assert failed.outcome_line() == f"job {JOB_ID} failed at step 3/8: training_error: OOM"
    assert FollowState.from_job(job("cancelled", step=3)).outcome_line() == f"job {JOB_ID} cancelled at step 3/?"
    assert [exit_code_for(s) for s in ("succeeded", "failed", "cancelled")] == [0, EXIT_FAILED, EXIT_CANCELLED]
    assert [format_duration(s) for s in (None, 4.4, 75, 3 * 3600 + 120)] == ["?", "4s", "1m15s", "3h02m"]


def test_the_live_progress_bar_draws_and_returns_the_final_job(api: FakeApi) -> None:
    api.sse(
        STREAM,
        [
            sse(1, "plan", {"total_steps": 2, "world_size": 1}),
            sse(2, "metric", metric(1, 1)),
            sse(3, "warning", {"message": "worker lost; requeued"}),
            sse(4, "metric", metric(2, 2)),
            sse(5, "status", {"status": "succeeded", "error": None}),
        ],
    )
    api.json("GET", f"/jobs/{JOB_ID}", job("succeeded", step=2, total_steps=2))
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with client_for(api) as client:
        final = follow_job(client, job("running"), live=True, console=console)
    assert final["status"] == "succeeded"
    assert "2/2" in out.getvalue() and "warning: worker lost; requeued" in out.getvalue()


def test_a_follow_ends_with_the_streams_outcome_though_the_api_answers_an_older_read(api: FakeApi) -> None:
    """The stream says cancelled; GET /jobs/{id} may come from the API's read of the job up to
    TUNEQ_JOB_CACHE_SECONDS old (still cancelling): the follow reads it again, and ends
    cancelled (exit 3), not with a non-terminal status (exit 1)."""
    api.sse(STREAM, [sse(1, "status", {"status": "cancelling"}), sse(2, "status", {"status": "cancelled"})])
    answers = [job("cancelling", step=7), job("cancelled", step=7, error={"code": "cancelled", "message": "x"})]

    def get_job(h: Handler) -> None:
        send_json(h, 200, answers.pop(0) if len(answers) > 1 else answers[0])

    api.route("GET", f"/jobs/{JOB_ID}", get_job)
    with client_for(api) as client:
        final = follow_job(client, job("running"), live=False, console=Console(file=io.StringIO()))
    assert final["status"] == "cancelled" and exit_code_for(final["status"]) == EXIT_CANCELLED
    assert len([r for r in api.requests if r["path"] == f"/jobs/{JOB_ID}"]) == 2


# ---- downloads ----------------------------------------------------------------------------------

CHECKPOINTS = [
    {"step": 5, "kind": "deepspeed", "uri": "/runs/j/checkpoints/step-00000005", "bytes": 10},
    {"step": 10, "kind": "deepspeed", "uri": "/runs/j/checkpoints/step-00000010", "bytes": 10},
    {"step": 10, "kind": "model", "uri": "/runs/j/model", "bytes": 10},
]


def test_after_a_pause_the_rate_and_eta_are_of_the_steps_since_the_resume() -> None:
    state = FollowState.from_job(job("running", total_steps=10))
    state.apply(_event(1, "metric", metric(1, 10)))
    state.apply(_event(2, "metric", metric(2, 12)))
    assert state.progress_text == "step 2/10 loss 2.5000 1500 tok/s eta 16s"  # 2 s a step
    paused = state.apply(_event(3, "status", {"status": "paused", "step": 2}))
    assert paused == f"paused at step 2 (`tuneq resume {JOB_ID}` continues it)"
    assert state.progress_text == "step 2/10 loss 2.5000 - tok/s eta ?"  # nothing runs: no rate, no ETA
    assert state.apply(_event(4, "status", {"status": "queued", "resumed": True, "step": 2})) == "queued"
    assert state.apply(_event(5, "status", {"status": "running", "attempt": 2})) == "running (attempt 2)"
    # Resumed 40 s after the last step: the first step since then says nothing of the time a step takes.
    assert state.apply(_event(6, "metric", {**metric(3, 52), "tokens_per_second": 900.0})) == (
        "step 3/10 loss 2.5000 900 tok/s eta ?"
    )
    assert state.apply(_event(7, "metric", metric(4, 55))) == "step 4/10 loss 2.5000 1500 tok/s eta 18s"  # 3 s a step


def test_following_a_long_run_prints_its_steps_from_where_it_is(api: FakeApi) -> None:
    """`show --follow` of a job at step 300 (or one that ended while the follow began) does not
    replay 300 lines: the steps before the follow are where `show` says the job is."""
    history = [sse(i, "metric", metric(i, i % 60)) for i in range(1, 301)]
    api.sse(
        STREAM,
        [
            sse(0, "plan", {"total_steps": 302, "world_size": 1}),
            *history,
            sse(301, "metric", metric(301, 1)),
            sse(302, "metric", metric(302, 2)),
            sse(303, "status", {"status": "succeeded", "error": None}),
        ],
    )
    running = job("running", step=300, total_steps=302, latest_metrics=metric(300, 0))
    api.json("GET", f"/jobs/{JOB_ID}", job("succeeded", step=302, total_steps=302, latest_metrics=metric(302, 2)))
    out = io.StringIO()
    with client_for(api) as client:
        final = follow_job(client, running, live=False, console=Console(file=out, width=200))
    assert final["status"] == "succeeded"
    assert [line.partition(" eta")[0] for line in out.getvalue().splitlines()] == [
        "plan: 302 steps on 1 rank(s)",
        "step 301/302 loss 2.5000 1500 tok/s",
        "step 302/302 loss 2.5000 1500 tok/s",
    ]


def test_show_follow_of_a_job_that_ended_prints_its_summary(api: FakeApi) -> None:
    api.json("GET", f"/jobs/{JOB_ID}", job("succeeded", step=3000, total_steps=3000, latest_metrics=metric(3000, 1)))
    api.json("GET", f"/jobs/{JOB_ID}/checkpoints", {"data": []})
    api.sse(STREAM, [sse(i, "metric", metric(i, 1)) for i in range(1, 3001)])
    shown = invoke(api, "show", JOB_ID, "--follow")
    assert shown.exit_code == 0, shown.output
    assert not any(line.startswith("step ") for line in shown.stdout.splitlines())
    assert shown.stdout.splitlines()[-1] == f"job {JOB_ID} succeeded at step 3000/3000 (loss 2.5000)"
    assert api.stream_requests(STREAM) == []


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _run_time(bar: JobProgressBar) -> str:
    return str(bar.run_time_column.render(bar.progress.tasks[0]))


def test_the_bar_of_a_paused_job_stands_still_and_goes_on_after_the_resume() -> None:
    clock = FakeClock()
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    bar = JobProgressBar(console, get_time=clock)
    state = FollowState.from_job(job("running", step=3, total_steps=10))
    bar.show(state)
    clock.now += 10
    assert _run_time(bar) == "0:00:10"
    state.apply(_event(1, "status", {"status": "paused", "step": 3}))
    bar.show(state)
    clock.now += 600  # paused for ten minutes: the clock does not run
    assert _run_time(bar) == "0:00:10"
    assert bar.progress.tasks[0].description == "paused"
    assert bar.progress.tasks[0].fields["rate"] == "-" and bar.progress.tasks[0].fields["eta"] == "?"
    state.apply(_event(2, "status", {"status": "queued", "resumed": True}))
    bar.show(state)
    clock.now += 30  # queued again, waiting for a worker
    state.apply(_event(3, "status", {"status": "running", "attempt": 2}))
    bar.show(state)
    clock.now += 5
    assert _run_time(bar) == "0:00:15"


def test_the_live_follow_says_the_job_paused(api: FakeApi) -> None:
    api.sse(
        STREAM,
        [
            sse(1, "metric", metric(1, 1)),
            sse(2, "status", {"status": "pausing"}),
            sse(3, "status", {"status": "paused", "step": 1}),
            sse(4, "status", {"status": "cancelled", "error": None}),
        ],
    )
    api.json("GET", f"/jobs/{JOB_ID}", job("cancelled", step=1))
    out = io.StringIO()
    with client_for(api) as client:
        follow_job(
            client, job("running", total_steps=4), live=True, console=Console(file=out, force_terminal=True, width=200)
        )
    assert f"paused at step 1 (`tuneq resume {JOB_ID}` continues it)" in out.getvalue()


# ---- a plain follow's lines in step order ---------------------------------------------------------


def test_a_checkpoints_line_comes_after_its_step_though_its_event_comes_later() -> None:
    """The checkpoint of step 20 is recorded once its files are stored, here after step 35's
    metric: it used to be printed after "step 35/40"."""
    printed: list[str] = []
    lines = StepOrderedLines(printed.append)
    lines.expect(due_checkpoints({"checkpoint_every_steps": 20}, 40))
    lines.add(0, "plan: 40 steps on 1 rank(s)")
    for step in range(1, 36):
        lines.add(step, f"step {step}/40")
    assert printed[-1] == "step 20/40"  # the later steps wait for the checkpoint that is due
    lines.add(20, "checkpoint deepspeed at step 20", checkpoint=True)
    for step in range(36, 41):
        lines.add(step, f"step {step}/40")
    lines.add(40, "checkpoint deepspeed at step 40", checkpoint=True)
    lines.add(40, "checkpoint model at step 40", checkpoint=True)
    lines.flush()
    steps = [f"step {step}/40" for step in range(1, 41)]
    assert printed == [
        "plan: 40 steps on 1 rank(s)",
        *steps[:20],
        "checkpoint deepspeed at step 20",
        *steps[20:],
        "checkpoint deepspeed at step 40",
        "checkpoint model at step 40",
    ]


def test_lines_held_for_a_checkpoint_that_never_comes_are_printed_at_the_end_or_after_the_hold() -> None:
    printed: list[str] = []
    lines = StepOrderedLines(printed.append)
    lines.expect([5])
    for step in range(1, 8):
        lines.add(step, f"step {step}")
    assert printed == [f"step {step}" for step in range(1, 6)]
    lines.flush()
    assert printed == [f"step {step}" for step in range(1, 8)]

    # A checkpoint that failed to store: the follow goes on once it has waited hold_seconds.
    printed.clear()
    now = [0.0]
    lines = StepOrderedLines(printed.append, hold_seconds=15.0, clock=lambda: now[0])
    lines.expect([5, 10])
    for step in range(1, 9):
        now[0] += 10.0
        lines.add(step, f"step {step}")
    assert printed == [f"step {step}" for step in range(1, 9)]  # step 6 waits from 60 s; at 80 s, given up
    lines.add(9, "step 9")
    lines.add(10, "step 10")
    lines.add(11, "step 11")
    assert printed[-1] == "step 10"  # the next checkpoint is waited for again


@pytest.mark.parametrize(
    ("training", "total", "due"),
    [
        ({"checkpoint_every_steps": 20}, 40, [20, 40]),
        ({"checkpoint_every_steps": 20}, 45, [20, 40, 45]),
        ({}, 10, [10]),
    ],
)
def test_the_checkpoints_a_job_saves(training: dict[str, int], total: int, due: list[int]) -> None:
    assert due_checkpoints(training, total) == due


def test_show_follow_prints_a_checkpoint_after_its_step_and_before_later_steps(api: FakeApi) -> None:
    """`tuneq show --follow` without a terminal: step 2's checkpoint event comes after step 4's
    metric (it is recorded once stored); its line comes right after "step 2/4"."""
    api.sse(
        STREAM,
        [
            sse(1, "plan", {"total_steps": 4, "world_size": 1}),
            *[sse(1 + step, "metric", metric(step, step)) for step in range(1, 5)],
            sse(6, "checkpoint", {"kind": "deepspeed", "step": 2, "uri": "/c/2"}),
            sse(7, "checkpoint", {"kind": "deepspeed", "step": 4, "uri": "/c/4"}),
            sse(8, "status", {"status": "succeeded", "error": None}),
        ],
    )
    running = job("running", step=0, training={"max_steps": 4, "checkpoint_every_steps": 2})
    api.json("GET", f"/jobs/{JOB_ID}", job("succeeded", step=4, total_steps=4))
    out = io.StringIO()
    with client_for(api) as client:
        follow_job(client, running, live=False, console=Console(file=out, width=200))
    assert [line.partition(" loss")[0] for line in out.getvalue().splitlines()] == [
        "plan: 4 steps on 1 rank(s)",
        "step 1/4",
        "step 2/4",
        "checkpoint deepspeed at step 2: /c/2",
        "step 3/4",
        "step 4/4",
        "checkpoint deepspeed at step 4: /c/4",
    ]
