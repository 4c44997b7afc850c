"""Following a job as it runs, and a download as it arrives: the state a follow keeps from the
job's events, the lines a plain follow prints, and the progress bars a terminal shows.

``rich`` is imported where a bar or a console is made, so that ``tuneq --help`` and the
commands that print plain text do not load it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from cli.api_client import JobEvent, TuneqClient
from cli.downloads import DownloadPlan, DownloadResult, download_checkpoint
from shared.jobs.status import TERMINAL_STATUSES

# ---- what a follow shows -------------------------------------------------------------------


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def format_loss(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"


def format_rate(rate: float | None) -> str:
    if rate is None:
        return "-"
    return f"{rate / 1000:.1f}k" if rate >= 10_000 else f"{rate:.0f}"


def format_measure(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


# A DPO job's measures, as `show` prints them: (the key in the job's latest_metrics and in its
# metric events, TRL's name). GET /jobs/{id}/metrics answers them under TRL's names.
PREFERENCE_MEASURES = (
    ("rewards_chosen", "rewards/chosen"),
    ("rewards_rejected", "rewards/rejected"),
    ("rewards_margins", "rewards/margins"),
    ("rewards_accuracies", "rewards/accuracies"),
    ("eval_rewards_accuracies", "eval_rewards/accuracies"),
)
PHASE_NAMES = {"reference_logps": "reference log-probabilities"}
# While the job is in one of these its ranks are at work: the bar's clock runs.
WORKING_STATUSES = frozenset({"running", "pausing", "cancelling"})


def phase_text(phase: dict[str, Any]) -> str:
    """A phase report (work before the first step) as a line: its progress, or that it was
    found computed."""
    name = PHASE_NAMES.get(str(phase.get("name")), str(phase.get("name")))
    total = phase.get("total")
    if phase.get("cached"):
        return f"{name}: found cached ({total} pairs)"
    return f"{name}: {phase.get('done')}/{total} pairs"


def parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@dataclass
class FollowState:
    """What a follow shows, updated from the job and its events. ``apply`` returns the line
    a plain (non-TTY) follow prints for an event, or None.

    ``history_through_step``: the step the job was at when the follow began. The stream starts
    with the job's whole history; its steps up to there print no line each (``show`` printed
    where the job is), so following a long run does not replay thousands of lines."""

    job_id: str
    status: str = "queued"
    step: int = 0
    total_steps: int | None = None
    loss: float | None = None
    tokens_per_second: float | None = None
    eta_seconds: float | None = None
    # A DPO job's: the share of pairs whose chosen answer has the higher reward, and the mean margin.
    reward_accuracy: float | None = None
    reward_margin: float | None = None
    error: dict[str, Any] | None = None
    history_through_step: int = 0
    _origin: tuple[int, datetime] | None = field(default=None, repr=False)

    @classmethod
    def from_job(cls, job: dict[str, Any]) -> FollowState:
        state = cls(job_id=str(job["id"]))
        state.update_from_job(job)
        state.history_through_step = state.step
        return state

    def update_from_job(self, job: dict[str, Any]) -> None:
        self.status = str(job.get("status") or self.status)
        self.step = int(job.get("step") or 0)
        self.total_steps = job.get("total_steps") or self.total_steps
        self.eta_seconds = job.get("eta_seconds")
        self.error = job.get("error")
        latest = job.get("latest_metrics") or {}
        self.loss = latest.get("loss", self.loss)
        self.tokens_per_second = latest.get("tokens_per_second", self.tokens_per_second)
        self.reward_accuracy = latest.get("rewards_accuracies", self.reward_accuracy)
        self.reward_margin = latest.get("rewards_margins", self.reward_margin)

    @property
    def progress_text(self) -> str:
        total = self.total_steps if self.total_steps is not None else "?"
        text = (
            f"step {self.step}/{total} loss {format_loss(self.loss)} "
            f"{format_rate(self.tokens_per_second)} tok/s eta {format_duration(self.eta_seconds)}"
        )
        if self.reward_accuracy is None and self.reward_margin is None:
            return text
        return (
            f"{text} rewards/accuracies {format_measure(self.reward_accuracy)} "
            f"rewards/margins {format_measure(self.reward_margin)}"
        )

    def apply(self, event: JobEvent) -> str | None:
        data = event.data
        if event.type == "status":
            return self._status(data)
        if event.type == "plan":
            if data.get("total_steps") is not None:
                self.total_steps = int(data["total_steps"])
            extras = [f"kernels: {', '.join(data['kernels'])}"] if data.get("kernels") else []
            extras += ["compiled"] if data.get("compiled") else []
            text = f"plan: {self.total_steps} steps on {data.get('world_size', '?')} rank(s)"
            return "; ".join([text, *extras])
        if event.type == "metric":
            self._metric(data)
            return self.progress_text if self.step > self.history_through_step else None
        if event.type == "checkpoint":
            return f"checkpoint {data.get('kind')} at step {data.get('step')}: {data.get('uri')}"
        if event.type == "resumed":
            self._origin = None
            self.step = int(data.get("from_step") or 0)
            return f"resumed from step {data.get('from_step')} (attempt {data.get('attempt')})"
        if event.type == "warning":
            return f"warning: {data.get('message')}"
        if event.type == "phase":
            return phase_text(data)
        if event.type == "download":
            done, total = data.get("bytes_done") or 0, data.get("bytes_total")
            of = f"/{total / 1e6:.1f}" if total else ""
            state = "done" if data.get("finished") else "downloading"
            return f"{state} {data.get('field', 'dataset')}: {done / 1e6:.1f}{of} MB"
        return None  # log lines: `tuneq logs` shows them

    def _status(self, data: dict[str, Any]) -> str | None:
        self.status = str(data.get("status", self.status))
        if data.get("error"):
            self.error = data["error"]
        if self.status not in WORKING_STATUSES:
            # Paused, or queued again: the rate and time per step of before say nothing of the
            # steps after a resume (their time would count the pause).
            self._origin, self.eta_seconds, self.tokens_per_second = None, None, None
        if self.status == "running" and data.get("attempt"):
            return f"running (attempt {data['attempt']})"
        if self.status == "paused":
            if data.get("step") is not None:
                self.step = int(data["step"])
            return f"paused at step {self.step} (`tuneq resume {self.job_id}` continues it)"
        return None if self.status in TERMINAL_STATUSES else self.status

    def _metric(self, data: dict[str, Any]) -> None:
        step = int(data.get("step") or self.step)
        self.step = step
        if data.get("loss") is not None:
            self.loss = float(data["loss"])
        if data.get("tokens_per_second") is not None:
            self.tokens_per_second = float(data["tokens_per_second"])
        if data.get("rewards_accuracies") is not None:
            self.reward_accuracy = float(data["rewards_accuracies"])
        if data.get("rewards_margins") is not None:
            self.reward_margin = float(data["rewards_margins"])
        when = parse_time(data.get("time"))
        if when is None:
            return
        if self._origin is None or step <= self._origin[0]:
            self._origin = (step, when)
            return
        origin_step, origin_time = self._origin
        if self.total_steps is not None:
            per_step = (when - origin_time).total_seconds() / (step - origin_step)
            self.eta_seconds = max(0.0, per_step * (self.total_steps - step))

    def outcome_line(self) -> str:
        total = self.total_steps if self.total_steps is not None else "?"
        where = f"at step {self.step}/{total}"
        if self.status == "succeeded":
            return f"job {self.job_id} succeeded {where} (loss {format_loss(self.loss)})"
        if self.status == "failed":
            err = self.error or {}
            return f"job {self.job_id} failed {where}: {err.get('code', 'unknown')}: {err.get('message', '')}"
        return f"job {self.job_id} {self.status} {where}"


# ---- on a terminal -------------------------------------------------------------------------


class StepOrderedLines:
    """A plain follow's lines, printed in the order of the steps they are about.

    A checkpoint's event is recorded once its files are stored (worker.publisher), which can be
    after the metrics of later steps: the lines of the steps past a checkpoint that is due
    (``expect``: the steps whose checkpoint is expected) wait for its line, so that "checkpoint
    ... at step 20" never comes after "step 35/40". They wait ``hold_seconds`` at most (a
    checkpoint that failed to store never comes). ``flush`` prints what still waits."""

    def __init__(
        self, echo: Callable[[str], None], *, hold_seconds: float = 300.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.echo = echo
        self.due: list[int] = []
        self.hold_seconds = hold_seconds
        self.clock = clock
        self.waiting: list[tuple[int, str]] = []  # (step, line), in the order they are printed
        self.waiting_since: float | None = None

    def expect(self, due: Iterable[int]) -> None:
        self.due = sorted(set(due))

    def add(self, step: int, line: str, *, checkpoint: bool = False) -> None:
        if checkpoint:
            if step in self.due:
                self.due.remove(step)
            # After the lines of its step and those before, ahead of the lines of later steps.
            at = next((i for i, (s, _) in enumerate(self.waiting) if s > step), len(self.waiting))
            self.waiting.insert(at, (step, line))
        else:
            self.waiting.append((step, line))
        if self.waiting_since is not None and self.clock() - self.waiting_since > self.hold_seconds:
            self.due = [s for s in self.due if s >= self.waiting[-1][0]]  # given up on
        while self.waiting and not (self.due and self.due[0] < self.waiting[0][0]):
            self.echo(self.waiting.pop(0)[1])
        if not self.waiting:
            self.waiting_since = None
        elif self.waiting_since is None:
            self.waiting_since = self.clock()

    def flush(self) -> None:
        for _, line in self.waiting:
            self.echo(line)
        self.waiting.clear()
        self.waiting_since = None


def due_checkpoints(training: dict[str, Any], total_steps: int) -> list[int]:
    """The steps at which a job of ``training`` and ``total_steps`` saves a checkpoint (every
    ``checkpoint_every_steps``, and its last)."""
    every = training.get("checkpoint_every_steps")
    return sorted({*range(every, total_steps + 1, every), total_steps} if every else {total_steps})


def follow_plain(client: TuneqClient, job: dict[str, Any], *, echo: Callable[[str], None]) -> dict[str, Any]:
    """A line per event of note until the job ends, in step order (StepOrderedLines); the job
    as it ended."""
    state = FollowState.from_job(job)
    training = job.get("training") or {}
    lines = StepOrderedLines(echo)

    def expect_from(step: int) -> None:
        if state.total_steps:
            lines.expect(s for s in due_checkpoints(training, state.total_steps) if s > step)

    expect_from(state.history_through_step)
    for event in client.stream_events(str(job["id"])):
        line = state.apply(event)
        if event.type == "resumed":  # the steps from its checkpoint on are trained again
            lines.flush()
            expect_from(state.step)
        elif event.type == "plan":
            expect_from(max(state.step, state.history_through_step))
        if line is not None:
            step = int(event.data.get("step") or 0) if event.type == "checkpoint" else state.step
            lines.add(step, line, checkpoint=event.type == "checkpoint")
    lines.flush()
    return client.get_ended_job(str(job["id"]))


def make_console(*, stderr: bool = False) -> Any:
    """A rich console; piped, one without colours and wide enough that tables never wrap an id."""
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:
        console = Console(stderr=stderr, highlight=False, width=max(console.width, 200), no_color=True)
    return console


@dataclass
class RunClock:
    """How long a job has worked while followed: it stands still while the job is paused or
    queued (``stop``) and goes on from there once it runs again (``start``)."""

    ran: float = 0.0
    since: float | None = None

    def start(self, now: float) -> None:
        if self.since is None:
            self.since = now

    def stop(self, now: float) -> None:
        if self.since is not None:
            self.ran += now - self.since
            self.since = None

    def seconds(self, now: float) -> float:
        return self.ran + (now - self.since if self.since is not None else 0.0)


def _run_time_column(clock: RunClock) -> Any:
    """A column of the time on ``clock``, as rich's elapsed column shows time (H:MM:SS)."""
    from datetime import timedelta

    from rich.progress import ProgressColumn, Task
    from rich.text import Text

    class RunTimeColumn(ProgressColumn):
        def render(self, task: Task) -> Text:
            shown = timedelta(seconds=int(clock.seconds(task.get_time())))
            return Text(str(shown), style="progress.elapsed")

    return RunTimeColumn()


class JobProgressBar:
    """A job's progress bar: its status, steps, loss, tokens/s, ETA, and the time it has
    worked, which stands still while it is paused. Lines of note print above it."""

    def __init__(self, console: Any, *, get_time: Callable[[], float] | None = None) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self.clock = RunClock()
        self.run_time_column = _run_time_column(self.clock)
        columns = (
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]} tok/s"),
            TextColumn("eta {task.fields[eta]}"),
            self.run_time_column,
        )
        self.progress = Progress(*columns, console=console, transient=False, get_time=get_time)
        self.task = self.progress.add_task("", total=None, loss="-", rate="-", eta="?")

    def __enter__(self) -> JobProgressBar:
        self.progress.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.progress.stop()

    def show(self, state: FollowState) -> None:
        now = self.progress.get_time()
        if state.status in WORKING_STATUSES:
            self.clock.start(now)
        else:
            self.clock.stop(now)
        self.progress.update(
            self.task,
            description=state.status,
            total=state.total_steps,
            completed=state.step,
            loss=format_loss(state.loss),
            rate=format_rate(state.tokens_per_second),
            eta=format_duration(state.eta_seconds),
        )

    def print(self, line: str) -> None:
        self.progress.console.print(line, markup=False, highlight=False)


def follow_job(
    client: TuneqClient,
    job: dict[str, Any],
    *,
    live: bool,
    console: Any = None,
    echo: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Show a job's progress until it ends and return it as it ended; a job that has ended
    already is returned as it is. ``live``: a progress bar; otherwise one plain line per event
    of note (``follow_plain``), to ``echo`` (the console's, by default)."""
    job_id = str(job["id"])
    state = FollowState.from_job(job)
    if state.status in TERMINAL_STATUSES:
        return job
    console = console or make_console()
    if live:
        with JobProgressBar(console) as bar:
            bar.show(state)
            for event in client.stream_events(job_id):
                line = state.apply(event)
                if line is not None and (event.type not in ("metric", "status") or state.status == "paused"):
                    bar.print(line)
                bar.show(state)
    else:
        return follow_plain(client, job, echo=echo or (lambda line: console.print(line, markup=False)))
    final = client.get_ended_job(job_id)
    state.update_from_job(final)
    return final


def download_with_progress(client: TuneqClient, plan: DownloadPlan, *, console: Any = None) -> DownloadResult:
    """``download_checkpoint`` with a progress bar over its bytes on a terminal's stderr."""
    console = console or make_console(stderr=True)
    if not console.is_terminal:
        return download_checkpoint(client, plan)
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("check" if plan.done else "download", total=plan.total_bytes)
        progress.update(task, completed=plan.kept_bytes())
        return download_checkpoint(
            client,
            plan,
            progress=lambda n: progress.advance(task, n),
            on_file=lambda f: progress.update(task, description=f.name),
        )
