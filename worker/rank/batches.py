"""Tokenized samples to batches: rows (one sample each, or several packed), collate, shard.

A packed row holds several samples back to back up to ``max_seq_length``. Positions restart
at each sample and no attention mask is passed, which tells transformers' mask builder
(``masking_utils``, used by its decoder models) to keep attention within each sample; the
first token of a sample is not a label, so no sample learns from the one before it.

``padding_free`` uses the same mechanism one level up: a micro-batch's rows go end to end
into a single row instead of being padded to the longest, so the step sees the same samples
and computes the same loss (mean over the same label tokens) with no padding in it. This is
Hugging Face's ``DataCollatorWithFlattening``. With flash attention (``single_row``), whose
variable-length path keeps samples apart only in a batch of one row, a micro-batch's rows,
packed or padding-free, all go end to end into that one row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from shared.data.tokenized import TokenizedSamples

IGNORE_INDEX = -100  # transformers' label value for "no loss here"


class SampleRows(Dataset[list[tuple[np.ndarray, np.ndarray]]]):
    """Rows of samples: one sample per row, or several packed (``shared.data.prepared``)."""

    def __init__(
        self,
        samples: TokenizedSamples,
        rows: list[list[int]],
        *,
        packing: bool,
        padding_free: bool = False,
        max_seq_length: int | None = None,
        single_row: bool = False,
    ) -> None:
        self.samples = samples
        self.packing = packing
        self.padding_free = padding_free
        self.max_seq_length = max_seq_length  # padding-free rows stay within it
        # Rows of several samples (packed or padding-free) go into one row per micro-batch.
        self.single_row = single_row and (packing or padding_free)
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> list[tuple[np.ndarray, np.ndarray]]:
        return [self.samples.sample(i) for i in self.rows[index]]

    def collator(self, pad_token_id: int) -> Callable[[list[Any]], Batch]:
        return RowCollator(
            pad_token_id,
            packing=self.packing,
            padding_free=self.padding_free,
            max_seq_length=self.max_seq_length,
            single_row=self.single_row,
        )


Pair = tuple[int, tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


class PairRows(Dataset[Pair]):
    """Preference pairs, one a row (``shared.data.prepared``: row [2i, 2i + 1]): each item is
    the pair's index in its file, its chosen sequence and its rejected one."""

    def __init__(self, samples: TokenizedSamples, rows: list[list[int]]) -> None:
        self.samples = samples
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Pair:
        chosen, rejected = self.rows[index]
        return chosen // 2, self.samples.sample(chosen), self.samples.sample(rejected)

    def collator(self, pad_token_id: int) -> Callable[[list[Pair]], PairBatch]:
        return PairCollator(pad_token_id)


@dataclass
class Batch:
    inputs: dict[str, torch.Tensor]  # what the model takes
    real_tokens: int  # tokens that are not padding
    samples: int
    slots: int  # rows x width: real tokens plus padding

    def inputs_on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The model's keyword arguments, moved to ``device``."""
        return {name: tensor.to(device) for name, tensor in self.inputs.items()}


class RowCollator:
    """Pad a batch of rows to its longest (padding is never a label and never attended to), or
    with ``padding_free`` lay them end to end, in as few rows of at most ``max_seq_length``
    tokens as taking them in order allows (models such as GPT-Neo cannot attend over more
    positions than they were built for, even when positions restart). ``single_row``: every
    row of the batch end to end in one row, however long (flash attention's variable-length path)."""

    def __init__(
        self,
        pad_token_id: int,
        *,
        packing: bool,
        padding_free: bool = False,
        max_seq_length: int | None = None,
        single_row: bool = False,
    ) -> None:
        self.pad_token_id = pad_token_id
        self.packing = packing
        self.padding_free = padding_free
        self.max_seq_length = max_seq_length
        self.single_row = single_row

    def _end_to_end(self, rows: list[list[tuple[np.ndarray, np.ndarray]]]) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        limit = None if self.single_row else self.max_seq_length
        joined: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
        width = 0
        for row in rows:
            row_width = sum(len(ids) for ids, _ in row)
            if joined[-1] and limit is not None and width + row_width > limit:
                joined.append([])
                width = 0
            joined[-1].extend(row)
            width += row_width
        return joined

    def __call__(self, rows: list[list[tuple[np.ndarray, np.ndarray]]]) -> Batch:
        if self.padding_free or self.single_row:
            rows = self._end_to_end(rows)
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
        if self.packing or self.padding_free:
            inputs["position_ids"] = positions
        else:
            inputs["attention_mask"] = attention_mask
        return Batch(inputs=inputs, real_tokens=sum(widths), samples=sum(map(len, rows)), slots=len(rows) * width)


@dataclass
class PairBatch:
    """A micro-batch of preference pairs: the chosen sequences and the rejected ones, each padded
    as ``RowCollator`` pads (what ``preference_loss.concatenated_forward`` takes), and each
    pair's index in its file (where its reference log-probabilities are)."""

    chosen: dict[str, torch.Tensor]
    rejected: dict[str, torch.Tensor]
    pairs: torch.Tensor  # int64 [pairs]
    real_tokens: int
    samples: int  # pairs
    slots: int

    def sides_on(self, device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(chosen, rejected) moved to ``device``."""
        return (
            {name: t.to(device) for name, t in self.chosen.items()},
            {name: t.to(device) for name, t in self.rejected.items()},
        )


class PairCollator:
    """Pairs to a ``PairBatch``: each side padded to its own longest (the forward pads the two
    to one width when it joins them)."""

    def __init__(self, pad_token_id: int) -> None:
        self.rows = RowCollator(pad_token_id, packing=False)

    def __call__(self, pairs: list[Pair]) -> PairBatch:
        chosen = self.rows([[c] for _, c, _ in pairs])
        rejected = self.rows([[r] for _, _, r in pairs])
        return PairBatch(
            chosen=chosen.inputs,
            rejected=rejected.inputs,
            pairs=torch.tensor([i for i, _, _ in pairs], dtype=torch.long),
            real_tokens=chosen.real_tokens + rejected.real_tokens,
            samples=len(pairs),
            slots=chosen.slots + rejected.slots,
        )


def make_loader(
    rows: SampleRows | PairRows,
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
        collate_fn=rows.collator(pad_token_id),
        drop_last=drop_last,
    )
    return loader, sampler
