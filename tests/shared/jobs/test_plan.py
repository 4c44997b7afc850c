"""``compute_plan`` on a real (tiny) model and real data: a DPO job's reference pass is counted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cli.samples import seed_config
from shared.jobs.plan import ReferencePass, compute_plan, count_reference_pass
from shared.jobs.spec import JobCreate
from shared.settings import get_settings


def write_pairs(path: Path, count: int) -> Path:
    records = [
        {"prompt": f"Question {i}: the sky is", "chosen": " blue.", "rejected": f" green {i}."} for i in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def config(*, micro_batch: int, accumulation: int, world_size: int) -> dict[str, Any]:
    ds = seed_config(fp16=False, train_batch_size=micro_batch * accumulation * world_size)
    ds["train_micro_batch_size_per_gpu"] = micro_batch
    ds["gradient_accumulation_steps"] = accumulation
    ds["zero_optimization"]["offload_optimizer"] = {"device": "none"}  # type: ignore[index]
    return ds


def test_the_reference_pass_is_a_forward_per_micro_batch_of_pairs_a_third_of_a_step_each() -> None:
    # 10 pairs over 2 ranks, 2 a micro-batch: 3 forwards a rank (the last one short).
    assert count_reference_pass(pairs=10, world_size=2, micro_batch=2, accumulation=1) == ReferencePass(
        pairs=10, forward_batches_per_rank=3, step_equivalents=1.0
    )
    assert count_reference_pass(pairs=10, world_size=2, micro_batch=2, accumulation=2).step_equivalents == 0.5
    assert count_reference_pass(pairs=1, world_size=8, micro_batch=4, accumulation=1).forward_batches_per_rank == 1
    assert count_reference_pass(pairs=400, world_size=1, micro_batch=1, accumulation=4).step_equivalents == 33.333


@pytest.mark.parametrize(
    ("training", "validation_pairs", "pairs"),
    [
        ({"method": "dpo"}, None, 20),
        ({"method": "dpo", "validation_split": 0.25}, None, 20),  # the held-out pairs are in the same file
        ({"method": "dpo"}, 6, 26),  # and a validation file's are scored too
    ],
)
def test_a_dpo_plan_counts_the_reference_pass_over_every_pair(
    tuneq_home: Path, tiny_model: Path, training: dict[str, Any], validation_pairs: int | None, pairs: int
) -> None:
    data = tuneq_home / "data"
    job = JobCreate(
        model=str(tiny_model),
        dataset=str(write_pairs(data / "pairs.jsonl", 20)),
        validation_dataset=str(write_pairs(data / "held.jsonl", validation_pairs)) if validation_pairs else None,
        num_gpus=1,
        training={**training, "max_seq_length": 32},
    )
    plan = compute_plan(job, config(micro_batch=4, accumulation=2, world_size=1), get_settings())
    batches = -(-pairs // 4)
    assert plan.reference_pass == ReferencePass(
        pairs=pairs, forward_batches_per_rank=batches, step_equivalents=round(batches / 2 / 3, 3)
    )


def test_an_sft_plan_has_no_reference_pass(tuneq_home: Path, tiny_model: Path, text_dataset: Path) -> None:
    job = JobCreate(model=str(tiny_model), dataset=str(text_dataset), num_gpus=1, training={"max_seq_length": 32})
    plan = compute_plan(job, config(micro_batch=4, accumulation=1, world_size=1), get_settings())
    assert plan.reference_pass is None and plan.total_steps > 0
