"""The DeepSpeed config tuneq chooses for a job without one: by model size, hardware, world size."""

from __future__ import annotations

from typing import Any

import pytest

from shared.deepspeed.auto_values import AutoInputs, fill_auto, hidden_size_of, without_auto
from shared.deepspeed.chosen import (
    ChosenDeepSpeedConfig,
    DeepSpeedChoiceError,
    choose_deepspeed_config,
    parameter_count,
)
from shared.deepspeed.config import resolve_deepspeed_config
from shared.deepspeed.safety import sanitize_deepspeed_config
from shared.jobs.hardware import Hardware
from shared.jobs.spec import LoraOptions, TrainingOptions

GIB = 2**30
# cli.samples' tiny GPT-Neo, as its config.json has it.
TINY_GPT_NEO: dict[str, Any] = {
    "model_type": "gpt_neo",
    "vocab_size": 1000,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "max_position_embeddings": 128,
    "activation_function": "gelu_new",
}
# meta-llama/Llama-2-7b-hf's config.json (the fields the count reads): 6,738,415,616 parameters.
LLAMA_7B: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 11008,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
CUDA_1, CUDA_8, CPU_2 = Hardware("cuda", 1, (1,)), Hardware("cuda", 8, (8,)), Hardware("cpu", 2, (2,))


def choose(
    model_config: dict[str, Any] | None, hardware: Hardware | None, num_gpus: int, **kw: Any
) -> ChosenDeepSpeedConfig:
    return choose_deepspeed_config(
        model_config=model_config,
        hardware=hardware,
        num_gpus=num_gpus,
        num_nodes=kw.pop("num_nodes", 1),
        training=kw.pop("training", TrainingOptions()),
        assumed_device_memory_bytes=kw.pop("assumed_device_memory_bytes", 80 * GIB),
        **kw,
    )


def parses(chosen: ChosenDeepSpeedConfig, model_config: dict[str, Any] | None, world_size: int) -> Any:
    """What DeepSpeed's parser makes of the choice once "auto" is filled as at submit."""
    hidden = hidden_size_of(model_config) if model_config else None
    filled = fill_auto(chosen.config, AutoInputs(TrainingOptions(), world_size, hidden_size=hidden))
    _, unsafe = sanitize_deepspeed_config(filled, run_dir="/tmp/run")
    assert unsafe == []
    return resolve_deepspeed_config(without_auto(filled), world_size=world_size)


def test_the_parameter_count_of_a_7b_llama_from_its_config_matches_the_published_one() -> None:
    # 6,738,415,616 less the 2 x 32 + 1 RMSNorm weights of width 4096 the count leaves out.
    size = parameter_count(LLAMA_7B)
    assert size is not None and size.parameters == 6_738_415_616 - 65 * 4096
    assert size.largest_layer == 32000 * 4096
    assert parameter_count({"hidden_size": 64}) is None  # no vocabulary, no layers: unknown


def test_a_tiny_model_gets_zero2_without_offload_and_bf16() -> None:
    chosen = choose(TINY_GPT_NEO, CUDA_1, 1)
    zero = chosen.config["zero_optimization"]
    assert zero["stage"] == 2 and "offload_optimizer" not in zero and "offload_param" not in zero
    assert chosen.memory is not None and chosen.memory.per_device_bytes < GIB
    batch = parses(chosen, TINY_GPT_NEO, 1)
    assert (batch.zero_stage, batch.bf16, batch.fp16) == (2, True, False)


def test_a_7b_model_on_one_80gb_gpu_offloads_and_on_eight_fits_zero2() -> None:
    one = choose(LLAMA_7B, CUDA_1, 1)
    zero = one.config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"
    assert one.memory is not None and one.memory.per_device_bytes <= 0.6 * 80 * GIB
    assert parses(one, LLAMA_7B, 1).zero_stage == 3
    eight = choose(LLAMA_7B, CUDA_8, 8)
    assert eight.config["zero_optimization"]["stage"] == 2
    assert "offload_optimizer" not in eight.config["zero_optimization"]
    assert parses(eight, LLAMA_7B, 8).zero_stage == 2
    # Half the memory a device: ZeRO-2's unsharded weights and gradients no longer fit on 8.
    smaller = choose(LLAMA_7B, CUDA_8, 8, assumed_device_memory_bytes=40 * GIB)
    assert smaller.config["zero_optimization"]["stage"] == 3
    assert parses(smaller, LLAMA_7B, 8).zero_stage == 3


def test_a_cpu_host_gets_bf16_never_fp16_and_no_offload() -> None:
    chosen = choose(LLAMA_7B, CPU_2, 2, assumed_device_memory_bytes=200 * GIB)
    zero = chosen.config["zero_optimization"]
    assert "offload_optimizer" not in zero and "offload_param" not in zero
    batch = parses(chosen, LLAMA_7B, 2)
    assert batch.bf16 and not batch.fp16


def test_an_explicit_precision_in_training_is_kept() -> None:
    chosen = choose(TINY_GPT_NEO, CUDA_1, 1, training=TrainingOptions(precision="fp32"))
    assert chosen.config["bf16"] == {"enabled": False} and chosen.config["fp16"] == {"enabled": False}


def test_lora_trains_few_parameters_so_a_7b_model_needs_no_offload_on_one_gpu() -> None:
    chosen = choose(LLAMA_7B, CUDA_1, 1, training=TrainingOptions(lora=LoraOptions()))
    assert chosen.config["zero_optimization"]["stage"] == 2
    assert "offload_optimizer" not in chosen.config["zero_optimization"]


def test_a_hub_model_of_unknown_size_gets_zero2() -> None:
    chosen = choose(None, None, 4)
    assert chosen.memory is None and chosen.config["zero_optimization"]["stage"] == 2
    assert parses(chosen, None, 4).zero_stage == 2


@pytest.mark.parametrize(("batch_size", "ranks", "micro", "accumulation"), [(8, 1, 8, 1), (32, 2, 8, 2), (24, 8, 3, 1)])
def test_a_requested_batch_size_becomes_micro_batch_and_accumulation(
    batch_size: int, ranks: int, micro: int, accumulation: int
) -> None:
    chosen = choose(TINY_GPT_NEO, Hardware("cuda", ranks, (ranks,)), ranks, batch_size=batch_size)
    batch = parses(chosen, TINY_GPT_NEO, ranks)
    assert (batch.train_batch_size, batch.micro_batch_per_gpu, batch.gradient_accumulation_steps) == (
        batch_size,
        micro,
        accumulation,
    )


def test_a_batch_size_that_does_not_split_over_the_ranks_is_refused() -> None:
    with pytest.raises(DeepSpeedChoiceError, match="multiple of 4"):
        choose(TINY_GPT_NEO, CUDA_8, 4, batch_size=6)


def test_a_model_too_large_even_with_offload_is_refused_with_the_fix() -> None:
    with pytest.raises(DeepSpeedChoiceError, match="use more GPUs"):
        choose(LLAMA_7B, CUDA_1, 1, assumed_device_memory_bytes=GIB // 2)


def gpus(count: int, memory_gib: float | None, *, bf16: bool | None = True) -> Hardware:
    """One worker of ``count`` GPUs, as it records itself (None: a row from an older release)."""
    memory = int(memory_gib * GIB) if memory_gib is not None else None
    return Hardware("cuda", count, device_memory_bytes=memory, bf16_supported=bf16)


def test_the_memory_the_workers_recorded_wins_over_the_setting() -> None:
    # A 7B model on one 16 GiB T4 (no native bf16): even its weights do not stay on the GPU, and
    # fp16, though the setting says 80 GiB (where the optimizer alone would go to the CPU).
    t4 = Hardware.most_of([gpus(1, 16, bf16=False)])
    chosen = choose(LLAMA_7B, t4, 1)
    zero = chosen.config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
    assert chosen.memory is not None and chosen.memory.per_device_bytes <= 0.6 * 16 * GIB
    batch = parses(chosen, LLAMA_7B, 1)
    assert (batch.zero_stage, batch.fp16, batch.bf16) == (3, True, False)
    # Eight 24 GiB GPUs: ZeRO-2 (it fits eight 80 GiB ones) becomes ZeRO-3 with the optimizer offloaded.
    eight = choose(LLAMA_7B, Hardware.most_of([gpus(8, 24)]), 8)
    zero = eight.config["zero_optimization"]
    assert zero["stage"] == 3 and "offload_optimizer" in zero and "offload_param" not in zero
    assert eight.config["bf16"] == {"enabled": True}
    assert parses(eight, LLAMA_7B, 8).zero_stage == 3


def test_the_choice_fits_every_worker_that_could_run_the_job() -> None:
    # A 1-GPU job may land on either worker, so it fits the 16 GiB one, in its fp16; an 8-GPU
    # job runs on the 8-GPU worker only, in its 80 GiB and bf16.
    deployment = Hardware.most_of([gpus(1, 16, bf16=False), gpus(8, 80)])
    assert deployment is not None
    assert deployment.memory_per_rank(1) == 16 * GIB and not deployment.supports_bf16(1)
    assert deployment.memory_per_rank(8) == 80 * GIB and deployment.supports_bf16(8)
    one = choose(LLAMA_7B, deployment, 1).config
    assert "offload_param" in one["zero_optimization"] and one["fp16"] == {"enabled": True}
    eight = choose(LLAMA_7B, deployment, 8).config
    assert eight["zero_optimization"]["stage"] == 2 and eight["bf16"] == {"enabled": True}


def test_workers_that_recorded_nothing_fall_back_to_the_setting_and_bf16() -> None:
    older = Hardware.most_of([gpus(8, None, bf16=None)])
    assert older is not None and older.memory_per_rank(8) is None and older.supports_bf16(8)
    chosen = choose(LLAMA_7B, older, 8, assumed_device_memory_bytes=40 * GIB)
    assert chosen.config["zero_optimization"]["stage"] == 3 and chosen.config["bf16"] == {"enabled": True}
    # Beside a worker that did record its memory, an older row says nothing about memory.
    mixed = Hardware.most_of([gpus(8, None, bf16=None), gpus(8, 24)])
    assert mixed is not None and mixed.memory_per_rank(8) == 24 * GIB


def test_the_ranks_of_a_cpu_worker_share_its_host_memory() -> None:
    host = Hardware.most_of([Hardware("cpu", 16, device_memory_bytes=256 * GIB, bf16_supported=True)])
    assert host is not None and host.memory_per_rank(1) == 256 * GIB and host.memory_per_rank(4) == 64 * GIB
    one = choose(LLAMA_7B, host, 1)
    assert one.config["zero_optimization"]["stage"] == 2 and one.config["bf16"] == {"enabled": True}
    four = choose(LLAMA_7B, host, 4)
    zero = four.config["zero_optimization"]
    assert zero["stage"] == 3 and "offload_optimizer" not in zero  # nothing to offload to on a CPU worker
    small = Hardware.most_of([Hardware("cpu", 16, device_memory_bytes=64 * GIB, bf16_supported=True)])
    refusal = r"even with ZeRO-3, more than 60% of the 64.0 GiB a rank has \(as recorded"
    with pytest.raises(DeepSpeedChoiceError, match=refusal):
        choose(LLAMA_7B, small, 1)


def test_an_explicit_precision_is_kept_on_gpus_without_bf16() -> None:
    v100s = Hardware.most_of([gpus(8, 32, bf16=False)])
    chosen = choose(TINY_GPT_NEO, v100s, 8, training=TrainingOptions(precision="bf16"))
    assert chosen.config["bf16"] == {"enabled": True} and chosen.config["fp16"] == {"enabled": False}
