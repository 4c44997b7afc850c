"""The client commands of ``tuneq``: ``submit``, ``jobs``, ``show``, ``logs``, ``cancel``,
``pause``, ``resume``, ``download``, registered on the ``tuneq`` app by ``register(app)``.

A thin layer over the HTTP API (docs/api.md) through ``cli.api_client``; following
a job and a download's progress bar are ``cli.live``'s, the download itself ``cli.downloads``'.
Every command that takes a job's ID takes its short id too (its first characters, as the
dashboard and ``tuneq jobs`` show them) when that starts one job's id only. Exit codes:
``cli.api_client``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Callable
from datetime import UTC
from pathlib import Path
from typing import Annotated, Any

import typer

from cli.api_client import (
    EXIT_CANCELLED,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    ClientError,
    TuneqClient,
    full_job_id,
)
from cli.downloads import KIND_PREFERENCE, pick_checkpoint, plan_download
from cli.live import (
    PREFERENCE_MEASURES,
    FollowState,
    download_with_progress,
    follow_job,
    format_duration,
    format_loss,
    format_measure,
    format_rate,
    make_console,
    parse_time,
    phase_text,
)

STATUS_STYLE = {
    "queued": "cyan",
    "running": "blue",
    "cancelling": "yellow",
    "pausing": "magenta",
    "paused": "magenta",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "yellow",
}

JsonOption = Annotated[bool, typer.Option("--json", help="Print the API's JSON (one object) for scripts.")]
FollowOption = Annotated[
    bool, typer.Option("--follow", "-f", help="Show progress until the job ends; exit 0 / 1 / 3 by outcome.")
]
JobIdArgument = Annotated[
    str, typer.Argument(metavar="ID", help="The job's id, or its first characters (as `tuneq jobs` shows them).")
]


# ---- shared by the commands -------------------------------------------------------------------


def _fail(error: ClientError) -> typer.Exit:
    typer.echo(f"tuneq: {error.message}", err=True)
    return typer.Exit(error.exit_code)


def _client() -> TuneqClient:
    logging.basicConfig(level=logging.WARNING, format="tuneq: %(message)s")
    try:
        return TuneqClient()
    except ClientError as e:  # a TUNEQ_URL that is no URL
        raise _fail(e) from None


def _job_id(client: TuneqClient, given: str) -> str:
    """The whole id ``given`` (a whole or short id) names; the command fails with the reason."""
    try:
        return client.resolve_job_id(given)
    except ClientError as e:
        raise _fail(e) from None


def _print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2))


def _stdout_is_tty() -> bool:
    return sys.stdout.isatty()


def _short_time(value: Any) -> str:
    when = parse_time(value)
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if when else "-"


def exit_code_for(status: str) -> int:
    return {"succeeded": EXIT_OK, "failed": EXIT_FAILED, "cancelled": EXIT_CANCELLED}.get(status, EXIT_FAILED)


def _finish_follow(job: dict[str, Any], *, as_json: bool) -> None:
    state = FollowState.from_job(job)
    if as_json:
        _print_json(job)
    else:
        typer.echo(state.outcome_line(), err=state.status != "succeeded")
    raise typer.Exit(exit_code_for(state.status))


def _interrupted(job_id: str) -> typer.Exit:
    typer.echo(f"\ntuneq: stopped following; job {job_id} goes on (`tuneq cancel {job_id}` stops it)", err=True)
    return typer.Exit(EXIT_INTERRUPTED)


def _follow_and_exit(client: TuneqClient, job: dict[str, Any], *, as_json: bool) -> None:
    try:
        if as_json:
            for _event in client.stream_events(str(job["id"])):
                pass
            final = client.get_ended_job(str(job["id"]))
        else:
            final = follow_job(client, job, live=_stdout_is_tty())
    except KeyboardInterrupt:
        raise _interrupted(str(job["id"])) from None
    except ClientError as e:
        raise _fail(e) from None
    _finish_follow(final, as_json=as_json)


# ---- submit -----------------------------------------------------------------------------------


def _load_json_option(value: str, *, option: str, file_by_default: bool) -> dict[str, Any]:
    """``@path`` or a path (when ``file_by_default``) is read as a JSON file; else inline JSON."""
    text = value
    stripped = value.strip()
    is_file = stripped.startswith("@") or (file_by_default and not stripped.startswith("{"))
    if is_file:
        path = Path(stripped.removeprefix("@")).expanduser()
        try:
            text = path.read_text()
        except OSError as e:
            raise typer.BadParameter(f"cannot read {path}: {e.strerror or e}", param_hint=option) from None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"not valid JSON: {e}", param_hint=option) from None
    if not isinstance(parsed, dict):
        raise typer.BadParameter("must be a JSON object", param_hint=option)
    return parsed


# A URI (s3://, hf://, file://...) or another job's output (job:<id>, ft:...): not a local path.
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
# A hub model id, as the API's shared.jobs.validation.HUB_ID takes it.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# An uploaded file's id (POST /v1/files), which the API takes as a dataset.
_FILE_ID = re.compile(r"^file-[A-Za-z0-9]+$")


def local_reference(value: str, *, option: str, hub_ids: bool = False) -> str:
    """``value`` as the API must get it. A URI, another job's output, an uploaded file's id, an
    absolute path (the server's to check: it may be a path on the server) and, with
    ``hub_ids``, a hub id go as given; a relative or ``~`` path is made absolute against this
    directory, and must exist here (raises BadParameter saying it does not)."""
    if _SCHEME.match(value) or os.path.isabs(value):
        return value
    path = Path(os.path.abspath(Path(value).expanduser()))
    if path.exists():
        return str(path)
    plain = not value.startswith(("./", "../", "~"))
    if plain and ((hub_ids and _HUB_ID.fullmatch(value)) or (not hub_ids and _FILE_ID.fullmatch(value))):
        return value
    alternatives = ", or a hub id like org/name" if hub_ids else ", or a URI (s3://, https://, hf://)"
    raise typer.BadParameter(
        f"{value} does not exist ({path}): give an existing path, relative to this directory or absolute{alternatives}",
        param_hint=option,
    )


_JOB_MODEL = re.compile(r"^job:(?P<id>[^@]+)(?P<step>@.*)?$")


def _model_reference(client: TuneqClient, model: str) -> str:
    """``--model`` as submitted: ``job:<short id>`` (and ``@step-<n>``) names the job by its whole id."""
    match = _JOB_MODEL.match(model)
    if match is None or full_job_id(match["id"]) is not None:
        return model
    return f"job:{_job_id(client, match['id'])}{match['step'] or ''}"


def submit(
    model: Annotated[
        str,
        typer.Option(
            help="A hub id (org/name), a local model directory, or one of your jobs' outputs to continue from: "
            "job:<id> (its exported model) or job:<id>@step-<n> (its checkpoint)."
        ),
    ],
    dataset: Annotated[
        str, typer.Option(help="A dataset path (relative to this directory, or absolute) or URI (file://, s3://, ...).")
    ],
    deepspeed: Annotated[
        str | None,
        typer.Option(
            "--deepspeed",
            help="The DeepSpeed config: a JSON file (or @file, or inline JSON). Left out, tuneq chooses one "
            "for the model's size and the workers' hardware (shown in `tuneq show`).",
        ),
    ] = None,
    validation_dataset: Annotated[
        str | None, typer.Option(help="Held-out records for eval_loss, a path or URI as --dataset.")
    ] = None,
    num_gpus: Annotated[int, typer.Option(min=1, help="Ranks to launch on each node: GPUs, or CPU processes.")] = 1,
    num_nodes: Annotated[
        int,
        typer.Option(
            min=1,
            help="Hosts to run on at once, one worker each: the world size is nodes x GPUs per node (--num-gpus).",
        ),
    ] = 1,
    name: Annotated[str | None, typer.Option(help="A label for the job.")] = None,
    training: Annotated[
        str | None, typer.Option(help="Training options as JSON or @file, e.g. '{\"max_steps\": 100}'.")
    ] = None,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Makes a retried submit safe: the same key answers the same job.")
    ] = None,
    follow: FollowOption = False,
    as_json: JsonOption = False,
) -> None:
    """Submit a fine-tuning job (POST /jobs)."""
    body: dict[str, Any] = {
        "model": local_reference(model, option="--model", hub_ids=True),
        "dataset": local_reference(dataset, option="--dataset"),
        "num_gpus": num_gpus,
    }
    if validation_dataset is not None:
        body["validation_dataset"] = local_reference(validation_dataset, option="--validation-dataset")
    if deepspeed is not None:
        body["deepspeed_config"] = _load_json_option(deepspeed, option="--deepspeed", file_by_default=True)
    if num_nodes != 1:
        # Only when asked for: a one-node submit's body stays what a server without
        # multi-node jobs accepts (it refuses fields it does not know).
        body["num_nodes"] = num_nodes
    if name is not None:
        body["name"] = name
    if training is not None:
        body["training"] = _load_json_option(training, option="--training", file_by_default=False)
    with _client() as client:
        body["model"] = _model_reference(client, body["model"])
        try:
            job = client.submit(body, idempotency_key=idempotency_key)
        except ClientError as e:
            raise _fail(e) from None
        if not follow:
            if as_json:
                _print_json(job)
            else:
                typer.echo(f"submitted job {job['id']} ({job['status']})")
            return
        if not as_json:
            typer.echo(f"submitted job {job['id']} ({job['status']}); following it (Ctrl-C stops following)")
        _follow_and_exit(client, job, as_json=as_json)


# ---- jobs ---------------------------------------------------------------------------------------


def jobs(
    status: Annotated[
        str | None,
        typer.Option(
            help="Only jobs in this status: queued, running, cancelling, pausing, paused, succeeded, failed, cancelled."
        ),
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="At most this many, newest first.")] = 50,
    skip: Annotated[int, typer.Option(min=0, help="Skip this many of the newest.")] = 0,
    as_json: JsonOption = False,
) -> None:
    """List jobs, newest first (GET /jobs)."""
    if status is not None and status not in STATUS_STYLE:
        raise typer.BadParameter(f"unknown status {status!r}: one of {', '.join(STATUS_STYLE)}", param_hint="--status")
    with _client() as client:
        try:
            page = client.list_jobs(status=status, skip=skip, limit=limit)
        except ClientError as e:
            raise _fail(e) from None
    if as_json:
        _print_json(page)
        return
    console = make_console()
    console.print(jobs_table(page["data"]))
    shown, count = len(page["data"]), int(page["count"])
    if shown < count:
        console.print(f"{shown} of {count} jobs (--skip/--limit for more)", markup=False)


def jobs_table(rows: list[dict[str, Any]]) -> Any:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, show_edge=False)
    for column in ("ID", "NAME", "STATUS", "GPUS", "STEP", "LOSS", "CREATED (UTC)", "MODEL"):
        table.add_column(column, no_wrap=column in ("ID", "STATUS", "CREATED (UTC)"))
    for job in rows:
        total = job.get("total_steps")
        latest = job.get("latest_metrics") or {}
        status = str(job["status"])
        table.add_row(
            str(job["id"]),
            # The user's own text as text: a name or path with [brackets] is not rich markup.
            Text(job.get("name") or "-"),
            f"[{STATUS_STYLE.get(status, 'white')}]{status}[/]",
            gpus_text(job),
            f"{job.get('step', 0)}/{total if total is not None else '?'}",
            format_loss(latest.get("loss")),
            _short_time(job.get("created_at")),
            Text(Path(str(job.get("model", ""))).name or str(job.get("model"))),
        )
    return table


def gpus_text(job: dict[str, Any]) -> str:
    """A job's ranks: ``num_gpus``, or ``nodes x GPUs per node`` for a multi-node job."""
    nodes = int(job.get("num_nodes") or 1)
    return f"{nodes}x{job.get('num_gpus')}" if nodes > 1 else str(job.get("num_gpus"))


# ---- show ---------------------------------------------------------------------------------------


def node_line(node: dict[str, Any]) -> str:
    """One node of a multi-node job: its worker and address, its global ranks, its state, and
    why it ended the gang, if it did."""
    first, last = node["ranks"]
    line = f"worker {node['worker_id']} at {node['address']}, ranks {first}-{last}, {node['state']}"
    return f"{line}: {node['error_message']}" if node.get("error_message") else line


def attempts_text(job: dict[str, Any]) -> str:
    """Attempts, the paused and handed-back ones among them (they are not restarts), and the
    restarts allowed."""
    pauses = int(job.get("pauses") or 0)  # an older server sends neither count
    handbacks = int(job.get("handbacks") or 0)
    paused = f", {pauses} paused" if pauses else ""
    handed = f", {handbacks} handed back by a stopping worker" if handbacks else ""
    return f"{job.get('attempts', 0)}{paused}{handed} (max restarts {job.get('max_restarts')})"


def job_deepspeed_config(job: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config the job runs with: as resolved ("auto" filled), else as given or chosen."""
    config = job.get("resolved_deepspeed_config") or job.get("deepspeed_config") or {}
    return config if isinstance(config, dict) else {}


def precision_text(config: dict[str, Any]) -> str:
    """The precision a DeepSpeed config trains in, and the switch in it that says so."""
    for name, section_names in (("bf16", ("bf16", "bfloat16")), ("fp16", ("fp16",))):
        for section_name in section_names:
            section = config.get(section_name)
            enabled = section.get("enabled") if isinstance(section, dict) else None
            if enabled is True:
                return f"{name} ({section_name}.enabled in the DeepSpeed config)"
            if enabled == "auto":
                return f"set by the worker ({section_name}.enabled: auto in the DeepSpeed config)"
    return "fp32 (neither bf16 nor fp16 is enabled in the DeepSpeed config)"


def training_text(training: dict[str, Any]) -> str:
    """The training options the job set, those left at their defaults left out (``precision``'s
    default among them: what the job trains in is the DeepSpeed config's, shown apart)."""
    from shared.jobs.spec import TrainingOptions

    defaults = TrainingOptions().model_dump(mode="json")
    chosen = {key: value for key, value in training.items() if key not in defaults or defaults[key] != value}
    return json.dumps(chosen, sort_keys=True) + ("" if chosen else " (all defaults)")


def describe_job(job: dict[str, Any], checkpoints: list[dict[str, Any]] | None = None) -> list[tuple[str, str]]:
    """``show``'s rows: (label, value)."""
    total = job.get("total_steps")
    latest = job.get("latest_metrics") or {}
    epoch = job.get("epoch")
    epoch_text = f", epoch {epoch:.2f}" if isinstance(epoch, int | float) else ""
    chosen = "chosen by tuneq" if job.get("deepspeed_config_chosen") else "as submitted"
    rows = [
        ("id", str(job["id"])),
        ("name", job.get("name") or "-"),
        ("status", str(job["status"])),
        ("model", str(job.get("model"))),
        ("dataset", str(job.get("dataset"))),
        *([("validation", str(job["validation_dataset"]))] if job.get("validation_dataset") else []),
        ("num_gpus", str(job.get("num_gpus"))),
        ("num_nodes", str(job.get("num_nodes") or 1)),  # a server without multi-node jobs sends none
        ("training", training_text(job.get("training") or {})),
        ("precision", precision_text(job_deepspeed_config(job))),
        ("deepspeed", f"{chosen} (below)"),
        ("created", _short_time(job.get("created_at"))),
        ("started", _short_time(job.get("started_at"))),
        ("finished", _short_time(job.get("finished_at"))),
        ("progress", f"step {job.get('step', 0)}/{total if total is not None else '?'}{epoch_text}"),
        # Work before the first step (a DPO job's reference log-probabilities); an older server sends none.
        *([("phase", phase_text(job["phase"]))] if job.get("phase") else []),
        ("tokens seen", str(job.get("tokens_seen", 0))),
        ("loss", format_loss(latest.get("loss"))),
        # A DPO job's measures, those its last step reported.
        *((label, format_measure(latest[key])) for key, label in PREFERENCE_MEASURES if latest.get(key) is not None),
        ("tokens/s", format_rate(latest.get("tokens_per_second"))),
        ("eta", format_duration(job.get("eta_seconds")) if job.get("eta_seconds") is not None else "-"),
        ("attempts", attempts_text(job)),
    ]
    # The nodes of the current attempt (none for a one-node job).
    rows += [(f"node {n['node_rank']}", node_line(n)) for n in job.get("nodes") or []]
    error = job.get("error")
    if error:
        rows.append(("error", f"{error.get('code')}: {error.get('message')}"))
    for c in checkpoints or []:
        rows.append(("checkpoint", f"{c['kind']} step {c['step']} ({int(c['bytes']) / 1e6:.1f} MB) {c['uri']}"))
    return rows


def show_lines(job: dict[str, Any], checkpoints: list[dict[str, Any]] | None = None) -> list[str]:
    """``show``'s text: a label and a value a line, then the job's DeepSpeed config. Values are
    the job's own text, whole (never markup, never cut or padded to the terminal's width)."""
    rows = describe_job(job, checkpoints)
    width = max(len(label) for label, _ in rows)
    lines = [f"{label.ljust(width)}  {value}".rstrip() for label, value in rows]
    chosen = "chosen by tuneq" if job.get("deepspeed_config_chosen") else "as submitted"
    filled = ', "auto" values filled' if job.get("resolved_deepspeed_config") else ""
    config = json.dumps(job_deepspeed_config(job), indent=2, sort_keys=True)
    lines += ["", f"DeepSpeed config ({chosen}{filled}):", *(f"  {line}" for line in config.splitlines())]
    return lines


def show(job_id: JobIdArgument, follow: FollowOption = False, as_json: JsonOption = False) -> None:
    """Show one job: status, progress, precision, nodes, error, checkpoints and its DeepSpeed
    config (GET /jobs/{id}); with --follow, then its progress until it ends."""
    with _client() as client:
        job_id = _job_id(client, job_id)
        try:
            job = client.get_job(job_id)
            checkpoints = None if as_json else client.checkpoints(job_id)
        except ClientError as e:
            raise _fail(e) from None
        if as_json and not follow:
            _print_json(job)
            return
        if not as_json:
            for line in show_lines(job, checkpoints):
                typer.echo(line)
        if follow:
            _follow_and_exit(client, job, as_json=as_json)


# ---- logs, cancel, pause, resume ----------------------------------------------------------------


def logs(
    job_id: JobIdArgument,
    tail: Annotated[int, typer.Option(min=1, help="The last N lines.")] = 200,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Print new lines until the job ends.")] = False,
) -> None:
    """Print the lines the job's ranks wrote (GET /jobs/{id}/logs)."""
    with _client() as client:
        job_id = _job_id(client, job_id)
        try:
            if follow:
                for line in client.follow_logs(job_id, tail=tail):
                    typer.echo(line)
            else:
                for line in client.logs(job_id, tail=tail):
                    typer.echo(line)
        except KeyboardInterrupt:
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except ClientError as e:
            raise _fail(e) from None


def _change_job(job_id: str, as_json: bool, ask: Callable[[TuneqClient, str], dict[str, Any]]) -> None:
    """One request that changes a job (cancel, pause, resume); prints the job's new status."""
    with _client() as client:
        job_id = _job_id(client, job_id)
        try:
            job = ask(client, job_id)
        except ClientError as e:
            raise _fail(e) from None
    if as_json:
        _print_json(job)
    else:
        typer.echo(f"job {job['id']}: {job['status']}")


def cancel(job_id: JobIdArgument, as_json: JsonOption = False) -> None:
    """Cancel a job: a queued or paused one at once, a running one through `cancelling` (POST /jobs/{id}/cancel)."""
    _change_job(job_id, as_json, TuneqClient.cancel)


def pause(job_id: JobIdArgument, as_json: JsonOption = False) -> None:
    """Pause a job: a running one through `pausing` (its ranks save a checkpoint at their next step and
    exit, freeing the worker), a queued one at once (POST /jobs/{id}/pause)."""
    _change_job(job_id, as_json, TuneqClient.pause)


def resume(job_id: JobIdArgument, as_json: JsonOption = False) -> None:
    """Resume a paused job: queued again, it continues from its pause checkpoint (POST /jobs/{id}/resume)."""
    _change_job(job_id, as_json, TuneqClient.resume)


# ---- download -----------------------------------------------------------------------------------


def _size(n: int) -> str:
    from rich.filesize import decimal

    return decimal(n)


def download(
    job_id: JobIdArgument,
    dest: Annotated[
        Path | None,
        typer.Argument(
            metavar="DEST",
            help="The directory to create (as --output); default ./tuneq-<id>-<kind>-<step>.",
            show_default=False,
        ),
    ] = None,
    step: Annotated[
        int | None,
        typer.Option("--step", "--checkpoint", min=0, help="The step of the checkpoint; default the newest."),
    ] = None,
    model: Annotated[bool, typer.Option("--model", help="The exported model: the same as --kind model.")] = False,
    kind: Annotated[str | None, typer.Option(help="model, adapter or deepspeed; default model, else adapter.")] = None,
    output: Annotated[
        Path | None, typer.Option(help="The directory to create; default ./tuneq-<id>-<kind>-<step>.")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Download a checkpoint of a job over HTTP, checking every file's SHA-256; run again to resume one cut
    short, or to check one that is complete (nothing is fetched again)."""
    if kind is not None and kind not in KIND_PREFERENCE:
        raise typer.BadParameter(f"unknown kind {kind!r}: one of {', '.join(KIND_PREFERENCE)}", param_hint="--kind")
    if model:
        if kind not in (None, "model"):
            raise typer.BadParameter(f"--model is --kind model, not --kind {kind}", param_hint="--model")
        kind = "model"
    if dest is not None and output is not None:
        raise typer.BadParameter("both name the directory to create: give one of them", param_hint="DEST, --output")
    with _client() as client:
        job_id = _job_id(client, job_id)
        try:
            chosen = pick_checkpoint(client.checkpoints(job_id), step=step, kind=kind)
            target = dest or output or Path(f"tuneq-{job_id[:8]}-{chosen['kind']}-{chosen['step']}")
            plan = plan_download(client, job_id, chosen, target)
            result = download_with_progress(client, plan)
        except KeyboardInterrupt:
            typer.echo("\ntuneq: download stopped; the same command resumes it", err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except ClientError as e:
            raise _fail(e) from None
    if as_json:
        _print_json(
            {
                **chosen,
                "output": str(result.output),
                "files": result.files,
                "bytes": result.bytes,
                "resumed_bytes": result.resumed_bytes,
                "already_there": result.already_there,
            }
        )
        return
    what = f"the {chosen['kind']} checkpoint at step {chosen['step']}"
    if result.already_there:
        typer.echo(
            f"{what} is in {target} already: its {result.files} files ({_size(result.bytes)}) match the "
            "server's sizes and SHA-256; nothing fetched"
        )
        return
    resumed = f", {_size(result.resumed_bytes)} of it resumed" if result.resumed_bytes else ""
    typer.echo(f"downloaded {what} to {target} ({result.files} files, {_size(result.bytes)}{resumed})")


def register(app: typer.Typer) -> None:
    """Add the client commands to the ``tuneq`` app."""
    for command in (submit, jobs, show, logs, cancel, pause, resume, download):
        app.command()(command)
