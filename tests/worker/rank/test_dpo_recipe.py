"""DPO through the real recipe on one CPU rank (issue 42): the reference scored once before the
first step, TRL's measures every step, a held-out reward accuracy that rises, and the reference
never scored again: not on a resume (it comes from the checkpoint), not by a later job of the
same inputs (the host's cache), and for LoRA from the base with the adapter disabled.

The runs share one spawned child, as tests/worker/rank/test_recipe.py's do (its docstring says why).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from cli.samples import write_preference_dataset
from shared.jobs.events import CheckpointEvent, MetricEvent, PhaseEvent, PlanEvent
from shared.jobs.run_layout import RunLayout
from shared.jobs.spec import DpoOptions, LoraOptions, ResumePoint, TrainingOptions, TrainingSpec
from tests.worker.rank.test_recipe import DEEPSPEED_CONFIG, events_of, losses_of, train

pytestmark = pytest.mark.slow

# 80 pairs, a fifth held out: 64 train pairs, 64 // (4 x 2) = 8 steps an epoch.
TRAINING = TrainingOptions(
    method="dpo",
    dpo=DpoOptions(beta=0.5),
    epochs=2,
    micro_batch_size=4,
    gradient_accumulation_steps=2,
    checkpoint_every_steps=4,
    eval_every_steps=4,
    validation_split=0.2,
    learning_rate=1e-4,
    warmup_steps=2,
    seed=7,
)


def phases(events: list[Any]) -> list[PhaseEvent]:
    return [e for e in events if isinstance(e, PhaseEvent)]


def test_dpo_scores_the_reference_once_learns_the_preference_and_resumes_without_rescoring(
    tuneq_home: Path, tiny_model: Path
) -> None:
    dataset = write_preference_dataset(tuneq_home / "data" / "pairs.jsonl", records=80)

    def spec(name: str, resume_from: ResumePoint | None = None, **training: Any) -> TrainingSpec:
        run_dir = tuneq_home / "runs" / name
        run_dir.mkdir(parents=True)
        return TrainingSpec(
            job_id=uuid.uuid4(),
            resume_from=resume_from,
            model=str(tiny_model),
            dataset=str(dataset),
            deepspeed_config=DEEPSPEED_CONFIG,
            num_gpus=1,
            training=TRAINING.model_copy(update=training),
            run_dir=str(run_dir),
            cache_dir=str(tuneq_home / "cache"),
        )

    full = spec("full")
    checkpoints = RunLayout(Path(full.run_dir)).checkpoints_dir
    resumed = spec("resumed", ResumePoint(checkpoints_dir=str(checkpoints), tag="step-00000004", step=4))
    again = spec("again")  # a later job of the same inputs
    lora = spec("lora", lora=LoraOptions(r=8, alpha=16, dropout=0.0), learning_rate=5e-3)
    train([full, resumed, again, lora])

    events = events_of(full)
    plan = events[0]
    assert isinstance(plan, PlanEvent)
    assert (plan.num_samples, plan.steps_per_epoch, plan.total_steps) == (64, 8, 16)  # pairs, not sequences
    # Scored before the first step: started, then done, every pair of the file (train and held out).
    scored = phases(events)
    assert [(p.done, p.total, p.cached) for p in (scored[0], scored[-1])] == [(0, 80, False), (80, 80, False)]
    first_metric = next(i for i, e in enumerate(events) if isinstance(e, MetricEvent))
    assert events.index(scored[-1]) < first_metric

    metrics = [e for e in events if isinstance(e, MetricEvent)]
    assert [m.step for m in metrics] == list(range(1, 17))
    for m in metrics:
        assert None not in (m.loss, m.rewards_chosen, m.rewards_rejected, m.rewards_margins, m.logps_chosen)
        assert None not in (m.logps_rejected, m.logits_chosen, m.logits_rejected, m.rewards_accuracies)
    # Step 1 starts at the reference: every reward 0, no pair accurate, the loss log 2.
    assert metrics[0].rewards_accuracies == 0.0
    assert metrics[0].loss == pytest.approx(0.6931, abs=1e-3)
    assert metrics[0].rewards_chosen == pytest.approx(0.0, abs=1e-5)
    # The policy learns the preference: the margin grows, and on held-out pairs the reward accuracy ends high.
    assert metrics[-1].loss is not None and metrics[-1].loss < 0.3
    assert metrics[-1].rewards_margins is not None and metrics[-1].rewards_margins > 1.0
    evaluated = [m for m in metrics if m.eval_loss is not None]
    assert [m.step for m in evaluated] == [4, 8, 12, 16]
    assert evaluated[-1].eval_rewards_accuracies is not None and evaluated[-1].eval_rewards_accuracies > 0.9
    assert evaluated[-1].eval_loss < evaluated[0].eval_loss  # type: ignore[operator]

    # The checkpoints carry the scores; a resume reads them there and repeats the run exactly.
    state = torch.load(checkpoints / "step-00000004" / "mp_rank_00_model_states.pt", weights_only=False)
    assert state["reference_logps"]["files"] and state["reference_logps"]["key"]
    resumed_events = events_of(resumed)
    assert [(p.done, p.total, p.cached) for p in phases(resumed_events)] == [(80, 80, True)]
    losses = losses_of(events)
    continued = losses_of(resumed_events)
    assert list(continued) == list(range(5, 17))
    for step, loss in continued.items():
        assert loss == pytest.approx(losses[step], rel=1e-5)

    # A later job of the same model, data and settings finds the scores in the host's cache.
    assert [(p.done, p.total, p.cached) for p in phases(events_of(again))] == [(80, 80, True)]
    assert losses_of(events_of(again)) == pytest.approx(losses, rel=1e-5)

    # LoRA: the reference is the base with the adapter disabled (the same scores as the full
    # model's start, so the same cache entry), the adapters learn the preference too.
    lora_events = events_of(lora)
    assert [p.cached for p in phases(lora_events)] == [True]
    lora_metrics = [e for e in lora_events if isinstance(e, MetricEvent)]
    assert lora_metrics[0].loss == pytest.approx(0.6931, abs=1e-3)
    assert lora_metrics[-1].rewards_margins is not None and lora_metrics[-1].rewards_margins > 0
    assert ("adapter", 16) in [(e.kind, e.step) for e in lora_events if isinstance(e, CheckpointEvent)]
