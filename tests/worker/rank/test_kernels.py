"""Which fused kernels and whether compile, per job (``worker.rank.kernels``).

The choice is plain logic over the job and the host and runs anywhere. Liger Kernel itself is
the ``gpu`` extra (Triton); where it is installed, the tests below also read its real table and
patch a real (tiny, CPU) Llama with it. Running its kernels needs CUDA: that is the GPU
benchmark's part (benchmarks/gpu.py compares the loss curves with and without them).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from shared.jobs.spec import LoraOptions, TrainingOptions
from worker.rank.kernels import (
    FUSED_LOSS,
    KernelChoice,
    apply_kernels,
    choose_compile,
    choose_kernels,
    liger_installed,
    offered_kernels,
)

LLAMA_KERNELS = ("rope", "rms_norm", "swiglu", FUSED_LOSS)


def llama_offers(model_type: str) -> tuple[str, ...]:
    """What Liger 0.8.5 offers a llama (the test with Liger installed checks it is so)."""
    return LLAMA_KERNELS if model_type == "llama" else ()


def choose(options: TrainingOptions | None = None, **facts: Any) -> KernelChoice:
    options = options or TrainingOptions()
    given = {"model_type": "llama", "device_type": "cuda", "zero_stage": 2, "liger_available": True} | facts
    return choose_kernels(options, offered=llama_offers, **given)


def test_auto_applies_every_kernel_of_the_type_on_cuda() -> None:
    assert choose() == KernelChoice(LLAMA_KERNELS)


def test_off_a_cpu_and_a_type_without_kernels_apply_nothing_and_warn_of_nothing() -> None:
    for choice in (
        choose(TrainingOptions(kernels="off")),
        choose(device_type="cpu"),
        choose(model_type="bloom"),
    ):
        assert choice.kernels == () and choice.note and not choice.warn
    assert "cpu" in (choose(device_type="cpu").note or "")


def test_a_gpu_worker_without_liger_warns_that_it_trains_without() -> None:
    choice = choose(liger_available=False)
    assert choice.kernels == () and choice.warn and "tuneq[gpu]" in (choice.note or "")


def test_a_liger_that_does_not_import_warns_and_trains_without() -> None:
    def broken(model_type: str) -> tuple[str, ...]:
        raise ImportError("libcuda.so.1: cannot open shared object file")

    choice = choose_kernels(
        TrainingOptions(), model_type="llama", device_type="cuda", zero_stage=2, liger_available=True, offered=broken
    )
    assert choice.kernels == () and choice.warn and "libcuda" in (choice.note or "")


def test_zero3_keeps_the_other_kernels_and_says_why_the_fused_loss_is_not_applied() -> None:
    choice = choose(zero_stage=3)
    assert choice.kernels == ("rope", "rms_norm", "swiglu")
    assert choice.warn and "ZeRO-3" in (choice.note or "") and "fused linear cross-entropy" in (choice.note or "")


def test_a_lora_adapter_on_the_lm_head_keeps_the_logits() -> None:
    on_head = TrainingOptions(lora=LoraOptions(target_modules=["q_proj", "lm_head"]))
    choice = choose(on_head)
    assert FUSED_LOSS not in choice.kernels and choice.warn and "lm_head" in (choice.note or "")
    # Adapters elsewhere leave the head a plain layer: the fused loss stays.
    assert choose(TrainingOptions(lora=LoraOptions(target_modules=["q_proj"]))) == KernelChoice(LLAMA_KERNELS)
    assert choose(TrainingOptions(lora=LoraOptions())) == KernelChoice(LLAMA_KERNELS)


def test_compile_auto_is_cuda_below_zero3_and_on_or_off_are_as_asked() -> None:
    auto = TrainingOptions()
    assert choose_compile(auto, device_type="cuda", zero_stage=2).compile
    assert not choose_compile(auto, device_type="cuda", zero_stage=3).compile
    assert not choose_compile(auto, device_type="cpu", zero_stage=0).compile
    assert choose_compile(TrainingOptions(compile="on"), device_type="cpu", zero_stage=3).compile
    assert not choose_compile(TrainingOptions(compile="off"), device_type="cuda", zero_stage=2).compile


def test_nothing_chosen_is_nothing_applied() -> None:
    apply_kernels(object(), ())  # not even the model is looked at


needs_liger = pytest.mark.skipif(not liger_installed(), reason="liger-kernel (the gpu extra) is not installed")


@needs_liger
def test_the_kernels_offered_are_read_from_liger_s_own_table() -> None:
    assert offered_kernels("llama") == LLAMA_KERNELS
    assert offered_kernels("qwen2") == LLAMA_KERNELS
    # Gemma's MLP is GeGLU; granite's head scales its logits, so its loss stays transformers'.
    assert offered_kernels("gemma") == ("rope", "rms_norm", "geglu", FUSED_LOSS)
    assert FUSED_LOSS not in offered_kernels("granite") and offered_kernels("granite")
    # GPT-Neo is not in Liger's table: its LayerNorm module and tuneq's fused loss.
    assert offered_kernels("gpt_neo") == ("layer_norm", FUSED_LOSS)
    assert offered_kernels("bloom") == ()


@pytest.fixture
def llama_module_restored() -> Iterator[None]:
    """Liger's llama patches swap names in transformers' modeling_llama too (for models built
    later, as a rank builds one): put them back for the tests after this one."""
    from transformers.models.llama import modeling_llama

    saved = dict(vars(modeling_llama))
    yield
    for name, value in saved.items():
        setattr(modeling_llama, name, value)


@needs_liger
@pytest.mark.usefixtures("llama_module_restored")
def test_liger_patches_a_loaded_llama_in_place() -> None:
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    model = LlamaForCausalLM(config)
    eager_rope = modeling_llama.apply_rotary_pos_emb
    apply_kernels(model, ("rms_norm", "swiglu", FUSED_LOSS))  # chosen without rope
    layer = model.model.layers[0]
    assert layer.input_layernorm.forward.__func__ is LigerRMSNorm.forward
    assert model.model.norm.forward.__func__ is LigerRMSNorm.forward
    assert layer.mlp.forward.__func__ is LigerSwiGLUMLP.forward
    assert modeling_llama.apply_rotary_pos_emb is eager_rope  # not chosen, not applied
    # The fused loss's forward is this instance's; the class keeps transformers' own.
    assert model.forward.__func__ is not LlamaForCausalLM.forward
    assert LlamaForCausalLM(config).forward.__func__ is LlamaForCausalLM.forward


@needs_liger
def test_gpt_neo_gets_liger_s_layer_norm() -> None:
    import torch
    from liger_kernel.transformers.layer_norm import LigerLayerNorm
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    config = GPTNeoConfig(
        vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]]
    )
    model = GPTNeoForCausalLM(config)
    apply_kernels(model, offered_kernels("gpt_neo"))
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 5 and all(m.forward.__func__ is LigerLayerNorm.forward for m in norms)
    assert all(m.variance_epsilon == config.layer_norm_epsilon for m in norms)
