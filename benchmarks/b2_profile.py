"""B2's profile: what one micro-batch's forward and backward cost in each layout, alone.

B2 times whole epochs, where every step also pays for things padding does not change (the
optimizer step with its CPU offload, the gradient all-reduce, the data loader). This takes
those out: B2's model and records, plain PyTorch on one thread (a rank's share of this
host), the same micro-batches through

- ``padded``: each row padded to the micro-batch's longest, with an attention mask (the HF
  collator's layout);
- ``padding-free``: tuneq's ``training.padding_free`` (``worker.rank.batches.RowCollator``): the rows
  end to end in rows of at most ``max_seq_length``, positions restarting, no padding;
- ``one row at a time``: a forward per row, so no padding and no attention across rows, the
  least compute these samples can take (the reference, not a tuneq layout).

It prints seconds per micro-batch (median of the passes) and each layout's ratio to
``padded``, for micro-batches of 2 (B2's) and 8 (the Trainer's default per device), and
writes ``benchmarks/results/b2-profile-<date>.json``.

    .venv/bin/python -m benchmarks.b2_profile [--batches 6] [--passes 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks import workload
from benchmarks.results import RESULTS_DIR, machine

MICRO_BATCHES = (2, 8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=6, help="micro-batches per pass")
    parser.add_argument("--passes", type=int, default=3, help="timed passes (after one warm-up); the median")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.data.prepared import rows_of
    from shared.data.records import read_records
    from shared.data.tokenized import tokenize_records
    from shared.settings import DEFAULT_MAX_LINE_BYTES
    from worker.rank.batches import IGNORE_INDEX, RowCollator, SampleRows

    torch.set_num_threads(1)
    torch.manual_seed(workload.SEED)
    with tempfile.TemporaryDirectory(prefix="tuneq-bench-b2-profile-") as tmp:
        work = Path(tmp)
        workload.build_model(work / "model")
        workload.write_variable_length_dataset(work / "data.jsonl")
        tokenizer = AutoTokenizer.from_pretrained(work / "model")
        model = AutoModelForCausalLM.from_pretrained(work / "model", use_safetensors=True).train()
        # The rows a job trains on: the job's own tokenization, one sample a row.
        limit = workload.MAX_SEQ_LENGTH
        records = read_records(work / "data.jsonl", max_line_bytes=DEFAULT_MAX_LINE_BYTES)
        samples, _ = tokenize_records(records, tokenizer, max_seq_length=limit)
    dataset = SampleRows(samples, rows_of(samples, packing=False, max_seq_length=limit), packing=False)
    rows = [dataset[i] for i in range(len(dataset))]
    eos = tokenizer.eos_token_id

    padded = RowCollator(eos, packing=False)
    padding_free = RowCollator(eos, packing=False, padding_free=True, max_seq_length=limit)

    def forward_backward(inputs: dict[str, Any], **loss_kwargs: Any) -> None:
        model(**inputs, **loss_kwargs).loss.backward()

    def one_row_at_a_time(batch: list[Any]) -> None:
        # num_items_in_batch: every row's loss summed over the micro-batch's labels, one mean
        labels = (padded(batch).inputs["labels"][:, 1:] != IGNORE_INDEX).sum()
        for row in batch:
            forward_backward(padded([row]).inputs, num_items_in_batch=labels)

    layouts: dict[str, Callable[[list[Any]], None]] = {
        "padded": lambda batch: forward_backward(padded(batch).inputs),
        "padding-free": lambda batch: forward_backward(padding_free(batch).inputs),
        "one row at a time": one_row_at_a_time,
    }
    rng = random.Random(workload.SEED)
    results: list[dict[str, Any]] = []
    for micro_batch in MICRO_BATCHES:
        batches = [rng.sample(rows, micro_batch) for _ in range(args.batches)]
        for name, step in layouts.items():
            passes = []
            for timed in range(args.passes + 1):
                start = time.perf_counter()
                for batch in batches:
                    step(batch)
                if timed:
                    passes.append((time.perf_counter() - start) / len(batches))
            model.zero_grad(set_to_none=True)
            results.append({"micro_batch": micro_batch, "layout": name, "seconds": statistics.median(passes)})
    for r in results:
        base = next(x for x in results if x["micro_batch"] == r["micro_batch"] and x["layout"] == "padded")
        r["ratio_to_padded"] = r["seconds"] / base["seconds"]

    path = args.output or RESULTS_DIR / f"b2-profile-{datetime.now(UTC).date().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"written_at": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(), "rows": results}
    path.write_text(json.dumps(document, indent=2) + "\n")
    table = Table(title="B2: forward + backward of one micro-batch, one thread")
    for column in ("micro-batch", "layout", "seconds", "÷ padded"):
        table.add_column(column)
    for r in results:
        table.add_row(str(r["micro_batch"]), r["layout"], f"{r['seconds']:.3f}", f"{r['ratio_to_padded']:.3f}")
    console = Console()
    console.print(table)
    console.print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
