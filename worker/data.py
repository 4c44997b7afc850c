"""Turning JSON Lines into batches: tokenize, truncate, pad per batch, shard across ranks."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from shared.dataset import DatasetError, read_text_records
from shared.validation import local_path
from worker.errors import InvalidInputError


class TokenizedTexts(Dataset[list[int]]):
    def __init__(self, samples: list[list[int]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> list[int]:
        return self.samples[index]


def load_text_dataset(dataset: str, tokenizer: Any, *, max_seq_length: int) -> TokenizedTexts:
    """Read ``{"text": ...}`` lines and tokenize each, truncated to ``max_seq_length``."""
    try:
        texts = read_text_records(local_path(dataset))
    except DatasetError as e:
        raise InvalidInputError(f"dataset: {e}") from None
    except OSError as e:
        raise InvalidInputError(f"dataset '{dataset}' cannot be read: {e.strerror}") from None
    eos = tokenizer.eos_token_id
    samples = []
    for ids in tokenizer(texts, add_special_tokens=True, truncation=True, max_length=max_seq_length)["input_ids"]:
        # End each sample with EOS (when there is room) so the model learns where text stops.
        if eos is not None and len(ids) < max_seq_length and (not ids or ids[-1] != eos):
            ids = [*ids, eos]
        if len(ids) >= 2:  # a single token has nothing to predict
            samples.append(ids)
    if not samples:
        raise InvalidInputError("dataset: no record has two or more tokens to train on")
    return TokenizedTexts(samples)


class PadCollator:
    """Pad a batch to its longest sample; padding is masked out of attention and loss."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, batch: list[list[int]]) -> dict[str, torch.Tensor]:
        width = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, ids in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, : len(ids)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def make_loader(
    dataset: TokenizedTexts, *, micro_batch: int, world_size: int, rank: int, seed: int, pad_token_id: int
) -> tuple[DataLoader[Any], DistributedSampler[list[int]]]:
    # drop_last keeps every rank at the same number of batches: a rank with one batch more
    # would wait forever in the next collective.
    sampler: DistributedSampler[list[int]] = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True
    )
    loader = DataLoader(
        dataset, batch_size=micro_batch, sampler=sampler, collate_fn=PadCollator(pad_token_id), drop_last=True
    )
    return loader, sampler
