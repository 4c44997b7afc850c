"""'auto' values, filled the way the Hugging Face Trainer fills them, for configs from its docs."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from shared.deepspeed.auto_values import AutoInputs, auto_keys, fill_auto, hidden_size_of, without_auto
from shared.deepspeed.config import resolve_deepspeed_config
from shared.jobs.hardware import Hardware
from shared.jobs.spec import JobCreate, TrainingOptions
from shared.jobs.validation import JobValidationError, validate_job_request
from shared.settings import Settings

# The ZeRO-2 and ZeRO-3 configs of the Hugging Face DeepSpeed integration docs.
HF_ZERO2: dict[str, Any] = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_ZERO3: dict[str, Any] = {
    **HF_ZERO2,
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def test_every_auto_of_the_zero3_docs_config_is_filled() -> None:
    training = TrainingOptions(
        micro_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-4,
        weight_decay=0.01,
        warmup_ratio=0.1,
        precision="bf16",
    )
    original = copy.deepcopy(HF_ZERO3)
    filled = fill_auto(HF_ZERO3, AutoInputs(training, world_size=2, hidden_size=64, total_steps=95))
    assert original == HF_ZERO3  # the submitted config is never changed
    assert list(auto_keys(filled)) == []
    assert (filled["train_micro_batch_size_per_gpu"], filled["gradient_accumulation_steps"]) == (4, 2)
    assert filled["train_batch_size"] == 16 and filled["gradient_clipping"] == 1.0
    assert filled["optimizer"]["params"] == {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    assert filled["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 1e-4,
        "warmup_num_steps": 10,
        "total_num_steps": 95,
    }
    assert filled["fp16"]["enabled"] is False and filled["bf16"]["enabled"] is True
    zero = filled["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (4096, 3686)
    assert zero["stage3_param_persistence_threshold"] == 640
    resolved = resolve_deepspeed_config(filled, world_size=2)
    assert (resolved.train_batch_size, resolved.zero_stage, resolved.bf16) == (16, 3, True)


def test_numbers_the_user_wrote_win_and_feed_the_arithmetic() -> None:
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": "auto"}
    filled = fill_auto(config, AutoInputs(TrainingOptions(gradient_accumulation_steps=5), world_size=2))
    assert filled == {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}


def test_what_is_not_known_yet_stays_auto_and_is_left_out_for_the_parser() -> None:
    filled = fill_auto(HF_ZERO3, AutoInputs(TrainingOptions(), world_size=1))
    assert sorted(auto_keys(filled)) == [
        "scheduler.params.total_num_steps",
        "scheduler.params.warmup_num_steps",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.stage3_prefetch_bucket_size",
    ]
    pruned = without_auto(filled)
    assert "reduce_bucket_size" not in pruned["zero_optimization"] and list(auto_keys(pruned)) == []
    resolve_deepspeed_config(pruned, world_size=1)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"hidden_size": 768}, 768),
        ({"n_embd": 64}, 64),
        ({"d_model": 512}, 512),
        ({"hidden_sizes": [8, 32]}, 32),
        ({"text_config": {"hidden_size": 96}}, 96),
        ({"vocab_size": 5}, None),
    ],
)
def test_hidden_size_of(config: dict[str, Any], expected: int | None) -> None:
    assert hidden_size_of(config) == expected


def submit(tuneq_home: Path, config: dict[str, Any], hardware: Hardware | None = None, **training: Any) -> Any:
    model = tuneq_home / "data" / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"hidden_size": 32}')
    (model / "model.safetensors").write_bytes(b"x")
    dataset = tuneq_home / "data" / "train.jsonl"
    dataset.write_text('{"text": "hello"}\n')
    job = JobCreate(model=str(model), dataset=str(dataset), deepspeed_config=config, num_gpus=2, training=training)
    return validate_job_request(job, settings=Settings(), hardware=hardware).deepspeed_config


def test_submit_resolves_what_it_can_with_the_local_models_hidden_size(tuneq_home: Path) -> None:
    resolved = submit(tuneq_home, HF_ZERO3, micro_batch_size=2)
    assert resolved["train_batch_size"] == 4
    assert resolved["zero_optimization"]["reduce_bucket_size"] == 1024  # 32 * 32
    assert resolved["scheduler"]["params"]["total_num_steps"] == "auto"  # the worker knows the step count


def test_auto_where_tuneq_cannot_fill_it_is_refused_by_name(tuneq_home: Path) -> None:
    config = {**HF_ZERO2, "zero_optimization": {"stage": 2, "sub_group_size": "auto"}}
    with pytest.raises(JobValidationError) as e:
        submit(tuneq_home, config)
    (problem,) = e.value.problems
    assert problem.loc == ("body", "deepspeed_config", "zero_optimization", "sub_group_size")
    assert "'auto' is not supported for zero_optimization.sub_group_size" in problem.message


def test_auto_precision_is_checked_against_the_hardware(tuneq_home: Path) -> None:
    with pytest.raises(JobValidationError, match="fp16 needs a CUDA GPU"):
        submit(tuneq_home, HF_ZERO2, Hardware("cpu", 2), precision="fp16")
    assert submit(tuneq_home, HF_ZERO2, Hardware("cpu", 2), precision="bf16")["bf16"]["enabled"]
