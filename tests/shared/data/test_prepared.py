"""A DPO job's data as the ranks and the plan see it: pairs as rows, a validation split of
pairs, each pair keeping its index in its file, and the tokenized cache's key carried along."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cli.samples import write_preference_dataset
from shared.data.prepared import count_steps_per_epoch, load_training_data
from shared.data.tokenized import prepare_preference_tokenized
from shared.jobs.spec import TrainingOptions


@pytest.fixture(scope="module")
def tokenizer(tiny_model_template: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_template)


def load(path: Path, tmp_path: Path, tokenizer: Any, validation: Path | None = None, **options: Any) -> Any:
    return load_training_data(
        dataset=path,
        validation_dataset=validation,
        options=TrainingOptions(method="dpo", max_seq_length=64, **options),
        tokenizer=tokenizer,
        cache_dir=tmp_path / "cache",
        max_line_bytes=1 << 20,
    )


def test_dpo_rows_are_pairs_and_a_split_holds_out_pairs_of_the_same_file(tokenizer: Any, tmp_path: Path) -> None:
    pairs = write_preference_dataset(tmp_path / "pairs.jsonl", records=40)
    data = load(pairs, tmp_path, tokenizer, validation_split=0.25, seed=5)
    assert data.preference and not data.packing and not data.padding_free
    assert len(data.train) == 80  # two sequences a pair
    assert data.validation is data.train  # the held-out pairs are rows of the same samples
    assert data.validation_rows is not None and len(data.validation_rows) == 10 and len(data.rows) == 30
    held_out = {row[0] // 2 for row in data.validation_rows}
    trained = {row[0] // 2 for row in data.rows}
    assert not held_out & trained and held_out | trained == set(range(40))
    assert all(row == [row[0], row[0] + 1] and row[0] % 2 == 0 for row in data.rows + data.validation_rows)
    # Chosen then rejected: both start with the pair's prompt, which is never a target.
    chosen, chosen_targets = data.train.sample(data.rows[0][0])
    rejected, rejected_targets = data.train.sample(data.rows[0][1])
    prompt = len(chosen) - int(chosen_targets.sum())
    assert prompt > 0 and list(chosen[:prompt]) == list(rejected[:prompt]) and not rejected_targets[:prompt].any()
    stats = data.stats()
    assert (stats["train"]["format"], stats["train"]["records"], stats["validation_samples"]) == ("preference", 40, 10)
    # An optimizer step takes train_batch_size pairs.
    assert count_steps_per_epoch(len(data.rows), world_size=2, micro_batch=2, accumulation=2) == 3
    # The samples carry the cache key of their file (what the reference scores are kept by).
    _, again = prepare_preference_tokenized(
        pairs, tokenizer, max_seq_length=64, cache_root=tmp_path / "cache" / "tokenized", max_line_bytes=1 << 20
    )
    assert again.cached and data.train.key is not None


def test_a_validation_file_of_pairs_is_its_own_samples(tokenizer: Any, tmp_path: Path) -> None:
    train = write_preference_dataset(tmp_path / "train.jsonl", records=24, seed=1)
    held = write_preference_dataset(tmp_path / "held.jsonl", records=8, seed=2)
    data = load(train, tmp_path, tokenizer, validation=held)
    assert len(data.rows) == 24 and data.validation is not None and data.validation_rows is not None
    assert len(data.validation_rows) == 8 and data.validation.key not in (None, data.train.key)
    assert data.stats()["validation_samples"] == 8


def test_a_split_that_leaves_no_pair_to_train_on_is_refused_in_pairs(tokenizer: Any, tmp_path: Path) -> None:
    from shared.data.records import DatasetError

    pairs = write_preference_dataset(tmp_path / "pairs.jsonl", records=1)
    with pytest.raises(DatasetError, match=r"0\.2 of 1 pairs leaves nothing to train on"):
        load(pairs, tmp_path, tokenizer, validation_split=0.2)
