"""What one rank does for a job, from its spec to the exported model, as a recipe.

Like a torchtune recipe, one class holds the run and reads top to bottom: ``setup()`` builds
the tokenizer, the data, the model and the DeepSpeed engine (and puts it where a checkpoint
left off), ``train()`` is the classic DeepSpeed loop, ``engine(**inputs)``,
``engine.backward(loss)``, ``engine.step()``, with the micro-batches of one optimizer step
as its inner loop, then ``export()`` and ``cleanup()``. Rank 0 reports the plan, metrics and
checkpoints as JSON lines for the worker (``worker.rank.reporting``); no rank touches SQL.
"""

from __future__ import annotations

import itertools
import logging
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from enum import IntEnum
from functools import partial
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from transformers import set_seed

from shared.data.prepared import TrainingData, count_steps_per_epoch, count_total_steps, load_training_data
from shared.data.records import DatasetError
from shared.data.tokenized import TokenizationError, TokenizedSamples
from shared.deepspeed.auto_values import AutoInputs, auto_keys, fill_auto, hidden_size_of, without_auto
from shared.deepspeed.config import DeepSpeedConfigError, resolve_deepspeed_config
from shared.jobs.events import MetricEvent, PlanEvent, WarningEvent
from shared.jobs.run_layout import RunLayout
from shared.jobs.spec import DpoOptions, TrainingOptions, TrainingSpec
from worker.errors import InvalidInputError
from worker.rank import checkpointing
from worker.rank.batches import IGNORE_INDEX, Batch, PairBatch, PairRows, SampleRows, make_loader
from worker.rank.kernels import choose_compile, choose_kernels, liger_installed
from worker.rank.model_loading import load_config, load_model, load_tokenizer, settle_training
from worker.rank.preference_loss import concatenated_forward, dpo_loss
from worker.rank.reference_logps import CLIENT_STATE_KEY, ReferenceLogps, prepare_reference, reference_key
from worker.rank.reporting import EventWriter, write_paused

logger = logging.getLogger(__name__)


class Stop(IntEnum):
    """What the ranks do after a step: go on, or leave. Larger is more urgent: when ranks ask
    for different things, they all do the most urgent one."""

    none = 0
    pause = 1  # save a checkpoint at this step, then leave (the worker asked: RunLayout.pause_request)
    now = 2  # leave without saving (SIGTERM: a cancel, or the worker stopping)


class StopRequested:
    """SIGTERM (cancel, or the worker stopping) lets the current step finish, then the loop
    exits; so does a pause request, after a checkpoint of that step."""

    def __init__(self, pause_request: Path) -> None:
        self.requested = False
        self.pause_request = pause_request
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, _signum: int, _frame: Any) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> Stop:
        """The same on every rank: the most urgent stop any rank was asked for, so all leave
        after the same step (a rank that stayed would wait forever in the next collective).
        Only the ranks on the worker's disk see a pause request; the others learn it here."""
        wanted = Stop.now if self.requested else Stop.pause if self.pause_request.exists() else Stop.none
        flag = torch.tensor([float(wanted)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return Stop(int(flag.item()))


@dataclass
class MetricsWindow:
    """What the micro-batches since the last report add up to: one rank's, until ``summed``."""

    loss_sum: float = 0.0
    micro_batches: int = 0
    real_tokens: int = 0
    samples: int = 0
    token_slots: int = 0  # rows x padded width: real tokens plus padding
    # A method's own measures (DPO's rewards_chosen ...), each summed over the micro-batches:
    # reported as their mean over every rank's micro-batches, as TRL logs them.
    measures: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter, compare=False)  # not summed

    def add(self, loss: float, batch: Batch | PairBatch, measures: dict[str, float]) -> None:
        self.loss_sum += loss
        self.micro_batches += 1
        self.real_tokens += batch.real_tokens
        self.samples += batch.samples
        self.token_slots += batch.slots
        for name, value in measures.items():
            self.measures[name] = self.measures.get(name, 0.0) + value

    def summed(self, device: torch.device) -> MetricsWindow:
        """The sums over every rank (a collective: every rank calls it), so the reported loss
        is every rank's, not rank 0's alone. Every rank has the same measures' names."""
        names = sorted(self.measures)
        sums = [self.loss_sum, self.micro_batches, self.real_tokens, self.samples, self.token_slots]
        packed = torch.tensor(sums + [self.measures[n] for n in names], dtype=torch.float64, device=device)
        dist.all_reduce(packed)
        loss_sum, micro_batches, real_tokens, samples, token_slots, *measures = packed.tolist()
        counts = int(micro_batches), int(real_tokens), int(samples), int(token_slots)
        return MetricsWindow(loss_sum, *counts, measures=dict(zip(names, measures, strict=True)), started=self.started)

    def mean_measures(self) -> dict[str, float]:
        return {name: total / self.micro_batches for name, total in self.measures.items()}


def deepspeed_config(spec: TrainingSpec, inputs: AutoInputs) -> dict[str, Any]:
    """The job's DeepSpeed config with every "auto" that ``inputs`` can answer filled in.

    Called twice, down this one path, because ZeRO-3 needs a config before the model exists
    (``load_model`` builds it partitioned) while some "auto" values need the model (its
    hidden size: bucket sizes) or the batched data (the run's total steps: the scheduler).
    Without ``total_steps`` it is that early config: the values not known yet are left out,
    so DeepSpeed's defaults stand in for them. With it, it is the config the engine runs:
    an "auto" still left is the user's to give.
    """
    config = fill_auto(spec.deepspeed_config, inputs)
    if inputs.total_steps is None:
        return without_auto(config)
    unfilled = list(auto_keys(config))
    if unfilled:
        raise InvalidInputError(f"deepspeed_config: cannot fill 'auto' for {', '.join(unfilled)}: give values")
    if spec.start_from is not None and spec.start_from.universal:
        config = {**config, "checkpoint": {**config.get("checkpoint", {}), "load_universal": True}}
    if spec.num_nodes > 1:
        # Nodes share no disk: every node writes the model states its ranks load on resume
        # (DeepSpeed's node-local storage), beside its ranks' own optimizer shards.
        config = {**config, "checkpoint": {**config.get("checkpoint", {}), "use_node_local_storage": True}}
    return config


def evaluate(engine: Any, loader: Any) -> float:
    """Mean loss per label token over the validation rows, across ranks."""
    engine.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=engine.device)
    with torch.no_grad():
        for batch in loader:
            inputs = batch.inputs_on(engine.device)
            labels = int((inputs["labels"][:, 1:] != IGNORE_INDEX).sum())  # the model shifts by one
            loss = engine(**inputs).loss  # every rank runs every batch: ZeRO-3 gathers in step
            if labels:
                totals += torch.tensor([loss.item() * labels, labels], dtype=torch.float64, device=engine.device)
    dist.all_reduce(totals)
    engine.train()
    return float(totals[0] / totals[1]) if totals[1] else float("nan")


def measure_names(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """TRL's metric names as ``MetricFields`` has them: rewards/chosen is rewards_chosen."""
    return {name.replace("/", "_"): float(value) for name, value in metrics.items()}


def evaluate_preference(
    engine: Any,
    loader: Any,
    *,
    samples: TokenizedSamples,
    reference: ReferenceLogps,
    options: DpoOptions,
    pad_token_id: int,
) -> tuple[float, float]:
    """The DPO loss and the reward accuracy over the validation pairs, each a mean per pair,
    across ranks."""
    engine.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=engine.device)  # loss x pairs, accurate pairs, pairs
    with torch.no_grad():
        for batch in loader:
            chosen, rejected = batch.sides_on(engine.device)
            policy = concatenated_forward(engine, chosen, rejected, pad_token_id=pad_token_id)
            ref_chosen, ref_rejected = reference.of(samples, batch.pairs)
            out = dpo_loss(policy, ref_chosen.to(engine.device), ref_rejected.to(engine.device), config=options)
            pairs = batch.samples
            accurate = float(out.metrics["rewards/accuracies"]) * pairs
            totals += torch.tensor(
                [float(out.loss) * pairs, accurate, pairs], dtype=torch.float64, device=engine.device
            )
    dist.all_reduce(totals)
    engine.train()
    if not totals[2]:
        return float("nan"), float("nan")
    return float(totals[0] / totals[2]), float(totals[1] / totals[2])


class FineTuneRecipe:
    """One rank's run of a job: ``setup()``, ``train()``, ``export()``, ``cleanup()``.

    ``training.method`` decides what a micro-step computes (``_micro_step``): the model's own
    causal-LM loss (SFT), or the DPO loss of a batch of pairs against the reference's
    log-probabilities, scored once in ``setup()`` (``worker.rank.reference_logps``).
    """

    # Known once setup() has run.
    opts: TrainingOptions  # the job's, settled for its model
    rank: int
    world_size: int
    events: EventWriter
    stop: StopRequested
    engine: Any  # deepspeed.DeepSpeedEngine
    tokenizer: Any
    loader: Any
    sampler: Any
    eval_loader: Any | None
    data: TrainingData
    reference: ReferenceLogps | None  # DPO's: every pair's reference log-probabilities
    accumulation: int  # micro-batches per optimizer step, per rank
    steps_per_epoch: int  # optimizer steps
    total_steps: int
    # Where training is: the last optimizer step done and the micro-batch that ended it.
    step: int
    epoch: int
    micro_step: int
    tokens_seen: int  # real tokens trained on, across ranks and attempts
    # Where this attempt starts in the data: that epoch, after that many micro-batches.
    start_epoch: int
    skip_micro_steps: int
    last_saved_step: int

    def __init__(self, spec: TrainingSpec, layout: RunLayout) -> None:
        self.spec = spec
        self.layout = layout
        self.lora = spec.training.lora is not None
        # (tag, step) of the last checkpoint this attempt saved: the next save waits until the
        # worker has published it, so uploads never pile up.
        self.unpublished: tuple[str, int] | None = None
        self.preference = spec.training.method == "dpo"
        self.reference = None
        self.resumed_state: Any = None  # the reference scores in the checkpoint resumed from, if any

    def setup(self) -> None:
        """Tokenizer, data, model and engine; then the step, schedule and data position to
        start from (a checkpoint of this job, or another job's weights)."""
        spec = self.spec
        # The model's config, read once: max_seq_length follows the model unless the job set it.
        model_config = load_config(spec)
        self.opts = opts = settle_training(spec, model_config)
        # NCCL on CUDA hosts, gloo (or ccl) on CPU; across nodes, at MASTER_ADDR:MASTER_PORT.
        deepspeed.init_distributed(timeout=timedelta(minutes=spec.dist_timeout_minutes))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Global rank 0 reports the job (plan, metrics, checkpoints, exports); on the other nodes
        # of a multi-node job, the node's first rank reports its own checkpoint saves, which its
        # worker uploads.
        local_first = self.rank % spec.num_gpus == 0
        self.node_events = EventWriter(self.layout.events(spec.attempt), enabled=local_first)
        self.events = (
            self.node_events if self.rank == 0 else EventWriter(self.layout.events(spec.attempt), enabled=False)
        )
        self.stop = StopRequested(self.layout.pause_request(spec.attempt))
        set_seed(opts.seed)

        self.tokenizer = load_tokenizer(spec)
        # Every rank asks; the first tokenizes (or finds the cache), the others then read it.
        try:
            self.data = data = load_training_data(
                dataset=Path(spec.dataset),
                validation_dataset=Path(spec.validation_dataset) if spec.validation_dataset else None,
                options=opts,
                tokenizer=self.tokenizer,
                cache_dir=Path(spec.cache_dir),
                max_line_bytes=spec.max_line_bytes,
            )
        except (DatasetError, TokenizationError) as e:
            raise InvalidInputError(str(e)) from None

        # Batch sizes do not depend on the model, and ZeRO-3 needs them to build it partitioned.
        inputs = AutoInputs(opts, self.world_size)
        early_config = deepspeed_config(spec, inputs)
        try:
            batch_sizes = resolve_deepspeed_config(early_config, world_size=self.world_size)
        except DeepSpeedConfigError as e:
            raise InvalidInputError(f"deepspeed_config: {e.message}") from None
        # Fused kernels and compile: chosen from what every rank knows alike, so all choose the same.
        device_type = get_accelerator().device_name()
        kernels = choose_kernels(
            opts,
            model_type=model_config.model_type,
            device_type=device_type,
            zero_stage=batch_sizes.zero_stage,
            liger_available=liger_installed(),
        )
        compiling = choose_compile(opts, device_type=device_type, zero_stage=batch_sizes.zero_stage)
        for note in (kernels.note, compiling.note):
            if note is not None:
                logger.info("%s", note)
        if kernels.warn and kernels.note is not None:
            self.events.emit(WarningEvent(message=kernels.note))
        loaded = load_model(
            spec,
            config=model_config,
            deepspeed_config=early_config,
            zero_stage=batch_sizes.zero_stage,
            kernels=kernels.kernels,
        )
        model = loaded.model
        # Flash attention keeps the samples sharing a row apart only in a batch of one row.
        rows_of = partial(
            SampleRows,
            packing=data.packing,
            padding_free=data.padding_free,
            max_seq_length=opts.seq_length,
            single_row=loaded.attention == "flash_attention_2",
        )
        dataset: SampleRows | PairRows = (
            PairRows(data.train, data.rows) if data.preference else rows_of(data.train, data.rows)
        )

        micro_batch, self.accumulation = batch_sizes.micro_batch_per_gpu, batch_sizes.gradient_accumulation_steps
        self.loader, self.sampler = self._loader(dataset, micro_batch, training=True)
        self.eval_loader = None
        if data.validation is not None and data.validation_rows is not None:
            validation_rows = (
                PairRows(data.validation, data.validation_rows)
                if data.preference
                else rows_of(data.validation, data.validation_rows)
            )
            self.eval_loader, _ = self._loader(validation_rows, micro_batch, training=False)
        self.steps_per_epoch = count_steps_per_epoch(
            len(dataset), world_size=self.world_size, micro_batch=micro_batch, accumulation=self.accumulation
        )
        assert self.steps_per_epoch == len(self.loader) // self.accumulation  # the plan endpoint counts the same way
        if self.steps_per_epoch == 0:
            unit = "preference pairs" if data.preference else "packed rows" if data.packing else "usable records"
            raise InvalidInputError(
                f"dataset has {len(dataset)} {unit}, fewer than one optimizer step needs "
                f"(train_batch_size {batch_sizes.train_batch_size}): add records or lower train_batch_size"
            )
        self.total_steps = count_total_steps(self.steps_per_epoch, opts)

        # The "auto" values the API could not fill: the model's hidden size, the total steps.
        hidden_size = hidden_size_of(model.config.to_dict())
        config = deepspeed_config(spec, replace(inputs, hidden_size=hidden_size, total_steps=self.total_steps))
        self.events.emit(
            PlanEvent(
                total_steps=self.total_steps,
                steps_per_epoch=self.steps_per_epoch,
                num_samples=len(data.rows) if data.preference else len(data.train),
                num_rows=len(dataset),
                packing=data.packing,
                world_size=self.world_size,
                deepspeed_config=config,
                model_load=loaded.load,
                attention=loaded.attention,
                kernels=list(kernels.kernels),
                compiled=compiling.compile,
                dataset_stats=data.stats(),
            )
        )
        # Only what trains gets optimizer state: with LoRA, the adapters.
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.engine, _, _, _ = deepspeed.initialize(model=model, config_params=config, model_parameters=trainable)
        if compiling.compile:
            # In place (nn.Module.compile): the module's state_dict keys, hence checkpoints and
            # exports, stay those of the eager model. Inductor's and Triton's caches are the
            # worker's (worker.launcher.settings_environment), so the next job skips the work.
            self.engine.compile()
        self._restore()
        if self.preference:
            self._prepare_reference(micro_batch)

    def _prepare_reference(self, micro_batch: int) -> None:
        """DPO's reference scores, before the first step: the weights are still the starting ones
        unless this attempt resumed a checkpoint, which holds the scores."""
        files = [self.data.train]
        if self.data.validation is not None and self.data.validation.key != self.data.train.key:
            files.append(self.data.validation)
        key = reference_key(self.spec, files=files, dtype=next(self.engine.module.parameters()).dtype, lora=self.lora)
        self.reference = prepare_reference(
            self.engine,
            key=key,
            files=files,
            resumed_state=self.resumed_state,
            cache_dir=Path(self.spec.cache_dir),
            micro_batch=micro_batch,
            pad_token_id=self.tokenizer.pad_token_id,
            lora=self.lora,
            events=self.events,
        )

    def _loader(self, rows: SampleRows | PairRows, micro_batch: int, *, training: bool) -> tuple[Any, Any]:
        # Evaluation keeps the order and every row; training shuffles and drops a last partial
        # micro-batch (make_loader says why).
        return make_loader(
            rows,
            micro_batch=micro_batch,
            world_size=self.world_size,
            rank=self.rank,
            seed=self.opts.seed,
            pad_token_id=self.tokenizer.pad_token_id,
            shuffle=training,
            drop_last=training,
        )

    def _restore(self) -> None:
        """Where this attempt starts: the beginning, or just after a complete checkpoint, with
        the step count, the learning-rate schedule (in the checkpoint) and the data position."""
        spec, engine = self.spec, self.engine
        self.start_epoch, self.skip_micro_steps, self.tokens_seen = 0, 0, 0
        if spec.resume_from is not None:
            # A LoRA checkpoint holds the adapters only; the frozen base comes from the model.
            load_path, client_state = engine.load_checkpoint(
                spec.resume_from.checkpoints_dir, tag=spec.resume_from.tag, load_module_strict=not self.lora
            )
            if load_path is None:
                raise RuntimeError(f"could not load checkpoint {spec.resume_from.tag}")
            self.start_epoch = int(client_state["epoch"])
            self.skip_micro_steps = int(client_state["micro_step"]) + 1
            self.tokens_seen = int(client_state.get("tokens_seen", 0))
            # Present (and required) for DPO: a resumed attempt must never score trained weights.
            self.resumed_state = client_state.get(CLIENT_STATE_KEY, {})
            logger.info("resumed from %s at step %d", spec.resume_from.tag, engine.global_steps)
        elif spec.start_from is not None:
            # Another job's weights and optimizer state; this job's steps, schedule and data are its own.
            load_path, _ = engine.load_checkpoint(
                spec.start_from.checkpoints_dir,
                tag=spec.start_from.tag,
                load_module_strict=not self.lora,
                load_lr_scheduler_states=False,
            )
            if load_path is None:
                raise RuntimeError(f"could not load checkpoint {spec.start_from.tag} of the resume_from job")
            engine.global_steps = engine.global_samples = engine.micro_steps = 0
            logger.info("started from %s (universal: %s)", load_path, spec.start_from.universal)
        if self.skip_micro_steps >= self.steps_per_epoch * self.accumulation:
            self.start_epoch, self.skip_micro_steps = self.start_epoch + 1, 0  # it ended an epoch
        self.step = engine.global_steps
        self.epoch, self.micro_step = self.start_epoch, -1
        # A resumed attempt's step is saved already; anything else saves at the end.
        self.last_saved_step = self.step if spec.resume_from is not None else -1

    def train(self) -> bool:
        """Optimizer steps up to ``total_steps``, then the final checkpoint. False when a
        stop (SIGTERM on any rank) was agreed after a step: no final checkpoint, no export;
        or a pause: that step's checkpoint, and no export."""
        engine, opts = self.engine, self.opts
        eval_every, save_every = opts.eval_every_steps, opts.checkpoint_every_steps
        data = self._micro_batches()
        window = MetricsWindow()
        engine.train()
        for step in range(self.step + 1, self.total_steps + 1):
            for _ in range(self.accumulation):
                self.epoch, self.micro_step, batch = next(data)
                loss, measures = self._micro_step(batch)
                engine.backward(loss)  # gradients add up over the micro-batches of the step
                engine.step()  # the optimizer steps (and zeroes them) at the last micro-batch only
                window.add(loss.item(), batch, measures)
            assert engine.global_steps == step  # DeepSpeed's accumulation boundary is this loop's end
            self.step = step

            evaluation = None
            if self.eval_loader is not None and (step == self.total_steps or (eval_every and step % eval_every == 0)):
                evaluation = self._evaluate()
            if step % opts.log_every_steps == 0 or step == self.total_steps or evaluation is not None:
                self._report(window, evaluation)
                window = MetricsWindow()
            if save_every and step % save_every == 0 and step < self.total_steps:
                self.save_checkpoint(unreported=window)
            if step < self.total_steps and (stop := self.stop.agreed(engine.device)):
                if stop == Stop.pause:
                    self.pause(window)
                logger.info(
                    "%s requested: leaving after step %d", "pause" if stop == Stop.pause else "cancel or stop", step
                )
                return False

        if self.last_saved_step != self.step:
            self.save_checkpoint()
        return True

    def _micro_step(self, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's loss (what backward takes) and the method's own measures of it."""
        engine = self.engine
        if self.reference is None:
            return engine(**batch.inputs_on(engine.device)).loss, {}
        # Chosen and rejected in one forward, scored against the reference's stored scores.
        chosen, rejected = batch.sides_on(engine.device)
        policy = concatenated_forward(engine, chosen, rejected, pad_token_id=self.tokenizer.pad_token_id)
        ref_chosen, ref_rejected = self.reference.of(self.data.train, batch.pairs)
        assert self.opts.dpo is not None
        out = dpo_loss(policy, ref_chosen.to(engine.device), ref_rejected.to(engine.device), config=self.opts.dpo)
        return out.loss, measure_names(out.metrics)

    def _evaluate(self) -> dict[str, float]:
        """``eval_loss`` on the validation data, and DPO's reward accuracy there."""
        if self.reference is None:
            return {"eval_loss": evaluate(self.engine, self.eval_loader)}
        assert self.data.validation is not None and self.opts.dpo is not None
        loss, accuracy = evaluate_preference(
            self.engine,
            self.eval_loader,
            samples=self.data.validation,
            reference=self.reference,
            options=self.opts.dpo,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        return {"eval_loss": loss, "eval_rewards_accuracies": accuracy}

    def pause(self, unreported: MetricsWindow) -> None:
        """Leave the job resumable exactly here: this step's metrics reported (a resume
        continues with the next step, so nothing is reported twice or never), its checkpoint
        saved (even between ``checkpoint_every_steps``), then rank 0 tells the worker."""
        if unreported.micro_batches:  # the same count on every rank: all take part in the sum
            self._report(unreported, None)
        if self.last_saved_step != self.step:
            self.save_checkpoint()
        if self.rank == 0:
            write_paused(self.layout, attempt=self.spec.attempt, step=self.step)

    def _micro_batches(self) -> Iterator[tuple[int, int, Batch]]:
        """(epoch, micro-step in the epoch, batch) from where this attempt starts, epoch after
        epoch, for as long as the loop asks."""
        per_epoch = self.steps_per_epoch * self.accumulation
        skip = self.skip_micro_steps
        for epoch in itertools.count(self.start_epoch):
            self.sampler.set_epoch(epoch)  # the same order as a lost attempt saw: seed + epoch
            for micro_step, batch in enumerate(self.loader):
                if micro_step >= per_epoch:
                    break  # a trailing partial accumulation would never reach an optimizer step
                if micro_step < skip:
                    continue  # trained on before the checkpoint this attempt resumed from
                yield epoch, micro_step, batch
            skip = 0

    def _report(self, window: MetricsWindow, evaluation: dict[str, float] | None) -> None:
        """One MetricEvent for the steps since the last report (rank 0 writes it)."""
        total = window.summed(self.engine.device)
        elapsed = max(time.perf_counter() - window.started, 1e-9)
        self.tokens_seen += total.real_tokens
        grad_norm = self.engine.get_global_grad_norm()
        self.events.emit(
            MetricEvent(
                step=self.step,
                loss=total.loss_sum / total.micro_batches,
                learning_rate=float(self.engine.get_lr()[0]),
                grad_norm=float(grad_norm) if grad_norm is not None else None,
                epoch=self.epoch + (self.micro_step + 1) / (self.steps_per_epoch * self.accumulation),
                tokens_per_second=total.real_tokens / elapsed,
                samples_per_second=total.samples / elapsed,
                real_token_share=total.real_tokens / total.token_slots if total.token_slots else None,
                tokens_seen=self.tokens_seen,
                **total.mean_measures(),
                **(evaluation or {}),
                time=datetime.now(UTC).isoformat(),
            )
        )

    def save_checkpoint(self, unreported: MetricsWindow | None = None) -> None:
        """A DeepSpeed checkpoint of this step, with the data position a resume continues from.
        ``unreported``: the steps since the last report, whose tokens count too (every rank
        saves at the same step, so summing them across ranks here is safe)."""
        pending = 0
        if unreported is not None and unreported.micro_batches:  # the same count on every rank
            pending = unreported.summed(self.engine.device).real_tokens
        if self.unpublished is not None:
            tag, step = self.unpublished
            checkpointing.wait_until_published(
                layout=self.layout,
                tag=tag,
                step=self.step,
                waiting_for=step,
                events=self.events,
                stop=lambda: self.stop.requested,
            )
        position: dict[str, Any] = {
            "step": self.step,
            "epoch": self.epoch,
            "micro_step": self.micro_step,
            "tokens_seen": self.tokens_seen + pending,
        }
        if self.reference is not None:  # so that a resume never scores trained weights
            position[CLIENT_STATE_KEY] = self.reference.client_state()
        checkpointing.save_checkpoint(
            self.engine,
            layout=self.layout,
            step=self.step,
            events=self.node_events,
            client_state=position,
            frozen=not self.lora,
            ranks_per_node=self.spec.num_gpus,
        )
        self.last_saved_step = self.step
        self.unpublished = (self.layout.checkpoint_tag(self.step), self.step)

    def export(self) -> None:
        """The trained model as Hugging Face loads it: the LoRA adapter (and, if asked, the
        merged model), or the full model."""
        if self.lora:
            checkpointing.export_adapter(
                self.engine, self.tokenizer, spec=self.spec, layout=self.layout, step=self.step, events=self.events
            )
        else:
            checkpointing.export_model(
                self.engine, self.tokenizer, layout=self.layout, step=self.step, events=self.events
            )

    def cleanup(self) -> None:
        """Close the events file; every rank leaves together."""
        self.node_events.close()
        dist.barrier()
