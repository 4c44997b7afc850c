"""The job's attention implementation (``training.attention``): the choice for this model on
this device, and GPT-Neo's local-window attention on the fast paths.

transformers gives GPT-Neo ``eager`` and ``flash_attention_2`` only, and its flash path drops
the local layers' window (and the boundaries of samples sharing a row). Here GPT-Neo gets
``sdpa`` and ``flex_attention`` of its own: the model is built with eager attention, each
``GPTNeoSelfAttention`` becomes a :class:`GPTNeoLocalWindowAttention` (same weights, its
``_attn`` replaced) and the config names the implementation, so the model's mask builder
(``masking_utils``) makes that implementation's mask (a boolean mask or None for sdpa, a
``BlockMask`` for flex), padding and packed samples included; a local layer adds its window to
it. GPT-Neo's scores are not scaled by 1/sqrt(head_dim) (``scale=1.0``); the fused kernels
accumulate the scores in fp32, as eager's upcast does.

Samples sharing a row (packing, ``padding_free``) are kept apart by the mask builder for
eager, sdpa and flex attention, from the restarting ``position_ids``. transformers' flash
attention does it only in a batch of one row (its variable-length path), so with flash
attention such micro-batches are collated into one row (``worker.rank.batches``).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import sys
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.nn import functional
from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention

from shared.jobs.attention import (
    FLASH_ATTENTION_NEEDS_CUDA,
    FLEX_ATTENTION_DROPOUT,
    FLEX_ATTENTION_NEEDS_CUDA,
    GPT_NEO,
    GPT_NEO_FLASH_ATTENTION,
    Attention,
    AttentionChoice,
    attention_dropout_of,
)
from worker.errors import InvalidInputError

logger = logging.getLogger(__name__)

TUNEQ_GPT_NEO = ("sdpa", "flex_attention")  # GPT-Neo implementations that are tuneq's
# The names of masking_utils' mask builders: a model whose modeling code calls one keeps the
# samples of a row apart given restarting position_ids.
MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_masks_for_generate")


def flash_attention_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def causal_lm_class(config: Any) -> type | None:
    """The transformers class ``AutoModelForCausalLM`` builds for ``config`` (None: none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        found: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None
    return found if isinstance(found, type) else None


def supported_attention(config: Any) -> set[str]:
    """The implementations this model computes correctly, device aside."""
    if config.model_type == GPT_NEO:
        return {"eager", *TUNEQ_GPT_NEO}
    model_class = causal_lm_class(config)
    supported = {"eager"}
    if model_class is not None:
        flags = {
            "sdpa": "_supports_sdpa",
            "flex_attention": "_supports_flex_attn",
            "flash_attention_2": "_supports_flash_attn",
        }
        supported |= {name for name, flag in flags.items() if getattr(model_class, flag, False)}
    return supported


def keeps_samples_apart(config: Any) -> bool:
    """Whether the model's code builds its mask with masking_utils, which keeps samples sharing
    a row apart given restarting position_ids."""
    if config.model_type == GPT_NEO:
        return True
    model_class = causal_lm_class(config)
    module = sys.modules.get(model_class.__module__) if model_class is not None else None
    if module is None:
        return False
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return False
    return any(name in source for name in MASK_BUILDERS)


@dataclass(frozen=True)
class AttentionFacts:
    """What the choice depends on besides the model: where the ranks compute, and how."""

    device_type: str  # "cuda" or "cpu": the DeepSpeed accelerator's
    half_precision: bool  # the run computes in fp16 or bf16
    padding_free: bool
    flash_attention_installed: bool


def choose_attention(requested: AttentionChoice, *, config: Any, facts: AttentionFacts) -> Attention:
    """The implementation the job runs: ``requested``, checked against the model and the
    device, or for ``auto`` the fastest that computes the same attention as eager here.
    An implementation that cannot work is the user's input error naming training.attention."""
    supported = supported_attention(config)
    flash_ready = facts.device_type == "cuda" and facts.flash_attention_installed
    if requested == "auto":
        chosen: Attention
        if "flash_attention_2" in supported and flash_ready and facts.half_precision:
            chosen = "flash_attention_2"
        elif facts.device_type == "cuda" and "sdpa" in supported:
            chosen = "sdpa"
        elif facts.device_type != "cuda" and config.model_type != GPT_NEO and "sdpa" in supported:
            # transformers' own default; GPT-Neo stays eager on CPUs (BENCHMARKS.md: B1).
            chosen = "sdpa"
        else:
            chosen = "eager"
    else:
        chosen = requested
        _check_requested(chosen, supported=supported, config=config, facts=facts, flash_ready=flash_ready)
    if facts.padding_free and not keeps_samples_apart(config):
        raise InvalidInputError(
            f"training.padding_free needs an attention that keeps the samples of a row apart, and the "
            f"{config.model_type} model's code in transformers builds its mask without them: turn padding_free off"
        )
    return chosen


def _check_requested(
    requested: Attention, *, supported: set[str], config: Any, facts: AttentionFacts, flash_ready: bool
) -> None:
    if requested == "flash_attention_2":
        if config.model_type == GPT_NEO:
            raise InvalidInputError(GPT_NEO_FLASH_ATTENTION)
        if not flash_ready:
            where = (
                ", which this worker has not installed"
                if facts.device_type == "cuda"
                else ", and this worker has no GPU"
            )
            raise InvalidInputError(FLASH_ATTENTION_NEEDS_CUDA.format(where=where))
    if requested not in supported:
        raise InvalidInputError(
            f"training.attention {requested}: the {config.model_type} model has no {requested} attention in "
            f"transformers: set training.attention to auto or one of {', '.join(sorted(supported))}"
        )
    if requested == "flash_attention_2" and not facts.half_precision:
        raise InvalidInputError(
            "training.attention flash_attention_2 computes in fp16 or bf16 only, and this run computes in fp32: "
            "set training.precision (or the DeepSpeed config's bf16/fp16) to bf16, or training.attention to auto "
            "or sdpa"
        )
    if requested == "flex_attention":
        if facts.device_type != "cuda":
            raise InvalidInputError(FLEX_ATTENTION_NEEDS_CUDA.format(where=", and this worker has no GPU"))
        dropout = attention_dropout_of(config.to_dict())
        if dropout > 0:
            raise InvalidInputError(FLEX_ATTENTION_DROPOUT.format(dropout=dropout))


def implementation_to_load(config: Any, attention: Attention) -> str:
    """What ``from_pretrained`` is asked for: GPT-Neo's own fast paths start from eager."""
    if config.model_type == GPT_NEO and attention in TUNEQ_GPT_NEO:
        return "eager"
    return attention


def install_attention(model: Any, attention: Attention) -> None:
    """Put tuneq's GPT-Neo attention in place (any other model was built with ``attention``)."""
    if model.config.model_type != GPT_NEO or attention not in TUNEQ_GPT_NEO:
        return
    local_masks = LocalMasks()
    for module in model.modules():
        if isinstance(module, GPTNeoSelfAttention):
            module.__class__ = GPTNeoLocalWindowAttention
            cast(GPTNeoLocalWindowAttention, module).local_masks = local_masks
    # The mask builder now makes this implementation's mask (GPTNeoAttention chose its layer
    # class at construction, so nothing else reads the name).
    model.config._attn_implementation = attention


class LocalMasks:
    """The flex ``BlockMask`` of the local layers, derived once per forward from the model's
    (every layer gets the same mask object in one forward)."""

    def __init__(self) -> None:
        self.source: Any = None
        self.local: Any = None


def _diagonal(q_length: int, kv_length: int, device: torch.device) -> torch.Tensor:
    """Each query's own key (queries are the last ``q_length`` keys)."""
    rows = torch.arange(q_length, device=device)
    diagonal = torch.zeros(q_length, kv_length, dtype=torch.bool, device=device)
    diagonal[rows, rows + kv_length - q_length] = True
    return diagonal


class GPTNeoLocalWindowAttention(GPTNeoSelfAttention):
    """GPT-Neo's self-attention through sdpa or flex attention, global or local as the layer
    is. Padding queries of a local layer may see no key in their window: they attend to
    themselves (only padding attends to padding, so no real token's output changes), where
    eager's additive mask leaves them a finite softmax and sdpa would give NaN."""

    local_masks: LocalMasks

    def _attn(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any = None,
    ) -> tuple[torch.Tensor, None]:
        q_length, kv_length = query.size(-2), key.size(-2)
        # The window excludes keys only when there are more than window_size of them.
        windowed = self.attention_type == "local" and kv_length > self.config.window_size
        if self.config._attn_implementation == "flex_attention":
            return self._flex(query, key, value, attention_mask, windowed), None
        dropout = self.attn_dropout.p if self.training else 0.0
        if attention_mask is None and not windowed:
            causal = q_length > 1  # one query (decoding) sees every key
            return (
                functional.scaled_dot_product_attention(
                    query, key, value, dropout_p=dropout, is_causal=causal, scale=1.0
                ),
                None,
            )
        # The layer's own causal (and, for a local layer, windowed) pattern, as eager slices it.
        mask = self.bias[:, :, kv_length - q_length : kv_length, :kv_length]
        if attention_mask is not None:
            mask = mask & attention_mask
            if windowed:
                mask = mask | _diagonal(q_length, kv_length, query.device)
        output = functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=1.0
        )
        return output, None

    def _flex(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any, windowed: bool
    ) -> torch.Tensor:
        from transformers.integrations.flex_attention import compile_friendly_flex_attention

        if windowed:
            block_mask = self._local_block_mask(block_mask, batch=query.size(0), device=query.device)
        output = compile_friendly_flex_attention(
            query, key, value, block_mask=block_mask, scale=1.0, training=self.training
        )
        return output[0] if isinstance(output, tuple) else output

    def _local_block_mask(self, block_mask: Any, *, batch: int, device: torch.device) -> Any:
        from torch.nn.attention.flex_attention import create_block_mask

        cache = self.local_masks
        if cache.source is not block_mask:
            base, window = block_mask.mask_mod, self.config.window_size

            def local(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return (base(b, h, q_idx, kv_idx) & (q_idx - kv_idx < window)) | (q_idx == kv_idx)

            _, _, q_length, kv_length = block_mask.shape
            cache.local = create_block_mask(
                local, B=batch, H=None, Q_LEN=q_length, KV_LEN=kv_length, device=device, _compile=True
            )
            cache.source = block_mask
        return cache.local
