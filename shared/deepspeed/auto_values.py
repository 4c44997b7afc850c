"""Filling ``"auto"`` values in a DeepSpeed config the way the Hugging Face Trainer does.

Users copy configs from the Hugging Face docs, where batch sizes, optimizer and scheduler
numbers and bucket sizes are ``"auto"``. The Trainer fills them from its arguments and the
model; tuneq fills them from ``training`` (the same names and defaults as the Trainer's
arguments) and the model's config. Only ``"auto"`` values are filled; numbers the user wrote
stay as written.

Filled twice: at submit with what the API knows (batch sizes, optimizer, precision, bucket
sizes for a local model), and by rank 0 before ``deepspeed.initialize`` with the rest (the
model's hidden size, the run's total steps).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from shared.jobs.spec import TrainingOptions

AUTO = "auto"


@dataclass(frozen=True)
class AutoInputs:
    training: TrainingOptions
    world_size: int
    hidden_size: int | None = None  # the model's; fills the bucket sizes
    total_steps: int | None = None  # optimizer steps of the run; fills the scheduler


def hidden_size_of(model_config: dict[str, Any]) -> int | None:
    """The model's hidden size from its config.json, under the names architectures use."""
    for source in (model_config, model_config.get("text_config") or {}):
        for key in ("hidden_size", "n_embd", "d_model"):
            if isinstance(source.get(key), int):
                return int(source[key])
        if isinstance(source.get("hidden_sizes"), list) and source["hidden_sizes"]:
            return int(max(source["hidden_sizes"]))
    return None


def _get(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(config: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = config
    for part in parents:
        node = node[part]
    node[leaf] = value


def _number(config: dict[str, Any], key: str, fallback: int) -> int:
    value = config.get(key)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else fallback


def _rules(config: dict[str, Any], inputs: AutoInputs) -> dict[str, Callable[[], Any]]:
    """Dotted key -> how to compute it (None when it cannot be known yet)."""
    t = inputs.training
    micro = _number(config, "train_micro_batch_size_per_gpu", t.micro_batch_size)
    accumulation = _number(config, "gradient_accumulation_steps", t.gradient_accumulation_steps)
    hidden, total = inputs.hidden_size, inputs.total_steps

    def warmup() -> int | None:
        if total is None:
            return None
        return max(1, t.warmup_steps if t.warmup_steps > 0 else math.ceil(total * t.warmup_ratio))

    return {
        "train_micro_batch_size_per_gpu": lambda: t.micro_batch_size,
        "gradient_accumulation_steps": lambda: t.gradient_accumulation_steps,
        "train_batch_size": lambda: micro * accumulation * inputs.world_size,
        "gradient_clipping": lambda: t.max_grad_norm,
        "optimizer.params.lr": lambda: t.learning_rate,
        "optimizer.params.betas": lambda: [t.adam_beta1, t.adam_beta2],
        "optimizer.params.eps": lambda: t.adam_epsilon,
        "optimizer.params.weight_decay": lambda: t.weight_decay,
        "scheduler.params.warmup_min_lr": lambda: 0,
        "scheduler.params.warmup_max_lr": lambda: t.learning_rate,
        "scheduler.params.total_num_steps": lambda: total,
        "scheduler.params.warmup_num_steps": warmup,
        "fp16.enabled": lambda: t.precision == "fp16",
        "bf16.enabled": lambda: t.precision == "bf16",
        "zero_optimization.reduce_bucket_size": lambda: hidden * hidden if hidden else None,
        "zero_optimization.stage3_prefetch_bucket_size": lambda: int(0.9 * hidden * hidden) if hidden else None,
        "zero_optimization.stage3_param_persistence_threshold": lambda: 10 * hidden if hidden else None,
    }


FILLABLE = frozenset(_rules({}, AutoInputs(TrainingOptions(), 1)))


def fill_auto(config: dict[str, Any], inputs: AutoInputs) -> dict[str, Any]:
    """A copy of ``config`` with every ``"auto"`` that ``inputs`` can answer filled in."""
    filled = copy.deepcopy(config)
    for key, compute in _rules(filled, inputs).items():
        if _get(filled, key) == AUTO:
            value = compute()
            if value is not None:
                _set(filled, key, value)
    return filled


def auto_keys(config: Any, prefix: str = "") -> Iterator[str]:
    """Dotted keys whose value is still ``"auto"``."""
    if isinstance(config, dict):
        for key, value in config.items():
            dotted = f"{prefix}{key}"
            if value == AUTO:
                yield dotted
            else:
                yield from auto_keys(value, dotted + ".")


def without_auto(config: dict[str, Any]) -> dict[str, Any]:
    """A copy for DeepSpeed's parser with the ``"auto"`` values not yet known left out, so
    DeepSpeed's defaults stand in for them while the rest is checked."""
    pruned = copy.deepcopy(config)
    for dotted in list(auto_keys(pruned)):
        *parents, leaf = dotted.split(".")
        node = pruned
        for part in parents:
            node = node[part]
        del node[leaf]
    return pruned
