"""``POST /jobs/plan``: what a job would do, worked out without training.

The dataset is tokenized by the code the ranks use (and lands in the same cache, so the job
that follows does not tokenize again); steps are counted by the functions the ranks count
with; memory per device comes from DeepSpeed's own estimators for the model's parameter
count. The model is built on the meta device: no weights are read or allocated.

This needs transformers (and so torch): the API runs ``compute_plan`` in a child process.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from shared.data.records import DatasetError
from shared.data.remote import DatasetSourceError, dataset_file
from shared.data.tokenized import TokenizationError
from shared.deepspeed.auto_values import AutoInputs, fill_auto, hidden_size_of, without_auto
from shared.deepspeed.config import resolve_deepspeed_config
from shared.jobs.lora import LoraTargetError, add_lora
from shared.jobs.spec import JobCreate, LoraOptions, TrainingOptions, max_positions_of
from shared.jobs.validation import Problem
from shared.settings import Settings

if TYPE_CHECKING:
    from shared.data.prepared import TrainingData

logger = logging.getLogger(__name__)

MEMORY_NOTE = (
    "model states only (weights, gradients, optimizer state) as DeepSpeed's estimators count them; "
    "activations come on top and grow with the micro-batch size and max_seq_length"
)


class MemoryEstimate(BaseModel):
    zero_stage: int
    offload_optimizer: bool
    offload_param: bool
    per_device_bytes: int
    per_host_cpu_bytes: int
    method: str
    note: str = MEMORY_NOTE


class ReferencePass(BaseModel):
    """A DPO job's pass of the reference model before its first step: the log-probabilities of
    every pair's chosen and rejected answers, computed once and kept (a forward, no backward)."""

    pairs: int  # every pair of the dataset file (a validation_split's too) and of validation_dataset
    forward_batches_per_rank: int  # micro-batches of pairs each rank runs forward
    step_equivalents: float  # its cost in optimizer steps of this job, roughly


# A forward without backward costs about a third of a training micro-step (the backward pass
# costs about twice the forward), whose pair is one concatenated forward of chosen and rejected,
# as the reference pass's is.
FORWARD_SHARE_OF_A_STEP = 1 / 3


def count_reference_pass(*, pairs: int, world_size: int, micro_batch: int, accumulation: int) -> ReferencePass:
    """The reference pass over ``pairs`` pairs, shared out over the ranks a micro-batch at a time."""
    batches = -(-pairs // (world_size * micro_batch))  # ceil(pairs / world_size / micro_batch)
    return ReferencePass(
        pairs=pairs,
        forward_batches_per_rank=batches,
        step_equivalents=round(batches / accumulation * FORWARD_SHARE_OF_A_STEP, 3),
    )


class JobPlan(BaseModel):
    world_size: int
    resolved_deepspeed_config: dict[str, Any]
    # The request named no DeepSpeed config: the one above is what tuneq chose for it.
    deepspeed_config_chosen: bool = False
    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int
    dataset_stats: dict[str, Any]
    steps_per_epoch: int
    total_steps: int
    # A DPO job's reference pass, before its first step and not in total_steps; None for SFT.
    reference_pass: ReferencePass | None = None
    parameters: int
    trainable_parameters: int
    memory: MemoryEstimate


class PlanProblems(Exception):
    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(p.message for p in problems))
        self.problems = problems


def _offload(config: dict[str, Any], section: str) -> bool:
    device = (config.get("zero_optimization") or {}).get(section, {}) or {}
    return device.get("device") in ("cpu", "nvme")


def estimate_memory(
    *,
    config: dict[str, Any],
    zero_stage: int,
    parameters: int,
    trainable: int,
    largest_layer: int,
    world_size: int,
    num_nodes: int = 1,
) -> MemoryEstimate:
    """Per device and per host, for ``world_size`` devices over ``num_nodes`` hosts."""
    offload_optimizer, offload_param = _offload(config, "offload_optimizer"), _offload(config, "offload_param")
    if trainable == parameters and zero_stage >= 2:
        if zero_stage == 2:
            from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

            cpu, device = estimate_zero2_model_states_mem_needs(
                parameters,
                num_gpus_per_node=world_size // num_nodes,
                num_nodes=num_nodes,
                cpu_offload=offload_optimizer,
            )
            method = "deepspeed estimate_zero2_model_states_mem_needs"
        else:
            from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

            cpu, device, _ = estimate_zero3_model_states_mem_needs(
                parameters,
                largest_layer,
                num_gpus_per_node=world_size // num_nodes,
                num_nodes=num_nodes,
                cpu_offload=offload_optimizer,
                cpu_offload_params=offload_param,
                zero_init=True,
            )
            method = "deepspeed estimate_zero3_model_states_mem_needs"
    else:
        # Stages 0 and 1, and LoRA (frozen weights need no gradients or optimizer state), by
        # the same accounting DeepSpeed's estimators use: 2 bytes per 16-bit weight, 2 per
        # gradient, 16 per trained weight for fp32 master weights and Adam's two moments.
        shards = world_size if zero_stage >= 1 else 1
        weights = 2 * parameters // (world_size if zero_stage == 3 else 1)
        grads = 2 * trainable // (world_size if zero_stage >= 2 else 1)
        optimizer = 16 * trainable // shards
        cpu = 0
        if offload_optimizer:
            cpu, optimizer = optimizer * (world_size // num_nodes), 0
        device = weights + grads + optimizer + (4 * largest_layer if zero_stage == 3 else 0)
        method = "bytes per parameter: 2 (weights) + 2 (gradients) + 16 (fp32 master + Adam), sharded by stage"
    return MemoryEstimate(
        zero_stage=zero_stage,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        per_device_bytes=int(device),
        per_host_cpu_bytes=int(cpu),
        method=method,
    )


def _count_parameters(
    model: str, revision: str | None, lora: LoraOptions | None
) -> tuple[int, int, int, int | None, int | None]:
    """(parameters, trainable, largest layer, hidden size, positions) of the model, built on the meta device."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=False)
    with init_empty_weights():
        module = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    module.tie_weights()  # on the meta device the tied embeddings are not tied yet: count them once
    if lora is not None:
        module = add_lora(module, lora)
    parameters = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()), default=0)
    values = config.to_dict()
    return parameters, trainable, largest, hidden_size_of(values), max_positions_of(values)


def _training_data(job_in: JobCreate, opts: TrainingOptions, tokenizer: Any, settings: Settings) -> TrainingData:
    """The job's data as the ranks load it (into the same cache); PlanProblems naming the field."""
    from shared.data.prepared import load_training_data

    try:
        validation_file = None
        if job_in.validation_dataset is not None:
            validation_file = dataset_file(job_in.validation_dataset, settings=settings)
        return load_training_data(
            dataset=dataset_file(job_in.dataset, settings=settings),
            validation_dataset=validation_file,
            options=opts,
            tokenizer=tokenizer,
            cache_dir=settings.cache_dir,
            max_line_bytes=settings.max_line_bytes,
        )
    except (DatasetError, TokenizationError, DatasetSourceError) as e:
        field = "validation_dataset" if str(e).startswith("validation_dataset") else "dataset"
        raise PlanProblems([Problem(("body", field), str(e))]) from None


def compute_plan(job_in: JobCreate, deepspeed_config: dict[str, Any], settings: Settings) -> JobPlan:
    """Raises PlanProblems for what the user must fix (records, chat template, LoRA targets)."""
    from transformers import AutoTokenizer

    from shared.data.prepared import count_steps_per_epoch, count_total_steps

    opts, world_size = job_in.training, job_in.world_size
    try:
        tokenizer = AutoTokenizer.from_pretrained(job_in.model, revision=job_in.revision, trust_remote_code=False)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        parameters, trainable, largest, hidden, positions = _count_parameters(job_in.model, job_in.revision, opts.lora)
    except LoraTargetError as e:
        raise PlanProblems([Problem(("body", "training", "lora"), str(e))]) from None
    except (OSError, ValueError) as e:
        raise PlanProblems([Problem(("body", "model"), f"cannot load '{job_in.model}': {e}")]) from None
    try:
        opts = opts.for_model(positions)
    except ValueError as e:
        raise PlanProblems([Problem(("body", "training", "max_seq_length"), str(e))]) from None
    data = _training_data(job_in, opts, tokenizer, settings)
    inputs = AutoInputs(opts, world_size, hidden_size=hidden)
    batch = resolve_deepspeed_config(without_auto(fill_auto(deepspeed_config, inputs)), world_size=world_size)
    steps_per_epoch = count_steps_per_epoch(
        len(data.rows),
        world_size=world_size,
        micro_batch=batch.micro_batch_per_gpu,
        accumulation=batch.gradient_accumulation_steps,
    )
    total_steps = count_total_steps(steps_per_epoch, opts)
    reference_pass = None
    if opts.method == "dpo":  # a DPO job's rows are pairs, its validation rows too
        reference_pass = count_reference_pass(
            pairs=len(data.rows) + len(data.validation_rows or []),
            world_size=world_size,
            micro_batch=batch.micro_batch_per_gpu,
            accumulation=batch.gradient_accumulation_steps,
        )
    resolved = fill_auto(deepspeed_config, AutoInputs(opts, world_size, hidden_size=hidden, total_steps=total_steps))
    return JobPlan(
        world_size=world_size,
        resolved_deepspeed_config=resolved,
        train_batch_size=batch.train_batch_size,
        micro_batch_per_gpu=batch.micro_batch_per_gpu,
        gradient_accumulation_steps=batch.gradient_accumulation_steps,
        dataset_stats=data.stats(),
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        reference_pass=reference_pass,
        parameters=parameters,
        trainable_parameters=trainable,
        memory=estimate_memory(
            config=resolved,
            zero_stage=batch.zero_stage,
            parameters=parameters,
            trainable=trainable,
            largest_layer=largest,
            world_size=world_size,
            num_nodes=job_in.num_nodes,
        ),
    )
