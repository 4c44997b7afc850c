"""Packing, collation and sharding, checked against the tiny model's real forward pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from shared.data.prepared import pack_rows, rows_of, split_samples
from shared.data.tokenized import TokenizedSamples
from worker.rank.batches import IGNORE_INDEX, RowCollator, SampleRows, make_loader


def samples_of(*sequences: list[int], targets: list[list[int]] | None = None) -> TokenizedSamples:
    lengths = [len(s) for s in sequences]
    flat_targets = [t for ts in (targets or [[1] * n for n in lengths]) for t in ts]
    return TokenizedSamples(
        tokens=np.array([t for s in sequences for t in s], dtype=np.int32),
        targets=np.array(flat_targets, dtype=np.uint8),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
    )


def test_pack_rows_fits_every_sample_once_within_capacity() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 60, size=500)
    rows = pack_rows(lengths, 64)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(lengths[row].sum() <= 64 for row in rows)
    # Best fit wastes little: within 10 % of the lower bound on rows.
    assert len(rows) <= 1.1 * np.ceil(lengths.sum() / 64)


def test_collator_packs_with_restarting_positions_and_no_cross_sample_labels() -> None:
    samples = samples_of([5, 6, 7], [8, 9], targets=[[0, 1, 1], [1, 1]])
    rows = SampleRows(samples, rows_of(samples, packing=True, max_seq_length=8), packing=True)
    assert rows.rows == [[0, 1]]
    batch = RowCollator(pad_token_id=0, packing=True)([rows[0], [samples.sample(1)]])
    assert batch.inputs["input_ids"].tolist() == [[5, 6, 7, 8, 9], [8, 9, 0, 0, 0]]
    assert batch.inputs["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    ignore = IGNORE_INDEX
    assert batch.inputs["labels"].tolist() == [[ignore, 6, 7, ignore, 9], [ignore, 9, ignore, ignore, ignore]]
    assert "attention_mask" not in batch.inputs
    assert (batch.real_tokens, batch.samples, batch.slots) == (7, 3, 10)


def test_collator_without_packing_pads_with_a_mask() -> None:
    samples = samples_of([5, 6, 7], [8, 9])
    rows = SampleRows(samples, rows_of(samples, packing=False, max_seq_length=8), packing=False)
    batch = RowCollator(pad_token_id=0, packing=False)([rows[0], rows[1]])
    assert batch.inputs["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch.inputs["labels"].tolist() == [[IGNORE_INDEX, 6, 7], [IGNORE_INDEX, 9, IGNORE_INDEX]]
    assert "position_ids" not in batch.inputs


def test_packed_samples_do_not_attend_to_each_other(tiny_model_template: Path) -> None:
    """A packed row gives each sample exactly the logits it gets alone."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_template).eval()
    model.config.use_cache = False  # as in training: with a cache, transformers ignores the packing
    a, b = list(range(10, 30)), list(range(40, 52))
    batch = RowCollator(pad_token_id=1, packing=True)([[(np.array(a), np.ones(20)), (np.array(b), np.ones(12))]])
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.inputs.items() if k != "labels"}).logits[0]
        alone_a = model(input_ids=torch.tensor([a])).logits[0]
        alone_b = model(input_ids=torch.tensor([b])).logits[0]
    torch.testing.assert_close(packed[:20], alone_a, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(packed[20:], alone_b, atol=1e-5, rtol=1e-4)


def test_padding_free_lays_the_micro_batch_end_to_end() -> None:
    samples = samples_of([5, 6, 7], [8, 9], [3, 4, 2, 1], targets=[[0, 1, 1], [1, 1], [1, 1, 1, 1]])
    rows = SampleRows(samples, [[0, 1], [2]], packing=True, padding_free=True)
    batch = RowCollator(pad_token_id=0, packing=True, padding_free=True)([rows[0], rows[1]])
    assert batch.inputs["input_ids"].tolist() == [[5, 6, 7, 8, 9, 3, 4, 2, 1]]
    assert batch.inputs["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    ignore = IGNORE_INDEX
    assert batch.inputs["labels"].tolist() == [[ignore, 6, 7, ignore, 9, ignore, 4, 2, 1]]
    assert "attention_mask" not in batch.inputs
    assert (batch.real_tokens, batch.samples, batch.slots) == (9, 3, 9)


def test_padding_free_rows_stay_within_max_seq_length() -> None:
    """A model cannot attend over more positions than it has, even when they restart."""
    samples = samples_of([5, 6, 7], [8, 9], [3, 4, 2, 1])
    rows = SampleRows(samples, [[0], [1], [2]], packing=False, padding_free=True, max_seq_length=5)
    batch = RowCollator(pad_token_id=0, packing=False, padding_free=True, max_seq_length=5)([rows[0], rows[1], rows[2]])
    assert batch.inputs["input_ids"].tolist() == [[5, 6, 7, 8, 9], [3, 4, 2, 1, 0]]
    assert batch.inputs["position_ids"].tolist()[0] == [0, 1, 2, 0, 1]
    assert (batch.real_tokens, batch.samples, batch.slots) == (9, 3, 10)


@pytest.mark.parametrize("padding_free", [True, False])
def test_single_row_lays_every_row_end_to_end(padding_free: bool) -> None:
    """Flash attention keeps samples apart only in a batch of one row: packed or padding-free
    rows all go into it, past max_seq_length (positions still restart at each sample)."""
    samples = samples_of([5, 6, 7], [8, 9], [3, 4, 2, 1])
    rows = SampleRows(
        samples, [[0, 1], [2]], packing=True, padding_free=padding_free, max_seq_length=5, single_row=True
    )
    collate = RowCollator(
        pad_token_id=0, packing=True, padding_free=padding_free, max_seq_length=5, single_row=rows.single_row
    )
    batch = collate([rows[0], rows[1]])
    assert batch.inputs["input_ids"].tolist() == [[5, 6, 7, 8, 9, 3, 4, 2, 1]]
    assert batch.inputs["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert "attention_mask" not in batch.inputs
    # Rows of one sample each, padded with a mask, stay as they are.
    assert not SampleRows(samples, [[0], [1]], packing=False, single_row=True).single_row


def test_padding_free_batch_has_the_padded_batch_loss(tiny_model_template: Path) -> None:
    """Same samples, same label tokens, same mean: only the padding's compute is gone."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(tiny_model_template).eval()
    model.config.use_cache = False
    samples = samples_of(list(range(10, 30)), list(range(40, 47)), list(range(60, 73)))
    micro_batch = [[samples.sample(i)] for i in range(3)]
    padded = RowCollator(pad_token_id=1, packing=False)(micro_batch)
    flat = RowCollator(pad_token_id=1, packing=False, padding_free=True)(micro_batch)
    assert flat.slots == flat.real_tokens == padded.real_tokens < padded.slots
    with torch.no_grad():
        padded_loss = model(**padded.inputs).loss
        flat_loss = model(**flat.inputs).loss
    torch.testing.assert_close(flat_loss, padded_loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("packing", [True, False])
def test_every_rank_gets_the_same_number_of_batches(packing: bool) -> None:
    rng = np.random.default_rng(1)
    samples = samples_of(*[list(range(2, 2 + int(n))) for n in rng.integers(2, 30, size=37)])
    rows = SampleRows(samples, rows_of(samples, packing=packing, max_seq_length=32), packing=packing)
    counts = set()
    for rank in range(2):
        loader, _ = make_loader(rows, micro_batch=2, world_size=2, rank=rank, seed=0, pad_token_id=0)
        counts.add(len(list(loader)))
    assert len(counts) == 1


def test_validation_split_is_seeded_and_disjoint() -> None:
    samples = samples_of(*[[i, i + 1] for i in range(0, 40, 2)])
    train, held = split_samples(samples, 0.25, seed=3)
    again_train, again_held = split_samples(samples, 0.25, seed=3)
    assert len(held) == 5 and len(train) == 15
    assert np.array_equal(held.tokens, again_held.tokens) and np.array_equal(train.tokens, again_train.tokens)
    assert not set(held.tokens[::2].tolist()) & set(train.tokens[::2].tolist())
