"""The training recipe for real, on one CPU rank: per-step metrics, gradient accumulation,
checkpoints and the export, a pause, and a resume that continues where the checkpoint left off.

The runs happen in a spawned child, not in pytest's process: DeepSpeed's process group lives
as long as the process does, the recipe installs a SIGTERM handler (StopRequested), and the
rank's environment (RANK, MASTER_PORT, DS_ACCELERATOR...) must be set before DeepSpeed is
imported. One child runs every run of the test, so torch and DeepSpeed are imported once.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from shared.jobs.events import CheckpointEvent, MetricEvent, PlanEvent, UploadWaitEvent, training_event_adapter
from shared.jobs.hardware import Hardware
from shared.jobs.run_layout import CheckpointManifest, RunLayout
from shared.jobs.spec import ResumePoint, TrainingOptions, TrainingSpec
from shared.ports import free_port
from shared.settings import Settings
from tests.worker.conftest import LockedOps
from worker import launcher
from worker.shm_buffers import remove_job_buffers

# Real DeepSpeed engines in a spawned child, half a minute a test: started with the end-to-end
# tests (tests/conftest.py's order), not last, where they were the suite's tail.
pytestmark = pytest.mark.slow

# Every "auto" the ranks fill: batch sizes, learning rate and, once the data is batched,
# the scheduler's total and warmup steps. fp32 (no fp16/bf16 section), so losses repeat exactly.
DEEPSPEED_CONFIG: dict[str, Any] = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "optimizer": {"type": "Adam", "params": {"lr": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
}
# 64 records, one per row: 64 // (4 x 2) = 8 optimizer steps an epoch, 16 in all.
TRAINING = TrainingOptions(
    epochs=2,
    packing=False,
    micro_batch_size=4,
    gradient_accumulation_steps=2,
    checkpoint_every_steps=4,
    learning_rate=1e-3,
    warmup_steps=2,
    seed=7,
)


def publish_when_waited_for(layout: RunLayout, attempt: int, done: threading.Event) -> None:
    """Stands in for the worker's publisher: marks a checkpoint published only once rank 0
    has said it waits for it, so every save after the first provably waits for the one before."""
    while not done.is_set():
        events = layout.events(attempt)
        for line in events.read_text().splitlines() if events.exists() else []:
            event = training_event_adapter.validate_json(line)
            if isinstance(event, UploadWaitEvent):
                marker = layout.published_marker(layout.checkpoint_tag(event.waiting_for))
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
        time.sleep(0.05)


def train_in_child(specs: list[str], environment: dict[str, str]) -> None:
    """In the spawned child: become rank 0 of 1, then run each spec as worker.rank.train does."""
    os.environ.update(environment)
    from worker.deepspeed_ops import remember_cpu_info
    from worker.rank.train import run

    remember_cpu_info()  # as worker.rank.train.main does: py-cpuinfo asked once per host, not per op

    for text in specs:
        spec = TrainingSpec.model_validate_json(text)
        layout, done = RunLayout(Path(spec.run_dir)), threading.Event()
        publisher = threading.Thread(target=publish_when_waited_for, args=(layout, spec.attempt, done), daemon=True)
        publisher.start()
        run(spec, layout)
        done.set()
        publisher.join()


def train(specs: list[TrainingSpec], settings_env: dict[str, str] | None = None) -> None:
    port = free_port()
    env = launcher.rank_environment(Hardware("cpu", 1), num_ranks=1, worker_pid=0) | (settings_env or {})
    env = launcher.launch_environment(
        env, local_rank=0, num_ranks=1, placement=launcher.NodePlacement(), master_port=port
    )
    child = multiprocessing.get_context("spawn").Process(
        target=train_in_child, args=([s.model_dump_json() for s in specs], env)
    )
    child.start()
    child.join(timeout=600)
    try:
        assert child.exitcode == 0, f"the recipe's process exited with {child.exitcode}"
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        remove_job_buffers(port)


def events_of(spec: TrainingSpec) -> list[Any]:
    lines = RunLayout(Path(spec.run_dir)).events(spec.attempt).read_text().splitlines()
    return [training_event_adapter.validate_json(line) for line in lines]


def losses_of(events: list[Any]) -> dict[int, float | None]:
    return {e.step: e.loss for e in events if isinstance(e, MetricEvent)}


def test_a_run_reports_every_step_and_a_resume_continues_it(
    tuneq_home: Path, tiny_model: Path, text_dataset: Path, ops_left_locked: LockedOps
) -> None:
    def spec(name: str, resume_from: ResumePoint | None = None, **training: Any) -> TrainingSpec:
        run_dir = tuneq_home / "runs" / name
        run_dir.mkdir(parents=True)  # as the worker makes it before starting the ranks
        return TrainingSpec(
            job_id=uuid.uuid4(),
            resume_from=resume_from,
            model=str(tiny_model),
            dataset=str(text_dataset),
            deepspeed_config=DEEPSPEED_CONFIG,
            num_gpus=1,
            training=TRAINING.model_copy(update=training),
            run_dir=str(run_dir),
            cache_dir=str(tuneq_home / "cache"),
        )

    full = spec("full")
    checkpoints = RunLayout(Path(full.run_dir)).checkpoints_dir

    def resumed(name: str, step: int) -> TrainingSpec:
        tag = f"step-{step:08d}"
        return spec(name, ResumePoint(checkpoints_dir=str(checkpoints), tag=tag, step=step))

    # From step 4: halfway through the first epoch. From step 8: its end (the next epoch's start).
    mid_epoch, epoch_end = resumed("mid-epoch", 4), resumed("epoch-end", 8)
    # Reports every third step: the checkpoint at step 4 falls between two.
    sparse = spec("sparse-reports", log_every_steps=3)
    # The worker asked for a pause before the run started: the ranks pause after step 1, between
    # two reports and two checkpoints; the next attempt continues from there.
    paused = spec("paused", log_every_steps=2)
    paused_layout = RunLayout(Path(paused.run_dir))
    paused_layout.pause_request(paused.attempt).parent.mkdir(parents=True)
    paused_layout.pause_request(paused.attempt).touch()
    after_pause = spec(
        "after-pause",
        ResumePoint(checkpoints_dir=str(paused_layout.checkpoints_dir), tag="step-00000001", step=1),
    )
    # GPT-Neo through tuneq's sdpa attention (auto keeps eager on a CPU): the same training.
    sdpa = spec("sdpa", attention="sdpa")
    # DeepSpeed's ops as a loader killed mid-load leaves them: the rank loads them all the same.
    train(
        [full, mid_epoch, epoch_end, sparse, paused, after_pause, sdpa],
        {"TORCH_EXTENSIONS_DIR": str(ops_left_locked.directory)},
    )
    assert not any(lock.exists() for lock in ops_left_locked.locks)

    events = events_of(full)
    plan = events[0]
    assert isinstance(plan, PlanEvent)
    assert plan.attention == "eager"
    assert (plan.steps_per_epoch, plan.total_steps) == (8, 16)  # optimizer steps, not micro-batches
    assert plan.deepspeed_config is not None
    assert plan.deepspeed_config["scheduler"]["params"]["total_num_steps"] == 16
    metrics = [e for e in events if isinstance(e, MetricEvent)]
    assert [m.step for m in metrics] == list(range(1, 17))
    assert all(m.loss is not None and m.loss > 0 for m in metrics)
    assert metrics[-1].loss < metrics[0].loss  # type: ignore[operator]
    assert metrics[-1].epoch == 2.0
    saved = [(e.kind, e.step) for e in events if isinstance(e, CheckpointEvent)]
    assert saved == [("deepspeed", 4), ("deepspeed", 8), ("deepspeed", 12), ("deepspeed", 16), ("model", 16)]
    # One upload at a time: each save waited until the checkpoint before it was published.
    waits = [(e.step, e.waiting_for) for e in events if isinstance(e, UploadWaitEvent)]
    assert waits == [(8, 4), (12, 8), (16, 12)]
    manifest = CheckpointManifest.read(checkpoints / "step-00000016")
    assert manifest is not None and manifest.step == 16
    model_dir = RunLayout(Path(full.run_dir)).model_dir
    assert CheckpointManifest.read(model_dir) is not None
    assert (model_dir / "model.safetensors").exists() and (model_dir / "config.json").exists()

    losses = losses_of(events)
    for run, first_step in ((mid_epoch, 5), (epoch_end, 9)):
        continued = events_of(run)
        assert losses_of(continued) == {step: losses[step] for step in range(first_step, 17)}
        last = [e for e in continued if isinstance(e, MetricEvent)][-1]
        assert (last.tokens_seen, last.epoch) == (metrics[-1].tokens_seen, 2.0)

    # A pause reports the step it stops after and saves its checkpoint, whatever the periods
    # say, exports nothing, and tells the worker; the resume continues with the next step.
    paused_events = events_of(paused)
    assert losses_of(paused_events) == {1: losses[1]}
    assert [(e.kind, e.step) for e in paused_events if isinstance(e, CheckpointEvent)] == [("deepspeed", 1)]
    assert paused_layout.paused_at(paused.attempt) == 1 and not paused_layout.model_dir.exists()
    continued = events_of(after_pause)
    assert losses_of(continued) == {step: losses[step] for step in range(2, 17)}
    assert [e for e in continued if isinstance(e, MetricEvent)][-1].tokens_seen == metrics[-1].tokens_seen
    assert RunLayout(Path(full.run_dir)).paused_at(full.attempt) is None  # it ran to the end

    sdpa_events = events_of(sdpa)
    assert isinstance(sdpa_events[0], PlanEvent) and sdpa_events[0].attention == "sdpa"
    sdpa_losses = losses_of(sdpa_events)
    assert sdpa_losses.keys() == losses.keys()
    assert all(abs(sdpa_losses[s] - loss) <= 1e-4 * loss for s, loss in losses.items() if loss is not None)

    # A checkpoint between two reports counts the tokens of the steps not reported yet.
    sparse_checkpoint = RunLayout(Path(sparse.run_dir)).checkpoints_dir / "step-00000004"
    state = torch.load(sparse_checkpoint / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    assert state["tokens_seen"] == metrics[3].tokens_seen > 0


def test_a_compiled_run_trains_as_the_eager_one_and_leaves_its_cache_with_the_worker(
    tuneq_home: Path, tiny_model: Path, text_dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """training.compile on, through DeepSpeed's engine.compile() (inductor, on this CPU): the
    same losses as eager, step by step, and the compiled code cached in the worker's cache
    directory, where the worker's settings put it for every rank."""

    def spec(name: str, compile: Literal["on", "off"]) -> TrainingSpec:
        run_dir = tuneq_home / "runs" / name
        run_dir.mkdir(parents=True)
        # Packed rows all have max_seq_length tokens: one shape, so inductor compiles once.
        update = {"max_steps": 3, "checkpoint_every_steps": None, "compile": compile, "packing": True}
        options = TRAINING.model_copy(update=update | {"max_seq_length": 32})
        return TrainingSpec(
            job_id=uuid.uuid4(),
            model=str(tiny_model),
            dataset=str(text_dataset),
            deepspeed_config=DEEPSPEED_CONFIG,
            num_gpus=1,
            training=options,
            run_dir=str(run_dir),
            cache_dir=str(tuneq_home / "cache"),
        )

    eager, compiled = spec("eager", "off"), spec("compiled", "on")
    # torch, once imported in this process, sets it to its default; a worker's own process never imports torch.
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    settings = Settings()
    train([eager, compiled], launcher.settings_environment(settings))

    plans = [events_of(run)[0] for run in (eager, compiled)]
    assert [(p.compiled, p.kernels) for p in plans] == [(False, []), (True, [])]  # no Liger kernels on a CPU
    eager_losses, compiled_losses = losses_of(events_of(eager)), losses_of(events_of(compiled))
    assert list(compiled_losses) == [1, 2, 3]
    for step, loss in eager_losses.items():
        assert compiled_losses[step] == pytest.approx(loss, rel=1e-4)
    inductor_cache = launcher.compile_cache_dirs(settings.cache_dir)["TORCHINDUCTOR_CACHE_DIR"]
    assert inductor_cache.is_relative_to(tuneq_home) and any(inductor_cache.rglob("*.py"))
