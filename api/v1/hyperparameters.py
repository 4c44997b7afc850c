"""OpenAI's supervised and DPO hyperparameters, each a number or ``"auto"``, resolved to numbers
the way OpenAI documents them and turned into tuneq's training options.

- ``n_epochs``: OpenAI's chat fine-tuning data guide (the cookbook's data preparation) trains 3
  epochs, more for a small file so that at least 100 examples are seen, fewer for a large one so
  that at most 25,000 are, and always between 1 and 25.
- ``batch_size``: about 0.2 % of the training examples, at most 256 (OpenAI's reference for it).
- ``learning_rate_multiplier``: it scales the learning rate the base model was pretrained with;
  "auto" is 0.05, 0.1 or 0.2 depending on the final batch size, larger batches taking larger
  rates (OpenAI's reference). Where OpenAI gives no thresholds, tuneq takes 0.05 up to a batch
  of 8 examples, 0.1 up to 32, 0.2 above.
- DPO's ``batch_size``, ``n_epochs`` and ``learning_rate_multiplier`` resolve as the supervised
  ones do, an example being a pair; its ``beta`` "auto" is 0.1 (``DEFAULT_DPO_BETA``: the DPO
  paper's and TRL's), and a given one must be more than 0 and at most 2 (OpenAI's bounds).

An open model's pretraining rate is known per family from its paper or its released training
config (``PRETRAINING_LEARNING_RATES``, by config.json's ``model_type``); other families take
``DEFAULT_PRETRAINING_LEARNING_RATE``, the peak of LLaMA's 7B-13B models, the usual size of a
model fine-tuned on one host. LoRA trains a few new weights from zero and takes a rate ten
times higher (``LORA_LEARNING_RATE_FACTOR``), as LoRA recipes do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from api.v1.fine_tuning_objects import (
    DpoHyperparameters,
    ResolvedDpoHyperparameters,
    ResolvedHyperparameters,
    SupervisedHyperparameters,
)
from shared.deepspeed.chosen import largest_micro_batch

TARGET_EPOCHS = 3
MIN_TARGET_EXAMPLES = 100
MAX_TARGET_EXAMPLES = 25_000
MIN_DEFAULT_EPOCHS = 1
MAX_DEFAULT_EPOCHS = 25
MAX_EPOCHS = 50  # OpenAI's bound for a given n_epochs
AUTO_BATCH_SHARE = 0.002
MAX_BATCH_SIZE = 256
MAX_LEARNING_RATE_MULTIPLIER = 10.0
DEFAULT_DPO_BETA = 0.1
MAX_DPO_BETA = 2.0  # OpenAI's bound; beta must also be more than 0

# Only families whose rate is published; the rest take the default.
PRETRAINING_LEARNING_RATES = {
    "llama": 3e-4,  # LLaMA 2 (7B, 13B) and LLaMA 3 8B papers
    "gpt2": 6e-4,  # the GPT-3 paper's rate for models of GPT-2 small's size
    "gpt_neo": 6e-4,  # EleutherAI's GPT-Neo 125M config, after the GPT-3 paper
}
DEFAULT_PRETRAINING_LEARNING_RATE = 3e-4
LORA_LEARNING_RATE_FACTOR = 10.0


class HyperparameterError(ValueError):
    """A hyperparameter the request gave cannot be used; ``param`` names it as OpenAI does."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


def auto_epochs(examples: int) -> int:
    if examples * TARGET_EPOCHS < MIN_TARGET_EXAMPLES:
        return min(MAX_DEFAULT_EPOCHS, math.ceil(MIN_TARGET_EXAMPLES / examples))
    if examples * TARGET_EPOCHS > MAX_TARGET_EXAMPLES:
        return max(MIN_DEFAULT_EPOCHS, MAX_TARGET_EXAMPLES // examples)
    return TARGET_EPOCHS


def auto_batch_size(examples: int) -> int:
    return max(1, min(MAX_BATCH_SIZE, round(examples * AUTO_BATCH_SHARE)))


def auto_learning_rate_multiplier(batch_size: int) -> float:
    if batch_size <= 8:
        return 0.05
    if batch_size <= 32:
        return 0.1
    return 0.2


def resolve_hyperparameters(
    requested: SupervisedHyperparameters, *, examples: int, param_prefix: str
) -> ResolvedHyperparameters:
    """Numbers for a training file of ``examples`` records. Raises HyperparameterError naming
    ``param_prefix``.<name> for a given value out of OpenAI's bounds or larger than the file."""
    n_epochs = auto_epochs(examples) if requested.n_epochs == "auto" else requested.n_epochs
    if not 1 <= n_epochs <= MAX_EPOCHS:
        raise HyperparameterError(
            f"n_epochs must be between 1 and {MAX_EPOCHS}, or 'auto'", param=f"{param_prefix}.n_epochs"
        )
    batch_size = auto_batch_size(examples) if requested.batch_size == "auto" else requested.batch_size
    if not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise HyperparameterError(
            f"batch_size must be between 1 and {MAX_BATCH_SIZE}, or 'auto'", param=f"{param_prefix}.batch_size"
        )
    if batch_size > examples:
        raise HyperparameterError(
            f"batch_size {batch_size} is more than the {examples} examples of the training file: give at most "
            f"{examples}, or 'auto'",
            param=f"{param_prefix}.batch_size",
        )
    multiplier = requested.learning_rate_multiplier
    if multiplier == "auto":
        multiplier = auto_learning_rate_multiplier(batch_size)
    if not 0 < multiplier <= MAX_LEARNING_RATE_MULTIPLIER:
        raise HyperparameterError(
            f"learning_rate_multiplier must be more than 0 and at most {MAX_LEARNING_RATE_MULTIPLIER:g}, or 'auto'",
            param=f"{param_prefix}.learning_rate_multiplier",
        )
    return ResolvedHyperparameters(n_epochs=n_epochs, batch_size=batch_size, learning_rate_multiplier=float(multiplier))


def resolve_dpo_hyperparameters(
    requested: DpoHyperparameters, *, examples: int, param_prefix: str
) -> ResolvedDpoHyperparameters:
    """Numbers for a file of ``examples`` preference pairs: the supervised ones resolved as
    ``resolve_hyperparameters`` resolves them, and ``beta``. Raises HyperparameterError."""
    shared = resolve_hyperparameters(requested, examples=examples, param_prefix=param_prefix)
    beta = DEFAULT_DPO_BETA if requested.beta == "auto" else requested.beta
    if not 0 < beta <= MAX_DPO_BETA:
        raise HyperparameterError(
            f"beta must be more than 0 and at most {MAX_DPO_BETA:g}, or 'auto' ({DEFAULT_DPO_BETA:g})",
            param=f"{param_prefix}.beta",
        )
    return ResolvedDpoHyperparameters(**shared.model_dump(), beta=float(beta))


def pretraining_learning_rate(model_config: dict[str, Any] | None, *, lora: bool = False) -> float:
    """The rate a multiplier of 1 means for this model (its config.json; None: not known)."""
    model_type = (model_config or {}).get("model_type")
    rate = PRETRAINING_LEARNING_RATES.get(str(model_type), DEFAULT_PRETRAINING_LEARNING_RATE)
    return rate * (LORA_LEARNING_RATE_FACTOR if lora else 1.0)


@dataclass(frozen=True)
class BatchLayout:
    """How a batch of ``batch_size`` examples runs: on ``num_gpus`` ranks of one worker, each
    doing ``gradient_accumulation_steps`` micro-batches of ``micro_batch_size`` examples."""

    num_gpus: int
    micro_batch_size: int
    gradient_accumulation_steps: int


def batch_layout(batch_size: int, *, devices: int) -> BatchLayout:
    """The most of a worker's ``devices`` that split ``batch_size`` evenly, and the micro-batch
    tuneq would choose for each rank's share (``largest_micro_batch``)."""
    num_gpus = max(n for n in range(1, max(1, devices) + 1) if batch_size % n == 0)
    per_rank = batch_size // num_gpus
    micro = largest_micro_batch(per_rank)
    return BatchLayout(num_gpus=num_gpus, micro_batch_size=micro, gradient_accumulation_steps=per_rank // micro)
