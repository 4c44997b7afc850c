"""Which fused kernels and whether compile, per job (``worker.rank.kernels``).

The choice is plain logic over the job and the host and runs anywhere. Liger Kernel itself is
the ``gpu`` extra (Triton); where it is installed, the tests below also read its real table and
patch a real (tiny, CPU) Llama with it. Running its kernels needs CUDA: that is the GPU
benchmark's part (benchmarks/gpu.py compares the loss curves with and without them). What runs
here is tuneq's side of the fused loss: the forward that feeds it, on every model type it is
offered for, with the function Liger's kernel computes written in plain torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from shared.jobs.spec import LoraOptions, TrainingOptions
from worker.rank.kernels import (
    FUSED_LOSS,
    PLAIN_HEAD_MODEL_TYPES,
    KernelChoice,
    apply_kernels,
    choose_compile,
    choose_kernels,
    install_fused_loss,
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


def linear_cross_entropy(
    *, hidden_states: Any, lm_head_weight: Any, labels: Any, hidden_size: int, accum_dtype: Any
) -> Any:
    """What Liger's ``LigerForCausalLMLoss`` computes, in plain torch (its kernel is Triton, for
    CUDA): logits from the hidden states and the head's weight in ``accum_dtype``, the labels
    shifted by one, -100 ignored, the mean over the rest."""
    from torch.nn import functional

    logits = hidden_states.reshape(-1, hidden_size).to(accum_dtype) @ lm_head_weight.to(accum_dtype).T
    targets = functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    return functional.cross_entropy(logits, targets, ignore_index=-100)


def tiny_causal_lm(model_type: str, **config: Any) -> Any:
    """A two-layer ``model_type`` causal LM with random weights, vocabulary 128, in training mode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type == "gpt_neo":
        shape: dict[str, Any] = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "window_size": 4}
        shape["attention_types"] = [[["global", "local"], 1]]
    else:
        shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "head_dim": 8}
        shape |= {"num_attention_heads": 4, "num_key_value_heads": 2}
    shape |= {"vocab_size": 128, "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    torch.manual_seed(0)
    built = AutoConfig.for_model(model_type, **shape)
    for name, value in config.items():
        setattr(built, name, value)
    return AutoModelForCausalLM.from_config(built).train()


def outputs_and_gradients(model: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    outputs = model(**batch)
    outputs.loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return outputs, gradients


def a_padded_batch() -> dict[str, Any]:
    """Two rows of 12 tokens, the second with 5 of padding (masked, its labels -100)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 128, (2, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0
    input_ids[1, 7:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@pytest.mark.parametrize("model_type", sorted(PLAIN_HEAD_MODEL_TYPES))
def test_the_fused_loss_trains_on_the_model_s_own_loss(model_type: str) -> None:
    """For every type the fused loss is offered for, the loss from the base model's hidden
    states and the head's weight is the model's own, and so are the gradients: this is what
    PLAIN_HEAD_MODEL_TYPES claims of transformers' modeling code (a bias-free head, no logit
    scaling or soft-capping, the last hidden state as the head's input)."""
    import torch

    model = tiny_causal_lm(model_type)
    batch = a_padded_batch()
    expected, expected_gradients = outputs_and_gradients(model, batch)
    install_fused_loss(model, linear_cross_entropy)
    fused, gradients = outputs_and_gradients(model, batch)
    assert fused.logits is None  # the logits were never built
    torch.testing.assert_close(fused.loss, expected.loss)
    assert gradients.keys() == expected_gradients.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, expected_gradients[name], msg=name)
    # Evaluation runs the class's own forward: it is the logits it wants.
    model.eval()
    with torch.no_grad():
        evaluated = model(**batch)
    torch.testing.assert_close(evaluated.loss, expected.loss)
    assert evaluated.logits is not None


def test_a_head_that_scales_its_logits_is_left_to_transformers_loss() -> None:
    """Why the list is a list: granite divides its logits by ``logits_scaling``, so the loss from
    the hidden states and the head's weight would train another model."""
    import torch

    assert "granite" not in PLAIN_HEAD_MODEL_TYPES
    model = tiny_causal_lm("granite", logits_scaling=0.05)  # random weights' logits are near 0: x 20
    batch = a_padded_batch()
    expected = model(**batch).loss
    install_fused_loss(model, linear_cross_entropy)
    assert not torch.isclose(model(**batch).loss, expected, rtol=1e-2)


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
    from transformers import LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    model = tiny_causal_lm("llama")
    eager_rope = modeling_llama.apply_rotary_pos_emb
    apply_kernels(model, ("rms_norm", "swiglu", FUSED_LOSS))  # chosen without rope
    layer = model.model.layers[0]
    assert layer.input_layernorm.forward.__func__ is LigerRMSNorm.forward
    assert model.model.norm.forward.__func__ is LigerRMSNorm.forward
    assert layer.mlp.forward.__func__ is LigerSwiGLUMLP.forward
    assert modeling_llama.apply_rotary_pos_emb is eager_rope  # not chosen, not applied
    # The fused loss's forward is this instance's; the class keeps transformers' own.
    assert model.forward.__func__ is not LlamaForCausalLM.forward
    assert LlamaForCausalLM(model.config).forward.__func__ is LlamaForCausalLM.forward


@needs_liger
def test_gpt_neo_gets_liger_s_layer_norm() -> None:
    import torch
    from liger_kernel.transformers.layer_norm import LigerLayerNorm

    model = tiny_causal_lm("gpt_neo")
    apply_kernels(model, offered_kernels("gpt_neo"))
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 5 and all(m.forward.__func__ is LigerLayerNorm.forward for m in norms)
    assert all(m.variance_epsilon == model.config.layer_norm_epsilon for m in norms)
