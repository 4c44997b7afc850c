"""A DeepSpeed config tuneq chooses for a job that brings none (an OpenAI-style request, or
``POST /jobs`` without ``deepspeed_config``).

What it looks at, all known at submit without loading weights:

* the model's size, from its config.json (``parameter_count``: decoder-only formulas over
  ``vocab_size``, the hidden size, the layer and head counts and the MLP width);
* the hardware, as the workers record it when they start (``worker.launcher.detect_hardware``,
  the ``workers`` table): the accelerator, and of the live workers that could run the job
  (those with at least ``num_gpus`` devices: it is routed to one of them, and requeued onto
  another) the smallest memory a rank has (``Hardware.memory_per_rank``: a GPU's, or a CPU
  worker's host memory shared by the job's ranks there) and whether all compute in bf16
  natively. The config has to fit wherever the job lands, hence the least of them, not the
  largest worker's. Before any worker recorded its memory (none seen yet, or rows of workers
  from an older release), ``TUNEQ_DEVICE_MEMORY_GIB`` stands in;
* the world size (num_nodes x num_gpus) and the requested global batch size.

What it picks:

* precision, unless ``training.precision`` was given: bf16 where every worker that could run
  the job has it natively (CPUs, NVIDIA GPUs from Ampere on, AMD GPUs), else fp16 (V100, T4:
  they only emulate bf16, slowly). bf16 needs no loss scaling (fp16 overflows and skips steps),
  hence first.
* ZeRO stage and offload: the first of ZeRO-2, ZeRO-3, ZeRO-3 with the optimizer in CPU
  memory, ZeRO-3 with optimizer and weights in CPU memory, whose model states (the plan's
  ``estimate_memory``: DeepSpeed's own estimators) take at most ``MODEL_STATES_SHARE`` of a
  device, leaving the rest for activations. Stages 0 and 1 are never chosen: ZeRO-2 moves as
  many bytes as plain data parallelism (a reduce-scatter and an all-gather instead of one
  all-reduce) and never needs more memory.
* AdamW and a WarmupDecayLR schedule whose numbers are ``"auto"``, filled from ``training``
  by ``shared.deepspeed.auto_values`` (the learning rate, warmup and total steps).
* micro-batch and accumulation: for a requested global batch size, the largest micro-batch up
  to ``MAX_MICRO_BATCH`` that divides each rank's share; without one, ``"auto"`` (training's
  ``micro_batch_size`` and ``gradient_accumulation_steps``).

Nothing here imports torch; the memory estimators import DeepSpeed when called, as the
submit-time checks already do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.deepspeed.auto_values import AUTO, hidden_size_of
from shared.jobs.hardware import Hardware
from shared.jobs.spec import LoraOptions, TrainingOptions

if TYPE_CHECKING:
    from shared.jobs.plan import MemoryEstimate

logger = logging.getLogger(__name__)

# Model states (weights, gradients, optimizer) may take this share of a device; activations,
# the CUDA context and the allocator's fragmentation need the rest.
MODEL_STATES_SHARE = 0.6
# Without an activation estimate, a larger micro-batch is a guess at what fits; 8 rows of a
# few thousand tokens fit next to the model states of any model the share above admits.
MAX_MICRO_BATCH = 8
# Gated MLPs (three projections, LLaMA, Mistral, Qwen2...) use these activations.
_GATED_ACTIVATIONS = frozenset({"silu", "swish"})
# peft's default targets for decoder-only models are the query and value projections.
_LORA_DEFAULT_TARGETS_PER_LAYER = 2

# (ZeRO stage, optimizer state in CPU memory, weights in CPU memory), fastest first.
_CANDIDATES: tuple[tuple[int, bool, bool], ...] = (
    (2, False, False),
    (3, False, False),
    (3, True, False),
    (3, True, True),
)


class DeepSpeedChoiceError(ValueError):
    """No configuration fits: the message says what to change."""


@dataclass(frozen=True)
class ModelSize:
    """A model's parameter count and its largest layer, the most weights one module holds
    itself (ZeRO-3's estimator needs it)."""

    parameters: int
    largest_layer: int


@dataclass(frozen=True)
class ChosenDeepSpeedConfig:
    config: dict[str, Any]
    # None: the model's size is unknown (a hub model): the stage is the default, not a fit.
    memory: MemoryEstimate | None


def _first_int(model_config: dict[str, Any], *keys: str) -> int | None:
    text_config = model_config.get("text_config")
    for source in (model_config, text_config if isinstance(text_config, dict) else {}):
        for key in keys:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def parameter_count(model_config: dict[str, Any]) -> ModelSize | None:
    """The parameter count of a decoder-only model from its config.json, None when a field is missing.

    Fields: ``vocab_size``; the hidden size (``hidden_size`` / ``n_embd`` / ``d_model``);
    layers (``num_hidden_layers`` / ``n_layer`` / ``num_layers``); heads
    (``num_attention_heads`` / ``n_head`` / ``num_heads``), ``num_key_value_heads`` (grouped-query
    attention) and ``head_dim``; the MLP width (``intermediate_size`` / ``n_inner`` /
    ``ffn_dim``, 4 x hidden when absent), gated (3 matrices) when ``hidden_act`` is SiLU;
    ``tie_word_embeddings`` (default true: the output layer is the embedding). Per layer:
    attention = hidden x (q + k + v widths) + q width x hidden; MLP = 2 or 3 x hidden x width.
    Norms, biases and learned position embeddings are left out (well under 1% of a model
    that needs ZeRO-3)."""
    vocab = _first_int(model_config, "vocab_size")
    hidden = hidden_size_of(model_config)
    layers = _first_int(model_config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first_int(model_config, "num_attention_heads", "n_head", "num_heads")
    if vocab is None or hidden is None or layers is None or heads is None:
        return None
    kv_heads = _first_int(model_config, "num_key_value_heads") or heads
    head_dim = _first_int(model_config, "head_dim") or hidden // heads
    width = _first_int(model_config, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    activation = model_config.get("hidden_act") or model_config.get("activation_function")
    mlp_matrices = 3 if activation in _GATED_ACTIVATIONS else 2
    attention = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    mlp = mlp_matrices * hidden * width
    embedding = vocab * hidden
    tied = model_config.get("tie_word_embeddings", True) is not False
    parameters = embedding * (1 if tied else 2) + layers * (attention + mlp)
    # ZeRO-3 gathers one module's own weights at a time: the largest single matrix.
    return ModelSize(parameters=parameters, largest_layer=max(embedding, hidden * width, hidden * heads * head_dim))


def _lora_trainable(model_config: dict[str, Any], lora: LoraOptions) -> int:
    """Adapter parameters: r x (in + out) per adapted linear, hidden x hidden for q and v."""
    hidden = hidden_size_of(model_config) or 0
    layers = _first_int(model_config, "num_hidden_layers", "n_layer", "num_layers") or 0
    targets = len(lora.target_modules) if lora.target_modules else _LORA_DEFAULT_TARGETS_PER_LAYER
    return layers * targets * lora.r * 2 * hidden


def _zero_section(stage: int, offload_optimizer: bool, offload_param: bool) -> dict[str, Any]:
    section: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if offload_optimizer:
        section["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_param:
        section["offload_param"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:
        # The export gathers every weight itself; the buckets follow the model's hidden size.
        section |= {
            "reduce_bucket_size": AUTO,
            "stage3_prefetch_bucket_size": AUTO,
            "stage3_param_persistence_threshold": AUTO,
        }
    else:
        section["reduce_bucket_size"] = AUTO
    return section


def largest_micro_batch(per_rank: int) -> int:
    """The micro-batch for a rank's share of a batch: the largest up to ``MAX_MICRO_BATCH`` that
    divides it (the rest is gradient accumulation)."""
    return max(m for m in range(1, min(per_rank, MAX_MICRO_BATCH) + 1) if per_rank % m == 0)


def _batch_section(batch_size: int | None, world_size: int) -> dict[str, Any]:
    if batch_size is None:
        return {"train_batch_size": AUTO, "train_micro_batch_size_per_gpu": AUTO, "gradient_accumulation_steps": AUTO}
    if batch_size % world_size:
        raise DeepSpeedChoiceError(
            f"batch size {batch_size} does not split evenly over {world_size} ranks: ask for a multiple of {world_size}"
        )
    per_rank = batch_size // world_size
    micro = largest_micro_batch(per_rank)
    return {
        "train_batch_size": batch_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": per_rank // micro,
    }


def _precision(training: TrainingOptions, hardware: Hardware | None, num_gpus: int) -> str:
    if "precision" in training.model_fields_set:
        return training.precision
    return "bf16" if hardware is None or hardware.supports_bf16(num_gpus) else "fp16"


def choose_deepspeed_config(
    *,
    model_config: dict[str, Any] | None,
    hardware: Hardware | None,
    num_gpus: int,
    num_nodes: int,
    training: TrainingOptions,
    assumed_device_memory_bytes: int,
    batch_size: int | None = None,
) -> ChosenDeepSpeedConfig:
    """The config for a job of ``training`` on ``num_nodes`` x ``num_gpus`` ranks of the
    workers in ``hardware`` that could run it (None: no worker seen yet, planned as CUDA).
    A rank has the memory those workers recorded (``Hardware.memory_per_rank``), or
    ``assumed_device_memory_bytes`` (``TUNEQ_DEVICE_MEMORY_GIB``) where none did.

    ``model_config`` is the model's config.json (None for a hub model: then ZeRO-2, the
    stage that runs anything that fits one device and scales without more communication).
    Raises DeepSpeedChoiceError when even ZeRO-3 with everything offloaded does not fit."""
    # The plan module imports the submit-time checks, which call this module.
    from shared.jobs.plan import estimate_memory

    world_size = num_gpus * num_nodes
    precision = _precision(training, hardware, num_gpus)
    recorded = hardware.memory_per_rank(num_gpus) if hardware is not None else None
    device_memory_bytes = recorded if recorded is not None else assumed_device_memory_bytes
    size = parameter_count(model_config) if model_config is not None else None
    on_cpu = hardware is not None and hardware.accelerator == "cpu"
    # On a CPU worker the "device" is host memory already: offloading to it gains nothing.
    candidates = [c for c in _CANDIDATES if not (on_cpu and (c[1] or c[2]))]
    chosen, memory = candidates[0], None
    if size is not None:
        trainable = size.parameters
        if training.lora is not None and model_config is not None:
            trainable = _lora_trainable(model_config, training.lora)
        budget = int(device_memory_bytes * MODEL_STATES_SHARE)
        estimates = []
        for stage, offload_optimizer, offload_param in candidates:
            estimate = estimate_memory(
                config={"zero_optimization": _zero_section(stage, offload_optimizer, offload_param)},
                zero_stage=stage,
                parameters=size.parameters,
                trainable=trainable,
                largest_layer=size.largest_layer,
                world_size=world_size,
                num_nodes=num_nodes,
            )
            estimates.append(((stage, offload_optimizer, offload_param), estimate))
            if estimate.per_device_bytes <= budget:
                break
        else:
            smallest = estimates[-1][1].per_device_bytes
            # A CPU worker's ranks are in host memory already: nothing to offload to.
            least = "ZeRO-3" if on_cpu else "ZeRO-3 and CPU offload"
            source = (
                "as recorded by the smallest worker that could run the job"
                if recorded is not None
                else "TUNEQ_DEVICE_MEMORY_GIB: no worker has recorded its memory yet"
            )
            raise DeepSpeedChoiceError(
                f"a model of {size.parameters:,} parameters needs {smallest / 2**30:.1f} GiB a rank for "
                f"its weights, gradients and optimizer state even with {least}, more than "
                f"{MODEL_STATES_SHARE:.0%} of the {device_memory_bytes / 2**30:.1f} GiB a rank has "
                f"({source}): use more GPUs (num_gpus, num_nodes), LoRA (training.lora), "
                "or give a deepspeed_config"
            )
        chosen, memory = estimates[-1]
    stage, offload_optimizer, offload_param = chosen
    config: dict[str, Any] = {
        **_batch_section(batch_size, world_size),
        "gradient_clipping": AUTO,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
        "optimizer": {"type": "AdamW", "params": {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {"warmup_min_lr": AUTO, "warmup_max_lr": AUTO, "warmup_num_steps": AUTO, "total_num_steps": AUTO},
        },
        "zero_optimization": _zero_section(stage, offload_optimizer, offload_param),
    }
    logger.info(
        "chose ZeRO-%d (offload optimizer %s, weights %s), %s, for %s parameters on %d ranks of %.1f GiB",
        stage,
        offload_optimizer,
        offload_param,
        precision,
        f"{size.parameters:,}" if size else "an unknown number of",
        world_size,
        device_memory_bytes / 2**30,
    )
    return ChosenDeepSpeedConfig(config=config, memory=memory)
