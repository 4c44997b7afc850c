"""Every submit-time rule, good and bad cases, with the field each error names."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from cli.samples import seed_config
from shared.deepspeed.config import DeepSpeedConfigError, resolve_deepspeed_config
from shared.jobs.hardware import Hardware
from shared.jobs.spec import JobCreate
from shared.jobs.validation import JobValidationError, validate_job_request
from shared.settings import Settings


@pytest.fixture
def settings(tuneq_home: Path) -> Settings:
    return Settings()


@pytest.fixture
def dataset(tuneq_home: Path) -> Path:
    path = tuneq_home / "data" / "train.jsonl"
    path.write_text('{"text": "hello world"}\n{"text": "more"}\n')
    return path


def job(model: Path | str, dataset: Path | str, **overrides: Any) -> JobCreate:
    fields: dict[str, Any] = {
        "model": str(model),
        "dataset": str(dataset),
        "deepspeed_config": seed_config(fp16=False),
    }
    fields.update(overrides)
    return JobCreate.model_validate(fields)


def problems(job_in: JobCreate, settings: Settings, hardware: Hardware | None = None) -> dict[tuple[Any, ...], str]:
    try:
        validate_job_request(job_in, settings=settings, hardware=hardware)
    except JobValidationError as e:
        return {p.loc: p.message for p in e.problems}
    return {}


def test_seed_config_with_fp16_off_is_accepted(settings: Settings, model_dir: Path, dataset: Path) -> None:
    assert problems(job(model_dir, dataset), settings) == {}
    assert problems(job(model_dir, f"file://{dataset}"), settings) == {}


def test_hub_ids(settings: Settings, dataset: Path) -> None:
    assert problems(job("EleutherAI/gpt-neo-2.7B", dataset), settings) == {}
    bad = problems(job("gpt neo", dataset), settings)
    assert "hub id" in bad[("body", "model")]
    assert "hub id" in problems(job("a/b/c", dataset), settings)[("body", "model")]


def test_revision_is_for_hub_models(settings: Settings, model_dir: Path, dataset: Path) -> None:
    assert problems(job("EleutherAI/gpt-neo-125m", dataset, revision="v1.0"), settings) == {}
    message = problems(job(model_dir, dataset, revision="main"), settings)[("body", "revision")]
    assert "hub models only" in message


def test_model_outside_allowed_roots(settings: Settings, tmp_path: Path, dataset: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    message = problems(job(outside, dataset), settings)[("body", "model")]
    assert "outside the allowed roots" in message and "TUNEQ_ALLOWED_ROOTS" in message


def test_model_dot_dot_escape_is_resolved_first(settings: Settings, tuneq_home: Path, dataset: Path) -> None:
    sneaky = f"{tuneq_home}/data/../../"
    assert "outside the allowed roots" in problems(job(sneaky, dataset), settings)[("body", "model")]


def test_model_directory_needs_config_and_safetensors(settings: Settings, tuneq_home: Path, dataset: Path) -> None:
    empty = tuneq_home / "data" / "empty"
    empty.mkdir()
    assert "config.json" in problems(job(empty, dataset), settings)[("body", "model")]
    (empty / "config.json").write_text("{}")
    (empty / "pytorch_model.bin").write_bytes(b"x")
    assert "safetensors" in problems(job(empty, dataset), settings)[("body", "model")]
    assert "does not exist" in problems(job(tuneq_home / "data" / "nope", dataset), settings)[("body", "model")]


def test_dataset_symlink_out_of_the_roots_is_refused(
    settings: Settings, tuneq_home: Path, tmp_path: Path, model_dir: Path
) -> None:
    secret = tmp_path / "secret.jsonl"
    secret.write_text('{"text": "x"}\n')
    link = tuneq_home / "data" / "link.jsonl"
    os.symlink(secret, link)
    assert "outside the allowed roots" in problems(job(model_dir, link), settings)[("body", "dataset")]


def test_dataset_rules(settings: Settings, tuneq_home: Path, model_dir: Path) -> None:
    missing = problems(job(model_dir, tuneq_home / "data" / "nope.jsonl"), settings)
    assert "does not exist" in missing[("body", "dataset")]
    assert problems(job(model_dir, "s3://bucket/key.jsonl"), settings) == {}  # checked once downloaded
    assert "'gs:' are not supported" in problems(job(model_dir, "gs://bucket/key.jsonl"), settings)[("body", "dataset")]
    assert "chains protocols" in problems(job(model_dir, "simplecache::s3://b/k.jsonl"), settings)[("body", "dataset")]
    assert "absolute" in problems(job(model_dir, "data/train.jsonl"), settings)[("body", "dataset")]
    directory = problems(job(model_dir, tuneq_home / "data"), settings)
    assert "does not exist" in directory[("body", "dataset")]


def test_malformed_dataset_line_is_named(settings: Settings, tuneq_home: Path, model_dir: Path) -> None:
    bad = tuneq_home / "data" / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": oops}\n')
    message = problems(job(model_dir, bad), settings)[("body", "dataset")]
    assert "line 3 is not valid JSON" in message


def test_allowed_roots_setting_adds_directories(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path
) -> None:
    extra = tmp_path / "datasets"
    extra.mkdir()
    (extra / "d.jsonl").write_text('{"text": "x y"}\n')
    monkeypatch.setenv("TUNEQ_ALLOWED_ROOTS", os.pathsep.join([str(model_dir.parent), str(extra)]))
    assert problems(job(model_dir, extra / "d.jsonl"), Settings()) == {}


def test_unknown_deepspeed_key_names_the_closest(settings: Settings, model_dir: Path, dataset: Path) -> None:
    config = {**seed_config(fp16=False), "gradient_acumulation_steps": 2}
    found = problems(job(model_dir, dataset, deepspeed_config=config), settings)
    message = found[("body", "deepspeed_config", "gradient_acumulation_steps")]
    assert "did you mean 'gradient_accumulation_steps'" in message


def test_batch_triplet_is_checked_for_the_world_size(settings: Settings, model_dir: Path, dataset: Path) -> None:
    # train_batch_size 1 fits one rank but not two.
    found = problems(job(model_dir, dataset, num_gpus=2), settings)
    message = found[("body", "deepspeed_config", "train_batch_size")]
    assert "Micro batch size per gpu: 0" in message and "num_gpus" in message
    config = {**seed_config(fp16=False, train_batch_size=3), "train_micro_batch_size_per_gpu": 1}
    found = problems(job(model_dir, dataset, num_gpus=2, deepspeed_config=config), settings)
    assert "3 != 1 * 1 * 2" in found[("body", "deepspeed_config", "train_batch_size")]
    config = seed_config(fp16=False, train_batch_size=2)
    assert problems(job(model_dir, dataset, num_gpus=2, deepspeed_config=config), settings) == {}


def test_zero_stage_and_offload_device_use_deepspeeds_message(
    settings: Settings, model_dir: Path, dataset: Path
) -> None:
    config = seed_config(fp16=False)
    config["zero_optimization"]["stage"] = 5  # type: ignore[index]
    found = problems(job(model_dir, dataset, deepspeed_config=config), settings)
    assert "must be 0, 1, 2 or 3, not 5" in found[("body", "deepspeed_config", "zero_optimization", "stage")]
    config = seed_config(fp16=False)
    config["zero_optimization"]["offload_optimizer"]["device"] = "gpu"  # type: ignore[index]
    found = problems(job(model_dir, dataset, deepspeed_config=config), settings)
    assert "'cpu'" in found[("body", "deepspeed_config", "zero_optimization", "offload_optimizer", "device")]


def test_fp16_needs_cuda_when_the_workers_are_known(settings: Settings, model_dir: Path, dataset: Path) -> None:
    seed = job(model_dir, dataset, deepspeed_config=seed_config(fp16=True))
    cpu_only = problems(seed, settings, Hardware("cpu", 2))
    assert "fp16 needs a CUDA GPU" in cpu_only[("body", "deepspeed_config", "fp16", "enabled")]
    assert problems(seed, settings, Hardware("cuda", 8)) == {}
    assert problems(seed, settings, None) == {}  # unknown: the worker decides, within seconds


def test_attention_that_can_never_work_is_refused_at_submit(settings: Settings, model_dir: Path, dataset: Path) -> None:
    def attention_problem(attention: str, model_config: dict[str, Any], hardware: Hardware | None) -> str | None:
        (model_dir / "config.json").write_text(json.dumps(model_config))
        found = problems(job(model_dir, dataset, training={"attention": attention}), settings, hardware)
        return found.get(("body", "training", "attention"))

    neo, llama = {"model_type": "gpt_neo"}, {"model_type": "llama", "attention_dropout": 0.1}
    gpu, cpu = Hardware("cuda", 1), Hardware("cpu", 2)
    message = attention_problem("flash_attention_2", neo, gpu)
    assert message is not None and "drops the local layers' window" in message
    assert "set training.attention to sdpa or flex_attention" in message
    message = attention_problem("flash_attention_2", llama, cpu)
    assert message is not None and "needs a CUDA GPU" in message and "have no GPU" in message
    message = attention_problem("flex_attention", {"model_type": "llama"}, cpu)
    assert message is not None and "flex_attention trains on CUDA GPUs only" in message
    message = attention_problem("flex_attention", llama, gpu)
    assert message is not None and "attention_dropout 0.1" in message
    # What may work is left to the ranks: a GPU deployment, unknown workers, a hub model.
    assert attention_problem("flash_attention_2", llama, gpu) is None
    assert attention_problem("flex_attention", neo, None) is None
    assert attention_problem("sdpa", neo, cpu) is None
    hub = job("EleutherAI/gpt-neo-125m", dataset, training={"attention": "flash_attention_2"})
    assert problems(hub, settings, gpu) == {}


def test_more_devices_than_any_worker_has(settings: Settings, model_dir: Path, dataset: Path) -> None:
    config = seed_config(fp16=False, train_batch_size=4)
    found = problems(job(model_dir, dataset, num_gpus=4, deepspeed_config=config), settings, Hardware("cpu", 2))
    assert "at most 2" in found[("body", "num_gpus")]


def test_every_problem_is_reported_at_once(settings: Settings, tuneq_home: Path) -> None:
    found = problems(job("not a model", tuneq_home / "missing.jsonl", deepspeed_config={"x": 1}), settings)
    assert {loc[1] for loc in found} == {"model", "dataset", "deepspeed_config"}


def test_resolve_reports_deepspeeds_batch_arithmetic() -> None:
    resolved = resolve_deepspeed_config(
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, world_size=2
    )
    assert (resolved.train_batch_size, resolved.micro_batch_per_gpu, resolved.gradient_accumulation_steps) == (12, 2, 3)
    with pytest.raises(DeepSpeedConfigError, match="cannot be simultaneously enabled"):
        resolve_deepspeed_config(
            {"train_batch_size": 1, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, world_size=1
        )


def test_keys_that_reach_outside_the_run_are_refused_at_submit(
    settings: Settings, model_dir: Path, dataset: Path
) -> None:
    config = {**seed_config(fp16=False), "wandb": {"enabled": True, "project": "x"}}
    found = problems(job(model_dir, dataset, deepspeed_config=config), settings)
    assert any(loc[:3] == ("body", "deepspeed_config", "wandb") for loc in found), found
    config = seed_config(fp16=False)
    config["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/etc"}  # type: ignore[index]
    found = problems(job(model_dir, dataset, deepspeed_config=config), settings)
    loc = ("body", "deepspeed_config", "zero_optimization", "offload_optimizer", "nvme_path")
    assert loc in found, found
    # Output paths are not refused: the worker rewrites them under the job's run directory.
    config = {**seed_config(fp16=False), "csv_monitor": {"enabled": True, "output_path": "/etc/evil"}}
    assert problems(job(model_dir, dataset, deepspeed_config=config), settings) == {}


def test_a_section_whose_package_is_not_installed_is_refused_at_submit(
    model_dir: Path, dataset: Path, settings: Settings
) -> None:
    import importlib.util

    assert importlib.util.find_spec("tensorboard") is None  # tuneq does not install it
    config = {**seed_config(fp16=False), "tensorboard": {"enabled": True}}
    found = problems(job(model_dir, dataset, deepspeed_config=config), settings)
    message = found[("body", "deepspeed_config", "tensorboard", "enabled")]
    assert "pip install tensorboard" in message
    off = {**seed_config(fp16=False), "tensorboard": {"enabled": False}}
    assert problems(job(model_dir, dataset, deepspeed_config=off), settings) == {}
