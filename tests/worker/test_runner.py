from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlmodel import Session

from shared.db import get_engine
from shared.models import Job, JobStatus
from shared.samples import seed_config
from shared.settings import get_settings
from shared.storage import RunLayout
from worker.launcher import HostHardware, deepspeed_arch_list, launch_command, rank_environment
from worker.runner import failure_from_ranks, hardware_problem, run_job


def test_hardware_problems() -> None:
    cpu = HostHardware("cpu", 2)
    gpu = HostHardware("cuda", 4)
    assert "fp16 needs a CUDA GPU" in (
        hardware_problem(num_gpus=1, deepspeed_config=seed_config(fp16=True), hardware=cpu) or ""
    )
    assert hardware_problem(num_gpus=1, deepspeed_config=seed_config(fp16=True), hardware=gpu) is None
    too_many = hardware_problem(num_gpus=8, deepspeed_config={}, hardware=gpu) or ""
    assert "num_gpus is 8" in too_many and "at most 4" in too_many
    assert hardware_problem(num_gpus=2, deepspeed_config=seed_config(fp16=False), hardware=cpu) is None


def test_fp16_job_on_a_cpu_worker_fails_at_once_with_a_plain_message(database_url: str) -> None:
    with Session(get_engine(), expire_on_commit=False) as session:
        job = Job(model="a/b", dataset="/d", deepspeed_config=seed_config(fp16=True), num_gpus=1, training={})
        session.add(job)
        session.commit()
    run_job(job.id, settings=get_settings(), hardware=HostHardware("cpu", 2), worker_id="w")
    with Session(get_engine()) as session:
        done = session.get(Job, job.id)
    assert done is not None and done.status == JobStatus.failed
    assert done.error_code == "unsupported_hardware" and "fp16 needs a CUDA GPU" in (done.error_message or "")


def test_failure_message_comes_from_the_first_failing_rank(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    layout.errors_dir.mkdir()
    for rank, when in ((1, "2026-01-01T00:00:02"), (0, "2026-01-01T00:00:01")):
        error = {"rank": rank, "code": "training_error", "message": f"boom {rank}", "time": when}
        (layout.errors_dir / f"rank-{rank}.json").write_text(json.dumps(error))
    assert failure_from_ranks(layout) == ("training_error", "boom 0")


def test_failure_message_falls_back_to_the_log(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    layout.log.write_text("starting\nRuntimeError: CUDA out of memory\nexiting\n")
    code, message = failure_from_ranks(layout)
    assert code == "training_error" and message.startswith("RuntimeError: CUDA out of memory")


def test_launch_command_is_deepspeeds_launcher(tmp_path: Path) -> None:
    cmd = launch_command(spec_path=tmp_path / "spec.json", num_ranks=2, master_port=29511)
    assert cmd[1:3] == ["-m", "deepspeed.launcher.runner"]
    assert cmd[3:] == [
        "--num_gpus",
        "2",
        "--master_port",
        "29511",
        "--module",
        "worker.train",
        "--spec",
        str(tmp_path / "spec.json"),
    ]


def test_rank_environment_sets_the_cpu_accelerator_only_without_gpus(monkeypatch: object) -> None:
    cpu_env = rank_environment(HostHardware("cpu", 4), num_ranks=2, worker_pid=123)
    assert cpu_env["DS_ACCELERATOR"] == "cpu" and cpu_env["TUNEQ_WORKER_PID"] == "123"
    gpu_env = rank_environment(HostHardware("cuda", 4), num_ranks=2, worker_pid=123)
    assert gpu_env.get("DS_ACCELERATOR") == __import__("os").environ.get("DS_ACCELERATOR")


def test_rank_environment_gives_deepspeed_an_arch_list_it_can_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    # GPU images set arch-specific targets ("9.0a", "10.0f") that DeepSpeed's op builder cannot read.
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 9.0a;10.0f+PTX; 12.0+PTX")
    env = rank_environment(HostHardware("cuda", 1), num_ranks=1, worker_pid=1)
    assert env["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0;10.0+PTX;12.0+PTX"
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert "TORCH_CUDA_ARCH_LIST" not in rank_environment(HostHardware("cuda", 1), num_ranks=1, worker_pid=1)


def test_the_arch_list_tuneq_passes_on_is_one_deepspeeds_op_builder_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    class Probe(CUDAOpBuilder):  # cross-compile mode: only TORCH_CUDA_ARCH_LIST is read
        def __init__(self) -> None:
            super().__init__(name="probe")

        def absolute_name(self) -> str:
            return "probe"

        def sources(self) -> list[str]:
            return []

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", deepspeed_arch_list("8.0;9.0a;10.0f+PTX"))
    args = Probe().compute_capability_args()
    assert "-gencode=arch=compute_90,code=sm_90" in args and "-gencode=arch=compute_100,code=compute_100" in args


def test_out_of_memory_failures_get_advice(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    layout.errors_dir.mkdir()
    error = {"rank": 0, "code": "training_error", "message": "OutOfMemoryError: CUDA out of memory.", "time": "t"}
    (layout.errors_dir / "rank-0.json").write_text(json.dumps(error))
    code, message = failure_from_ranks(layout)
    assert code == "training_error"
    assert "zero_optimization.stage 3" in message and "offload" in message and "micro_batch" in message


def test_resume_takes_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    from shared.storage import CheckpointManifest

    layout = RunLayout(tmp_path)
    for step, complete in ((10, True), (20, True), (30, False)):  # 30: killed during its save
        directory = layout.checkpoints_dir / layout.checkpoint_tag(step)
        directory.mkdir(parents=True)
        (directory / "shard.pt").write_bytes(b"x" * step)
        if complete:
            CheckpointManifest.describe(
                directory, step=step, tag=directory.name, kind="deepspeed", world_size=1, created_at="t"
            ).write(directory)
    newest = layout.newest_complete_checkpoint()
    assert newest is not None and newest.step == 20 and newest.tag == "step-00000020"
    assert RunLayout(tmp_path / "empty").newest_complete_checkpoint() is None


def test_the_spec_runs_the_sanitised_config_under_the_run_directory(database_url: str) -> None:
    from shared.lifecycle import claim_job
    from worker.runner import prepare_attempt

    config = {**seed_config(fp16=False), "tensorboard": {"enabled": True, "output_path": "/etc/evil"}}
    with Session(get_engine(), expire_on_commit=False) as session:
        job = Job(model="a/b", dataset="/d", deepspeed_config=config, num_gpus=1, training={})
        session.add(job)
        session.commit()
        claimed = claim_job(session=session, job_id=job.id, worker_id="w", lease_ttl=60)
    assert claimed is not None
    from shared.deepspeed_safety import sanitize_deepspeed_config

    layout = RunLayout.for_job(get_settings(), job.id)
    sanitized, unsafe = sanitize_deepspeed_config(config, run_dir=str(layout.root))
    assert unsafe == []
    attempt = prepare_attempt(
        claimed,
        deepspeed_config=sanitized,
        datasets={"dataset": claimed.dataset, "validation_dataset": None},
        settings=get_settings(),
        worker_id="w",
    )
    written = json.loads(layout.spec.read_text())["deepspeed_config"]
    assert written["tensorboard"]["output_path"].startswith(str(layout.root))
    assert attempt.spec.resume_from is None and attempt.number == 1
