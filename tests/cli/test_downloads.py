"""Downloading a checkpoint (cli.downloads): which one, its files, resuming one cut short, and
running the same download again, against the real API (tests/cli/served_api.py) or a scripted one."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from cli.api_client import EXIT_FAILED, ClientError, ClientSettings, ServerUnreachable, TuneqClient
from cli.downloads import DOWNLOAD_STATE_NAME, RemoteFile, checkpoint_files, fetch_file, pick_checkpoint, plan_download
from cli.live import download_with_progress
from shared.jobs.run_layout import CheckpointManifest
from tests.cli.fake_api import CHECKPOINTS, JOB_ID, FakeApi, Handler, client_for, invoke
from tests.cli.served_api import MODEL_FILES, WEIGHTS, ServedApi, tree


def test_pick_checkpoint() -> None:
    assert pick_checkpoint(CHECKPOINTS, step=None, kind=None)["kind"] == "model"
    assert pick_checkpoint(CHECKPOINTS, step=None, kind="deepspeed")["step"] == 10
    assert pick_checkpoint(CHECKPOINTS, step=5, kind=None)["kind"] == "deepspeed"
    assert pick_checkpoint(CHECKPOINTS, step=10, kind=None)["kind"] == "model"
    with pytest.raises(ClientError, match="no adapter checkpoint"):
        pick_checkpoint(CHECKPOINTS, step=None, kind="adapter")
    with pytest.raises(ClientError, match=r"no checkpoint at step 7 \(the job has: deepspeed@5"):
        pick_checkpoint(CHECKPOINTS, step=7, kind=None)
    with pytest.raises(ClientError, match="no model or adapter checkpoint"):
        pick_checkpoint(CHECKPOINTS[:2], step=None, kind=None)


def test_checkpoint_files_are_named_inside_the_checkpoint_directory() -> None:
    def artifact(path: str, kind: str = "deepspeed", step: int | None = 4) -> dict[str, Any]:
        return {"path": path, "kind": kind, "step": step, "size": 1, "sha256": "0" * 64}

    artifacts = [
        artifact("checkpoints/step-00000004/global_step4/mp_rank_00_model_states.pt"),
        artifact("checkpoints/step-00000004/latest"),
        artifact("checkpoints/step-00000004/tuneq-manifest.json"),
        artifact("checkpoints/step-00000008/tuneq-manifest.json", step=8),
        artifact("model/tuneq-manifest.json", kind="model"),
        artifact("train.log", kind="log", step=None),
    ]
    checkpoint = {"kind": "deepspeed", "step": 4, "uri": "/runs/j/checkpoints/step-00000004"}
    assert [f.name for f in checkpoint_files(artifacts, checkpoint)] == [
        "global_step4/mp_rank_00_model_states.pt",
        "latest",
        "tuneq-manifest.json",
    ]
    with pytest.raises(ClientError, match="lists no files of the adapter checkpoint at step 4"):
        checkpoint_files(artifacts, {**checkpoint, "kind": "adapter"})
    sneaky = [artifact("checkpoints/step-00000004/../../../etc/passwd"), artifacts[2]]
    with pytest.raises(ClientError, match="not a file name to write here"):
        checkpoint_files(sneaky, checkpoint)


def test_download_a_model_checkpoint(served_api: ServedApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served_api.publish("deepspeed", 8, "checkpoints/step-00000008", {"latest": b"global_step8"})
    expected = served_api.publish("model", 8, "model", MODEL_FILES)
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    done = invoke(served_api.url, "download", served_api.job_id)
    assert done.exit_code == 0, done.output
    dest = workdir / f"tuneq-{served_api.job_id[:8]}-model-8"
    assert tree(dest) == expected
    assert [p.name for p in workdir.iterdir()] == [dest.name]  # no staging left
    total = sum(len(data) for data in expected.values())
    assert done.stdout == f"downloaded the model checkpoint at step 8 to {dest.name} (3 files, {total / 1e6:.1f} MB)\n"
    assert done.stderr == ""  # not a terminal: no progress bar
    (weights,) = served_api.recorder.downloads("model.safetensors")
    assert weights["status"] == 200 and weights["sent"] == len(WEIGHTS) and "range" not in weights["headers"]


def test_the_same_download_again_checks_the_files_and_fetches_nothing(
    served_api: ServedApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = served_api.publish("model", 8, "model", MODEL_FILES)
    monkeypatch.chdir(tmp_path)
    first = invoke(served_api.url, "download", served_api.job_id[:8])  # by its short id, as a user would
    assert first.exit_code == 0, first.output
    dest = tmp_path / f"tuneq-{served_api.job_id[:8]}-model-8"
    before = {p: p.stat().st_mtime_ns for p in dest.rglob("*")}

    again = invoke(served_api.url, "download", served_api.job_id[:8], "--model")
    assert again.exit_code == 0, again.output
    total = sum(len(data) for data in expected.values())
    assert again.stdout == (
        f"the model checkpoint at step 8 is in {dest.name} already: its 3 files ({total / 1e6:.1f} MB) match "
        "the server's sizes and SHA-256; nothing fetched\n"
    )
    assert len(served_api.recorder.downloads("model.safetensors")) == 1  # the first download's only
    assert {p: p.stat().st_mtime_ns for p in dest.rglob("*")} == before and tree(dest) == expected
    as_json = invoke(served_api.url, "download", served_api.job_id, str(dest), "--json")
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["already_there"] is True

    (dest / "model.safetensors").write_bytes(WEIGHTS[::-1])  # changed since: same size, other bytes
    changed = invoke(served_api.url, "download", served_api.job_id)
    assert changed.exit_code == EXIT_FAILED
    assert f"tuneq: {dest / 'model.safetensors'} is not the file the server lists (SHA-256 " in changed.stderr
    assert f"remove {dest} to download the checkpoint again" in changed.stderr
    assert (dest / "model.safetensors").read_bytes() == WEIGHTS[::-1]  # left as it was: the user's to remove
    (dest / "notes.txt").write_text("mine")
    other = invoke(served_api.url, "download", served_api.job_id)
    assert other.exit_code == EXIT_FAILED
    assert "already exists and holds other files than the model checkpoint at step 8" in other.stderr


def test_a_download_cut_short_resumes(served_api: ServedApi, tmp_path: Path) -> None:
    expected = served_api.publish("model", 8, "model", MODEL_FILES)
    dest = tmp_path / "exported"
    staging = tmp_path / ".exported.partial"  # what an interrupted `tuneq download ID exported` left
    staging.mkdir()
    half = len(WEIGHTS) // 2
    (staging / "model.safetensors").write_bytes(WEIGHTS[:half])
    (staging / "config.json").write_bytes(b"X" * len(MODEL_FILES["config.json"]))  # complete, but not the file
    (staging / CheckpointManifest.FILENAME).write_bytes(expected[CheckpointManifest.FILENAME])  # complete and right
    (staging / "stale.bin").write_bytes(b"from an earlier listing")

    done = invoke(served_api.url, "download", served_api.job_id, str(dest), "--json")
    assert done.exit_code == 0, done.output
    answer = json.loads(done.stdout)
    total = sum(len(data) for data in expected.values())
    manifest_size = len(expected[CheckpointManifest.FILENAME])
    assert answer["kind"] == "model" and answer["step"] == 8 and answer["output"] == str(dest)
    assert (answer["files"], answer["bytes"], answer["resumed_bytes"]) == (3, total, half + manifest_size)
    assert tree(dest) == expected and not staging.exists()
    (weights,) = served_api.recorder.downloads("model.safetensors")
    assert weights["headers"]["range"] == f"bytes={half}-"
    assert weights["headers"]["if-range"] == f'"{hashlib.sha256(WEIGHTS).hexdigest()}"'
    assert weights["status"] == 206 and weights["sent"] == len(WEIGHTS) - half  # only the second half
    (config,) = served_api.recorder.downloads("config.json")
    assert config["status"] == 200 and "range" not in config["headers"]  # fetched again, whole
    assert served_api.recorder.downloads(CheckpointManifest.FILENAME) == []  # not fetched again


def test_a_partial_copy_of_another_version_is_fetched_whole(served_api: ServedApi, tmp_path: Path) -> None:
    served_api.publish("model", 8, "model", MODEL_FILES)
    staging = tmp_path / ".exported.partial"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"an older export's bytes")
    (staging / DOWNLOAD_STATE_NAME).write_text(json.dumps({"model/model.safetensors": "f" * 64}))
    done = invoke(served_api.url, "download", served_api.job_id, "--output", str(tmp_path / "exported"), "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["resumed_bytes"] == 0
    assert (tmp_path / "exported" / "model.safetensors").read_bytes() == WEIGHTS
    assert not (tmp_path / "exported" / DOWNLOAD_STATE_NAME).exists()
    (weights,) = served_api.recorder.downloads("model.safetensors")
    assert weights["headers"]["if-range"] == f'"{"f" * 64}"' and weights["status"] == 200


def test_a_checksum_mismatch_fails_and_leaves_no_destination(served_api: ServedApi, tmp_path: Path) -> None:
    served_api.publish("model", 8, "model", MODEL_FILES)
    served_api.stored("model/model.safetensors").write_bytes(WEIGHTS[::-1])  # changed in the store, same size
    dest = tmp_path / "exported"
    failed = invoke(served_api.url, "download", served_api.job_id, str(dest))
    assert failed.exit_code == EXIT_FAILED, failed.output
    assert "tuneq: model/model.safetensors is not the file the server lists" in failed.stderr
    assert not dest.exists()
    assert not (tmp_path / ".exported.partial" / "model.safetensors").exists()  # deleted, to be fetched anew


def test_download_a_deepspeed_checkpoint_by_step(served_api: ServedApi, tmp_path: Path) -> None:
    step4 = {"latest": b"global_step4", "global_step4/mp_rank_00_model_states.pt": b"state 4" * 1000}
    expected = served_api.publish("deepspeed", 4, "checkpoints/step-00000004", step4)
    served_api.publish("deepspeed", 8, "checkpoints/step-00000008", {"latest": b"global_step8"})
    served_api.publish("model", 8, "model", MODEL_FILES)
    by_step = invoke(served_api.url, "download", served_api.job_id, "--step", "4", "--output", str(tmp_path / "ds4"))
    assert by_step.exit_code == 0, by_step.output
    assert "downloaded the deepspeed checkpoint at step 4" in by_step.stdout
    assert tree(tmp_path / "ds4") == expected
    alias = invoke(
        served_api.url, "download", served_api.job_id, str(tmp_path / "ds8"), "--checkpoint", "8", "--kind", "deepspeed"
    )
    assert alias.exit_code == 0, alias.output
    assert (tmp_path / "ds8" / "latest").read_bytes() == b"global_step8"
    missing = invoke(served_api.url, "download", served_api.job_id, "--step", "5", "--output", str(tmp_path / "ds5"))
    assert missing.exit_code == EXIT_FAILED and "no checkpoint at step 5" in missing.stderr


def test_the_progress_bar_on_a_terminal(served_api: ServedApi, tmp_path: Path) -> None:
    from rich.console import Console

    expected = served_api.publish("model", 8, "model", MODEL_FILES)
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with TuneqClient(ClientSettings(url=served_api.url)) as client:
        checkpoint = pick_checkpoint(client.checkpoints(served_api.job_id), step=None, kind=None)
        plan = plan_download(client, served_api.job_id, checkpoint, tmp_path / "exported")
        result = download_with_progress(client, plan, console=console)
    total = sum(len(data) for data in expected.values())
    assert (result.files, result.bytes, result.received_bytes, result.resumed_bytes) == (3, total, total, 0)
    assert f"{total / 1e6:.1f}/{total / 1e6:.1f} MB" in out.getvalue()


def test_a_redirect_sends_no_api_key_to_the_other_host(tmp_path: Path) -> None:
    """A 307 to a presigned URL elsewhere: followed, with the Range but without the API key."""
    data = b"0123456789" * 100
    api, store = FakeApi(), FakeApi(host="127.0.0.2")  # another origin (all of 127/8 is loopback)

    def presigned(h: Handler) -> None:
        first = int(h.headers["Range"].removeprefix("bytes=").rstrip("-"))
        h.send_response(206)
        h.send_header("Content-Length", str(len(data) - first))
        h.send_header("Content-Range", f"bytes {first}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        h.wfile.write(data[first:])

    def redirect(h: Handler) -> None:
        h.send_response(307)
        h.send_header("Location", f"{store.url}/bucket/key?X-Amz-Signature=abc")
        h.send_header("Content-Length", "0")
        h.end_headers()

    api.route("GET", f"/jobs/{JOB_ID}/artifacts/model/model.safetensors", redirect)
    store.route("GET", "/bucket/key", presigned)
    for fake in (api, store):
        fake.thread.start()
    try:
        target = tmp_path / "model.safetensors"
        target.write_bytes(data[:300])
        file = RemoteFile("model/model.safetensors", "model.safetensors", len(data), hashlib.sha256(data).hexdigest())
        with client_for(api, api_key="secret-key") as client:
            fetched = fetch_file(client, JOB_ID, file, target)
    finally:
        for fake in (api, store):
            fake.server.shutdown()
            fake.server.server_close()
    assert target.read_bytes() == data and (fetched.received, fetched.resumed) == (700, 300)
    (asked,) = api.requests
    (signed,) = store.requests
    assert asked["headers"]["Authorization"] == "Bearer secret-key"
    assert "Authorization" not in signed["headers"] and signed["headers"]["Range"] == "bytes=300-"


def test_a_dropped_download_keeps_what_arrived(api: FakeApi, tmp_path: Path) -> None:
    data = b"x" * 5000

    def cut_off(h: Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data[:2000])
        h.wfile.flush()
        h.close_connection = True

    api.route("GET", f"/jobs/{JOB_ID}/artifacts/model/model.safetensors", cut_off)
    target = tmp_path / "model.safetensors"
    file = RemoteFile("model/model.safetensors", "model.safetensors", len(data), hashlib.sha256(data).hexdigest())
    with client_for(api) as client, pytest.raises(ServerUnreachable):
        fetch_file(client, JOB_ID, file, target)
    assert target.read_bytes() == data[:2000]  # for the next try to continue


# ---- the commands -----------------------------------------------------------------------------
