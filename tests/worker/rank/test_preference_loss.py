"""The DPO loss (``worker.rank.preference_loss``) against TRL's ``DPOTrainer``, and its parts by hand.

"Equal to TRL" builds a real ``DPOTrainer`` (TRL 1.16, the dev extra) on the tiny GPT-Neo of
tests/conftest.py with an explicit frozen reference (the same model with its weights moved, so
the log-ratios are not all 0), tokenizes the pairs with it, collates them with its own collator
and calls its ``compute_loss``, the method its training step calls, then ``backward``; tuneq's
side collates the same token ids with ``RowCollator`` and runs ``concatenated_forward`` and
``dpo_loss``. The losses, every parameter's gradient and TRL's logged metrics must agree to 1e-5.
Only ``compute_loss`` is called, not ``train()``: an optimizer step would only move both models
the same way, while a gradient compares every parameter's update direction before it is taken.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shared.jobs.spec import DpoOptions
from worker.rank.batches import IGNORE_INDEX, RowCollator
from worker.rank.preference_loss import (
    LOGITS_CHOSEN,
    LOGITS_REJECTED,
    LOGPS_CHOSEN,
    LOGPS_REJECTED,
    REWARDS_ACCURACIES,
    REWARDS_CHOSEN,
    REWARDS_MARGINS,
    REWARDS_REJECTED,
    AnswerLogps,
    concatenated_forward,
    dpo_loss,
    sequence_logps,
)

# Prompts and answers of different lengths: both sides are padded, and chosen is the longer in
# one pair, rejected in another.
PAIRS = [
    ("The capital of France is", " Paris, on the Seine.", " a large city somewhere in Germany, I think."),
    ("Two plus two equals", " four.", " five"),
    ("Say hello to the new team", " Hello, everyone: welcome aboard!", " No."),
]
METRICS = (
    REWARDS_CHOSEN,
    REWARDS_REJECTED,
    REWARDS_ACCURACIES,
    REWARDS_MARGINS,
    LOGPS_CHOSEN,
    LOGPS_REJECTED,
    LOGITS_CHOSEN,
    LOGITS_REJECTED,
)


@pytest.fixture(scope="module")
def models(tiny_model_template: Path) -> tuple[Any, Any, Any]:
    """The policy (training mode), a reference whose weights differ from it, and the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_template).train()
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return policy, reference, AutoTokenizer.from_pretrained(tiny_model_template)


def trl_step(
    models: tuple[Any, Any, Any], output_dir: Path, **dpo_args: Any
) -> tuple[list[dict[str, list[int]]], torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """TRL's tokenized pairs, and its loss, gradients and metrics on them as one batch."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    policy, reference, tokenizer = models
    args = DPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=len(PAIRS),
        bf16=False,  # TRL's default is bf16 unless fp16
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        **dpo_args,
    )
    prompts, chosen, rejected = (list(column) for column in zip(*PAIRS, strict=True))
    trainer: Any = DPOTrainer(
        model=copy.deepcopy(policy),
        ref_model=copy.deepcopy(reference),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected}),
        processing_class=copy.deepcopy(tokenizer),
    )
    pairs = [
        {key: trainer.train_dataset[i][key] for key in ("prompt_ids", "chosen_ids", "rejected_ids")}
        for i in range(len(PAIRS))
    ]
    loss = trainer.compute_loss(trainer.model, trainer.data_collator(pairs))
    loss.backward()
    gradients = {name: p.grad for name, p in trainer.model.named_parameters() if p.grad is not None}
    logged = trainer._metrics["train" if trainer.model.training else "eval"]
    return pairs, loss.detach(), gradients, {name: values[-1] for name, values in logged.items()}


def collated(pairs: list[dict[str, list[int]]], side: str, pad_token_id: int) -> dict[str, torch.Tensor]:
    """One side of the pairs as tuneq's collator pads a batch: prompt tokens are not labels."""
    rows = [
        [(np.array(pair["prompt_ids"] + pair[side]), np.array([0] * len(pair["prompt_ids"]) + [1] * len(pair[side])))]
        for pair in pairs
    ]
    return RowCollator(pad_token_id, packing=False)(rows).inputs


def tuneq_step(
    models: tuple[Any, Any, Any], pairs: list[dict[str, list[int]]], config: DpoOptions
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    policy, reference, tokenizer = models
    model = copy.deepcopy(policy)
    pad = tokenizer.eos_token_id  # the tiny tokenizer has no pad token; TRL pads with EOS too
    chosen, rejected = collated(pairs, "chosen_ids", pad), collated(pairs, "rejected_ids", pad)
    with torch.no_grad():
        ref = concatenated_forward(reference, chosen, rejected, pad_token_id=pad)
    output = dpo_loss(
        concatenated_forward(model, chosen, rejected, pad_token_id=pad), ref.chosen, ref.rejected, config=config
    )
    output.loss.backward()
    gradients = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return output.loss.detach(), gradients, {name: float(value) for name, value in output.metrics.items()}


# tuneq's settings, and the TRL 1.16 DPOConfig that computes the same loss.
EQUIVALENTS: dict[str, tuple[DpoOptions, dict[str, Any]]] = {
    "sigmoid": (DpoOptions(), {"loss_type": ["sigmoid"]}),
    "sigmoid, beta 0.3": (DpoOptions(beta=0.3), {"loss_type": ["sigmoid"], "beta": 0.3}),
    # cDPO, which TRL 1.16's sigmoid no longer applies: its "robust" loss at the same epsilon is
    # ((1-e) L(d) - e L(-d)) / (1-2e) with L(d) = -logsigmoid(beta d), so
    # (1-e) L(d) + e L(-d) = 2(1-e) sigmoid - (1-2e) robust.
    "sigmoid, label_smoothing 0.1": (
        DpoOptions(beta=0.3, label_smoothing=0.1),
        {"loss_type": ["sigmoid", "robust"], "loss_weights": [1.8, -0.8], "label_smoothing": 0.1, "beta": 0.3},
    ),
    "sigmoid, normalize_by_length": (
        DpoOptions(beta=0.3, normalize_by_length=True),
        {"loss_type": ["sigmoid_norm"], "beta": 0.3},
    ),
    "ipo": (DpoOptions(beta=0.3, loss_type="ipo"), {"loss_type": ["ipo"], "beta": 0.3}),
    "ipo, normalize_by_length": (
        DpoOptions(beta=0.3, loss_type="ipo", normalize_by_length=True),
        {"loss_type": ["ipo"], "beta": 0.3},
    ),
    "hinge": (DpoOptions(beta=0.3, loss_type="hinge"), {"loss_type": ["hinge"], "beta": 0.3}),
    "sigmoid, sft_weight 0.5": (
        DpoOptions(beta=0.3, sft_weight=0.5),
        {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5], "beta": 0.3},
    ),
    "sigmoid, normalize_by_length, sft_weight 2": (
        DpoOptions(beta=0.3, normalize_by_length=True, sft_weight=2.0),
        {"loss_type": ["sigmoid_norm", "sft"], "loss_weights": [1.0, 2.0], "beta": 0.3},
    ),
}


@pytest.mark.parametrize("case", list(EQUIVALENTS))
def test_the_loss_its_gradients_and_metrics_equal_trls_dpo_trainer(
    case: str, models: tuple[Any, Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config, trl_args = EQUIVALENTS[case]
    pairs, trl_loss, trl_gradients, trl_metrics = trl_step(models, tmp_path, **trl_args)
    loss, gradients, metrics = tuneq_step(models, pairs, config)

    torch.testing.assert_close(loss, trl_loss, rtol=0, atol=1e-5)
    assert gradients.keys() == trl_gradients.keys() and gradients
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, trl_gradients[name], rtol=0, atol=1e-5, msg=f"{case}: {name}")
    # The logps are sums over up to 40 tokens (near -100, where a float32 step is 7.6e-6), and a
    # random model's mean logits are near 0 (1e-3, 1e-4): compared relatively.
    expected = {name: pytest.approx(trl_metrics[name], rel=1e-7, abs=1e-5) for name in METRICS}
    expected |= {name: pytest.approx(trl_metrics[name], rel=1e-5) for name in (LOGITS_CHOSEN, LOGITS_REJECTED)}
    assert expected == metrics
    # The case is not a degenerate one: the reference differs, and some pairs are ranked each way.
    assert metrics[REWARDS_MARGINS] != 0 and 0 < metrics[REWARDS_ACCURACIES] < 1


def test_sequence_logps_counts_only_the_label_tokens_shifted_by_one() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11, requires_grad=True)
    labels = torch.tensor(
        [
            [IGNORE_INDEX, IGNORE_INDEX, 4, 7, 1, IGNORE_INDEX],  # two prompt tokens, three answer, one padding
            [IGNORE_INDEX] * 6,  # no answer at all
        ]
    )
    summed, counts = sequence_logps(logits, labels, average=False)
    log_probs = logits.detach().log_softmax(-1)
    # The logits at t score the label at t + 1.
    expected = log_probs[0, 1, 4] + log_probs[0, 2, 7] + log_probs[0, 3, 1]
    torch.testing.assert_close(summed, torch.stack([expected, torch.tensor(0.0)]))
    assert counts.tolist() == [3, 0]
    mean, _ = sequence_logps(logits, labels, average=True)
    torch.testing.assert_close(mean, torch.stack([expected / 3, torch.tensor(0.0)]))

    summed.sum().backward()
    assert logits.grad is not None
    scored = torch.zeros(2, 6, dtype=torch.bool)
    scored[0, 1:4] = True
    assert logits.grad[~scored].abs().max() == 0  # prompt, padding and the last position: no gradient
    assert logits.grad[scored].abs().min() > 0


def test_padding_and_the_concatenation_leave_each_answers_log_probability_as_it_is_alone(
    models: tuple[Any, Any, Any],
) -> None:
    _, reference, tokenizer = models
    pad = tokenizer.eos_token_id
    encode = tokenizer.encode
    pairs = [
        {"prompt_ids": encode(prompt), "chosen_ids": encode(chosen), "rejected_ids": encode(rejected)}
        for prompt, chosen, rejected in PAIRS
    ]
    with torch.no_grad():
        batched = concatenated_forward(
            reference, collated(pairs, "chosen_ids", pad), collated(pairs, "rejected_ids", pad), pad_token_id=pad
        )
        for i, pair in enumerate(pairs):
            chosen, rejected = collated([pair], "chosen_ids", pad), collated([pair], "rejected_ids", pad)
            logits = reference(input_ids=chosen["input_ids"]).logits  # no padding, no attention mask
            alone, tokens = sequence_logps(logits, chosen["labels"], average=False)
            torch.testing.assert_close(batched.chosen[i], alone[0], rtol=0, atol=1e-5)
            assert batched.chosen_tokens[i] == tokens[0] == len(pair["chosen_ids"])
            alone = concatenated_forward(reference, chosen, rejected, pad_token_id=pad).rejected
            torch.testing.assert_close(batched.rejected[i], alone[0], rtol=0, atol=1e-5)
    assert batched.rejected_tokens.tolist() == [len(pair["rejected_ids"]) for pair in pairs]


def policy_of_two_pairs(chosen_nll: float = 2.5) -> AnswerLogps:
    return AnswerLogps(
        chosen=torch.tensor([-10.0, -20.0]),
        rejected=torch.tensor([-12.0, -15.0]),
        chosen_tokens=torch.tensor([2, 4]),
        rejected_tokens=torch.tensor([3, 5]),
        chosen_nll=torch.tensor(chosen_nll),
        chosen_logits_sum=torch.tensor(3.0),
        rejected_logits_sum=torch.tensor(-8.0),
    )


# Against the policy above: chosen log-ratios [1, 0], rejected [-1, 1].
REF_CHOSEN, REF_REJECTED = torch.tensor([-11.0, -20.0]), torch.tensor([-11.0, -16.0])


def loss_of(**settings: Any) -> float:
    config = DpoOptions(beta=0.5, **settings)
    return float(dpo_loss(policy_of_two_pairs(), REF_CHOSEN, REF_REJECTED, config=config).loss)


def test_the_metrics_on_hand_computed_numbers() -> None:
    config = DpoOptions(beta=0.5)
    metrics = dpo_loss(policy_of_two_pairs(), REF_CHOSEN, REF_REJECTED, config=config).metrics
    assert {name: float(value) for name, value in metrics.items()} == {
        REWARDS_CHOSEN: 0.25,  # 0.5 * mean(1, 0)
        REWARDS_REJECTED: 0.0,  # 0.5 * mean(-1, 1)
        REWARDS_ACCURACIES: 0.5,  # 0.5 > -0.5, but 0 < 0.5
        REWARDS_MARGINS: 0.25,  # mean(1, -0.5)
        LOGPS_CHOSEN: -15.0,
        LOGPS_REJECTED: -13.5,
        LOGITS_CHOSEN: 0.5,  # 3 over 6 chosen tokens
        LOGITS_REJECTED: -1.0,  # -8 over 8 rejected tokens
    }
    # Rewards are the summed log-ratios, also where the loss divides them by length.
    by_length = DpoOptions(beta=0.5, normalize_by_length=True)
    normalized = dpo_loss(policy_of_two_pairs(), REF_CHOSEN, REF_REJECTED, config=by_length)
    assert float(normalized.metrics[REWARDS_CHOSEN]) == 0.25
    # A tie is not accurate: at the first step the policy is the reference.
    tie = policy_of_two_pairs()
    unmoved = dpo_loss(tie, tie.chosen, tie.rejected, config=config).metrics
    assert float(unmoved[REWARDS_ACCURACIES]) == 0.0 and float(unmoved[REWARDS_MARGINS]) == 0.0


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))  # -logsigmoid(-x)


def test_each_loss_type_on_hand_computed_numbers() -> None:
    # The log-ratio differences are [1 - -1, 0 - 1] = [2, -1]; beta times them [1, -0.5].
    assert loss_of() == pytest.approx((softplus(-1) + softplus(0.5)) / 2)
    assert loss_of(label_smoothing=0.1) == pytest.approx(
        (0.9 * softplus(-1) + 0.1 * softplus(1) + 0.9 * softplus(0.5) + 0.1 * softplus(-0.5)) / 2
    )
    assert loss_of(loss_type="hinge") == pytest.approx((0 + 1.5) / 2)
    # IPO divides by the tokens: chosen [1/2, 0/4], rejected [-1/3, 1/5]; 1 / (2 beta) = 1.
    ipo = ((0.5 + 1 / 3 - 1) ** 2 + (0 - 0.2 - 1) ** 2) / 2
    assert loss_of(loss_type="ipo") == pytest.approx(ipo)
    assert loss_of(loss_type="ipo", normalize_by_length=True) == pytest.approx(ipo)
    assert loss_of(normalize_by_length=True) == pytest.approx((softplus(-0.5 * (0.5 + 1 / 3)) + softplus(0.1)) / 2)
    assert loss_of(loss_type="hinge", normalize_by_length=True) == pytest.approx((1 - 0.5 * (0.5 + 1 / 3) + 1.1) / 2)
    # The NLL of the chosen answers (2.5 here) is added with its weight.
    assert loss_of(sft_weight=0.2) == pytest.approx(loss_of() + 0.5)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"loss_type": "kto"}, "loss_type"),
        ({"beta": 0.0}, "beta"),
        ({"sft_weight": -1.0}, "sft_weight"),
        ({"label_smoothing": 0.5}, "label_smoothing"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "label_smoothing"),
    ],
)
def test_settings_the_loss_does_not_define_are_refused_by_name(settings: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        DpoOptions(**settings)
