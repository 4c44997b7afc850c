"""The job a user submits, and the spec the worker hands to the training processes.

Shape rules (types, ranges, unknown fields) live here as pydantic models; rules that need
the filesystem, DeepSpeed or the deployment's hardware live in ``shared.jobs.validation``.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from shared.data.records import SftFormat
from shared.jobs.attention import AttentionChoice
from shared.settings import DEFAULT_MAX_LINE_BYTES


class LoraOptions(BaseModel):
    """Low-rank adapters (peft): only the adapters train; the base model stays frozen."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    r: int = Field(default=8, ge=1, le=1024, description="Rank of the adapter matrices.")
    alpha: int = Field(default=16, ge=1, description="Scale: the update is multiplied by alpha / r.")
    dropout: float = Field(default=0.05, ge=0, lt=1)
    target_modules: list[Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.]+$", max_length=200)]] | None = Field(
        default=None,
        min_length=1,
        description="Names of the linear layers to adapt, e.g. ['q_proj', 'v_proj']; default: peft's choice "
        "for the model type.",
    )
    merge: bool = Field(default=False, description="Also export the base model with the adapter merged into it.")


DEFAULT_MAX_SEQ_LENGTH = 512  # when the model's own limit is not smaller

TrainingMethod = Literal["sft", "dpo"]
DpoLossType = Literal["sigmoid", "ipo", "hinge"]


class DpoOptions(BaseModel):
    """Direct preference optimisation (``training.method: "dpo"``), as TRL's ``DPOTrainer``
    defines each option (``worker.rank.preference_loss`` computes the loss).

    The reference model is the job's starting weights, frozen; its log-probabilities of every
    answer are computed once before the first step and kept (``worker.rank.reference_logps``).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    beta: float = Field(
        default=0.1,
        gt=0,
        le=1000,
        description="How far the policy may move from the reference: TRL's beta (for ipo, the paper's tau).",
    )
    loss_type: DpoLossType = Field(
        default="sigmoid",
        description="sigmoid (the DPO paper's loss), ipo or hinge, as TRL defines them.",
    )
    sft_weight: float = Field(
        default=0.0,
        ge=0,
        le=1000,
        description="Add this weight times the chosen answers' NLL (TRL's loss_type [..., 'sft']: the RPO recipe).",
    )
    label_smoothing: float = Field(
        default=0.0,
        ge=0,
        lt=0.5,
        description="sigmoid only: the preference is taken as flipped with this probability (conservative DPO).",
    )
    normalize_by_length: bool = Field(
        default=False,
        description="Divide each answer's log-ratio by its token count before the loss (ipo always does).",
    )

    @model_validator(mode="after")
    def _smoothing_is_sigmoid(self) -> DpoOptions:
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(
                f"training.dpo.label_smoothing applies to the sigmoid loss only, not {self.loss_type}: set it to 0"
            )
        return self

    @property
    def length_normalized(self) -> bool:
        """Whether the loss divides the log-ratios by the answers' lengths (TRL's ipo always does)."""
        return self.normalize_by_length or self.loss_type == "ipo"


class TrainingOptions(BaseModel):
    """Training-loop knobs. Batch sizes, optimizer and precision come from the DeepSpeed config."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    method: TrainingMethod = Field(
        default="sft",
        description="sft: supervised fine-tuning on text, prompt_completion or messages records. dpo: direct "
        "preference optimisation on preference records (a prompt, a preferred and a rejected answer).",
    )
    dpo: DpoOptions | None = Field(
        default=None, description="The DPO loss's settings (method dpo only); left out, DPO's defaults."
    )

    epochs: int = Field(default=1, ge=1, le=10_000, description="Passes over the dataset (unless max_steps is set).")
    max_steps: int | None = Field(
        default=None,
        gt=0,
        description="Train exactly this many optimizer steps, the data repeating as needed: it overrides "
        "epochs, as the Hugging Face Trainer's max_steps does.",
    )
    max_seq_length: int | None = Field(
        default=None,
        ge=8,
        le=131_072,
        description=f"Tokens per sample; longer samples are truncated. Default: {DEFAULT_MAX_SEQ_LENGTH}, or the "
        "model's own limit (max_position_embeddings) when that is smaller.",
    )
    checkpoint_every_steps: int | None = Field(
        default=None, gt=0, description="Save a DeepSpeed checkpoint every N steps (and always at the end)."
    )
    keep_checkpoints: int | None = Field(
        default=3,
        ge=1,
        description="Keep the newest N DeepSpeed checkpoints, plus the one with the best eval_loss at its step; "
        "older ones are deleted from the artifact store. null keeps all. The exported model is always kept.",
    )
    log_every_steps: int = Field(default=1, ge=1, description="Report metrics every N optimizer steps.")
    seed: int = Field(default=42, ge=0, le=2**32 - 1, description="Seeds data order and initialisation.")
    max_duration_seconds: int | None = Field(
        default=None, gt=0, description="Fail the job with 'timeout' once one attempt has run this long."
    )
    dataset_format: SftFormat | None = Field(
        default=None,
        description="text, prompt_completion or messages; detected from the first record's fields when not given.",
    )
    packing: bool | None = Field(
        default=None,
        description="Pack several samples per row up to max_seq_length; on by default for the text format.",
    )
    padding_free: bool = Field(
        default=False,
        description=(
            "Lay each micro-batch's rows end to end in one row instead of padding them to the longest: "
            "the same samples, steps and loss, no compute spent on padding."
        ),
    )
    attention: AttentionChoice = Field(
        default="auto",
        description=(
            "The model's attention implementation: eager, sdpa, flash_attention_2 or flex_attention. auto picks "
            "the fastest that computes the same attention as eager for this model and hardware (the job's plan "
            "event says which). GPT-Neo's sdpa and flex_attention are tuneq's, with its local layers' window."
        ),
    )
    kernels: Literal["auto", "off"] = Field(
        default="auto",
        description=(
            "Fused kernels (Liger Kernel): auto applies, on CUDA, the ones the model's type has (fused "
            "RMSNorm/LayerNorm, SwiGLU/GeGLU, RoPE, and a linear cross-entropy that never holds the logits, "
            "accumulated in fp32) and nothing on a CPU or a model type without them; off applies none. The "
            "job's plan event lists what was applied."
        ),
    )
    compile: Literal["auto", "on", "off"] = Field(
        default="auto",
        description=(
            "torch.compile through DeepSpeed's engine.compile(): auto compiles on CUDA except under ZeRO-3; "
            "on compiles wherever it runs (a CPU too); off never. Compiled code is cached on the worker, so "
            "the next job of the same shape starts without compiling again."
        ),
    )
    validation_split: float | None = Field(
        default=None, gt=0, lt=0.5, description="Hold out this share of the samples for eval_loss."
    )
    lora: LoraOptions | None = Field(default=None, description="Train LoRA adapters instead of every weight.")
    eval_every_steps: int | None = Field(
        default=None,
        gt=0,
        description="Report eval_loss every N steps (and always at the end) when there is validation data.",
    )
    # Only "auto" values in the DeepSpeed config are filled from these (the Hugging Face
    # Trainer's names and defaults); numbers written in the config win.
    micro_batch_size: int = Field(default=1, ge=1, description="Fills train_micro_batch_size_per_gpu: auto.")
    gradient_accumulation_steps: int = Field(default=1, ge=1, description="Fills gradient_accumulation_steps: auto.")
    learning_rate: float = Field(default=5e-5, gt=0, description="Fills optimizer lr and warmup_max_lr: auto.")
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    adam_beta2: float = Field(default=0.999, ge=0, lt=1)
    adam_epsilon: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    max_grad_norm: float = Field(default=1.0, ge=0, description="Fills gradient_clipping: auto.")
    warmup_steps: int = Field(default=0, ge=0, description="Fills scheduler warmup_num_steps: auto.")
    warmup_ratio: float = Field(default=0.0, ge=0, le=1, description="Used when warmup_steps is 0.")
    precision: Literal["fp32", "fp16", "bf16"] = Field(default="fp32", description="Fills fp16/bf16 enabled: auto.")

    @model_validator(mode="after")
    def _method_options(self) -> TrainingOptions:
        """DPO's options belong to DPO, and its pairs are neither packed nor laid end to end."""
        if self.method != "dpo":
            if self.dpo is not None:
                raise ValueError('training.dpo is for training.method "dpo": set the method, or leave dpo out')
            return self
        for name in ("dataset_format", "packing"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"training.{name} is for supervised fine-tuning: a DPO job trains on preference records "
                    "(one pair a row), detected by their fields; leave it out"
                )
        if self.padding_free:
            raise ValueError("training.padding_free is for supervised fine-tuning, not DPO: leave it out")
        if self.dpo is None:
            self.dpo = DpoOptions()
        return self

    def for_model(self, max_positions: int | None) -> TrainingOptions:
        """These options with ``max_seq_length`` settled for a model of ``max_positions``
        positions (None: not known): a value the user left out follows the model; one they
        set past the model's limit is a ValueError saying what to set."""
        if self.max_seq_length is None:
            limit = DEFAULT_MAX_SEQ_LENGTH if max_positions is None else min(DEFAULT_MAX_SEQ_LENGTH, max_positions)
            return self.model_copy(update={"max_seq_length": limit})
        if max_positions is not None and self.max_seq_length > max_positions:
            raise ValueError(
                f"training.max_seq_length {self.max_seq_length} exceeds the model's {max_positions} positions: "
                f"set it to {max_positions} or less, or leave it out to follow the model"
            )
        return self

    @property
    def seq_length(self) -> int:
        """``max_seq_length`` as settled by :meth:`for_model` (the default before that)."""
        return DEFAULT_MAX_SEQ_LENGTH if self.max_seq_length is None else self.max_seq_length


def max_positions_of(model_config: dict[str, Any]) -> int | None:
    """How many positions a model takes, from its config.json, under the names architectures use."""
    for source in (model_config, model_config.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_positions"):
            if isinstance(source.get(key), int) and source[key] > 0:
                return int(source[key])
    return None


class ResumeFrom(BaseModel):
    """Start from another job's DeepSpeed checkpoint: its weights and optimizer state.

    This job's own steps, learning-rate schedule and data start from the beginning; the
    other job may have run on another number of ranks (the checkpoint is then converted to
    DeepSpeed's universal format first).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    job_id: uuid.UUID
    step: int | None = Field(
        default=None, ge=1, description="A step with a DeepSpeed checkpoint; default: that job's newest."
    )


class JobCreate(BaseModel):
    """Body of ``POST /jobs``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(
        min_length=1,
        max_length=1000,
        description="A hub id like 'EleutherAI/gpt-neo-2.7B', an absolute path to a local model directory, or "
        "another job's output to continue from: job:<id> (its exported model), job:<id>@step-<n> (its DeepSpeed "
        "checkpoint at step n), or an ft: name as /v1 gives it (fine_tuned_model, fine_tuned_model_checkpoint).",
    )
    revision: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        description="Branch, tag or commit of a hub model; the default branch when not given.",
    )
    dataset: str = Field(
        min_length=1,
        max_length=4000,
        description="A path, file://, s3://, https:// or hf:// URI of JSONL, JSON, CSV or Parquet.",
    )
    validation_dataset: str | None = Field(
        default=None, min_length=1, max_length=4000, description="Held-out records for eval_loss, in the same format."
    )
    deepspeed_config: dict[str, Any] | None = Field(
        default=None,
        description="A DeepSpeed config, exactly as deepspeed.initialize takes it. Left out, tuneq chooses one "
        "from the model's size, the workers' hardware and the world size (bf16, or fp16 on GPUs without it, "
        "ZeRO-2 or ZeRO-3 and CPU offload as memory requires, AdamW with warmup and linear decay), stored as the "
        "job's deepspeed_config with deepspeed_config_chosen true.",
    )
    num_gpus: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Ranks to launch on each node: GPUs, or CPU processes on a host without GPUs.",
    )
    num_nodes: int = Field(
        default=1,
        ge=1,
        le=256,
        description="Hosts the job spans, each running num_gpus ranks: the world size is num_nodes x num_gpus. "
        "More than one places the job on that many workers at once.",
    )
    name: str | None = Field(default=None, max_length=200)
    resume_from: ResumeFrom | None = None
    training: TrainingOptions = Field(default_factory=TrainingOptions)
    max_restarts: int = Field(
        default=2, ge=0, le=20, description="Times a job is requeued after its worker is lost, before it fails."
    )

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_gpus

    @model_validator(mode="after")
    def _one_validation_source(self) -> JobCreate:
        if self.validation_dataset is not None and self.training.validation_split is not None:
            raise ValueError(
                "give either validation_dataset or training.validation_split, not both: the split "
                "holds out part of the training data, the dataset is held out already"
            )
        return self


class ResumePoint(BaseModel):
    """A complete DeepSpeed checkpoint to continue from."""

    checkpoints_dir: str
    tag: str
    step: int
    # Converted to DeepSpeed's universal format (it was saved on another number of ranks).
    universal: bool = False


class TrainingSpec(BaseModel):
    """What ``worker.rank.train`` reads from ``spec.json``: the job, resolved, plus where to write."""

    job_id: uuid.UUID
    attempt: int = 1
    resume_from: ResumePoint | None = None  # this job's own checkpoint: continue where it stopped
    start_from: ResumePoint | None = None  # another job's checkpoint: its weights and optimizer state
    model: str
    revision: str | None = None
    dataset: str
    validation_dataset: str | None = None
    deepspeed_config: dict[str, Any]
    num_gpus: int  # per node
    num_nodes: int = 1
    training: TrainingOptions
    run_dir: str
    # How long a rank waits in a collective before DeepSpeed gives up (TUNEQ_DIST_TIMEOUT_MINUTES).
    dist_timeout_minutes: int = 30
    # The longest line of a JSON Lines dataset the ranks read (the worker's TUNEQ_MAX_LINE_BYTES).
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES
    cache_dir: str  # tokenized datasets, shared by the jobs of this host
