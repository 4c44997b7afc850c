"""A job's training data as the run will see it: tokenized, split, packed into rows, counted.

Rows decide the steps: an optimizer step takes train_batch_size rows, so packing (several
samples a row) makes fewer steps. For preference tuning (DPO) a row is a pair: its chosen and
rejected sequences, samples ``2i`` and ``2i + 1`` of the file (``PreferenceSamples``), so a
batch of rows is a batch of pairs and the counts below hold unchanged. How a micro-batch's rows
become one tensor (padded, or end to end with ``padding_free``) is the collator's business and
changes no count.

Torch-free: the ranks use it to build their loaders, and the plan endpoint uses it to say
how many steps a job will take without starting one. Both therefore count the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shared.data.records import DatasetError
from shared.data.tokenized import (
    DatasetStats,
    TokenizationError,
    TokenizedSamples,
    prepare_preference_tokenized,
    prepare_tokenized,
)
from shared.jobs.spec import TrainingOptions


@dataclass
class TrainingData:
    train: TokenizedSamples
    train_stats: DatasetStats
    validation: TokenizedSamples | None
    validation_stats: DatasetStats | None
    packing: bool
    padding_free: bool
    rows: list[list[int]]  # sample indices per training row
    validation_rows: list[list[int]] | None
    # Preference pairs (DPO): a row is a pair, [2i, 2i + 1]; ``validation`` may be ``train``
    # itself (a validation_split holds out pairs of the same file: rows, not samples, differ).
    preference: bool = False

    def stats(self) -> dict[str, Any]:
        """What the job shows as ``dataset_stats``."""
        return {
            "train": self.train_stats.model_dump(),
            "validation": self.validation_stats.model_dump() if self.validation_stats else None,
            "validation_samples": self._validation_count(),
            "packing": self.packing,
            "padding_free": self.padding_free,
            "rows": len(self.rows),
        }

    def _validation_count(self) -> int:
        """Validation samples, or pairs for preference data."""
        if self.preference:
            return len(self.validation_rows or [])
        return len(self.validation) if self.validation is not None else 0


def held_out_split(count: int, share: float, *, seed: int, unit: str = "samples") -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out): sorted indices of ``count`` items with a seeded random ``share`` held
    out, the same on every rank and in the plan."""
    order = np.random.default_rng(seed).permutation(count)
    held_out = max(1, round(count * share))
    if held_out >= count:
        raise DatasetError(f"training.validation_split {share} of {count} {unit} leaves nothing to train on: lower it")
    return np.sort(order[held_out:]), np.sort(order[:held_out])


def split_samples(samples: TokenizedSamples, share: float, *, seed: int) -> tuple[TokenizedSamples, TokenizedSamples]:
    """(train, validation): a seeded random ``share`` of the samples held out."""
    kept, held_out = held_out_split(len(samples), share, seed=seed)
    return samples.select(kept), samples.select(held_out)


def pair_rows(pairs: Any) -> list[list[int]]:
    """Preference pairs as rows: pair i's chosen and rejected sequences, samples 2i and 2i + 1."""
    return [[2 * int(i), 2 * int(i) + 1] for i in pairs]


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


def rows_of(samples: TokenizedSamples, *, packing: bool, max_seq_length: int) -> list[list[int]]:
    return pack_rows(samples.lengths, max_seq_length) if packing else [[i] for i in range(len(samples))]


def count_steps_per_epoch(rows: int, *, world_size: int, micro_batch: int, accumulation: int) -> int:
    """Optimizer steps in one pass: every rank gets rows // world_size rows (the rest are
    dropped, so ranks stay in step), in whole micro-batches, in whole accumulations."""
    return rows // world_size // micro_batch // accumulation


def count_total_steps(steps_per_epoch: int, options: TrainingOptions) -> int:
    """The optimizer steps of the run: ``max_steps`` when set (the data repeats as needed, as
    the Hugging Face Trainer's ``max_steps`` overrides its epochs), else ``epochs`` of data."""
    return options.max_steps if options.max_steps is not None else steps_per_epoch * options.epochs


def count_epochs(steps_per_epoch: int, total_steps: int) -> int:
    """The passes over the data (the last one possibly partial) that ``total_steps`` takes."""
    return -(-total_steps // steps_per_epoch)


def load_training_data(
    *,
    dataset: Path,
    validation_dataset: Path | None,
    options: TrainingOptions,
    tokenizer: Any,
    cache_dir: Path,
    max_line_bytes: int,
) -> TrainingData:
    """Raises DatasetError or TokenizationError, naming ``dataset`` or ``validation_dataset``.
    ``max_line_bytes``: the longest line of a JSON Lines file (``TUNEQ_MAX_LINE_BYTES``)."""

    def load(path: Path, what: str, dataset_format: Any) -> tuple[TokenizedSamples, DatasetStats]:
        try:
            if options.method == "dpo":
                pairs, stats = prepare_preference_tokenized(
                    path,
                    tokenizer,
                    max_seq_length=options.seq_length,
                    cache_root=cache_dir / "tokenized",
                    max_line_bytes=max_line_bytes,
                )
                samples = pairs.sequences
            else:
                samples, stats = prepare_tokenized(
                    path,
                    tokenizer,
                    dataset_format=dataset_format,
                    max_seq_length=options.seq_length,
                    cache_root=cache_dir / "tokenized",
                    max_line_bytes=max_line_bytes,
                )
        except DatasetError as e:
            raise DatasetError(f"{what}: {e}", e.problems) from None
        except TokenizationError as e:
            raise TokenizationError(f"{what}: {e}") from None
        if len(samples) == 0:
            raise DatasetError(f"{what}: no record has anything to train on (two or more tokens, a target token)")
        return samples, stats

    train, train_stats = load(dataset, "dataset", options.dataset_format)
    validation, validation_stats = None, None
    if validation_dataset is not None:
        validation, validation_stats = load(validation_dataset, "validation_dataset", train_stats.format)
    if options.method == "dpo":
        return _preference_data(train, train_stats, validation, validation_stats, options)
    if validation_dataset is None and options.validation_split is not None:
        train, validation = split_samples(train, options.validation_split, seed=options.seed)
    packing = options.packing if options.packing is not None else train_stats.format == "text"
    return TrainingData(
        train=train,
        train_stats=train_stats,
        validation=validation,
        validation_stats=validation_stats,
        packing=packing,
        padding_free=options.padding_free,
        rows=rows_of(train, packing=packing, max_seq_length=options.seq_length),
        validation_rows=(
            rows_of(validation, packing=packing, max_seq_length=options.seq_length) if validation is not None else None
        ),
    )


def _preference_data(
    train: TokenizedSamples,
    train_stats: DatasetStats,
    validation: TokenizedSamples | None,
    validation_stats: DatasetStats | None,
    options: TrainingOptions,
) -> TrainingData:
    """Pairs as rows. A validation_split holds out pairs of the training file: both row lists
    index the same samples, so each pair keeps its index in its file (the reference
    log-probabilities of a file are looked up by it)."""
    pairs = len(train) // 2
    kept, held_out = np.arange(pairs), None
    if validation is None and options.validation_split is not None:
        kept, held_out = held_out_split(pairs, options.validation_split, seed=options.seed, unit="pairs")
        validation = train
    validation_rows = None
    if validation is not None:
        validation_rows = pair_rows(held_out if held_out is not None else range(len(validation) // 2))
    return TrainingData(
        train=train,
        train_stats=train_stats,
        validation=validation,
        validation_stats=validation_stats,
        packing=False,
        padding_free=False,
        rows=pair_rows(kept),
        validation_rows=validation_rows,
        preference=True,
    )
