"""Continuing from a fine-tuned model: a job whose ``model`` is another job's output
(``job:<id>``, ``job:<id>@step-<n>``), on a real ``tuneq dev``: the worker fetches the weights from
the artifact store, checked, merges a LoRA job's adapter or makes a checkpoint a model, and trains.

OpenAI's ``ft:`` names through the unmodified SDK are tests/e2e/test_openai_sdk.py's; what submit
refuses, request by request, is tests/api/test_model_sources.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cli.samples import seed_config, write_text_dataset

from .harness import Tuneq, repeated_job_body, succeeded_with_losses

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def home(home: Path) -> Path:
    write_text_dataset(home / "data" / "repeated.jsonl", records=96, vary=False)
    return home


def continues(first: list[float], then: list[float]) -> bool:
    """The second job starts from the first one's trained weights: its first loss is nearer the
    first job's last than its first."""
    return then[0] < (first[0] + first[-1]) / 2


@pytest.fixture(scope="module")
def sft(service: Tuneq, home: Path) -> tuple[dict[str, Any], list[float]]:
    """A supervised fine-tune of the tiny model that learns: its loss halves."""
    training = {"max_steps": 20, "max_seq_length": 64, "checkpoint_every_steps": 10}
    job, losses = succeeded_with_losses(service, repeated_job_body(home, training=training))
    assert losses[-1] < 0.5 * losses[0]
    return job, losses


def test_sft_then_sft_on_its_exported_model(
    service: Tuneq, home: Path, sft: tuple[dict[str, Any], list[float]]
) -> None:
    first, losses = sft
    second, then = succeeded_with_losses(service, repeated_job_body(home, model=f"job:{first['id']}"))
    assert second["model_source"] == {
        "job_id": first["id"],
        "kind": "model",
        "step": 20,
        "base_model": str(home / "data" / "tiny-gpt-neo"),
    }
    assert continues(losses, then), (losses, then)
    # Its own export is a whole model again, which a third job continues from in turn.
    third, after = succeeded_with_losses(service, repeated_job_body(home, model=f"job:{second['id']}"))
    assert third["model_source"]["base_model"] == str(home / "data" / "tiny-gpt-neo")
    assert continues(losses, after), (losses, after)


def test_a_checkpoint_of_a_job_is_a_model_to_continue_from(
    service: Tuneq, home: Path, sft: tuple[dict[str, Any], list[float]]
) -> None:
    first, losses = sft
    job, then = succeeded_with_losses(service, repeated_job_body(home, model=f"job:{first['id']}@step-10"))
    assert job["model_source"]["kind"] == "deepspeed" and job["model_source"]["step"] == 10
    assert continues(losses, then), (losses, then)
    converted = Path(service.home) / "cache" / "base-models" / first["id"] / "deepspeed-step-10"
    assert (converted / "config.json").is_file() and (converted / "tokenizer.json").is_file()


def test_a_lora_jobs_adapter_is_merged_into_its_base_and_continued_from(service: Tuneq, home: Path) -> None:
    training = {"max_steps": 20, "max_seq_length": 64, "lora": {"r": 8, "alpha": 32}}
    lora, losses = succeeded_with_losses(service, repeated_job_body(home, training=training))
    assert losses[-1] < 0.9 * losses[0], losses
    # A full fine-tune of the merged model, and LoRA adapters of its own on it.
    full, then = succeeded_with_losses(service, repeated_job_body(home, model=f"job:{lora['id']}"))
    assert full["model_source"]["kind"] == "adapter"
    assert continues(losses, then), (losses, then)
    _, after = succeeded_with_losses(
        service, repeated_job_body(home, model=f"job:{lora['id']}", training=training | {"max_steps": 4})
    )
    assert continues(losses, after), (losses, after)
    merged = Path(service.home) / "cache" / "base-models" / lora["id"] / "adapter-step-20"
    assert (merged / "model.safetensors").is_file() and not (merged / "adapter_config.json").exists()
    # Planned from the adapter's tokenizer and its base's config, fetched without the weights.
    planned = service.client.post("/jobs/plan", json=repeated_job_body(home, model=f"job:{lora['id']}"))
    assert planned.status_code == 200, planned.text
    assert (
        planned.json()["parameters"]
        == service.client.post("/jobs/plan", json=repeated_job_body(home)).json()["parameters"]
    )


def test_a_job_on_an_output_is_checked_at_submit_and_planned(
    service: Tuneq, home: Path, sft: tuple[dict[str, Any], list[float]]
) -> None:
    first, _ = sft
    refused = service.client.post("/jobs", json=repeated_job_body(home, model=f"job:{first['id']}@step-15"))
    assert refused.status_code == 422, refused.text
    problem = refused.json()["detail"][0]
    assert problem["loc"] == ["body", "model"] and "(it has 10, 20)" in problem["msg"]
    planned = service.client.post("/jobs/plan", json=repeated_job_body(home, model=f"job:{first['id']}"))
    assert planned.status_code == 200, planned.text
    assert planned.json()["total_steps"] == 4


def test_a_zero3_checkpoint_of_two_ranks_is_a_model_to_continue_from(service: Tuneq, home: Path) -> None:
    """The checkpoint's weights are sharded over two ranks (ZeRO-3): made whole by DeepSpeed's
    zero_to_fp32 before the next job (on one rank, ZeRO-2) loads them."""
    config = seed_config(fp16=False, train_batch_size=2, zero_stage=3, lr=1e-2)
    training = {"max_steps": 12, "max_seq_length": 64, "checkpoint_every_steps": 6}
    body = repeated_job_body(home, deepspeed_config=config, training=training, num_gpus=2)
    sharded, losses = succeeded_with_losses(service, body)
    assert losses[-1] < 0.5 * losses[0], losses
    job, then = succeeded_with_losses(service, repeated_job_body(home, model=f"job:{sharded['id']}@step-6"))
    assert (job["model_source"]["kind"], job["model_source"]["step"]) == ("deepspeed", 6)
    assert then[0] < (losses[0] + losses[5]) / 2, (losses, then)  # it starts from step 6's weights
