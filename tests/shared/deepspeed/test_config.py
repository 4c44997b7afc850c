"""Checking a DeepSpeed config at submit (shared.deepspeed.config): the optimizer and scheduler
types DeepSpeed's engine can build, and pydantic's enum errors as sentences."""

from __future__ import annotations

from typing import Any

import pytest

from shared.deepspeed.config import (
    DeepSpeedConfigError,
    known_optimizer_types,
    known_scheduler_types,
    resolve_deepspeed_config,
)

BASE = {"train_batch_size": 1}


def refusal(config: dict[str, Any]) -> DeepSpeedConfigError:
    with pytest.raises(DeepSpeedConfigError) as raised:
        resolve_deepspeed_config({**BASE, **config}, world_size=1)
    return raised.value


def test_the_known_types_are_deepspeeds_own() -> None:
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

    deepspeed_optimizers, torch_optimizers = known_optimizer_types()
    assert list(deepspeed_optimizers) == DEEPSPEED_OPTIMIZERS and {"Adam", "AdamW", "SGD"} <= set(torch_optimizers)
    assert "Optimizer" not in torch_optimizers  # the base class builds nothing
    deepspeed_schedulers, torch_schedulers = known_scheduler_types()
    assert list(deepspeed_schedulers) == VALID_LR_SCHEDULES and "StepLR" in torch_schedulers
    assert not {"LRScheduler", "_LRScheduler"} & set(torch_schedulers)


@pytest.mark.parametrize(
    "section",
    [
        {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}},  # DeepSpeed's, any case
        {"optimizer": {"type": "adamw"}},
        {"optimizer": {"type": "Lion"}},
        {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}},  # torch.optim's, by its name
        {"optimizer": {"type": "RMSprop"}},
        {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10}}},
        {"scheduler": {"type": "CosineAnnealingLR", "params": {"T_max": 10}}},
        {"optimizer": {"params": {"lr": 1e-4}}},  # no type: DeepSpeed's own business
    ],
)
def test_types_deepspeed_builds_pass(section: dict[str, Any]) -> None:
    assert resolve_deepspeed_config({**BASE, **section}, world_size=1).train_batch_size == 1


def test_an_unknown_optimizer_names_the_field_the_known_types_and_the_closest() -> None:
    error = refusal({"optimizer": {"type": "Adamm", "params": {"lr": 1e-4}}})
    assert error.loc == ("optimizer", "type")
    assert error.message.startswith(
        "DeepSpeed does not know the optimizer 'Adamm': did you mean 'adam'? optimizer.type is one of "
        "DeepSpeed's adagrad, adam, adamw, lamb, "
    )
    assert "(any case), or a torch.optim optimizer: ASGD, Adadelta," in error.message
    assert "did you mean 'SGD'?" in refusal({"optimizer": {"type": "sgdd"}}).message  # torch's, by its case
    assert "did you mean" not in refusal({"optimizer": {"type": "Shampoo"}}).message
    assert refusal({"optimizer": {"type": 3}}).message.startswith("optimizer.type must be a name, not 3: one of")


def test_a_torch_optimizer_name_in_another_case_is_refused() -> None:
    """torch.optim's names are looked up as given (getattr): DeepSpeed lower-cases only its own."""
    error = refusal({"optimizer": {"type": "sgd"}})
    assert "did you mean 'SGD'?" in error.message


def test_an_unknown_scheduler_names_the_field_and_the_closest() -> None:
    error = refusal({"scheduler": {"type": "WarmupLr"}})
    assert error.loc == ("scheduler", "type")
    assert error.message.startswith(
        "DeepSpeed does not know the scheduler 'WarmupLr': did you mean 'WarmupLR'? scheduler.type is one of "
        "DeepSpeed's LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR, or a "
        "torch.optim.lr_scheduler scheduler: "
    )
    assert "(any case)" not in error.message  # DeepSpeed looks schedulers up by their exact names
    assert refusal({"scheduler": {"type": "torch"}}).loc == ("scheduler", "type")  # a module of lr_schedules


def test_an_enums_choices_are_listed_once_each() -> None:
    stage = refusal({"zero_optimization": {"stage": 5}})
    assert stage.loc == ("zero_optimization", "stage")
    assert stage.message == "DeepSpeed refused this config: must be 0, 1, 2 or 3, not 5"
    device = refusal({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}})
    assert device.message == "DeepSpeed refused this config: must be 'none', 'cpu' or 'nvme', not 'gpu'"
