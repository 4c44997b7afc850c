"""B2: one epoch of the variable-length dataset through tuneq ÷ the HF Trainer + DeepSpeed default.

Each repeat trains the same model on the same records for one epoch twice, alternating which
side goes first so drift on a shared machine hits both: once as
``benchmarks/hf_trainer_loop.py`` under DeepSpeed's launcher (``transformers.Trainer`` with
``deepspeed=`` and ``DataCollatorForLanguageModeling``: one record per row, each micro-batch
padded to its longest), once submitted to a real ``tuneq dev`` with ``training.padding_free``
on and ``packing`` off: one record per row as well, so the same rows, batches and optimizer
steps, but each micro-batch's rows laid end to end in one row instead of padded, so no compute
goes to padding. Same model, records, tokenization (EOS appended, cut to
``max_seq_length``), DeepSpeed config (so the same train_batch_size, optimizer and learning
rate), seed and rank environment.

Why padding-free rather than packing: packing fills rows with several records, so padding
is gone too, but ``train_batch_size`` counts rows, so a packed
epoch has a fraction of the Trainer's optimizer steps and, at the same learning rate, ends at
a far higher loss (measured 2026-12-03: time ratio 0.69, loss gap 0.83). Padding-free keeps
the Trainer's steps, so its loss is comparable; the time it saves is the padding's share.

Epoch time, the same definition on both sides: rank 0 takes the wall-clock time at the end
of every optimizer step (tuneq: the metric's ``time``; the Trainer: a callback's
``on_step_end``); the epoch time is (end of the last step - end of step 1) x N / (N - 1) for
N steps, i.e. N steps at the mean pace of steps 2..N. That leaves out, equally, everything
before the first step finishes (process start, tokenization, building the DeepSpeed engine,
the first step's allocations: B3 is the start-up figure) and everything after the last (the
final checkpoint and export, the Trainer's save). The step counts are in the details.

Final loss: the HF collator masks the EOS label (its pad token is the EOS token) and tuneq
does not, so the training losses are not quite the same quantity. Instead both final models
(tuneq's exported model, the Trainer's saved model) are evaluated by one function in one
process: mean cross-entropy per predicted token over ``HELDOUT_RECORDS`` held-out records
from the same generator (another seed), each record alone, tokenized as for training. The
checked figure leaves the EOS targets out (the tokens both sides train on); the loss with
them is in the details. The gap is \\|tuneq - HF\\| ÷ HF.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import workload
from benchmarks.common import REPO
from benchmarks.results import Check, Result, Stat
from benchmarks.training_runs import TuneqDev, alternate, metric_times, tuneq_dev

logger = logging.getLogger(__name__)

HELDOUT_RECORDS = 64
HELDOUT_SEED = workload.SEED + 1
JOB_TIMEOUT_SECONDS = 3600
EVALUATE_TIMEOUT_SECONDS = 900


@dataclass
class Run:
    epoch_seconds: float
    steps: int
    losses: list[float]
    model_dir: Path
    real_token_share: float | None = None  # real tokens ÷ token slots (tuneq: mean over steps; HF: rank 0)
    train_seconds: float | None = None  # HF: trainer.train() as a whole, engine included
    heldout_loss: float | None = None  # without EOS targets: what both sides train on
    heldout_loss_with_eos: float | None = None


def epoch_seconds(step_times: list[float]) -> float:
    """N steps at the pace of steps 2..N: (last - first) x N / (N - 1)."""
    n = len(step_times)
    if n < 2:
        raise ValueError(f"{n} step times: need two or more to time an epoch past its first step")
    return (step_times[-1] - step_times[0]) * n / (n - 1)


def _hf_run(work: Path, env: dict[str, str], repeat: int) -> Run:
    out = work / f"hf-{repeat}"
    recorded, _ = workload.run_reference_script(
        "hf_trainer_loop.py", work, env, out=out, timeout=JOB_TIMEOUT_SECONDS, output=out
    )
    return Run(
        epoch_seconds=epoch_seconds(recorded["step_times"]),
        steps=int(recorded["steps"]),
        losses=recorded["losses"],
        model_dir=out / "model",
        train_seconds=float(recorded["train_seconds"]),
        real_token_share=recorded.get("real_token_share"),
    )


def _tuneq_run(dev: TuneqDev, work: Path, repeat: int) -> Run:
    body = workload.job_body(
        work,
        name=f"b2-{repeat}",
        epochs=1,
        padding_free=True,  # one record a row, as the Trainer (the same steps), but no padding computed
        learning_rate=workload.deepspeed_config()["optimizer"]["params"]["lr"],
        log_every_steps=1,
    )
    job_id, _ = dev.run_job(body, timeout=JOB_TIMEOUT_SECONDS)
    metrics = dev.metrics(job_id)
    shares = [m["real_token_share"] for m in metrics if m.get("real_token_share") is not None]
    return Run(
        epoch_seconds=epoch_seconds(metric_times(metrics)),
        steps=len(metrics),
        losses=[m["loss"] for m in metrics],
        model_dir=dev.model_dir(job_id),
        real_token_share=sum(shares) / len(shares) if shares else None,
    )


def heldout_losses(models: list[Path], data: Path, env: dict[str, str]) -> list[dict[str, float]]:
    """Both sides' final models through one evaluation, in a child process (torch stays out of here)."""
    cmd = [sys.executable, "-m", "benchmarks.b2_epoch", "--evaluate", *map(str, models), "--data", str(data)]
    out = subprocess.run(
        cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=EVALUATE_TIMEOUT_SECONDS, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"held-out evaluation exited with {out.returncode}: {out.stderr[-2000:]}")
    return [{k: float(v) for k, v in x.items()} for x in json.loads(out.stdout.strip().splitlines()[-1])]


def evaluate(model_dir: Path, data: Path, *, max_seq_length: int) -> dict[str, float]:
    """Mean cross-entropy per predicted token over the records of ``data``, one record at a time:
    over the tokens both sides train on (``loss``: EOS targets left out, as the HF collator masks
    them) and over every token (``loss_with_eos``)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True).eval()
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines() if line.strip()]
    eos = tokenizer.eos_token_id
    sums = {"loss": 0.0, "loss_with_eos": 0.0}
    counts = {"loss": 0, "loss_with_eos": 0}
    with torch.no_grad():
        for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]:
            if eos is not None and (not ids or ids[-1] != eos):
                ids = [*ids, eos]
            ids = ids[:max_seq_length]
            if len(ids) < 2:
                continue
            tensor = torch.tensor([ids])
            logits = model(input_ids=tensor).logits[0, :-1].float()
            per_token = F.cross_entropy(logits, tensor[0, 1:], reduction="none")
            not_eos = tensor[0, 1:] != eos
            sums["loss_with_eos"] += float(per_token.sum())
            counts["loss_with_eos"] += per_token.numel()
            sums["loss"] += float(per_token[not_eos].sum())
            counts["loss"] += int(not_eos.sum())
    return {k: sums[k] / counts[k] for k in sums}


def run(repeats: int, *, records: int = workload.RECORDS) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="tuneq-bench-b2-") as tmp:
        work = Path(tmp)
        env = workload.prepare(work, records=records)
        heldout = workload.write_variable_length_dataset(
            work / "heldout.jsonl", records=HELDOUT_RECORDS, seed=HELDOUT_SEED
        )
        params = workload.parameter_count(work / "model")

        with tuneq_dev(work, env) as dev:
            hf_runs, tuneq_runs = alternate(
                repeats, lambda r: _hf_run(work, env, r), lambda r: _tuneq_run(dev, work, r)
            )
            for tuneq_run, hf_run in zip(tuneq_runs, hf_runs, strict=True):
                losses = heldout_losses([tuneq_run.model_dir, hf_run.model_dir], heldout, env)
                for side, loss in zip((tuneq_run, hf_run), losses, strict=True):
                    side.heldout_loss, side.heldout_loss_with_eos = loss["loss"], loss["loss_with_eos"]
    pairs = list(zip(tuneq_runs, hf_runs, strict=True))
    ratio = [t.epoch_seconds / h.epoch_seconds for t, h in pairs]
    gap = [abs(_value(t.heldout_loss) - _value(h.heldout_loss)) / _value(h.heldout_loss) for t, h in pairs]

    def stat(values: list[float | None]) -> dict[str, Any] | None:
        kept = [v for v in values if v is not None]
        return Stat.of(kept).__dict__ if kept else None

    return [
        Result(
            id="B2",
            title="one epoch of variable-length data through tuneq (padding-free) ÷ HF Trainer + DeepSpeed default",
            checks=[
                Check("epoch time ratio", Stat.of(ratio), "<=", 0.5),
                Check("final loss gap (held-out, relative)", Stat.of(gap), "<=", 0.02),
            ],
            details={
                "model": f"GPT-Neo, hidden {workload.HIDDEN_SIZE}, {workload.LAYERS} layers, "
                f"{params / 1e6:.1f} M parameters",
                "ranks": workload.RANKS,
                "records": records,
                "heldout_records": HELDOUT_RECORDS,
                "train_batch_size": workload.TRAIN_BATCH_SIZE,
                "max_seq_length": workload.MAX_SEQ_LENGTH,
                "deepspeed_config": workload.deepspeed_config(),
                "tuneq_epoch_seconds": stat([t.epoch_seconds for t in tuneq_runs]),
                "hf_epoch_seconds": stat([h.epoch_seconds for h in hf_runs]),
                "hf_train_seconds_whole_call": stat([h.train_seconds for h in hf_runs]),
                "tuneq_steps": [t.steps for t in tuneq_runs],
                "hf_steps": [h.steps for h in hf_runs],
                "tuneq_heldout_loss": stat([t.heldout_loss for t in tuneq_runs]),
                "hf_heldout_loss": stat([h.heldout_loss for h in hf_runs]),
                "tuneq_heldout_loss_with_eos": stat([t.heldout_loss_with_eos for t in tuneq_runs]),
                "hf_heldout_loss_with_eos": stat([h.heldout_loss_with_eos for h in hf_runs]),
                "tuneq_last_train_loss": stat([t.losses[-1] for t in tuneq_runs]),
                "hf_last_train_loss": stat([h.losses[-1] if h.losses else None for h in hf_runs]),
                "tuneq_real_token_share": stat([t.real_token_share for t in tuneq_runs]),
                "hf_real_token_share_rank0": stat([h.real_token_share for h in hf_runs]),
            },
        )
    ]


def _value(loss: float | None) -> float:
    if loss is None:
        raise RuntimeError("a run has no held-out loss")
    return loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="B2's held-out evaluation (run by the benchmark itself)")
    parser.add_argument("--evaluate", nargs="+", type=Path, required=True, help="model directories")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--max-seq-length", type=int, default=workload.MAX_SEQ_LENGTH)
    args = parser.parse_args(argv)
    losses = [evaluate(m, args.data, max_seq_length=args.max_seq_length) for m in args.evaluate]
    sys.stdout.write(json.dumps(losses) + "\n")


if __name__ == "__main__":
    main()
