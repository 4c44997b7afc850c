"""Tokenized samples to batches: rows (one sample each, or several packed), collate, shard.

A packed row holds several samples back to back up to ``max_seq_length``. Positions restart
at each sample and no attention mask is passed, which tells transformers' mask builder
(``masking_utils``, used by its decoder models) to keep attention within each sample; the
first token of a sample is not a label, so no sample learns from the one before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from shared.dataset import DatasetError, DatasetFormat
from shared.tokenized import DatasetStats, TokenizationError, TokenizedSamples, prepare_tokenized
from shared.validation import local_path
from worker.errors import InvalidInputError

IGNORE_INDEX = -100  # transformers' label value for "no loss here"


def load_samples(
    dataset: str,
    tokenizer: Any,
    *,
    dataset_format: DatasetFormat | None,
    max_seq_length: int,
    cache_dir: Path,
    what: str = "dataset",
) -> tuple[TokenizedSamples, DatasetStats]:
    """Tokenized samples from the cache, or tokenized now; user errors as InvalidInputError."""
    try:
        samples, stats = prepare_tokenized(
            local_path(dataset),
            tokenizer,
            dataset_format=dataset_format,
            max_seq_length=max_seq_length,
            cache_root=cache_dir / "tokenized",
        )
    except (DatasetError, TokenizationError) as e:
        raise InvalidInputError(f"{what}: {e}") from None
    except OSError as e:
        raise InvalidInputError(f"{what} '{dataset}' cannot be read: {e.strerror}") from None
    if len(samples) == 0:
        raise InvalidInputError(f"{what}: no record has anything to train on (two or more tokens, a target token)")
    return samples, stats


def split_samples(samples: TokenizedSamples, share: float, *, seed: int) -> tuple[TokenizedSamples, TokenizedSamples]:
    """(train, validation): a seeded random ``share`` of the samples held out, the same on every rank."""
    order = np.random.default_rng(seed).permutation(len(samples))
    held_out = max(1, round(len(samples) * share))
    if held_out >= len(samples):
        raise InvalidInputError(
            f"training.validation_split {share} of {len(samples)} samples leaves nothing to train on: lower it"
        )
    return samples.select(np.sort(order[held_out:])), samples.select(np.sort(order[:held_out]))


def pack_rows(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Group sample indices into rows of at most ``capacity`` tokens: best fit, longest first.

    ``free[c]`` lists the open rows with exactly c tokens of room, so each sample finds the
    tightest row by scanning room sizes upward from its own length.
    """
    free: list[list[int]] = [[] for _ in range(capacity + 1)]
    rows: list[list[int]] = []
    room: list[int] = []
    for index in np.argsort(-lengths, kind="stable"):
        length = int(lengths[index])
        target = next((c for c in range(length, capacity + 1) if free[c]), None)
        if target is None:
            rows.append([])
            room.append(capacity)
            row = len(rows) - 1
        else:
            row = free[target].pop()
        rows[row].append(int(index))
        room[row] -= length
        free[room[row]].append(row)
    return rows


class SampleRows(Dataset[list[tuple[np.ndarray, np.ndarray]]]):
    """Rows of samples: one sample per row, or several packed."""

    def __init__(self, samples: TokenizedSamples, *, packing: bool, max_seq_length: int) -> None:
        self.samples = samples
        self.packing = packing
        self.rows = pack_rows(samples.lengths, max_seq_length) if packing else [[i] for i in range(len(samples))]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[tuple[np.ndarray, np.ndarray]]:
        return [self.samples.sample(i) for i in self.rows[index]]


@dataclass
class Batch:
    inputs: dict[str, torch.Tensor]  # what the model takes
    real_tokens: int  # tokens that are not padding
    samples: int
    slots: int  # rows x width: real tokens plus padding


class RowCollator:
    """Pad a batch of rows to its longest; padding is never a label and never attended to."""

    def __init__(self, pad_token_id: int, *, packing: bool) -> None:
        self.pad_token_id = pad_token_id
        self.packing = packing

    def __call__(self, rows: list[list[tuple[np.ndarray, np.ndarray]]]) -> Batch:
        widths = [sum(len(ids) for ids, _ in row) for row in rows]
        width = max(widths)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
        # Padding forms its own "sample" from position 0, so no real token attends to it.
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            start = 0
            for ids, targets in row:
                end = start + len(ids)
                tokens = torch.from_numpy(np.asarray(ids, dtype=np.int64))
                input_ids[r, start:end] = tokens
                labels[r, start:end] = tokens.masked_fill(torch.from_numpy(np.asarray(targets) == 0), IGNORE_INDEX)
                labels[r, start] = IGNORE_INDEX  # predicted from the previous sample: not a label
                positions[r, start:end] = torch.arange(len(ids))
                start = end
            attention_mask[r, :start] = 1
            positions[r, start:] = torch.arange(width - start)
        inputs = {"input_ids": input_ids, "labels": labels}
        if self.packing:
            inputs["position_ids"] = positions
        else:
            inputs["attention_mask"] = attention_mask
        return Batch(inputs=inputs, real_tokens=sum(widths), samples=sum(map(len, rows)), slots=len(rows) * width)


def make_loader(
    rows: SampleRows,
    *,
    micro_batch: int,
    world_size: int,
    rank: int,
    seed: int,
    pad_token_id: int,
    shuffle: bool = True,
    drop_last: bool = True,
) -> tuple[DataLoader[Any], DistributedSampler[Any]]:
    # drop_last keeps every rank at the same number of batches: a rank with one batch more
    # would wait forever in the next collective. Evaluation keeps every row instead: the
    # sampler then repeats a few rows so that the ranks still get equal counts.
    sampler: DistributedSampler[Any] = DistributedSampler(
        rows, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    loader = DataLoader(
        rows,
        batch_size=micro_batch,
        sampler=sampler,
        collate_fn=RowCollator(pad_token_id, packing=rows.packing),
        drop_last=drop_last,
    )
    return loader, sampler
