"""The commands (cli.commands) as a user runs them, against a scripted server
(tests/cli/fake_api.py) or the real API (tests/cli/served_api.py)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.api_client import EXIT_API_ERROR, EXIT_CANCELLED, EXIT_FAILED, EXIT_UNREACHABLE
from cli.main import app
from tests.cli.fake_api import CHECKPOINTS, JOB_ID, STREAM, FakeApi, Handler, invoke, job, metric, sse
from tests.cli.served_api import ServedApi, add_job


def test_submit_sends_the_body_and_prints_the_job(api: FakeApi, tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 1}))
    (tmp_path / "training.json").write_text(json.dumps({"max_steps": 3}))
    api.json("POST", "/jobs", job("queued"), status=201)
    args = ["submit", "--model", "org/name", "--dataset", "s3://b/train.jsonl", "--deepspeed", str(config)]
    result = invoke(api, *args, "--num-gpus", "2", "--name", "x", "--training", f"@{tmp_path / 'training.json'}")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"submitted job {JOB_ID} (queued)"
    body = json.loads(api.requests[0]["body"])
    assert body == {
        "model": "org/name",
        "dataset": "s3://b/train.jsonl",
        "deepspeed_config": {"train_batch_size": 1},
        "num_gpus": 2,
        "name": "x",
        "training": {"max_steps": 3},
    }
    as_json = invoke(api, *args, "--training", '{"max_steps": 3}', "--json", "--idempotency-key", "k-1")
    assert json.loads(as_json.stdout)["id"] == JOB_ID
    assert api.requests[1]["headers"]["Idempotency-Key"] == "k-1"


def test_submit_without_deepspeed_sends_no_config_for_tuneq_to_choose(api: FakeApi) -> None:
    api.json("POST", "/jobs", job("queued"), status=201)
    result = invoke(api, "submit", "--model", "m/m", "--dataset", "/d.jsonl")
    assert result.exit_code == 0, result.output
    assert json.loads(api.requests[0]["body"]) == {"model": "m/m", "dataset": "/d.jsonl", "num_gpus": 1}


def test_submit_num_nodes(api: FakeApi) -> None:
    api.json("POST", "/jobs", job("queued", num_gpus=4, num_nodes=2), status=201)
    args = ["submit", "--model", "m/m", "--dataset", "/d.jsonl", "--deepspeed", "{}", "--num-gpus", "4"]
    result = invoke(api, *args, "--num-nodes", "2")
    assert result.exit_code == 0, result.output
    body = json.loads(api.requests[0]["body"])
    assert (body["num_gpus"], body["num_nodes"]) == (4, 2)
    # One node (the default) sends no num_nodes: the body a server without multi-node jobs takes.
    assert invoke(api, *args, "--num-nodes", "1").exit_code == 0
    assert "num_nodes" not in json.loads(api.requests[1]["body"])
    refused = invoke(api, *args, "--num-nodes", "0")
    assert refused.exit_code == 2 and len(api.requests) == 2
    wide = CliRunner().invoke(app, ["submit", "--help"], env={"COLUMNS": "250"})  # no wrapped help lines
    (option,) = [line for line in wide.stdout.splitlines() if "--num-nodes" in line]
    assert "[x>=1]" in option and "the world size is nodes x GPUs per node" in option


def test_submit_refused_prints_each_problem(api: FakeApi) -> None:
    detail = [{"type": "value_error", "loc": ["body", "training", "max_steps"], "msg": "must be > 0"}]
    api.json("POST", "/jobs", {"detail": detail}, status=422)
    result = invoke(api, "submit", "--model", "m/m", "--dataset", "/d.jsonl", "--deepspeed", "{}")
    assert result.exit_code == EXIT_API_ERROR
    assert "body.training.max_steps: must be > 0" in result.stderr


def test_submit_with_bad_json_is_a_usage_error(api: FakeApi) -> None:
    result = invoke(api, "submit", "--model", "m/m", "--dataset", "/d", "--deepspeed", "{}", "--training", "{oops")
    assert result.exit_code == 2 and "not valid JSON" in result.output
    assert api.requests == []


@pytest.mark.parametrize(
    ("status", "error", "code", "line"),
    [
        ("succeeded", None, 0, f"job {JOB_ID} succeeded at step 2/2"),
        (
            "failed",
            {"code": "training_error", "message": "CUDA OOM"},
            EXIT_FAILED,
            "failed at step 2/2: training_error: CUDA OOM",
        ),
        ("cancelled", None, EXIT_CANCELLED, f"job {JOB_ID} cancelled at step 2/2"),
    ],
)
def test_submit_follow_exits_with_the_outcome(
    api: FakeApi, status: str, error: dict[str, str] | None, code: int, line: str
) -> None:
    api.json("POST", "/jobs", job("queued"), status=201)
    api.sse(
        STREAM,
        [
            sse(1, "status", {"status": "running", "attempt": 1}),
            sse(2, "plan", {"total_steps": 2, "world_size": 1}),
            sse(3, "metric", metric(1, 1)),
            sse(4, "metric", metric(2, 3)),
            sse(5, "status", {"status": status, "error": error}),
        ],
    )
    api.json("GET", f"/jobs/{JOB_ID}", job(status, step=2, total_steps=2, error=error))
    result = invoke(api, "submit", "--model", "m/m", "--dataset", "/d", "--deepspeed", "{}", "--follow")
    assert result.exit_code == code, result.output
    assert "step 2/2 loss 2.5000 1500 tok/s eta 0s" in result.stdout
    assert line in (result.stdout if code == 0 else result.stderr)


def test_jobs_table_and_json(api: FakeApi) -> None:
    page = {"data": [job("running", step=3, total_steps=10, latest_metrics={"loss": 1.25})], "count": 7}
    api.json("GET", "/jobs", page)
    table = invoke(api, "jobs", "--status", "running", "--limit", "1")
    assert table.exit_code == 0, table.output
    row = next(line for line in table.stdout.splitlines() if JOB_ID in line)
    assert row.split() == [JOB_ID, "sft", "running", "1", "3/10", "1.2500", "2026-12-02", "10:00:00", "tiny-gpt-neo"]
    assert "1 of 7 jobs" in table.stdout
    assert api.requests[0]["query"] == "skip=0&limit=1&status=running"
    assert json.loads(invoke(api, "jobs", "--json").stdout) == page
    assert invoke(api, "jobs", "--status", "runnin").exit_code == 2


def test_show_cancel_logs(api: FakeApi) -> None:
    error = {"code": "timeout", "message": "ran past 60 s"}
    api.json("GET", f"/jobs/{JOB_ID}", job("failed", step=4, total_steps=4, error=error))
    api.json("GET", f"/jobs/{JOB_ID}/checkpoints", {"data": CHECKPOINTS})
    api.json("POST", f"/jobs/{JOB_ID}/cancel", {"detail": f"job {JOB_ID} already failed"}, status=409)
    api.json("GET", f"/jobs/{JOB_ID}/logs", {"lines": ["one", "two"]})
    shown = invoke(api, "show", JOB_ID)
    assert shown.exit_code == 0, shown.output
    assert "timeout: ran past 60 s" in shown.stdout and "step 4/4" in shown.stdout
    assert "model step 10" in shown.stdout
    assert json.loads(invoke(api, "show", JOB_ID, "--json").stdout)["status"] == "failed"
    cancelled = invoke(api, "cancel", JOB_ID)
    assert cancelled.exit_code == EXIT_API_ERROR and f"conflict (409): job {JOB_ID} already failed" in cancelled.stderr
    logs = invoke(api, "logs", JOB_ID, "--tail", "2")
    assert logs.stdout.splitlines() == ["one", "two"]
    assert api.requests[-1]["query"] == "tail=2"


def test_pause_and_resume(api: FakeApi) -> None:
    api.json("POST", f"/jobs/{JOB_ID}/pause", job("pausing", step=3))
    detail = f"job {JOB_ID} is pausing; only a paused job can be resumed; wait until it is paused"
    api.json("POST", f"/jobs/{JOB_ID}/resume", {"detail": detail}, status=409)
    api.json("GET", f"/jobs/{JOB_ID}", job("paused", step=3, attempts=2, pauses=1))
    api.json("GET", f"/jobs/{JOB_ID}/checkpoints", {"data": []})
    paused = invoke(api, "pause", JOB_ID)
    assert paused.exit_code == 0 and paused.stdout.strip() == f"job {JOB_ID}: pausing", paused.output
    assert json.loads(invoke(api, "pause", JOB_ID, "--json").stdout)["status"] == "pausing"
    early = invoke(api, "resume", JOB_ID)
    assert early.exit_code == EXIT_API_ERROR and f"conflict (409): {detail}" in early.stderr
    assert [(r["method"], r["path"]) for r in api.requests[-3:]] == [
        ("POST", f"/jobs/{JOB_ID}/pause"),
        ("POST", f"/jobs/{JOB_ID}/pause"),
        ("POST", f"/jobs/{JOB_ID}/resume"),
    ]
    shown = invoke(api, "show", JOB_ID)
    assert "paused" in shown.stdout and "2, 1 paused (max restarts 2)" in shown.stdout, shown.output


def test_show_and_jobs_a_multi_node_job(api: FakeApi) -> None:
    nodes = [
        {
            "node_rank": 0,
            "worker_id": "gpu-a",
            "address": "10.0.0.5",
            "ranks": [0, 3],
            "state": "released",
            "error_message": None,
        },
        {
            "node_rank": 1,
            "worker_id": "gpu-b",
            "address": "10.0.0.6",
            "ranks": [4, 7],
            "state": "released",
            "error_message": "[rank5]: exited with code 1",
        },
    ]
    gang = job("failed", num_gpus=4, num_nodes=2, nodes=nodes)
    api.json("GET", f"/jobs/{JOB_ID}", gang)
    api.json("GET", f"/jobs/{JOB_ID}/checkpoints", {"data": []})
    api.json("GET", "/jobs", {"data": [gang, {**job("queued"), "id": str(uuid.uuid4())}], "count": 2})
    shown = invoke(api, "show", JOB_ID)
    assert shown.exit_code == 0, shown.output
    lines = [" ".join(line.split()) for line in shown.stdout.splitlines()]
    assert "num_gpus 4" in lines and "num_nodes 2" in lines
    assert [line for line in lines if line.startswith("node ")] == [
        "node 0 worker gpu-a at 10.0.0.5, ranks 0-3, released",
        "node 1 worker gpu-b at 10.0.0.6, ranks 4-7, released: [rank5]: exited with code 1",
    ]
    listed = invoke(api, "jobs")
    assert listed.exit_code == 0, listed.output
    gpus = [line.split()[3] for line in listed.stdout.splitlines() if "sft" in line]
    assert gpus == ["2x4", "1"]  # nodes x GPUs per node; a one-node job its GPUs


def test_show_a_one_node_job_has_no_node_lines(api: FakeApi) -> None:
    api.json("GET", f"/jobs/{JOB_ID}", job("running"))
    api.json("GET", f"/jobs/{JOB_ID}/checkpoints", {"data": []})
    shown = invoke(api, "show", JOB_ID)
    assert shown.exit_code == 0, shown.output
    lines = [" ".join(line.split()) for line in shown.stdout.splitlines()]
    assert "num_nodes 1" in lines and not any(line.startswith("node ") for line in lines)


def test_show_and_jobs_print_the_jobs_text_not_markup(api: FakeApi) -> None:
    error = {"code": "training_error", "message": "[rank3]: CUDA OOM [/x]"}
    shown_job = job("failed", name="[bold]sft[/bold]", model="/srv/models/[v2]", error=error)
    api.json("GET", f"/jobs/{JOB_ID}", shown_job)
    api.json("GET", f"/jobs/{JOB_ID}/checkpoints", {"data": []})
    api.json("GET", "/jobs", {"data": [shown_job], "count": 1})
    shown = invoke(api, "show", JOB_ID)
    assert shown.exit_code == 0, shown.output
    assert "training_error: [rank3]: CUDA OOM [/x]" in shown.stdout
    assert "[bold]sft[/bold]" in shown.stdout
    listed = invoke(api, "jobs")
    assert listed.exit_code == 0, listed.output
    assert "[bold]sft[/bold]" in listed.stdout and "[v2]" in listed.stdout


def test_logs_follow_streams_lines(api: FakeApi) -> None:
    def serve(h: Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/plain; charset=utf-8")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        h.chunk(b"first\nsec")
        h.chunk(b"ond\n")
        h.wfile.write(b"0\r\n\r\n")

    api.route("GET", f"/jobs/{JOB_ID}/logs", serve)
    result = invoke(api, "logs", JOB_ID, "--follow", "--tail", "5")
    assert result.exit_code == 0 and result.stdout.splitlines() == ["first", "second"]
    assert api.requests[0]["query"] == "tail=5&follow=true"


def test_download_usage_errors(api: FakeApi, tmp_path: Path) -> None:
    both = invoke(api, "download", JOB_ID, str(tmp_path / "a"), "--output", str(tmp_path / "b"))
    assert both.exit_code == 2 and "Invalid value for DEST, --output: both name the" in both.output
    assert invoke(api, "download", JOB_ID, "--kind", "weights").exit_code == 2
    assert invoke(api, "download", JOB_ID, "--model", "--kind", "adapter").exit_code == 2
    assert api.requests == [] and list(tmp_path.iterdir()) == []


def test_unreachable_and_unknown(api: FakeApi) -> None:
    nobody = invoke(None, "jobs")
    assert nobody.exit_code == EXIT_UNREACHABLE and "is `tuneq serve` running at" in nobody.stderr
    missing = invoke(api, "show", str(uuid.uuid4()))
    assert missing.exit_code == EXIT_API_ERROR and "not found (404)" in missing.stderr


def test_show_a_dpo_job(api: FakeApi) -> None:
    latest = {**metric(3, 10, loss=0.5), "rewards_chosen": 0.4, "rewards_rejected": -0.2}
    latest.update(rewards_margins=0.6, rewards_accuracies=0.875, eval_rewards_accuracies=None)
    phase = {"name": "reference_logps", "done": 400, "total": 400, "cached": False, "time": "2026-12-02T10:00:00Z"}
    api.json("GET", f"/jobs/{JOB_ID}", job("running", step=3, latest_metrics=latest, phase=phase))
    api.json("GET", f"/jobs/{JOB_ID}/checkpoints", {"data": []})
    shown = invoke(api, "show", JOB_ID)
    assert shown.exit_code == 0, shown.output
    lines = [" ".join(line.split()) for line in shown.stdout.splitlines()]
    assert "phase reference log-probabilities: 400/400 pairs" in lines
    assert [line for line in lines if line.startswith("rewards/")] == [
        "rewards/chosen 0.4000",
        "rewards/rejected -0.2000",
        "rewards/margins 0.6000",
        "rewards/accuracies 0.8750",
    ]
    assert not any(line.startswith("eval_rewards") for line in lines)  # not measured at this step
    api.json("GET", f"/jobs/{JOB_ID}", job("running", step=3, latest_metrics=metric(3, 10)))
    sft = [" ".join(line.split()) for line in invoke(api, "show", JOB_ID).stdout.splitlines()]
    assert not any(line.startswith(("rewards/", "phase")) for line in sft)


# ---- show: the DeepSpeed config, the precision, the lines ---------------------------------------

CHOSEN_CONFIG = {
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    "train_micro_batch_size_per_gpu": "auto",
    "zero_optimization": {"stage": 2},
}
RESOLVED_CONFIG = {
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 5e-05}},
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 2},
}


def test_show_prints_the_chosen_deepspeed_config_and_the_precision_it_trains_in(api: FakeApi) -> None:
    training = {"max_steps": 10, "precision": "fp32", "epochs": 1, "learning_rate": 5e-5}  # as the API answers them
    chosen = job(
        "running",
        training=training,
        deepspeed_config=CHOSEN_CONFIG,
        deepspeed_config_chosen=True,
        resolved_deepspeed_config=RESOLVED_CONFIG,
    )
    api.json("GET", f"/jobs/{JOB_ID}", chosen)
    api.json("GET", f"/jobs/{JOB_ID}/checkpoints", {"data": []})
    shown = invoke(api, "show", JOB_ID)
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert 'training     {"max_steps": 10}' in lines  # the options set; fp32 is precision's default only
    assert "precision    bf16 (bf16.enabled in the DeepSpeed config)" in lines
    assert "deepspeed    chosen by tuneq (below)" in lines
    config_at = lines.index('DeepSpeed config (chosen by tuneq, "auto" values filled):')
    assert json.loads("\n".join(lines[config_at + 1 :])) == RESOLVED_CONFIG
    assert all(line == line.rstrip() for line in lines)  # no line padded to the terminal's width
    assert all(len(line) < 120 for line in lines)

    fp16 = {**RESOLVED_CONFIG, "bf16": {"enabled": False}, "fp16": {"enabled": True}}
    api.json("GET", f"/jobs/{JOB_ID}", {**chosen, "resolved_deepspeed_config": fp16, "deepspeed_config_chosen": False})
    again = invoke(api, "show", JOB_ID).stdout.splitlines()
    assert "precision    fp16 (fp16.enabled in the DeepSpeed config)" in again
    assert 'DeepSpeed config (as submitted, "auto" values filled):' in again
    api.json("GET", f"/jobs/{JOB_ID}", {**chosen, "resolved_deepspeed_config": None, "deepspeed_config": {}})
    plain = invoke(api, "show", JOB_ID).stdout.splitlines()
    assert "precision    fp32 (neither bf16 nor fp16 is enabled in the DeepSpeed config)" in plain
    assert "DeepSpeed config (chosen by tuneq):" in plain and "  {}" in plain


def test_show_pads_no_line_to_the_longest_or_the_terminals_width(api: FakeApi) -> None:
    long_name = "a-long-name-" * 20
    api.json("GET", f"/jobs/{JOB_ID}", job("queued", name=long_name, deepspeed_config={}))
    api.json("GET", f"/jobs/{JOB_ID}/checkpoints", {"data": []})
    shown = CliRunner().invoke(app, ["show", JOB_ID], env={"TUNEQ_URL": api.url, "TUNEQ_API_KEY": "", "COLUMNS": "300"})
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert f"name         {long_name}" in lines  # whole, on its line
    assert "status       queued" in lines and "num_gpus     1" in lines  # as long as they are, no longer
    assert all(line == line.rstrip() for line in lines)


# ---- submit: paths, typos ---------------------------------------------------------------------


def test_submit_resolves_relative_paths_against_this_directory(
    api: FakeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "data" / "eval.jsonl").write_text('{"text": "y"}\n')
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    api.json("POST", "/jobs", job("queued"), status=201)
    args = ["submit", "--model", "models/tiny", "--dataset", "data/train.jsonl"]
    result = invoke(api, *args, "--validation-dataset", "./data/eval.jsonl")
    assert result.exit_code == 0, result.output
    body = json.loads(api.requests[0]["body"])
    assert (body["model"], body["dataset"], body["validation_dataset"]) == (
        str(tmp_path / "models" / "tiny"),
        str(tmp_path / "data" / "train.jsonl"),
        str(tmp_path / "data" / "eval.jsonl"),
    )
    # What is not a path here goes as given: a hub id, a URI, an uploaded file, an absolute path (the server's).
    as_given = ["--model", "EleutherAI/gpt-neo-125m", "--dataset", "s3://bucket/train.jsonl"]
    assert invoke(api, "submit", *as_given, "--validation-dataset", "file-abc123").exit_code == 0
    assert invoke(api, "submit", "--model", "/srv/m", "--dataset", "/srv/missing.jsonl").exit_code == 0
    sent = [json.loads(r["body"]) for r in api.requests[1:]]
    assert [(b["model"], b["dataset"], b.get("validation_dataset")) for b in sent] == [
        ("EleutherAI/gpt-neo-125m", "s3://bucket/train.jsonl", "file-abc123"),
        ("/srv/m", "/srv/missing.jsonl", None),
    ]


def usage_error(api: FakeApi, *args: str) -> str:
    """The message of a command refused as bad usage (exit 2), on one line."""
    env = {"TUNEQ_URL": api.url, "TUNEQ_API_KEY": "", "COLUMNS": "400"}
    result = CliRunner().invoke(app, list(args), env=env)
    assert result.exit_code == 2, result.output
    return " ".join(result.output.replace("│", " ").split())


def test_submit_says_a_missing_relative_path_does_not_exist(
    api: FakeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    dataset = usage_error(api, "submit", "--model", "org/name", "--dataset", "data/train.jsonl")
    assert (
        f"Invalid value for --dataset: data/train.jsonl does not exist ({tmp_path / 'data' / 'train.jsonl'}): give "
        "an existing path, relative to this directory or absolute, or a URI (s3://, https://, hf://)"
    ) in dataset
    assert "must be absolute" not in dataset
    model = usage_error(api, "submit", "--model", "./models/tiny", "--dataset", "s3://b/t.jsonl")
    assert f"--model: ./models/tiny does not exist ({tmp_path / 'models' / 'tiny'})" in model
    assert "or a hub id like org/name" in model
    validation = usage_error(api, "submit", "--model", "o/n", "--dataset", "s3://b", "--validation-dataset", "e.jsonl")
    assert "--validation-dataset: e.jsonl does not exist" in validation
    assert api.requests == []


def test_a_typo_in_the_training_options_gets_a_suggestion(served_api: ServedApi, tmp_path: Path) -> None:
    refused = invoke(
        served_api.url, "submit", "--model", "org/name", "--dataset", "s3://b/t.jsonl", "--training", '{"max_step": 10}'
    )
    assert refused.exit_code == EXIT_API_ERROR
    assert refused.stderr.splitlines() == [
        "tuneq: the server refused the job (422):",
        "  body.training.max_step: Extra inputs are not permitted: training has no field 'max_step'; did you mean "
        "'max_steps'?",
    ]


def test_submit_names_another_jobs_output_by_its_short_id(served_api: ServedApi) -> None:
    short = served_api.job_id[:8]
    refused = invoke(served_api.url, "submit", "--model", f"job:{short}@step-3", "--dataset", "s3://b/t.jsonl")
    assert refused.exit_code == EXIT_API_ERROR  # the server looked the job up by its whole id:
    assert f"job {served_api.job_id} has no DeepSpeed checkpoint at step 3" in refused.stderr, refused.output
    unknown_prefix = "0000000" if not served_api.job_id.startswith("0000000") else "1111111"
    unknown = invoke(served_api.url, "submit", "--model", f"job:{unknown_prefix}", "--dataset", "s3://b/t.jsonl")
    assert unknown.exit_code == EXIT_API_ERROR
    assert f"no job of yours has an id that starts with {unknown_prefix}" in unknown.stderr


# ---- resume: the advice ------------------------------------------------------------------------


def test_resume_of_a_running_job_advises_the_pause_command(served_api: ServedApi) -> None:
    from shared.jobs.status import JobStatus

    running = add_job(uuid.UUID("5eed0000-0000-4000-8000-000000000001"), status=JobStatus.running)
    refused = invoke(served_api.url, "resume", "5eed0000")
    assert refused.exit_code == EXIT_API_ERROR
    assert refused.stderr == (
        f"tuneq: conflict (409): job {running} is running; only a paused job can be resumed "
        f"(`tuneq pause {running}` pauses a queued or running one)\n"
    )
