"""training.attention: the fast implementations train as eager does (GPT-Neo's local layers
included), padding-free rows keep their loss, auto's choice, and the refusals.

The models are tiny and built here with random weights: a GPT-Neo with one global and one
local layer whose window (8) is shorter than the samples, and a Llama. Training is plain
torch AdamW steps in this process.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cli.samples import build_tiny_model
from shared.jobs.attention import Attention
from shared.jobs.spec import TrainingOptions, TrainingSpec
from worker.errors import InvalidInputError
from worker.rank.attention import (
    AttentionFacts,
    GPTNeoLocalWindowAttention,
    choose_attention,
    implementation_to_load,
    install_attention,
)
from worker.rank.batches import RowCollator
from worker.rank.model_loading import load_config, load_model

WINDOW = 8
STEPS = 20
CPU = AttentionFacts(device_type="cpu", half_precision=False, padding_free=False, flash_attention_installed=False)
CUDA = AttentionFacts(device_type="cuda", half_precision=True, padding_free=False, flash_attention_installed=False)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Models this small gain nothing from threads, and threads waiting on a busy host's other
    work slow them down many times over."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def gpt_neo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Layers: global, local (window 8)."""
    return build_tiny_model(
        tmp_path_factory.mktemp("attention") / "gpt-neo",
        hidden_size=32,
        layers=2,
        window_size=WINDOW,
        max_positions=128,
    )


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    directory = tmp_path_factory.mktemp("attention") / "llama"
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def model_with(directory: Path, attention: Attention) -> Any:
    """The model as load_model builds it with ``attention``, in training mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation=implementation_to_load(config, attention)
    )
    install_attention(model, attention)
    model.config.use_cache = False
    return model.train()


def micro_batches(*, padding_free: bool, packing: bool = False) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of three samples of 9 to 40 tokens (most longer than the window), as the
    collator makes them: padded with a mask, packed, or padding-free."""
    generator = np.random.default_rng(0)
    collate = RowCollator(pad_token_id=1, packing=packing, padding_free=padding_free, max_seq_length=128)
    batches = []
    for _ in range(4):
        samples = [generator.integers(5, 300, size=int(generator.integers(9, 41))) for _ in range(3)]
        rows = [[(ids, np.ones(len(ids)))] for ids in samples]
        if packing:
            rows = [[pair for row in rows for pair in row]]
        batches.append(collate(rows).inputs)
    return batches


def train_losses(model: Any, batches: list[dict[str, torch.Tensor]], steps: int = STEPS) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        loss = model(**batches[step % len(batches)]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def largest_relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("model_name", ["gpt_neo", "llama"])
def test_sdpa_trains_as_eager(model_name: str, packing: bool, request: pytest.FixtureRequest) -> None:
    directory = request.getfixturevalue(model_name)
    batches = micro_batches(padding_free=False, packing=packing)
    eager = train_losses(model_with(directory, "eager"), batches)
    sdpa = train_losses(model_with(directory, "sdpa"), batches)
    assert largest_relative_gap(eager, sdpa) < 1e-4
    assert eager[-1] < eager[0]  # it trained: the agreement is over a moving model


def test_gpt_neo_local_layers_keep_their_window(gpt_neo: Path) -> None:
    """The window matters for these samples: attention without it (the stock flash attention
    path's mistake) trains differently from the first step."""
    model = model_with(gpt_neo, "sdpa")
    layers = [m for m in model.modules() if isinstance(m, GPTNeoLocalWindowAttention)]
    assert [m.attention_type for m in layers] == ["global", "local"]
    assert model.config._attn_implementation == "sdpa"
    windowless = model_with(gpt_neo, "sdpa")
    global_layer, local_layer = (m for m in windowless.modules() if isinstance(m, GPTNeoLocalWindowAttention))
    local_layer.bias = global_layer.bias  # the global layer's causal pattern, no window
    reference = model_with(gpt_neo, "eager")
    batch = micro_batches(padding_free=False)[0]
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        eager_logits = reference(**batch).logits[real]
        gap = (model(**batch).logits[real] - eager_logits).abs().max().item()
        windowless_gap = (windowless(**batch).logits[real] - eager_logits).abs().max().item()
    assert gap < 1e-5 < 1e-3 < windowless_gap
    # ...and the loss agreement above would fail without the window.
    batches = micro_batches(padding_free=False)
    eager = train_losses(reference, batches, steps=3)
    assert largest_relative_gap(eager, train_losses(windowless, batches, steps=3)) > 1e-4


@pytest.fixture
def uncompiled_flex(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Flex attention without torch.compile (seconds instead of half a minute a mask shape on
    a CPU): the same masks and scale, torch's unfused kernel."""
    import torch._dynamo
    from torch.nn.attention import flex_attention

    monkeypatch.setattr(flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    with torch._dynamo.config.patch(disable=True):
        yield


@pytest.mark.usefixtures("uncompiled_flex")
@pytest.mark.parametrize("model_name", ["gpt_neo", "llama"])
def test_flex_attention_computes_eagers_losses(model_name: str, request: pytest.FixtureRequest) -> None:
    """Per step of a run trained with eager, flex attention's loss on the same weights. torch
    has no flex attention backward on CPUs (a job refuses flex there), so the forward pass is
    what the CPU can check: masks (window, padding, packed samples) and scale."""
    directory = request.getfixturevalue(model_name)
    eager, flex = model_with(directory, "eager"), model_with(directory, "flex_attention")
    batches = micro_batches(padding_free=False) + micro_batches(padding_free=False, packing=True)
    optimizer = torch.optim.AdamW(eager.parameters(), lr=3e-3)
    eager_losses, flex_losses = [], []
    for step in range(STEPS):
        batch = batches[step % len(batches)]
        flex.load_state_dict(eager.state_dict())
        with torch.no_grad():
            flex_losses.append(flex(**batch).loss.item())
        loss = eager(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        eager_losses.append(loss.item())
    assert largest_relative_gap(eager_losses, flex_losses) < 1e-4
    assert eager_losses[-1] < eager_losses[0]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("model_name", ["gpt_neo", "llama"])
def test_padding_free_trains_as_padding(model_name: str, attention: Attention, request: pytest.FixtureRequest) -> None:
    directory = request.getfixturevalue(model_name)
    padded = train_losses(model_with(directory, attention), micro_batches(padding_free=False))
    flat_batches = micro_batches(padding_free=True)
    assert all(len(batch["input_ids"]) == 1 and "attention_mask" not in batch for batch in flat_batches)
    flat = train_losses(model_with(directory, attention), flat_batches)
    assert largest_relative_gap(padded, flat) < 1e-4


def config_of(directory: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(directory)


def test_auto_picks_the_fastest_same_attention(gpt_neo: Path, llama: Path) -> None:
    neo, lla = config_of(gpt_neo), config_of(llama)
    # CPUs: GPT-Neo stays eager (sdpa measured no faster there: BENCHMARKS.md), Llama keeps
    # transformers' default sdpa.
    assert choose_attention("auto", config=neo, facts=CPU) == "eager"
    assert choose_attention("auto", config=lla, facts=CPU) == "sdpa"
    # CUDA: sdpa (GPT-Neo's is tuneq's, windowed), flash attention where installed and the
    # run is in half precision, never for GPT-Neo (transformers' drops the window).
    assert choose_attention("auto", config=neo, facts=CUDA) == "sdpa"
    assert choose_attention("auto", config=lla, facts=CUDA) == "sdpa"
    with_flash = AttentionFacts(
        device_type="cuda", half_precision=True, padding_free=True, flash_attention_installed=True
    )
    assert choose_attention("auto", config=lla, facts=with_flash) == "flash_attention_2"
    assert choose_attention("auto", config=neo, facts=with_flash) == "sdpa"
    fp32 = AttentionFacts(device_type="cuda", half_precision=False, padding_free=False, flash_attention_installed=True)
    assert choose_attention("auto", config=lla, facts=fp32) == "sdpa"


def test_load_model_builds_the_chosen_attention(gpt_neo: Path) -> None:
    def spec(attention: str) -> TrainingSpec:
        return TrainingSpec(
            job_id=uuid.uuid4(),
            model=str(gpt_neo),
            dataset="/data/train.jsonl",
            deepspeed_config={},
            num_gpus=1,
            training=TrainingOptions.model_validate({"attention": attention}),
            run_dir="/runs/x",
            cache_dir="/cache",
        )

    config = load_config(spec("auto"))
    auto = load_model(spec("auto"), config=config, deepspeed_config={}, zero_stage=0)
    assert auto.attention == "eager" and auto.model.config._attn_implementation == "eager"
    sdpa = load_model(spec("sdpa"), config=config, deepspeed_config={}, zero_stage=0)
    assert sdpa.attention == "sdpa" and sdpa.model.config._attn_implementation == "sdpa"
    assert any(isinstance(m, GPTNeoLocalWindowAttention) for m in sdpa.model.modules())
    with pytest.raises(InvalidInputError, match=r"training.attention flex_attention trains on CUDA GPUs only"):
        load_model(spec("flex_attention"), config=config, deepspeed_config={}, zero_stage=0)


def test_refusals_name_the_field_and_the_fix(gpt_neo: Path, llama: Path) -> None:
    from transformers import BloomConfig, LlamaConfig, RwkvConfig

    neo, lla = config_of(gpt_neo), config_of(llama)
    with pytest.raises(InvalidInputError, match=r"flash_attention_2 needs a CUDA GPU .*this worker has no GPU"):
        choose_attention("flash_attention_2", config=lla, facts=CPU)
    with pytest.raises(InvalidInputError, match=r"flash_attention_2 needs a CUDA GPU .*has not installed"):
        choose_attention("flash_attention_2", config=lla, facts=CUDA)
    with pytest.raises(InvalidInputError, match=r"drops the local layers' window.*set training.attention to sdpa"):
        choose_attention("flash_attention_2", config=neo, facts=CUDA)
    fp32 = AttentionFacts(device_type="cuda", half_precision=False, padding_free=False, flash_attention_installed=True)
    with pytest.raises(InvalidInputError, match=r"fp16 or bf16 only"):
        choose_attention("flash_attention_2", config=lla, facts=fp32)
    with pytest.raises(InvalidInputError, match=r"flex_attention trains on CUDA GPUs only"):
        choose_attention("flex_attention", config=neo, facts=CPU)
    with pytest.raises(
        InvalidInputError, match=r"attention_dropout 0.1: set training.attention to auto, sdpa or eager"
    ):
        choose_attention("flex_attention", config=LlamaConfig(attention_dropout=0.1), facts=CUDA)
    assert choose_attention("flex_attention", config=neo, facts=CUDA) == "flex_attention"
    bloom = BloomConfig(n_layer=1, hidden_size=16, n_head=2)
    with pytest.raises(InvalidInputError, match=r"the bloom model has no sdpa attention.*auto or one of eager"):
        choose_attention("sdpa", config=bloom, facts=CPU)
    assert choose_attention("auto", config=bloom, facts=CPU) == "eager"
    # padding_free needs a model whose mask keeps the samples of a row apart.
    padding_free = AttentionFacts(
        device_type="cpu", half_precision=False, padding_free=True, flash_attention_installed=False
    )
    with pytest.raises(InvalidInputError, match=r"training.padding_free needs .*rwkv.*turn padding_free off"):
        choose_attention("auto", config=RwkvConfig(num_hidden_layers=1, hidden_size=16), facts=padding_free)
    assert choose_attention("auto", config=neo, facts=padding_free) == "eager"
    assert choose_attention("sdpa", config=lla, facts=padding_free) == "sdpa"
