from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from sqlmodel import Session

from cli.samples import seed_config
from shared.artifacts.store import ArtifactIntegrityError, ArtifactStore, job_key
from shared.db.engine import get_engine
from shared.db.models import CheckpointKind, Job, JobMetric, utcnow
from shared.jobs.hardware import Hardware, hardware_problems
from shared.jobs.run_layout import RunLayout
from shared.jobs.status import JobStatus
from shared.settings import Settings, get_settings
from worker.disk_space import full_disk_failure
from worker.launcher import (
    Launcher,
    NodePlacement,
    deepspeed_arch_list,
    launch_command,
    launch_environment,
    rank_environment,
)
from worker.runner import failure_from_ranks, host_failure, killed_rank, run_job, stalled_rank


def test_hardware_problems() -> None:
    cpu = Hardware("cpu", 2)
    gpu = Hardware("cuda", 4)
    (fp16,) = hardware_problems(num_gpus=1, deepspeed_config=seed_config(fp16=True), hardware=cpu)
    assert fp16.loc == ("deepspeed_config", "fp16", "enabled") and "fp16 needs a CUDA GPU" in fp16.message
    assert hardware_problems(num_gpus=1, deepspeed_config=seed_config(fp16=True), hardware=gpu) == []
    (too_many,) = hardware_problems(num_gpus=8, deepspeed_config={}, hardware=gpu, whose="this worker")
    assert too_many.loc == ("num_gpus",)
    assert "num_gpus is 8 but this worker has 4 GPUs" in too_many.message and "at most 4" in too_many.message
    assert hardware_problems(num_gpus=2, deepspeed_config=seed_config(fp16=False), hardware=cpu) == []
    assert hardware_problems(num_gpus=64, deepspeed_config=seed_config(fp16=True), hardware=None) == []  # unknown
    most = Hardware.most_of([cpu, gpu, Hardware("cpu", 16)])
    assert most is not None and (most.accelerator, most.device_count, most.sizes) == ("cuda", 16, (2, 4, 16))
    assert [w.device_count for w in most.able_to_run(4)] == [4, 16]  # the workers a 4-rank job may land on
    # A multi-node job needs num_nodes workers of its size; unknown sizes leave it to the workers.
    offered = Hardware.most_of([cpu, cpu, gpu])
    (nodes,) = hardware_problems(num_gpus=2, deepspeed_config={}, hardware=offered, num_nodes=4)
    assert nodes.loc == ("num_nodes",) and "3 live worker(s)" in nodes.message and "at most 3 nodes" in nodes.message
    assert hardware_problems(num_gpus=2, deepspeed_config={}, hardware=offered, num_nodes=3) == []
    assert hardware_problems(num_gpus=4, deepspeed_config={}, hardware=Hardware("cuda", 4), num_nodes=2) == []
    assert Hardware.most_of([]) is None


def test_fp16_job_on_a_cpu_worker_fails_at_once_with_a_plain_message(database_url: str) -> None:
    with Session(get_engine(), expire_on_commit=False) as session:
        job = Job(model="a/b", dataset="/d", deepspeed_config=seed_config(fp16=True), num_gpus=1, training={})
        session.add(job)
        session.commit()
    # A cold launcher: the job fails before any rank would start.
    cold = Launcher(hardware=Hardware("cpu", 2), settings=get_settings().model_copy(update={"launcher": "deepspeed"}))
    run_job(job.id, settings=get_settings(), launcher=cold, worker_id="w", stopping=threading.Event())
    with Session(get_engine()) as session:
        done = session.get(Job, job.id)
    assert done is not None and done.status == JobStatus.failed
    assert done.error_code == "unsupported_hardware" and "fp16 needs a CUDA GPU" in (done.error_message or "")


def test_a_stop_noted_before_the_attempt_handles_sigterm_releases_the_job_unrun(database_url: str) -> None:
    """A SIGTERM that reached the pool process while it claimed the job (worker/tasks.py only
    notes it there) stops the attempt as one during the run would: the job is requeued, nothing
    is started, the process exits."""
    with Session(get_engine(), expire_on_commit=False) as session:
        job = Job(model="a/b", dataset="/d", deepspeed_config=seed_config(fp16=False), num_gpus=1, training={})
        session.add(job)
        session.commit()
    cold = Launcher(hardware=Hardware("cpu", 2), settings=get_settings().model_copy(update={"launcher": "deepspeed"}))
    stopping = threading.Event()
    stopping.set()
    with pytest.raises(SystemExit) as exited:
        run_job(job.id, settings=get_settings(), launcher=cold, worker_id="w", stopping=stopping)
    assert exited.value.code == 0
    with Session(get_engine()) as session:
        released = session.get(Job, job.id)
    assert released is not None and released.status == JobStatus.queued and released.attempts == 1
    assert not RunLayout.for_job(get_settings(), job.id).spec.exists()  # no rank was started


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


WARM_EXITS = (
    "step 3\n"
    "tuneq warm start: rank 1 (pid 4242) exited with status -9\n"
    "tuneq warm start: rank 0 (pid 4241) exited with status -15\n"
)
LAUNCHER_EXIT = (
    "[launch.py:259:sigkill_handler] ['/venv/bin/python', '-u', '-m', 'worker.rank.train', '--local_rank=1', "
    "'--spec', '/runs/x/spec.json'] exits with return code = -9\n"
)


@pytest.mark.parametrize("log", [WARM_EXITS, LAUNCHER_EXIT], ids=["warm-start", "deepspeed-launcher"])
def test_a_rank_the_kernel_killed_is_a_host_failure_naming_the_signal(tmp_path: Path, log: str) -> None:
    killed = killed_rank(log)
    assert killed is not None and killed.rank == 1 and killed.signal.name == "SIGKILL"
    reason = host_failure(killed=killed, full_disk=None) or ""
    assert "rank 1 was killed by SIGKILL (signal 9)" in reason and "ran out of memory" in reason
    # The other ranks' errors (a peer closed the connection) do not hide it either way.
    layout = RunLayout(tmp_path)
    layout.log.write_text(log)
    code, message = failure_from_ranks(layout, killed=killed)
    assert code == "training_error" and message.startswith("rank 1 was killed by SIGKILL")


def test_other_rank_exits_are_not_host_failures() -> None:
    segfault = killed_rank("tuneq warm start: rank 0 (pid 7) exited with status -11\n")
    assert segfault is not None and segfault.describe() == "rank 0 was killed by SIGSEGV (signal 11)"
    # A crash in the job's code or a library is the job's failure.
    assert host_failure(killed=segfault, full_disk=None) is None
    stopped_after_a_failure = "rank 0 (pid 7) exited with status 1\nrank 1 (pid 8) exited with status -9\n"
    assert killed_rank(stopped_after_a_failure, killed_by_tuneq=frozenset({8})) is None  # tuneq's own SIGKILL
    # A rank the kernel killed is the cause even when its peer, failing on the broken
    # connection, was reaped first.
    reaped_first = killed_rank(stopped_after_a_failure)
    assert reaped_first is not None and reaped_first.rank == 1 and reaped_first.signal.name == "SIGKILL"
    assert killed_rank("rank 0 (pid 7) exited with status 0\n") is None


def test_launch_command_is_deepspeeds_launcher(tmp_path: Path) -> None:
    cmd = launch_command(spec_path=tmp_path / "spec.json", num_ranks=2, master_port=29511)
    assert cmd[1:3] == ["-m", "deepspeed.launcher.runner"]
    assert cmd[3:] == [
        "--num_gpus",
        "2",
        "--master_port",
        "29511",
        "--module",
        "worker.rank.train",
        "--spec",
        str(tmp_path / "spec.json"),
    ]


def test_a_node_of_a_gang_runs_deepspeeds_multi_node_mode_without_ssh(tmp_path: Path) -> None:
    placement = NodePlacement(node_rank=1, num_nodes=3, master_addr="10.0.0.5", master_port=29600)
    cmd = launch_command(spec_path=tmp_path / "spec.json", num_ranks=4, master_port=29600, placement=placement)
    assert cmd[3:12] == [
        "--no_ssh",
        "--node_rank",
        "1",
        "--hostfile",
        str(tmp_path / "hostfile"),
        "--master_addr",
        "10.0.0.5",
        "--master_port",
        "29600",
    ]
    # The same hostfile on every node: the names only order the nodes.
    assert (tmp_path / "hostfile").read_text() == "node-0 slots=4\nnode-1 slots=4\nnode-2 slots=4\n"
    env = launch_environment({}, local_rank=2, num_ranks=4, placement=placement, master_port=29600)
    assert env == {
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29600",
        "WORLD_SIZE": "12",
        "CROSS_RANK": "1",
        "CROSS_SIZE": "3",
        "LOCAL_SIZE": "4",
        "RANK": "6",
        "LOCAL_RANK": "2",
    }


def test_rank_environment_sets_the_cpu_accelerator_only_without_gpus(monkeypatch: object) -> None:
    cpu_env = rank_environment(Hardware("cpu", 4), num_ranks=2, worker_pid=123)
    assert cpu_env["DS_ACCELERATOR"] == "cpu" and cpu_env["TUNEQ_WORKER_PID"] == "123"
    gpu_env = rank_environment(Hardware("cuda", 4), num_ranks=2, worker_pid=123)
    assert gpu_env.get("DS_ACCELERATOR") == __import__("os").environ.get("DS_ACCELERATOR")


def test_rank_environment_gives_deepspeed_an_arch_list_it_can_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    # GPU images set arch-specific targets ("9.0a", "10.0f") that DeepSpeed's op builder cannot read.
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 9.0a;10.0f+PTX; 12.0+PTX")
    env = rank_environment(Hardware("cuda", 1), num_ranks=1, worker_pid=1)
    assert env["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0;10.0+PTX;12.0+PTX"
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert "TORCH_CUDA_ARCH_LIST" not in rank_environment(Hardware("cuda", 1), num_ranks=1, worker_pid=1)


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


def committed_checkpoint(session: Session, store: ArtifactStore, layout: RunLayout, job: Job, step: int) -> None:
    """A checkpoint the ranks saved at ``step``, published to ``store`` and committed."""
    from shared.db.artifacts import commit_checkpoint
    from shared.jobs.run_layout import CheckpointManifest

    directory = saved_checkpoint(layout, step)
    path_in_job = f"checkpoints/{directory.name}"
    files = [
        (f"{path_in_job}/{name}", store.put_file(directory / name, job_key(job.id, f"{path_in_job}/{name}")))
        for name in ("shard.pt", CheckpointManifest.FILENAME)
    ]
    commit_checkpoint(
        session,
        job_id=job.id,
        kind=CheckpointKind.deepspeed,
        step=step,
        uri=store.uri_of(job_key(job.id, path_in_job)),
        files=files,
        created_at=utcnow(),
    )


def saved_checkpoint(layout: RunLayout, step: int) -> Path:
    from shared.jobs.run_layout import CheckpointManifest

    directory = layout.checkpoints_dir / layout.checkpoint_tag(step)
    directory.mkdir(parents=True)
    (directory / "shard.pt").write_bytes(bytes([step]) * step)
    CheckpointManifest.describe(
        directory, step=step, tag=directory.name, kind="deepspeed", world_size=1, created_at="t"
    ).write(directory)
    return directory


def test_a_resume_takes_the_newest_committed_checkpoint_from_the_store_checked(
    database_url: str, tmp_path: Path
) -> None:
    """Not the newest on this disk: step 30 was saved but never published (the worker died),
    and the new worker's disk lacks step 20 (another host), which comes from the store."""
    from worker.runner import take_over

    store = ArtifactStore(str(tmp_path / "store"))
    with Session(get_engine(), expire_on_commit=False) as session:
        job = Job(model="a/b", dataset="/d", deepspeed_config={}, num_gpus=1, training={}, attempts=2)
        session.add(job)
        session.commit()
        old_host = RunLayout(tmp_path / "old-host" / str(job.id))
        for step in (10, 20):
            committed_checkpoint(session, store, old_host, job, step)
        session.commit()
    new_host = RunLayout(tmp_path / "new-host" / str(job.id))
    saved_checkpoint(new_host, 30)

    resume = take_over(job, new_host, store)
    assert resume is not None and (resume.step, resume.tag) == (20, "step-00000020")
    assert (new_host.checkpoints_dir / "step-00000020" / "shard.pt").read_bytes() == bytes([20]) * 20
    assert not (new_host.checkpoints_dir / "step-00000030").exists()  # trained again, never mixed in

    # A file changed in the store (or in the local copy) never reaches a rank.
    tampered = store.local_path(job_key(job.id, "checkpoints/step-00000020/shard.pt"))
    assert tampered is not None
    tampered.write_bytes(b"pickle that runs code")
    (new_host.checkpoints_dir / "step-00000020" / "shard.pt").unlink()
    with pytest.raises(ArtifactIntegrityError, match="not the file that was published"):
        take_over(job, new_host, store)


def test_retention_keeps_the_newest_and_the_best_evaluated_checkpoint(database_url: str, tmp_path: Path) -> None:
    from shared.db.artifacts import checkpoints_past_retention

    store = ArtifactStore(str(tmp_path / "store"))
    with Session(get_engine(), expire_on_commit=False) as session:
        job = Job(model="a/b", dataset="/d", deepspeed_config={}, num_gpus=1, training={})
        session.add(job)
        session.commit()
        layout = RunLayout(tmp_path / str(job.id))
        for step in (10, 20, 30, 40, 50):
            committed_checkpoint(session, store, layout, job, step)
        for step, eval_loss in ((10, 2.0), (20, 1.1), (25, 0.5), (30, 1.4), (50, 1.2)):  # 25: no checkpoint
            session.add(JobMetric(job_id=job.id, step=step, loss=1.0, eval_loss=eval_loss, time=utcnow()))
        session.commit()
        expired = checkpoints_past_retention(session=session, job_id=job.id, keep=2)
        assert sorted(c.step for c in expired) == [10, 30]  # kept: 40 and 50 (newest), 20 (best eval_loss)


def test_the_spec_runs_the_sanitised_config_under_the_run_directory(database_url: str) -> None:
    from shared.db.lifecycle import claim_job
    from worker.runner import prepare_attempt

    config = {**seed_config(fp16=False), "tensorboard": {"enabled": True, "output_path": "/etc/evil"}}
    with Session(get_engine(), expire_on_commit=False) as session:
        job = Job(model="a/b", dataset="/d", deepspeed_config=config, num_gpus=1, training={})
        session.add(job)
        session.commit()
        claimed = claim_job(session=session, job_id=job.id, worker_id="w", lease_ttl=60)
    assert claimed is not None
    from shared.deepspeed.safety import sanitize_deepspeed_config

    layout = RunLayout.for_job(get_settings(), job.id)
    sanitized, unsafe = sanitize_deepspeed_config(config, run_dir=str(layout.root))
    assert unsafe == []
    attempt = prepare_attempt(
        claimed,
        deepspeed_config=sanitized,
        datasets={"dataset": claimed.dataset, "validation_dataset": None},
        settings=get_settings().model_copy(update={"max_line_bytes": 12345}),
        worker_id="w",
    )
    spec = json.loads(layout.spec.read_text())
    written = spec["deepspeed_config"]
    assert written["tensorboard"]["output_path"].startswith(str(layout.root))
    assert spec["max_line_bytes"] == 12345  # the worker's TUNEQ_MAX_LINE_BYTES, for the ranks' reads
    assert attempt.spec.resume_from is None and attempt.number == 1


# How ranks that ran out of disk were seen to fail: torch.save's zip writer, DeepSpeed's C++
# streams, and the peer of the rank that hit the disk first (that rank died without a word: its
# error file and its log lines are writes too).
TORCH_SAVE = "RuntimeError: [enforce fail at inline_container.cc:664] . unexpected pos 3200 vs 3094"
IOSTREAM = "RuntimeError: basic_ios::clear: iostream error"
GLOO_PEER = (
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:41"
)


def disk_settings(tmp_path: Path, *, min_free_mb: int) -> Settings:
    return Settings(home=tmp_path, min_free_disk_mb=min_free_mb)


@pytest.mark.parametrize(
    ("error", "unfinished_save"),
    [(TORCH_SAVE, False), (IOSTREAM, False), (GLOO_PEER, True)],
    ids=["torch-save", "iostream", "gloo-peer"],
)
def test_ranks_that_ran_out_of_disk_are_a_host_failure_naming_the_disk(
    tmp_path: Path, error: str, unfinished_save: bool
) -> None:
    full = disk_settings(tmp_path, min_free_mb=10**9)  # more than any disk has: it is "full"
    reason = host_failure(
        killed=None, full_disk=full_disk_failure(full, evidence=[error], unfinished_save=unfinished_save)
    )
    assert (
        reason is not None
        and "disk filled up" in reason
        and "TUNEQ_MIN_FREE_DISK_MB" in reason
        and str(tmp_path) in reason
    )
    # The same words on a disk with room are the job's own failure.
    roomy = disk_settings(tmp_path, min_free_mb=0)
    assert full_disk_failure(roomy, evidence=[error], unfinished_save=unfinished_save) is None


def test_the_oss_word_for_a_full_disk_anywhere_is_a_host_failure(tmp_path: Path) -> None:
    log = "step 40\nOSError: [Errno 28] No space left on device: '/runs/x/checkpoints/step-00000040/mp_rank_00.pt'\n"
    roomy = disk_settings(tmp_path, min_free_mb=0)  # freed again since, by the half-written save's removal
    assert "No space left on device" in (
        full_disk_failure(roomy, evidence=[GLOO_PEER, log], unfinished_save=False) or ""
    )


def test_a_failure_that_wrote_nothing_is_the_jobs_even_on_a_full_disk(tmp_path: Path) -> None:
    full = disk_settings(tmp_path, min_free_mb=10**9)
    assert full_disk_failure(full, evidence=["ValueError: bad config"], unfinished_save=False) is None


def test_the_disk_check_follows_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.disk_space import disk_problem

    monkeypatch.setenv("TUNEQ_HOME", str(tmp_path))
    monkeypatch.setenv("TUNEQ_MIN_FREE_DISK_MB", str(10**12))  # more than any disk has
    get_settings.cache_clear()
    problem = disk_problem(get_settings()) or ""
    assert str(tmp_path) in problem and "TUNEQ_MIN_FREE_DISK_MB" in problem
    monkeypatch.setenv("TUNEQ_MIN_FREE_DISK_MB", "0")
    get_settings.cache_clear()
    assert disk_problem(get_settings()) is None
    get_settings.cache_clear()


class UnreachableStore(ArtifactStore):
    """A local store whose reads fail ``failures`` times (then work), as a store restarting."""

    def __init__(self, root: Path, *, failures: int) -> None:
        super().__init__(str(root))
        self.failures = failures

    def get_file(self, key: str, target: Path, *, sha256: str) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("connection refused")
        super().get_file(key, target, sha256=sha256)


def test_a_resume_waits_out_a_store_outage_up_to_the_deadline(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.artifacts.store import ArtifactStoreError, StoreOutage
    from worker.checkpoint_fetch import fetch_checkpoint

    monkeypatch.setattr(StoreOutage, "FIRST_SECONDS", 0.05)
    with Session(get_engine(), expire_on_commit=False) as session:
        job = Job(model="a/b", dataset="/d", deepspeed_config={}, num_gpus=1, training={})
        session.add(job)
        session.commit()
        committed_checkpoint(session, ArtifactStore(str(tmp_path / "store")), RunLayout(tmp_path / "old"), job, 10)
        session.commit()
    kept_alive: list[bool] = []

    back_soon = UnreachableStore(tmp_path / "store", failures=2)
    layout = RunLayout(tmp_path / "new" / str(job.id))
    directory = fetch_checkpoint(
        store=back_soon,
        job_id=job.id,
        layout=layout,
        step=10,
        keep_alive=lambda: kept_alive.append(True),
        deadline_seconds=30,
    )
    assert (directory / "shard.pt").read_bytes() == bytes([10]) * 10
    assert kept_alive == [True, True]  # the lease was renewed while waiting

    gone = UnreachableStore(tmp_path / "store", failures=1000)
    with pytest.raises(ArtifactStoreError, match=r"stayed unreachable for more than 0s.*connection refused"):
        fetch_checkpoint(store=gone, job_id=job.id, layout=RunLayout(tmp_path / "third" / str(job.id)), step=10)


def test_a_rank_whose_heartbeat_stopped_is_stalled_and_one_still_starting_is_not(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    launched = time.time() - 100
    assert stalled_rank(layout, range(0, 2), since=launched, limit=30) is None  # none started yet
    for rank in (0, 1):
        layout.heartbeat(rank).parent.mkdir(parents=True, exist_ok=True)
        layout.heartbeat(rank).touch()
    assert stalled_rank(layout, range(0, 2), since=launched, limit=30) is None
    old = time.time() - 40
    os.utime(layout.heartbeat(1), (old, old))
    problem = stalled_rank(layout, range(0, 2), since=launched, limit=30)
    assert problem is not None and problem.startswith("rank 1 showed no sign of life for 4")
    # A heartbeat left by an earlier launch says nothing about this one.
    assert stalled_rank(layout, range(0, 2), since=time.time() - 10, limit=30) is None


def test_node_0_marks_a_gang_succeeded_once_every_node_has_published_its_share(
    database_url: str, tmp_path: Path
) -> None:
    """A gang's last checkpoint is complete only with every node's shards in the store: node 0's
    worker waits for the other nodes to finish (their uploads done) before the job succeeds,
    so a client that sees it succeed can resume_from its last step at once."""
    import threading

    from shared.db.gangs import finish_node
    from shared.jobs.spec import TrainingOptions, TrainingSpec
    from tests.shared.db.test_gangs import new_job, start_placed_gang, status, workers
    from worker.ingest import EventIngestor
    from worker.publisher import ArtifactPublisher
    from worker.runner import Attempt, DatabaseOutage, Ending, LeaseKeeper, _record_outcome

    settings = get_settings()
    workers("w1", "w2")
    job = new_job(num_nodes=2)
    nodes = {node.node_rank: node for node in start_placed_gang(job)}
    layout = RunLayout(tmp_path / "host-0" / str(job.id))
    store = ArtifactStore(str(tmp_path / "store"))
    spec = TrainingSpec(
        job_id=job.id,
        model="a/b",
        dataset="/d",
        deepspeed_config={},
        num_gpus=1,
        training=TrainingOptions(),
        run_dir=str(layout.root),
        cache_dir=str(tmp_path / "cache"),
    )
    placement = NodePlacement(node_rank=0, num_nodes=2, master_addr="10.0.0.2", master_port=29500)
    attempt = Attempt(
        job_id=job.id,
        number=1,
        worker_id=nodes[0].worker_id,
        spec=spec,
        layout=layout,
        max_duration_seconds=None,
        log_offset=0,
        store=store,
        placement=placement,
    )
    lease = LeaseKeeper(job_id=job.id, worker_id=nodes[0].worker_id, attempt=1, settings=settings, node_rank=0)
    publisher = ArtifactPublisher(
        job_id=job.id, layout=layout, store=store, deadline_seconds=5, keep_checkpoints=None, node=attempt.node
    )
    ingestor = EventIngestor(events_path=layout.events(1), log_path=None, job_id=job.id)
    recording = threading.Thread(
        target=_record_outcome,
        args=(attempt, ingestor, publisher, Ending(JobStatus.succeeded, None, None)),
        kwargs={"outage": DatabaseOutage(job_id=job.id, lease=lease), "lease": lease, "settings": settings},
    )
    recording.start()
    try:
        time.sleep(2.0)  # several of node 0's polls: node 1 is still uploading its share
        assert status(job) == JobStatus.running
    finally:
        with Session(get_engine()) as session:
            finish_node(session=session, job_id=job.id, attempt=1, node_rank=1, worker_id=nodes[1].worker_id)
        recording.join(timeout=30)
    assert not recording.is_alive() and status(job) == JobStatus.succeeded
