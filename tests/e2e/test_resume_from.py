"""resume_from: a new job starts from another job's checkpoint, on the same or another rank count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cli.samples import build_tiny_model, write_text_dataset

from .harness import Tuneq, repeated_job_body, succeeded_with_losses

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def home(home: Path) -> Path:
    build_tiny_model(home / "data" / "other-model", seed=1)
    write_text_dataset(home / "data" / "repeated.jsonl", records=96, vary=False)
    return home


@pytest.fixture(scope="module")
def source(service: Tuneq, home: Path) -> tuple[dict[str, Any], list[float]]:
    training = {"epochs": 3, "max_steps": 20, "max_seq_length": 64, "checkpoint_every_steps": 10}
    return succeeded_with_losses(service, repeated_job_body(home, training=training))


@pytest.mark.parametrize("num_gpus", [2, 1], ids=["other-rank-count-universal", "same-rank-count"])
def test_a_new_job_starts_from_the_weights_of_another(
    service: Tuneq, home: Path, source: tuple[dict[str, Any], list[float]], num_gpus: int
) -> None:
    job_a, losses_a = source
    assert losses_a[-1] < 0.5 * losses_a[0]
    job_b, losses_b = succeeded_with_losses(
        service, repeated_job_body(home, num_gpus=num_gpus, resume_from={"job_id": job_a["id"]})
    )
    assert job_b["resume_from"] == {"job_id": job_a["id"], "step": 20}  # the newest checkpoint, pinned
    # It continues from the trained weights: its first loss is near A's last, far below A's first.
    assert losses_b[0] < (losses_a[0] + losses_a[-1]) / 2, (losses_a, losses_b)
    # Its own steps and schedule start at the beginning.
    assert job_b["total_steps"] == 4 and job_b["step"] == 4
    converted = Path(service.home) / "runs" / job_b["id"] / "start-from"
    assert converted.is_dir() == (num_gpus != 1)


def test_resume_from_is_checked_at_submit(
    service: Tuneq, home: Path, source: tuple[dict[str, Any], list[float]]
) -> None:
    job_a, _ = source

    def problems(**fields: Any) -> dict[str, str]:
        answer = service.client.post("/jobs", json=repeated_job_body(home, **fields))
        assert answer.status_code == 422, answer.text
        return {".".join(map(str, p["loc"])): p["msg"] for p in answer.json()["detail"]}

    assert "has 10, 20" in problems(resume_from={"job_id": job_a["id"], "step": 7})["body.resume_from.step"]
    unknown = "00000000-0000-4000-8000-000000000000"
    assert "not found" in problems(resume_from={"job_id": unknown})["body.resume_from.job_id"]
    other_model = problems(resume_from={"job_id": job_a["id"]}, model=str(home / "data" / "other-model"))
    assert "give the same model" in other_model["body.model"]
    with_lora = problems(resume_from={"job_id": job_a["id"]}, training={"lora": {"r": 4}})
    assert "every weight (no LoRA)" in with_lora["body.training.lora"]
