"""The training entrypoint: one process per rank, started by DeepSpeed's own launcher.

    deepspeed --num_gpus N --master_port P --module worker.rank.train --spec RUN_DIR/spec.json

It reads like the classic DeepSpeed recipe: tokenizer and model from the job, the engine
from the user's config, then ``engine(...)``, ``engine.backward(loss)``, ``engine.step()``.
Rank 0 reports metrics and checkpoints as JSON lines for the worker; no rank touches SQL.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from shared.db.models import ErrorCode
from shared.deepspeed.auto_values import AutoInputs, auto_keys, fill_auto, hidden_size_of, without_auto
from shared.deepspeed.config import DeepSpeedConfigError, resolve_deepspeed_config
from shared.jobs.events import MetricEvent, PlanEvent
from shared.jobs.run_layout import RunLayout
from shared.jobs.spec import TrainingSpec
from worker.errors import InvalidInputError
from worker.process_table import process_running
from worker.rank.reporting import EventWriter, write_rank_error

logger = logging.getLogger("worker.rank.train")

# Set by the worker: the ranks exit when that process is gone (see watch_worker).
WORKER_PID_ENV = "TUNEQ_WORKER_PID"
WATCH_INTERVAL_SECONDS = 2.0


def watch_worker() -> None:
    """Kill this rank's whole launcher group when the worker that started it dies.

    The launcher runs in its own session so the worker can signal it as one group; the
    price is that nothing kills it when the worker is SIGKILLed. Orphaned ranks would hold
    the GPUs the next job needs, so every rank polls its worker and takes the group down.
    """
    pid = int(os.environ.get(WORKER_PID_ENV, "0"))
    if pid <= 0:
        return

    def loop() -> None:
        while process_running(pid):
            time.sleep(WATCH_INTERVAL_SECONDS)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=loop, name="watch-worker", daemon=True).start()


class StopRequested:
    """SIGTERM (cancel, or the worker stopping) lets the current step finish, then the loop exits."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, _signum: int, _frame: Any) -> None:
        self.requested = True

    def agreed(self, device: Any) -> bool:
        """True on every rank once any rank got SIGTERM, so all leave after the same step
        (a rank that stayed would wait forever in the next collective)."""
        import torch
        from deepspeed import comm as dist

        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)


def evaluate(engine: Any, loader: Any) -> float:
    """Mean loss per label token over the validation rows, across ranks."""
    import torch
    from deepspeed import comm as dist

    from worker.rank.batches import IGNORE_INDEX

    engine.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=engine.device)
    with torch.no_grad():
        for batch in loader:
            inputs = {k: v.to(engine.device) for k, v in batch.inputs.items()}
            labels = int((inputs["labels"][:, 1:] != IGNORE_INDEX).sum())  # the model shifts by one
            loss = engine(**inputs).loss  # every rank runs every batch: ZeRO-3 gathers in step
            if labels:
                totals += torch.tensor([loss.item() * labels, labels], dtype=torch.float64, device=engine.device)
    dist.all_reduce(totals)
    engine.train()
    return float(totals[0] / totals[1]) if totals[1] else float("nan")


def train(spec: TrainingSpec, layout: RunLayout) -> None:
    import deepspeed
    import torch
    from deepspeed import comm as dist
    from transformers import set_seed

    from shared.data.prepared import count_epochs, count_steps_per_epoch, count_total_steps, load_training_data
    from shared.data.records import DatasetError
    from shared.data.tokenized import TokenizationError
    from worker.rank.batches import SampleRows, make_loader
    from worker.rank.checkpointing import export_adapter, export_model, save_checkpoint
    from worker.rank.model_loading import load_model, load_tokenizer, settle_training

    opts = settle_training(spec)  # max_seq_length follows the model unless the job set it
    deepspeed.init_distributed()  # NCCL on CUDA hosts, gloo (or ccl) on CPU
    rank, world_size = dist.get_rank(), dist.get_world_size()
    events = EventWriter(layout.events(spec.attempt), enabled=rank == 0)
    stop = StopRequested()
    set_seed(opts.seed)

    tokenizer = load_tokenizer(spec)
    # Every rank asks; the first tokenizes (or finds the cache), the others then read it.
    try:
        data = load_training_data(
            dataset=Path(spec.dataset),
            validation_dataset=Path(spec.validation_dataset) if spec.validation_dataset else None,
            options=opts,
            tokenizer=tokenizer,
            cache_dir=Path(spec.cache_dir),
        )
    except (DatasetError, TokenizationError) as e:
        raise InvalidInputError(str(e)) from None
    packing = data.packing
    dataset = SampleRows(
        data.train, data.rows, packing=packing, padding_free=data.padding_free, max_seq_length=opts.seq_length
    )

    # Batch sizes do not depend on the model, and ZeRO-3 needs them to build it partitioned.
    early_config = without_auto(fill_auto(spec.deepspeed_config, AutoInputs(opts, world_size)))
    try:
        batch_sizes = resolve_deepspeed_config(early_config, world_size=world_size)
    except DeepSpeedConfigError as e:
        raise InvalidInputError(f"deepspeed_config: {e.message}") from None
    model, model_load = load_model(spec, deepspeed_config=early_config, zero_stage=batch_sizes.zero_stage)

    # "auto" values the API could not fill: the model's hidden size (bucket sizes) now; the
    # run's total steps (scheduler) once the data is batched.
    inputs = AutoInputs(opts, world_size, hidden_size=hidden_size_of(model.config.to_dict()))
    micro_batch, accumulation = batch_sizes.micro_batch_per_gpu, batch_sizes.gradient_accumulation_steps
    loader, sampler = make_loader(
        dataset,
        micro_batch=micro_batch,
        world_size=world_size,
        rank=rank,
        seed=opts.seed,
        pad_token_id=tokenizer.pad_token_id,
    )
    eval_loader = None
    if data.validation is not None and data.validation_rows is not None:
        eval_loader, _ = make_loader(
            SampleRows(
                data.validation,
                data.validation_rows,
                packing=packing,
                padding_free=data.padding_free,
                max_seq_length=opts.seq_length,
            ),
            micro_batch=micro_batch,
            world_size=world_size,
            rank=rank,
            seed=opts.seed,
            pad_token_id=tokenizer.pad_token_id,
            shuffle=False,
            drop_last=False,
        )
    steps_per_epoch = count_steps_per_epoch(
        len(dataset), world_size=world_size, micro_batch=micro_batch, accumulation=accumulation
    )
    assert steps_per_epoch == len(loader) // accumulation  # the plan endpoint counts the same way
    if steps_per_epoch == 0:
        unit = "packed rows" if packing else "usable records"
        raise InvalidInputError(
            f"dataset has {len(dataset)} {unit}, fewer than one optimizer step needs "
            f"(train_batch_size {batch_sizes.train_batch_size}): add records or lower train_batch_size"
        )
    total_steps = count_total_steps(steps_per_epoch, opts)
    ds_config = fill_auto(spec.deepspeed_config, replace(inputs, total_steps=total_steps))
    unfilled = list(auto_keys(ds_config))
    if unfilled:
        raise InvalidInputError(f"deepspeed_config: cannot fill 'auto' for {', '.join(unfilled)}: give values")
    if spec.start_from is not None and spec.start_from.universal:
        ds_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}
    events.emit(
        PlanEvent(
            total_steps=total_steps,
            steps_per_epoch=steps_per_epoch,
            num_samples=len(data.train),
            num_rows=len(dataset),
            packing=packing,
            world_size=world_size,
            deepspeed_config=ds_config,
            model_load=model_load,
            dataset_stats=data.stats(),
        )
    )

    # Only what trains gets optimizer state: with LoRA, the adapters.
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, config_params=ds_config, model_parameters=trainable)
    lora = opts.lora is not None
    # Where this attempt starts: the beginning, or just after a complete checkpoint, with the
    # step count, the learning-rate schedule (in the checkpoint) and the data position.
    start_epoch, skip_micro_steps, tokens_seen = 0, 0, 0
    if spec.resume_from is not None:
        # A LoRA checkpoint holds the adapters only; the frozen base comes from the model.
        load_path, client_state = engine.load_checkpoint(
            spec.resume_from.checkpoints_dir, tag=spec.resume_from.tag, load_module_strict=not lora
        )
        if load_path is None:
            raise RuntimeError(f"could not load checkpoint {spec.resume_from.tag}")
        start_epoch = int(client_state["epoch"])
        skip_micro_steps = int(client_state["micro_step"]) + 1
        tokens_seen = int(client_state.get("tokens_seen", 0))
        logger.info("resumed from %s at step %d", spec.resume_from.tag, engine.global_steps)
    elif spec.start_from is not None:
        # Another job's weights and optimizer state; this job's steps, schedule and data are its own.
        load_path, _ = engine.load_checkpoint(
            spec.start_from.checkpoints_dir,
            tag=spec.start_from.tag,
            load_module_strict=not lora,
            load_lr_scheduler_states=False,
        )
        if load_path is None:
            raise RuntimeError(f"could not load checkpoint {spec.start_from.tag} of the resume_from job")
        engine.global_steps = engine.global_samples = engine.micro_steps = 0
        logger.info("started from %s (universal: %s)", load_path, spec.start_from.universal)
    if skip_micro_steps >= steps_per_epoch * accumulation:
        start_epoch, skip_micro_steps = start_epoch + 1, 0

    device = engine.device
    eval_every = opts.eval_every_steps
    step = engine.global_steps
    last_saved_step = step if spec.resume_from is not None else -1
    epoch = start_epoch
    micro_step = -1
    # Per-step sums across micro-batches: loss, micro-batches, real tokens, samples, token slots.
    window = torch.zeros(5, dtype=torch.float64, device=device)
    step_started = time.perf_counter()
    engine.train()
    for epoch in range(start_epoch, count_epochs(steps_per_epoch, total_steps)):
        if step >= total_steps:
            break
        sampler.set_epoch(epoch)  # the same order as the lost attempt saw: seed + epoch
        for micro_step, batch in enumerate(loader):
            if micro_step >= steps_per_epoch * accumulation:
                break  # a trailing partial accumulation would never reach an optimizer step
            if epoch == start_epoch and micro_step < skip_micro_steps:
                continue  # trained on before the checkpoint this attempt resumed from
            outputs = engine(**{k: v.to(device) for k, v in batch.inputs.items()})
            engine.backward(outputs.loss)
            engine.step()
            window += torch.tensor(
                [outputs.loss.item(), 1.0, batch.real_tokens, batch.samples, batch.slots],
                dtype=torch.float64,
                device=device,
            )
            if engine.global_steps == step:
                continue  # still accumulating
            step = engine.global_steps
            eval_loss = None
            if eval_loader is not None and (step == total_steps or (eval_every and step % eval_every == 0)):
                eval_loss = evaluate(engine, eval_loader)
            if step % opts.log_every_steps == 0 or step == total_steps or eval_loss is not None:
                dist.all_reduce(window)  # every rank's loss, not rank 0's alone
                elapsed = max(time.perf_counter() - step_started, 1e-9)
                loss_sum, micro_batches, tokens, samples_done, slots = window.tolist()
                tokens_seen += int(tokens)
                grad_norm = engine.get_global_grad_norm()
                events.emit(
                    MetricEvent(
                        step=step,
                        loss=loss_sum / micro_batches,
                        learning_rate=float(engine.get_lr()[0]),
                        grad_norm=float(grad_norm) if grad_norm is not None else None,
                        epoch=epoch + (micro_step + 1) / (steps_per_epoch * accumulation),
                        tokens_per_second=tokens / elapsed,
                        samples_per_second=samples_done / elapsed,
                        real_token_share=tokens / slots if slots else None,
                        eval_loss=eval_loss,
                        tokens_seen=tokens_seen,
                        time=datetime.now(UTC).isoformat(),
                    )
                )
                window.zero_()
                step_started = time.perf_counter()
            position = {"step": step, "epoch": epoch, "micro_step": micro_step, "tokens_seen": tokens_seen}
            if opts.checkpoint_every_steps and step % opts.checkpoint_every_steps == 0 and step < total_steps:
                save_checkpoint(engine, layout=layout, step=step, events=events, client_state=position, frozen=not lora)
                last_saved_step = step
            if step >= total_steps:
                break
            if stop.agreed(device):
                logger.info("stop requested: leaving after step %d", step)
                events.close()
                sys.exit(0)

    if last_saved_step != step:
        position = {"step": step, "epoch": epoch, "micro_step": micro_step, "tokens_seen": tokens_seen}
        save_checkpoint(engine, layout=layout, step=step, events=events, client_state=position, frozen=not lora)
    if lora:
        export_adapter(engine, tokenizer, spec=spec, layout=layout, step=step, events=events)
    else:
        export_model(engine, tokenizer, layout=layout, step=step, events=events)
    events.close()
    dist.barrier()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True, type=Path)
    parser.add_argument("--local_rank", type=int, default=0, help="set by DeepSpeed's launcher")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(rank)s %(levelname)s %(message)s")
    rank = int(os.environ.get("RANK", "0"))
    old_factory = logging.getLogRecordFactory()

    def record_factory(*a: Any, **k: Any) -> logging.LogRecord:
        record = old_factory(*a, **k)
        record.rank = rank
        return record

    logging.setLogRecordFactory(record_factory)
    watch_worker()
    spec = TrainingSpec.model_validate_json(args.spec.read_text(encoding="utf-8"))
    layout = RunLayout(Path(spec.run_dir))
    try:
        train(spec, layout)
    except InvalidInputError as e:
        logger.error("invalid input: %s", e)
        write_rank_error(layout, rank=rank, code=ErrorCode.invalid_input, message=str(e))
        sys.exit(1)
    except Exception as e:
        traceback.print_exc()
        write_rank_error(layout, rank=rank, code=ErrorCode.training_error, message=f"{type(e).__name__}: {e}")
        sys.exit(1)


if __name__ == "__main__":
    main()
