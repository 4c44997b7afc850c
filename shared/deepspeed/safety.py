"""Which DeepSpeed config keys may a stranger's job set, on a worker that holds credentials?

A user's ``deepspeed_config`` goes to ``deepspeed.initialize`` on our workers. Most keys are
numbers and switches, but some make DeepSpeed read or write files at a path the user chose,
import modules by name, start processes or send data to outside services. This module decides,
key by key, what happens to those, from what DeepSpeed 0.19.8's code does with them:

``rewrite``
    The key names where DeepSpeed writes harmless output (TensorBoard events, CSV metrics, the
    flops profile). tuneq forces it under the job's ``run_dir``, whatever the user gave, when the
    key is present or its section is enabled. Sections the user didn't give are not added.
``refuse``
    The job is refused when the key is set to anything but its default (``None`` counts as
    default): NVMe swap directories, autotuning result files, curriculum data paths, module names
    DeepSpeed imports, outside-service accounts.
``safe``
    The key looks like a path by its name or type but is not one; the reason says why.

Whole sections are refused too (``REFUSED_SECTIONS``): ``wandb`` and ``comet`` send training data
to outside services, ``autotuning`` writes result files and experiment configs, ``datastates_ckpt``
hands the whole section to a third-party checkpoint engine, ``data_efficiency`` reads index files
from user paths, and the ``nebula`` and ``curriculum_learning`` blocks (which DeepSpeed 0.19.8
itself rejects; older versions used them for a storage service and for curriculum data).

``elasticity`` and ``compression_training`` are not refused here: they hold no paths, and
DeepSpeed 0.19.8 rejects them itself (``runtime/config.py``, ``_REMOVED_TOP_LEVEL_CONFIG_KEYS``).
``aio`` is allowed: it only tunes the NVMe I/O library (block size, queue depth...), and the paths
it would act on are the refused ``nvme_path`` keys. ``checkpoint`` in 0.19.8 has no path keys: the
checkpoint directory is what tuneq's trainer passes to ``save_checkpoint``/``load_checkpoint``.

When is a section "enabled"? DeepSpeed's own rule differs between sections (pydantic sections
coerce ``"enabled"`` to a bool; dict sections test its raw truthiness, so the string ``"false"``
turns them on; ``datastates_ckpt`` is on unless it is literally ``false``). tuneq errs toward
"enabled": a dict is enabled when its ``"enabled"`` is truthy or any string, or, without an
``"enabled"`` key, when it is non-empty; any other value is enabled unless it is ``None`` or
``False``. Refusing a switched-off section costs the user one edit; missing a switched-on one
would run their paths.

The tables (all module-level, all documented at their definition):

* ``MODEL_FIELD_POLICY``: path-like fields of DeepSpeed's pydantic config models, keyed
  ``"<module without 'deepspeed.'>.<Model>.<field>"``, e.g.
  ``"monitor.config.TensorBoardConfig.output_path"``. Each entry lists the config locations
  where a training config reaches that field (empty for models only ``deepspeed.init_inference``
  builds); the test checks those against DeepSpeed's models.
* ``DICT_KEY_POLICY``: keys of the sections DeepSpeed parses by hand from dicts, keyed by their
  dotted config location, e.g. ``"flops_profiler.output_file"`` (``*`` stands for any key), each
  naming the DeepSpeed constant that spells the key.
* ``REFUSED_SECTIONS``: the top-level sections refused whole.

What every other top-level key is, and the walk over DeepSpeed's models and constants that makes
tests/shared/deepspeed/test_safety.py fail when a DeepSpeed upgrade adds a path-like key nobody
classified, live with that test (tests/shared/deepspeed/deepspeed_inventory.py): only the guard
needs them. Nothing here imports DeepSpeed, so the API starts fast.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger(__name__)

Policy = Literal["rewrite", "refuse", "safe"]

# Where a user reads about metrics instead of sending them to an outside service.
_METRICS_FIX = "remove it (tuneq records metrics itself: GET /jobs/{id}/metrics)"
_DATA_FIX = "remove it (tuneq loads and feeds the job's dataset itself)"


@dataclass(frozen=True)
class UnsafeKey:
    """A key that stops the job. ``loc`` is the path inside ``deepspeed_config``."""

    loc: tuple[str | int, ...]
    message: str


@dataclass(frozen=True)
class FieldPolicy:
    """What tuneq does with one DeepSpeed config key.

    ``reason`` reads after the key's location ("deepspeed_config.x.y <reason>") and says what
    DeepSpeed does with the key. ``fix`` says what the user should do when it is refused.
    ``locations``: dotted config locations of the key (``*`` matches any key or list index).
    ``default``: the value that is not refused (``None`` never is). ``rewrite_to``: the forced
    value; ``{run_dir}`` in it is replaced by the job's run directory. ``constants``: for
    dict-parsed keys, the DeepSpeed constants (``"<module without 'deepspeed.'>.<NAME>"``) that
    spell the key, so the test can tell a new path-like constant from a classified one.
    """

    policy: Policy
    reason: str
    locations: tuple[str, ...] = ()
    fix: str = "remove it"
    default: object = None
    rewrite_to: str | None = None
    constants: tuple[str, ...] = ()


SectionActive = Literal["enabled", "not_false", "any_content"]


@dataclass(frozen=True)
class SectionRule:
    """A top-level section refused as a whole while it is active.

    ``active``: ``"enabled"`` uses the module's enabled rule; ``"not_false"`` refuses anything but
    a literal ``false`` (DeepSpeed's own test for ``datastates_ckpt``); ``"any_content"`` refuses
    any content but a false ``"enabled"`` (``data_efficiency``, whose nested samplers DeepSpeed
    switches on independently of the section's own ``"enabled"``).
    """

    reason: str
    fix: str
    active: SectionActive = "enabled"
    constants: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------
# Whole sections
# ---------------------------------------------------------------------------------------------

REFUSED_SECTIONS: dict[str, SectionRule] = {
    "wandb": SectionRule(
        "sends training metrics to Weights & Biases, an outside service (monitor/wandb.py calls wandb.init)",
        _METRICS_FIX,
    ),
    "comet": SectionRule(
        "sends training metrics to Comet, an outside service (monitor/comet.py starts a comet_ml experiment)",
        _METRICS_FIX,
    ),
    "autotuning": SectionRule(
        "makes the engine profile the job and write metric and model-info JSON files to paths from the "
        "config (runtime/engine.py autotuning_metric_path); the autotuner also launches experiments",
        "remove it (tuneq runs the config it was given)",
        constants=("autotuning.constants.AUTOTUNING",),
    ),
    "datastates_ckpt": SectionRule(
        "switches checkpointing to the third-party DataStates engine, which is handed this whole section "
        "(runtime/checkpoint_engine/datastates_checkpoint_engine.py); DeepSpeed enables it unless it is false",
        "remove it (tuneq writes checkpoints with DeepSpeed's own engine)",
        active="not_false",
        constants=("datastates.config.DATASTATES_CHECKPOINTING",),
    ),
    "data_efficiency": SectionRule(
        "makes DeepSpeed's data sampler read index and metric files from paths in the config and run its "
        "data analyzer to write them (runtime/data_pipeline/data_sampling); its samplers switch on "
        "independently of data_efficiency.enabled",
        _DATA_FIX,
        active="any_content",
        constants=("runtime.data_pipeline.constants.DATA_EFFICIENCY",),
    ),
    "curriculum_learning": SectionRule(
        "is the legacy curriculum-learning block; DeepSpeed 0.19.8 rejects it and points to "
        "data_efficiency.data_sampling.curriculum_learning, which reads data paths",
        _DATA_FIX,
    ),
    "nebula": SectionRule(
        "configured Nebula, a persistent checkpoint storage service with its own storage paths; "
        "DeepSpeed 0.19.8 removed it and rejects the block",
        "remove it (tuneq stores checkpoints in the job's run directory)",
    ),
}


# ---------------------------------------------------------------------------------------------
# Pydantic config models
# ---------------------------------------------------------------------------------------------

# Reasons shared by several entries.
_INFERENCE_ONLY = "; only deepspeed.init_inference builds this model, never deepspeed.initialize from a job's config"
_PROCESS_OBJECT = (
    "holds a Python process-group or mpu object handed over in code; a JSON value is plain data, "
    "which torch.distributed rejects, and DeepSpeed never opens or imports it"
)
_INFERENCE_V2_METADATA = (
    "is DeepSpeed-Inference v2 metadata built from model code and flattened-checkpoint metadata, "
    "never from a job's config"
)
_TP = ("tensor_parallel.tensor_parallel", "tensor_parallel.tp")


def _under(prefixes: tuple[str, ...], field: str) -> tuple[str, ...]:
    return tuple(f"{prefix}.{field}" for prefix in prefixes)


MODEL_FIELD_POLICY: dict[str, FieldPolicy] = {
    # --- monitors: local files under run_dir --------------------------------------------------
    "monitor.config.TensorBoardConfig.output_path": FieldPolicy(
        "rewrite",
        "is the directory DeepSpeed's TensorBoard monitor creates and writes event files in (monitor/tensorboard.py)",
        ("tensorboard.output_path",),
        rewrite_to="{run_dir}/monitor/tensorboard",
    ),
    "monitor.config.TensorBoardConfig.job_name": FieldPolicy(
        "rewrite",
        "is os.path.join-ed onto output_path, so an absolute or '..' name escapes it (monitor/tensorboard.py)",
        ("tensorboard.job_name",),
        rewrite_to="DeepSpeedJobName",
    ),
    "monitor.config.CSVConfig.output_path": FieldPolicy(
        "rewrite",
        "is the directory DeepSpeed's CSV monitor creates and appends .csv files in (monitor/csv_monitor.py)",
        ("csv_monitor.output_path",),
        rewrite_to="{run_dir}/monitor/csv",
    ),
    "monitor.config.CSVConfig.job_name": FieldPolicy(
        "rewrite",
        "is os.path.join-ed onto output_path, so an absolute or '..' name escapes it (monitor/csv_monitor.py)",
        ("csv_monitor.job_name",),
        rewrite_to="DeepSpeedJobName",
    ),
    # --- monitors: outside services (the sections are refused whole when enabled) ---------------
    "monitor.config.WandbConfig.team": FieldPolicy(
        "refuse",
        "is the Weights & Biases entity DeepSpeed's wandb monitor sends metrics to (monitor/wandb.py)",
        ("wandb.team",),
        _METRICS_FIX,
    ),
    "monitor.config.WandbConfig.project": FieldPolicy(
        "refuse",
        "is the Weights & Biases project DeepSpeed's wandb monitor sends metrics to (monitor/wandb.py)",
        ("wandb.project",),
        _METRICS_FIX,
        default="deepspeed",
    ),
    "monitor.config.CometConfig.api_key": FieldPolicy(
        "refuse", "is the Comet credential DeepSpeed's comet monitor logs in with", ("comet.api_key",), _METRICS_FIX
    ),
    "monitor.config.CometConfig.project": FieldPolicy(
        "refuse", "is the Comet project DeepSpeed's comet monitor sends metrics to", ("comet.project",), _METRICS_FIX
    ),
    "monitor.config.CometConfig.workspace": FieldPolicy(
        "refuse",
        "is the Comet workspace DeepSpeed's comet monitor sends metrics to",
        ("comet.workspace",),
        _METRICS_FIX,
    ),
    "monitor.config.CometConfig.experiment_key": FieldPolicy(
        "refuse",
        "selects the Comet experiment DeepSpeed's comet monitor sends metrics to",
        ("comet.experiment_key",),
        _METRICS_FIX,
    ),
    "monitor.config.CometConfig.experiment_name": FieldPolicy(
        "refuse",
        "names the Comet experiment DeepSpeed's comet monitor sends metrics to",
        ("comet.experiment_name",),
        _METRICS_FIX,
    ),
    # --- ZeRO ---------------------------------------------------------------------------------
    "runtime.zero.offload_config.DeepSpeedZeroOffloadOptimizerConfig.nvme_path": FieldPolicy(
        "refuse",
        "is a directory where ZeRO-Infinity creates and writes optimizer-state swap files (runtime/swap_tensor)",
        ("zero_optimization.offload_optimizer.nvme_path",),
        "remove it and use offload_optimizer.device 'cpu' (tuneq gives jobs no NVMe swap space)",
    ),
    "runtime.zero.offload_config.DeepSpeedZeroOffloadParamConfig.nvme_path": FieldPolicy(
        "refuse",
        "is a directory where ZeRO-Infinity creates and writes parameter swap files (runtime/swap_tensor)",
        ("zero_optimization.offload_param.nvme_path",),
        "remove it and use offload_param.device 'cpu' (tuneq gives jobs no NVMe swap space)",
    ),
    "runtime.zero.leaf_module_config.DeepSpeedZeroLeafModuleConfig.classes": FieldPolicy(
        "safe",
        "holds class names compared with the model's own classes' names (utils/z3_leaf_module.py); nothing is imported",
        ("zero_optimization.leaf_module.classes",),
    ),
    "runtime.zero.leaf_module_config.DeepSpeedZeroLeafModuleConfig.names": FieldPolicy(
        "safe",
        "holds submodule names matched against model.named_modules() (utils/z3_leaf_module.py)",
        ("zero_optimization.leaf_module.names",),
    ),
    "runtime.zero.leaf_module_config.DeepSpeedZeroLeafModuleConfig.name_suffixes": FieldPolicy(
        "safe",
        "holds submodule name suffixes matched against model.named_modules() (utils/z3_leaf_module.py)",
        ("zero_optimization.leaf_module.name_suffixes",),
    ),
    # --- tensor parallel ------------------------------------------------------------------------
    "runtime.tensor_parallel.config.TPConfig.mpu": FieldPolicy("safe", _PROCESS_OBJECT, _under(_TP, "mpu")),
    "runtime.tensor_parallel.config.TPConfig.tp_group": FieldPolicy("safe", _PROCESS_OBJECT, _under(_TP, "tp_group")),
    "runtime.tensor_parallel.config.TPTrainingConfig.vocab_parallel_ce_backend": FieldPolicy(
        "safe",
        "is a Literal['torch', 'liger'] choice; 'liger' imports the fixed liger_kernel package "
        "(sequence/cross_entropy.py), not a user-named module",
        ("tensor_parallel.vocab_parallel_ce_backend",),
    ),
    "runtime.tensor_parallel.config.TPTrainingConfig.injection_policy_tuple": FieldPolicy(
        "safe",
        "holds the (layer class, linear-layer names) pairs AutoTP assigns in code before use "
        "(runtime/engine.py _configure_tensor_parallel); matched against layers, never opened or imported",
        ("tensor_parallel.injection_policy_tuple",),
    ),
    "runtime.tensor_parallel.config.TPTrainingConfig.partition_config": FieldPolicy(
        "safe",
        "holds AutoTP layer specs: weight-name regexes, partition types and shapes "
        "(module_inject/autotp_config.py AutoTPConfig.from_dict); no paths or imports",
        ("tensor_parallel.partition_config",),
    ),
    # --- other training sections ----------------------------------------------------------------
    "inference.config.WeightQuantConfig.quantized_initialization": FieldPolicy(
        "safe",
        "holds quantizer settings (bits, group size) passed to the ZeRO-3 weight quantizer "
        "(runtime/zero/partition_parameters.py)",
        ("weight_quantization.quantized_initialization",),
    ),
    "inference.config.WeightQuantConfig.post_init_quant": FieldPolicy(
        "safe",
        "maps layer-name patterns to quantizer settings (inference/quantization/quantization.py)",
        ("weight_quantization.post_init_quant",),
    ),
    "comm.config.CommsLoggerConfig.prof_ops": FieldPolicy(
        "safe",
        "lists communication op names whose timings the comms logger logs (comm/comm.py)",
        ("comms_logger.prof_ops",),
    ),
    # --- inference-only models (not reachable from a training config; refused if they ever are) ---
    "inference.config.DeepSpeedInferenceConfig.checkpoint": FieldPolicy(
        "refuse", "is a checkpoint file or JSON description DeepSpeed-Inference loads" + _INFERENCE_ONLY
    ),
    "inference.config.DeepSpeedInferenceConfig.base_dir": FieldPolicy(
        "refuse", "is the directory DeepSpeed-Inference resolves checkpoint files in" + _INFERENCE_ONLY, default=""
    ),
    "inference.config.DeepSpeedInferenceConfig.save_mp_checkpoint_path": FieldPolicy(
        "refuse", "is where DeepSpeed-Inference writes a model-parallel checkpoint" + _INFERENCE_ONLY
    ),
    "inference.config.InferenceCheckpointConfig.checkpoint_dir": FieldPolicy(
        "refuse", "is a checkpoint directory DeepSpeed-Inference loads" + _INFERENCE_ONLY
    ),
    "inference.config.InferenceCheckpointConfig.save_mp_checkpoint_path": FieldPolicy(
        "refuse", "is where DeepSpeed-Inference writes a model-parallel checkpoint" + _INFERENCE_ONLY
    ),
    "inference.config.InferenceCheckpointConfig.base_dir": FieldPolicy(
        "refuse", "is the directory DeepSpeed-Inference resolves checkpoint files in" + _INFERENCE_ONLY
    ),
    "inference.config.DeepSpeedInferenceConfig.injection_policy": FieldPolicy(
        "refuse", "maps model layer classes to the injection policies DeepSpeed-Inference applies" + _INFERENCE_ONLY
    ),
    "inference.config.DeepSpeedInferenceConfig.injection_policy_tuple": FieldPolicy(
        "refuse", "holds the (layer class, linear-layer names) pairs DeepSpeed-Inference injects" + _INFERENCE_ONLY
    ),
    "inference.config.DeepSpeedInferenceConfig.config": FieldPolicy(
        "safe", "is the model config DeepSpeed-Inference reads layer sizes from (inference/engine.py)" + _INFERENCE_ONLY
    ),
    "inference.config.DeepSpeedInferenceConfig.moe_experts": FieldPolicy(
        "safe", "lists expert counts per MoE layer" + _INFERENCE_ONLY
    ),
    "inference.config.DeepSpeedInferenceConfig.mpu": FieldPolicy("safe", _PROCESS_OBJECT),
    "inference.config.DeepSpeedInferenceConfig.ep_group": FieldPolicy("safe", _PROCESS_OBJECT),
    "inference.config.DeepSpeedInferenceConfig.ep_mp_group": FieldPolicy("safe", _PROCESS_OBJECT),
    "inference.config.DeepSpeedMoEConfig.moe_experts": FieldPolicy(
        "safe", "lists expert counts per MoE layer" + _INFERENCE_ONLY
    ),
    "inference.config.DeepSpeedMoEConfig.ep_group": FieldPolicy("safe", _PROCESS_OBJECT),
    "inference.config.DeepSpeedMoEConfig.ep_mp_group": FieldPolicy("safe", _PROCESS_OBJECT),
    "inference.config.DeepSpeedTPConfig.mpu": FieldPolicy("safe", _PROCESS_OBJECT),
    "inference.config.DeepSpeedTPConfig.tp_group": FieldPolicy("safe", _PROCESS_OBJECT),
    "inference.v2.model_implementations.flat_model_helpers.ModelMetadata.policy": FieldPolicy(
        "safe", "names the inference-v2 policy a flattened checkpoint was written by; " + _INFERENCE_V2_METADATA
    ),
    "inference.v2.modules.module_registry.ConfigBundle.name": FieldPolicy(
        "safe",
        "is looked up in DeepSpeed's registry of module implementations (a dict), not imported; "
        + _INFERENCE_V2_METADATA,
    ),
    "inference.v2.modules.module_registry.ConfigBundle.implementation_config": FieldPolicy(
        "safe", "holds keyword settings for a registered module implementation; " + _INFERENCE_V2_METADATA
    ),
    "inference.v2.modules.configs.attention_configs.DSSelfAttentionConfig.masking_args": FieldPolicy(
        "safe", "holds arguments for the attention masking type; " + _INFERENCE_V2_METADATA
    ),
    "inference.v2.modules.configs.embedding_config.DSEmbeddingsConfig.output_normalization": FieldPolicy(
        "safe", "is a NormTypeEnum choice (layer_norm / rms_norm); " + _INFERENCE_V2_METADATA
    ),
}


# ---------------------------------------------------------------------------------------------
# Sections DeepSpeed parses by hand from dicts
# ---------------------------------------------------------------------------------------------

_CURRICULUM = "data_efficiency.data_sampling.curriculum_learning"

DICT_KEY_POLICY: dict[str, FieldPolicy] = {
    "flops_profiler.output_file": FieldPolicy(
        "rewrite",
        "is the file the flops profiler opens for writing, creating its directory "
        "(profiling/flops_profiler/profiler.py print_model_profile)",
        rewrite_to="{run_dir}/flops_profiler.txt",
        constants=("profiling.constants.FLOPS_PROFILER_OUTPUT_FILE",),
    ),
    "flops_profiler.module_depth": FieldPolicy(
        "safe",
        "is an int: how deep into the model's module tree the flops report goes",
        default=-1,
        constants=("profiling.constants.FLOPS_PROFILER_MODULE_DEPTH",),
    ),
    "flops_profiler.top_modules": FieldPolicy(
        "safe",
        "is an int: how many of the costliest modules the flops report lists",
        default=1,
        constants=("profiling.constants.FLOPS_PROFILER_TOP_MODULES",),
    ),
    "torch_autocast.lower_precision_safe_modules": FieldPolicy(
        "refuse",
        "is a list of dotted names DeepSpeed imports with importlib.import_module (runtime/torch_autocast.py)",
        fix="remove it (DeepSpeed's default, torch.nn Linear and Conv layers, applies)",
        constants=("runtime.constants.TORCH_AUTOCAST_LOWER_PRECISION_SAFE_MODULES",),
    ),
    "data_types.keep_in_fp32_modules": FieldPolicy(
        "safe",
        "holds name patterns compiled into a regex and matched against module names (runtime/keep_in_fp32.py)",
        default="auto",
        constants=("runtime.constants.KEEP_IN_FP32_MODULES",),
    ),
    "optimizer.type": FieldPolicy(
        "safe",
        "is compared with DeepSpeed's optimizer names or looked up with getattr(torch.optim, ...) "
        "(runtime/engine.py); never imported by name",
    ),
    "scheduler.type": FieldPolicy(
        "safe",
        "is looked up with getattr on deepspeed.runtime.lr_schedules or torch.optim.lr_scheduler "
        "(runtime/engine.py _scheduler_from_config); never imported by name",
    ),
    "log_level": FieldPolicy(
        "safe", "sets the level of DeepSpeed's logger", constants=("runtime.constants.LOG_LEVEL",)
    ),
    "dump_state": FieldPolicy(
        "safe",
        "logs the engine's configuration through DeepSpeed's logger (runtime/engine.py print_configuration)",
        constants=("runtime.constants.DUMP_STATE",),
    ),
    # checkpoint: switches and DeepSpeed's own writers; the directory comes from the trainer.
    "checkpoint": FieldPolicy(
        "safe",
        "holds switches for how DeepSpeed writes checkpoints into the directory tuneq's trainer passes "
        "to save_checkpoint (runtime/model_checkpointing/config.py); it has no path keys",
        constants=("runtime.constants.CHECKPOINT", "runtime.model_checkpointing.constants.CHECKPOINT"),
    ),
    "checkpoint.load_universal": FieldPolicy(
        "safe",
        "is a bool: read the universal checkpoint layout from the directory the trainer loads",
        default=False,
        constants=("runtime.constants.LOAD_UNIVERSAL_CHECKPOINT",),
    ),
    "checkpoint.use_node_local_storage": FieldPolicy(
        "safe",
        "is a bool: every node saves its own copy inside the checkpoint directory the trainer passes",
        default=False,
        constants=("runtime.constants.USE_NODE_LOCAL_STORAGE_CHECKPOINT",),
    ),
    "checkpoint.checkpoint_serialization": FieldPolicy(
        "safe",
        "is a bool passed to torch.save's zipfile serialization",
        default=True,
        constants=("runtime.model_checkpointing.constants.CHECKPOINT_SERIALIZATION",),
    ),
    "checkpoint.writer": FieldPolicy(
        "safe",
        "picks one of DeepSpeed's own writers (type checked against MOCK/PYTHON/FAST) and its buffer sizes; "
        "decoupled=true runs DeepSpeed's writer in a child process that writes only where save_checkpoint points",
        constants=("runtime.model_checkpointing.constants.CHECKPOINT_WRITER",),
    ),
    # activation_checkpointing: in-memory recomputation switches.
    "activation_checkpointing": FieldPolicy(
        "safe",
        "holds switches and counts for recomputing activations in GPU or CPU memory; it has no path keys",
        constants=("runtime.activation_checkpointing.config.ACT_CHKPT",),
    ),
    "activation_checkpointing.number_checkpoints": FieldPolicy(
        "safe",
        "is a count of checkpointed layers",
        constants=("runtime.activation_checkpointing.config.ACT_CHKPT_NUMBER_CHECKPOINTS",),
    ),
    "activation_checkpointing.synchronize_checkpoint_boundary": FieldPolicy(
        "safe",
        "is a bool: synchronize the device at checkpoint boundaries",
        default=False,
        constants=("runtime.activation_checkpointing.config.ACT_CHKPT_SYNCHRONIZE_CHECKPOINT_BOUNDARY",),
    ),
    "activation_checkpointing.cpu_checkpointing": FieldPolicy(
        "safe",
        "is a bool: keep checkpointed activations in CPU memory",
        default=False,
        constants=("runtime.activation_checkpointing.config.ACT_CHKPT_CPU_CHECKPOINTING",),
    ),
    # autotuning (also refused whole when enabled): its path keys are refused even when it is off.
    "autotuning.results_dir": FieldPolicy(
        "refuse",
        "is the directory the autotuner writes its results in (autotuning/autotuner.py)",
        default="autotuning_results",
        constants=("autotuning.constants.AUTOTUNING_RESULTS_DIR",),
    ),
    "autotuning.exps_dir": FieldPolicy(
        "refuse",
        "is the directory the autotuner writes experiment configs in and launches them from (autotuning/autotuner.py)",
        default="autotuning_exps",
        constants=("autotuning.constants.AUTOTUNING_EXPS_DIR",),
    ),
    "autotuning.metric_path": FieldPolicy(
        "refuse",
        "is the file the engine writes autotuning metrics to (runtime/engine.py autotuning_metric_path)",
        constants=("autotuning.constants.AUTOTUNING_METRIC_PATH",),
    ),
    "autotuning.model_info_path": FieldPolicy(
        "refuse",
        "is the file the engine writes model info to (runtime/engine.py autotuning_model_info_path)",
        constants=("autotuning.constants.AUTOTUNING_MODEL_INFO_PATH",),
    ),
    # data_efficiency (also refused whole): its path keys, named for the record and the guard.
    f"{_CURRICULUM}.data_cluster_path": FieldPolicy(
        "refuse",
        "is the directory the curriculum data sampler reads and writes cluster index files in (data_sampler.py)",
        fix=_DATA_FIX,
        constants=("runtime.data_pipeline.constants.CURRICULUM_LEARNING_CLUSTER_PATH",),
    ),
    f"{_CURRICULUM}.curriculum_metrics.*.index_to_sample_path": FieldPolicy(
        "refuse",
        "is an index file the curriculum data sampler memory-maps (data_sampler.py)",
        fix=_DATA_FIX,
        constants=("runtime.data_pipeline.constants.CURRICULUM_LEARNING_SAMPLE_PATH",),
    ),
    f"{_CURRICULUM}.curriculum_metrics.*.index_to_metric_path": FieldPolicy(
        "refuse",
        "is a metric file the curriculum data sampler memory-maps (data_sampler.py)",
        fix=_DATA_FIX,
        constants=("runtime.data_pipeline.constants.CURRICULUM_LEARNING_METRIC_PATH",),
    ),
    "data_efficiency.data_sampling.dynamic_batching.metrics_path": FieldPolicy(
        "refuse",
        "is a directory DeepSpeed reads sequence-length metrics from, running its data analyzer to write "
        "them there when missing (data_sampling/variable_batch_size_and_lr.py)",
        fix=_DATA_FIX,
        constants=("runtime.data_pipeline.constants.DYNAMIC_BATCHING_METRICS_PATH",),
    ),
    "data_efficiency.data_routing.random_ltd.model_mask_name": FieldPolicy(
        "safe",
        "names the attention-mask keyword argument random-LTD layers read (data_routing/basic_layer.py)",
        constants=("runtime.data_pipeline.constants.RANDOM_LTD_MODEL_MASK_NAME",),
    ),
    "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule": FieldPolicy(
        "safe",
        "holds the random-LTD learning-rate schedule (a switch, layer-token counts and a warmup type)",
        constants=("runtime.data_pipeline.constants.RANDOM_LTD_LAYER_TOKEN_LR_SCHEDULE",),
    ),
}

# ---------------------------------------------------------------------------------------------
# Enforcement
# ---------------------------------------------------------------------------------------------


def _enforced_rules() -> list[tuple[str, FieldPolicy]]:
    """Every (location, policy) that does something: rewrite or refuse."""
    rules = [(loc, p) for p in MODEL_FIELD_POLICY.values() for loc in p.locations]
    rules += list(DICT_KEY_POLICY.items())
    return [(loc, p) for loc, p in rules if p.policy != "safe"]


_ENFORCED_RULES: list[tuple[str, FieldPolicy]] = _enforced_rules()


def _flag_is_on(flag: object) -> bool:
    # Dict sections test the raw value, so "false" switches them on; pydantic coerces it to
    # False. Counting every string as on refuses too much rather than too little.
    if isinstance(flag, str):
        return True
    return bool(flag)


def section_enabled(section: object) -> bool:
    """tuneq's cautious reading of "is this section on?" (see the module docstring)."""
    if isinstance(section, Mapping):
        if "enabled" in section:
            return _flag_is_on(section["enabled"])
        return bool(section)
    return section is not None and section is not False


def _section_active(section: object, active: SectionActive) -> bool:
    if active == "not_false":
        return section is not False
    if active == "any_content" and isinstance(section, Mapping):
        return _flag_is_on(section.get("enabled", False)) or any(key != "enabled" for key in section)
    return section_enabled(section)


def _parents(node: object, parts: list[str], loc: tuple[str | int, ...]) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    """Yield (location, dict) for every dict the dotted ``parts`` lead to; ``*`` is any key or index."""
    if not parts:
        if isinstance(node, dict):
            yield loc, node
        return
    head, rest = parts[0], parts[1:]
    if head == "*":
        if isinstance(node, dict):
            for key, child in node.items():
                yield from _parents(child, rest, (*loc, key))
        elif isinstance(node, list):
            for index, child in enumerate(node):
                yield from _parents(child, rest, (*loc, index))
    elif isinstance(node, dict) and head in node:
        yield from _parents(node[head], rest, (*loc, head))


def _dotted(loc: tuple[str | int, ...]) -> str:
    return ".".join(str(part) for part in loc)


def sanitize_deepspeed_config(config: dict[str, Any], *, run_dir: str) -> tuple[dict[str, Any], list[UnsafeKey]]:
    """Return (a deep copy of config with allowed path keys rewritten under run_dir, problems).

    ``config`` is not changed. ``run_dir`` must be absolute, since the rewritten paths must not
    depend on the worker's working directory. An empty problem list means the job may run with
    the returned config.
    """
    if not os.path.isabs(run_dir):
        raise ValueError(f"run_dir must be an absolute path, got {run_dir!r}")
    sanitized = copy.deepcopy(config)
    problems: list[UnsafeKey] = []

    refused_sections: set[str] = set()
    for section, rule in REFUSED_SECTIONS.items():
        if section in sanitized and _section_active(sanitized[section], rule.active):
            refused_sections.add(section)
            problems.append(UnsafeKey((section,), f"deepspeed_config.{section} {rule.reason}; {rule.fix}"))

    run_root = run_dir.rstrip("/") or "/"
    for location, policy in _ENFORCED_RULES:
        *parent_parts, key = location.split(".")
        if parent_parts and parent_parts[0] in refused_sections:
            continue  # one message for the whole section is enough
        for parent_loc, parent in _parents(sanitized, parent_parts, ()):
            loc = (*parent_loc, key)
            if policy.policy == "rewrite":
                # A top-level key (no parent section) is rewritten only when present.
                if key in parent or (parent_loc and section_enabled(parent)):
                    assert policy.rewrite_to is not None
                    parent[key] = policy.rewrite_to.replace("{run_dir}", run_root)
                    logger.debug("deepspeed_config.%s set to %s", _dotted(loc), parent[key])
            elif key in parent and parent[key] is not None and parent[key] != policy.default:
                problems.append(UnsafeKey(loc, f"deepspeed_config.{_dotted(loc)} {policy.reason}; {policy.fix}"))
    return sanitized, problems
