"""Direct preference optimisation's loss and metrics (issue 42, part 4), as TRL's ``DPOTrainer`` computes them.

TRL (1.16, ``trl/trainer/dpo_trainer.py``, ``DPOTrainer._compute_loss``) is the reference: each loss type,
the weighting of its NLL term and every metric below is defined as it defines them, and
tests/worker/rank/test_preference_loss.py checks the loss and every gradient against its trainer.
Where tuneq's options name something TRL 1.16 no longer has (``label_smoothing`` on the sigmoid
loss), the definition and why are given on the option.

A batch is pairs: a prompt and its chosen and rejected answers, each side a padded batch as
``worker.rank.batches.RowCollator`` makes it (``input_ids``, ``attention_mask``, ``labels``: the
token ids, the prompt and padding -100). The labels are not shifted: as for the model's own causal
LM loss (and TRL's labels), the logits at position t score the label at t + 1.

The reference's log-probabilities are only ever the answers' summed log-probabilities
(``AnswerLogps.chosen`` / ``.rejected`` of a forward without gradient), so they can be computed
once, before training, and stored; the token counts that length normalisation divides by are the
policy's, which are the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional

from shared.jobs.spec import DpoOptions
from worker.rank.batches import IGNORE_INDEX

# TRL's metric names (DPOTrainer._compute_loss's self._metrics keys), which tuneq reports as they are.
REWARDS_CHOSEN = "rewards/chosen"
REWARDS_REJECTED = "rewards/rejected"
REWARDS_ACCURACIES = "rewards/accuracies"
REWARDS_MARGINS = "rewards/margins"
LOGPS_CHOSEN = "logps/chosen"
LOGPS_REJECTED = "logps/rejected"
LOGITS_CHOSEN = "logits/chosen"
LOGITS_REJECTED = "logits/rejected"


@dataclass(frozen=True)
class AnswerLogps:
    """One forward over a batch of pairs, per pair (shape [pairs]) and over the batch (scalars)."""

    chosen: torch.Tensor  # the chosen answer's log-probability: its tokens' log-probabilities summed
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor  # label tokens of the chosen answer
    rejected_tokens: torch.Tensor
    # The mean over every chosen answer token of the batch of minus its log-probability: the NLL
    # TRL's "sft" loss type takes (a token mean over the batch, not a mean of per-answer means).
    chosen_nll: torch.Tensor
    # The next-token logits' mean over the vocabulary, summed over the answers' label tokens
    # (TRL's ``mean_logits``, without gradient): divided by the tokens, ``logits/chosen`` / ``rejected``.
    chosen_logits_sum: torch.Tensor
    rejected_logits_sum: torch.Tensor


@dataclass(frozen=True)
class DPOLossOutput:
    loss: torch.Tensor  # the mean over the pairs (plus the weighted NLL): what backward takes
    # TRL's metrics, detached scalars, for this batch: the rewards and logps are means over its
    # pairs, the logits means over its answer tokens (weigh them so when averaging over batches).
    metrics: dict[str, torch.Tensor]


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, *, average: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's log-probability of its label tokens, summed (``average=False``) or their mean per
    token (``average=True``), and each row's label token count.

    ``logits`` [rows, T, vocab] are the model's for ``labels`` [rows, T] as the model takes them,
    unshifted: the logits at t score the label at t + 1 (transformers' causal LM loss, TRL's
    ``add_fused_lm_head``). Labels of -100 (prompt, padding) contribute nothing, to the value or
    the gradient. Computed in float32 whatever the logits' dtype (TRL's chunked log-probabilities
    accumulate in float32 too). A row without labels has 0 for both.
    """
    targets = _next_labels(labels)
    # cross_entropy is log_softmax and the gather in one kernel, 0 where the target is ignored.
    per_token = -functional.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view_as(targets)
    counts = (targets != IGNORE_INDEX).sum(dim=1)
    summed = per_token.sum(dim=1)
    return (summed / counts.clamp(min=1) if average else summed), counts


def _next_labels(labels: torch.Tensor) -> torch.Tensor:
    """The label each position's logits score: the next one, none after the last position (the
    labels shifted there rather than the logits, so the logits are not copied to drop their last
    position, as in transformers' ``ForCausalLMLoss``)."""
    return functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def concatenated_forward(
    model: Callable[..., Any],
    chosen: Mapping[str, torch.Tensor],
    rejected: Mapping[str, torch.Tensor],
    *,
    pad_token_id: int,
) -> AnswerLogps:
    """Run ``model`` (a transformers causal LM, or the DeepSpeed engine around one) once on the
    chosen rows followed by the rejected ones, padded to one length, as TRL's collator and
    ``_compute_loss`` do (so gradients flow as in TRL: one graph for both answers).

    ``chosen`` and ``rejected`` each hold ``input_ids``, ``attention_mask`` and ``labels`` for the
    same pairs in the same order, right-padded (padding attended to by nothing and never a label).
    """
    width = max(chosen["input_ids"].size(1), rejected["input_ids"].size(1))

    def joined(name: str, fill: int) -> torch.Tensor:
        sides = [functional.pad(side[name], (0, width - side[name].size(1)), value=fill) for side in (chosen, rejected)]
        return torch.cat(sides, dim=0)

    input_ids = joined("input_ids", pad_token_id)
    attention_mask, labels = joined("attention_mask", 0), joined("labels", IGNORE_INDEX)
    # No labels: the model's own loss is not wanted, and a model given tuneq's fused loss
    # (worker.rank.kernels.install_fused_loss) returns its logits only when called without them.
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logps, tokens = sequence_logps(logits, labels, average=False)
    pairs = chosen["input_ids"].size(0)
    with torch.no_grad():
        answer_tokens = _next_labels(labels) != IGNORE_INDEX
        logits_sums = (logits.mean(dim=-1, dtype=torch.float32) * answer_tokens).sum(dim=1)
    return AnswerLogps(
        chosen=logps[:pairs],
        rejected=logps[pairs:],
        chosen_tokens=tokens[:pairs],
        rejected_tokens=tokens[pairs:],
        chosen_nll=-logps[:pairs].sum() / tokens[:pairs].sum(),
        chosen_logits_sum=logits_sums[:pairs].sum(),
        rejected_logits_sum=logits_sums[pairs:].sum(),
    )


def dpo_loss(
    policy: AnswerLogps,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    config: DpoOptions,
) -> DPOLossOutput:
    """The loss of a batch of pairs and TRL's metrics for it, from the policy's forward and the
    reference's summed log-probabilities of the same answers (without gradient).

    As TRL: the per-pair losses' mean (``per_sequence_loss.mean()``), plus ``sft_weight`` times
    the chosen NLL; the rewards are ``beta`` times the summed log-ratios, never length-normalised,
    whatever the loss type (TRL's ``chosen_rewards = self.beta * chosen_logratios``).
    """
    chosen_logratios = policy.chosen - ref_chosen_logps
    rejected_logratios = policy.rejected - ref_rejected_logps
    loss = _pair_losses(chosen_logratios, rejected_logratios, policy, config).mean()
    if config.sft_weight:
        loss = loss + config.sft_weight * policy.chosen_nll
    return DPOLossOutput(loss=loss, metrics=_metrics(chosen_logratios, rejected_logratios, policy, config.beta))


def _pair_losses(
    chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, policy: AnswerLogps, config: DpoOptions
) -> torch.Tensor:
    if config.length_normalized:
        # TRL divides by the answer's completion mask, at least 1 (ipo, sigmoid_norm branches).
        chosen_logratios = chosen_logratios / policy.chosen_tokens.clamp(min=1)
        rejected_logratios = rejected_logratios / policy.rejected_tokens.clamp(min=1)
    delta = chosen_logratios - rejected_logratios
    beta = config.beta
    if config.loss_type == "hinge":  # RSO's: beta is the reciprocal of the margin
        return torch.relu(1 - beta * delta)
    if config.loss_type == "ipo":  # the IPO paper's Eq. 17, beta its tau
        return (delta - 1 / (2 * beta)) ** 2
    smoothing = config.label_smoothing
    return -(1 - smoothing) * functional.logsigmoid(beta * delta) - smoothing * functional.logsigmoid(-beta * delta)


def _metrics(
    chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, policy: AnswerLogps, beta: float
) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        chosen_rewards = beta * chosen_logratios
        rejected_rewards = beta * rejected_logratios
        return {
            REWARDS_CHOSEN: chosen_rewards.mean(),
            REWARDS_REJECTED: rejected_rewards.mean(),
            # Strictly greater, as TRL: a tie (the first step, policy = reference) is not accurate.
            REWARDS_ACCURACIES: (chosen_rewards > rejected_rewards).float().mean(),
            REWARDS_MARGINS: (chosen_rewards - rejected_rewards).mean(),
            # The answers' summed log-probabilities averaged over the pairs (TRL's docs say "average
            # log-probability ... to the tokens"; its code, which this follows, logs the sums' mean).
            LOGPS_CHOSEN: policy.chosen.detach().mean(),
            LOGPS_REJECTED: policy.rejected.detach().mean(),
            # 0 for a batch without such tokens, as TRL.
            LOGITS_CHOSEN: policy.chosen_logits_sum / policy.chosen_tokens.sum().clamp(min=1),
            LOGITS_REJECTED: policy.rejected_logits_sum / policy.rejected_tokens.sum().clamp(min=1),
        }
