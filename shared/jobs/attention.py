"""``training.attention``: which attention implementation a job's model runs, and what can be
refused at submit, before any rank exists.

The ranks make the choice (``worker.rank.attention``): only they know the model's class, the
device and whether ``flash_attn`` is installed. What the API can already tell from a local
model's ``config.json`` and the deployment's hardware is refused here with the same words.
"""

from __future__ import annotations

from typing import Any, Literal

AttentionChoice = Literal["auto", "eager", "sdpa", "flash_attention_2", "flex_attention"]
Attention = Literal["eager", "sdpa", "flash_attention_2", "flex_attention"]  # what a job runs

# GPT-Neo runs sdpa and flex_attention through tuneq's own local-window attention
# (worker.rank.attention); transformers' own GPT-Neo has eager and flash_attention_2 only.
GPT_NEO = "gpt_neo"

GPT_NEO_FLASH_ATTENTION = (
    "training.attention flash_attention_2: transformers' GPT-Neo flash attention drops the local layers' "
    "window (they would attend globally) and the boundaries of samples sharing a row, which changes the "
    "model's math: set training.attention to sdpa or flex_attention (tuneq's local-window attention), or auto"
)
FLASH_ATTENTION_NEEDS_CUDA = (
    "training.attention flash_attention_2 needs a CUDA GPU with the flash-attn package installed{where}: "
    "set training.attention to auto or sdpa"
)
FLEX_ATTENTION_NEEDS_CUDA = (
    "training.attention flex_attention trains on CUDA GPUs only (torch has no flex attention backward on "
    "CPUs){where}: set training.attention to auto or sdpa"
)
FLEX_ATTENTION_DROPOUT = (
    "training.attention flex_attention has no attention dropout, and this model's config has "
    "attention_dropout {dropout}: set training.attention to auto, sdpa or eager"
)


def attention_dropout_of(model_config: dict[str, Any]) -> float:
    """The attention dropout a model's config.json asks for (0 where it names none)."""
    value = model_config.get("attention_dropout", 0.0)
    return float(value) if isinstance(value, int | float) else 0.0


def submit_attention_problem(
    attention: AttentionChoice, *, model_config: dict[str, Any] | None, accelerator: str | None
) -> str | None:
    """Why ``attention`` can never work for this job, as far as the API can tell: from a local
    model's ``config.json`` (None for a hub model) and the accelerator the deployment's live
    workers offer at most (None while none is known). None where it may work."""
    if attention == "flash_attention_2":
        if model_config is not None and model_config.get("model_type") == GPT_NEO:
            return GPT_NEO_FLASH_ATTENTION
        if accelerator is not None and accelerator != "cuda":
            return FLASH_ATTENTION_NEEDS_CUDA.format(where=", and the workers of this deployment have no GPU")
    if attention == "flex_attention":
        if accelerator is not None and accelerator != "cuda":
            return FLEX_ATTENTION_NEEDS_CUDA.format(where=", and the workers of this deployment have no GPU")
        dropout = attention_dropout_of(model_config) if model_config is not None else 0.0
        if dropout > 0:
            return FLEX_ATTENTION_DROPOUT.format(dropout=dropout)
    return None
