"""Loading the job's model: safetensors only, no remote code, partitioned at load under ZeRO-3,
with the attention ``worker.rank.attention`` chooses."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from shared.deepspeed.config import wants_half_precision
from shared.jobs.attention import Attention
from shared.jobs.lora import LoraTargetError, add_lora
from shared.jobs.spec import TrainingOptions, TrainingSpec, max_positions_of
from worker.errors import InvalidInputError
from worker.rank.attention import (
    AttentionFacts,
    choose_attention,
    flash_attention_installed,
    implementation_to_load,
    install_attention,
)
from worker.rank.kernels import apply_kernels

logger = logging.getLogger(__name__)

ModelLoad = Literal["full", "partitioned"]

# transformers finds ZeRO-3 through a weak reference to the live HfDeepSpeedConfig: it must
# outlive from_pretrained (and anything after that asks is_deepspeed_zero3_enabled()).
_zero3_config: Any = None


def load_tokenizer(spec: TrainingSpec) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(spec.model, revision=spec.revision, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise InvalidInputError(f"model '{spec.model}': cannot load its tokenizer ({e})") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_config(spec: TrainingSpec) -> Any:
    """The model's transformers config (no remote code)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(spec.model, revision=spec.revision, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise InvalidInputError(f"model '{spec.model}': cannot load its config ({e})") from None


def settle_training(spec: TrainingSpec, config: Any) -> TrainingOptions:
    """The job's training options settled for its model (``max_seq_length`` against the
    positions in its ``config``), before any data is tokenized."""
    try:
        return spec.training.for_model(max_positions_of(config.to_dict()))
    except ValueError as e:
        raise InvalidInputError(str(e)) from None


@dataclass(frozen=True)
class LoadedModel:
    model: Any
    load: ModelLoad
    attention: Attention  # the implementation it runs (training.attention settled)


def load_model(
    spec: TrainingSpec,
    *,
    config: Any,
    deepspeed_config: dict[str, Any],
    zero_stage: int,
    kernels: Sequence[str] = (),
) -> LoadedModel:
    """The model (its transformers ``config`` read once, by :func:`load_config`), how it was
    built, and the attention it runs.

    Under ZeRO-3 each layer is built inside ``deepspeed.zero.Init`` and only this rank's
    shard of its weights is kept, so a model larger than one device (or one host's memory
    per rank) loads; ``deepspeed_config`` must then hold numbers, not "auto". ``kernels``
    (``worker.rank.kernels.choose_kernels``) are applied before LoRA wraps the model, so
    the adapters wrap the patched modules' layers as they would the originals.
    """
    global _zero3_config
    from deepspeed.accelerator import get_accelerator
    from transformers import AutoModelForCausalLM

    facts = AttentionFacts(
        device_type=get_accelerator().device_name(),
        half_precision=wants_half_precision(deepspeed_config),
        padding_free=spec.training.padding_free,
        flash_attention_installed=flash_attention_installed(),
    )
    attention = choose_attention(spec.training.attention, config=config, facts=facts)
    logger.info("attention: %s (training.attention %s)", attention, spec.training.attention)
    if zero_stage == 3:
        from transformers.integrations import HfDeepSpeedConfig

        _zero3_config = HfDeepSpeedConfig(deepspeed_config)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            spec.model,
            revision=spec.revision,
            use_safetensors=True,
            trust_remote_code=False,
            attn_implementation=implementation_to_load(config, attention),
        )
    except (OSError, ValueError) as e:
        raise InvalidInputError(f"model '{spec.model}': cannot load safetensors weights ({e})") from None
    install_attention(model, attention)
    # ZeRO-3 marks every parameter it partitioned with a ds_id.
    partitioned = zero_stage == 3 and all(hasattr(p, "ds_id") for p in model.parameters())
    if zero_stage == 3 and not partitioned:
        logger.warning("ZeRO-3: the model was not partitioned at load; every rank holds it whole until initialize")
    # No KV cache in training; transformers also keeps packed samples apart only without one.
    model.config.use_cache = False
    apply_kernels(model, kernels)
    if spec.training.lora is not None:
        try:
            model = add_lora(model, spec.training.lora)
        except LoraTargetError as e:
            raise InvalidInputError(str(e)) from None
    return LoadedModel(model, "partitioned" if partitioned else "full", attention)
