"""A refused submit names the field and the fix: an unknown field says which one was meant (on
the native API and on /v1), an optimizer or scheduler DeepSpeed cannot build is refused at
submit, and an enum's choices read as a sentence."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient


@pytest.fixture
def client(tuneq_home: Any) -> Iterator[TestClient]:
    from api.main import create_app

    with TestClient(create_app()) as c:
        yield c


@pytest.mark.parametrize(
    ("training", "loc", "msg"),
    [
        ({"max_step": 10}, ["body", "training", "max_step"], "did you mean 'max_steps'?"),
        ({"lora": {"alfa": 16}}, ["body", "training", "lora", "alfa"], "did you mean 'alpha'?"),
        (
            {"method": "dpo", "dpo": {"betta": 0.2}},
            ["body", "training", "dpo", "betta"],
            "did you mean 'beta'?",
        ),
    ],
)
def test_an_unknown_training_field_says_which_was_meant(
    client: TestClient, body: dict[str, Any], training: dict[str, Any], loc: list[str], msg: str
) -> None:
    refused = client.post("/jobs", json={**body, "training": training})
    assert refused.status_code == 422
    (problem,) = refused.json()["detail"]
    assert problem["type"] == "extra_forbidden" and problem["loc"] == loc
    where = ".".join(loc[1:-1])
    assert problem["msg"] == f"Extra inputs are not permitted: {where} has no field '{loc[-1]}'; {msg}"


def test_an_unknown_field_with_no_close_name_lists_the_fields(client: TestClient, body: dict[str, Any]) -> None:
    refused = client.post("/jobs", json={**body, "colour": "blue"})
    assert refused.status_code == 422
    (problem,) = refused.json()["detail"]
    assert problem["msg"].startswith(
        "Extra inputs are not permitted: the body has no field 'colour'; its fields are model, revision, dataset,"
    )
    plan = client.post("/jobs/plan", json={**body, "training": {"epoch": 2}})
    assert plan.status_code == 422
    assert plan.json()["detail"][0]["msg"] == (
        "Extra inputs are not permitted: training has no field 'epoch'; did you mean 'epochs'?"
    )


def test_v1_says_which_hyperparameter_was_meant(client: TestClient, model_dir: Any) -> None:
    hyperparameters = {"n_epoch": 2}
    body = {"model": str(model_dir), "training_file": "file-x"}
    method = {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}}
    refused = client.post("/v1/fine_tuning/jobs", json={**body, "method": method})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "method.supervised.hyperparameters.n_epoch"
    assert error["message"] == (
        "field method.supervised.hyperparameters.n_epoch: Extra inputs are not permitted: "
        "method.supervised.hyperparameters has no field 'n_epoch'; did you mean 'n_epochs'?"
    )


def test_an_optimizer_deepspeed_cannot_build_is_refused_at_submit(client: TestClient, body: dict[str, Any]) -> None:
    config = body["deepspeed_config"]
    refused = client.post("/jobs", json={**body, "deepspeed_config": {**config, "optimizer": {"type": "Adamm"}}})
    assert refused.status_code == 422, refused.text
    (problem,) = refused.json()["detail"]
    assert problem["loc"] == ["body", "deepspeed_config", "optimizer", "type"]
    assert problem["msg"].startswith(
        "DeepSpeed does not know the optimizer 'Adamm': did you mean 'adam'? optimizer.type is one of DeepSpeed's "
        "adagrad, adam, adamw,"
    )
    assert "or a torch.optim optimizer: " in problem["msg"] and "SGD" in problem["msg"]
    scheduler = {**config, "scheduler": {"type": "WarmupLr", "params": {}}}
    refused = client.post("/jobs", json={**body, "deepspeed_config": scheduler})
    assert refused.status_code == 422
    (problem,) = refused.json()["detail"]
    assert problem["loc"] == ["body", "deepspeed_config", "scheduler", "type"]
    assert problem["msg"].startswith("DeepSpeed does not know the scheduler 'WarmupLr': did you mean 'WarmupLR'?")
    torch_names = {**config, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "scheduler": {"type": "StepLR"}}
    assert client.post("/jobs", json={**body, "deepspeed_config": torch_names}).status_code == 201


def test_zero_stage_5_reads_as_a_sentence(client: TestClient, body: dict[str, Any]) -> None:
    config = {**body["deepspeed_config"], "zero_optimization": {"stage": 5}}
    refused = client.post("/jobs", json={**body, "deepspeed_config": config})
    assert refused.status_code == 422
    (problem,) = refused.json()["detail"]
    assert problem["loc"] == ["body", "deepspeed_config", "zero_optimization", "stage"]
    assert problem["msg"] == "DeepSpeed refused this config: must be 0, 1, 2 or 3, not 5"
