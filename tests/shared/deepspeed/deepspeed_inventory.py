"""DeepSpeed's config keys, walked and classified, for the guard in test_safety.py.

``shared/deepspeed/safety.py`` holds the keys tuneq acts on (rewrite or refuse) and the ones it
has read and found safe. This module holds what only the guard needs: what every other
top-level key is, and the walk over DeepSpeed's pydantic config models and key constants that
finds every path-like key, so that a DeepSpeed upgrade bringing one nobody classified fails the
tests. Everything here that walks DeepSpeed imports it.
"""

from __future__ import annotations

import enum
import importlib
import logging
import pathlib
import re
import typing
from collections.abc import Iterator
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel

from shared.deepspeed.config import RecordingDict
from shared.deepspeed.safety import DICT_KEY_POLICY, REFUSED_SECTIONS

# ---------------------------------------------------------------------------------------------
# What every top-level key is (besides the keys and sections safety.py acts on)
# ---------------------------------------------------------------------------------------------

# Top-level config location -> the pydantic model DeepSpeed parses it with (key as in
# MODEL_FIELD_POLICY without the field). "" is DeepSpeedMonitorConfig, whose fields are the
# top-level tensorboard / wandb / csv_monitor / comet sections (monitor/config.py).
SECTION_MODELS: dict[str, str] = {
    "": "monitor.config.DeepSpeedMonitorConfig",
    "zero_optimization": "runtime.zero.config.DeepSpeedZeroConfig",
    "fp16": "runtime.precision_config.DeepSpeedFP16Config",
    "bf16": "runtime.precision_config.DeepSpeedBF16Config",
    "bfloat16": "runtime.precision_config.DeepSpeedBF16Config",
    "compile": "compile.config.CompileConfig",
    "comms_logger": "comm.config.CommsLoggerConfig",
    "hybrid_engine": "runtime.config.HybridEngineConfig",
    "weight_quantization": "inference.config.WeightQuantConfig",
    "timers.throughput": "utils.config.DeepSpeedThroughputTimerConfig",
    "tensor_parallel": "runtime.tensor_parallel.config.TPTrainingConfig",
}

# Path-like DeepSpeed constants that are no config key -> why.
NON_CONFIG_CONSTANTS: dict[str, str] = {
    "runtime.data_pipeline.constants.CURRICULUM_LEARNING_DATA_CLUSTER_PATHS": (
        "a key of the data sampler's state_dict (data_sampler.py state_dict), saved in checkpoints, not read "
        "from the config"
    ),
}

# Dict-parsed top-level sections that are allowed -> why. Their path-like keys, if any, are in
# DICT_KEY_POLICY.
DICT_SECTIONS: dict[str, str] = {
    "flops_profiler": "profiling switches; its output_file is rewritten under run_dir",
    "activation_checkpointing": DICT_KEY_POLICY["activation_checkpointing"].reason,
    "aio": (
        "block size, queue depth and similar knobs for DeepSpeed's async I/O library "
        "(runtime/swap_tensor/aio_config.py)"
    ),
    "checkpoint": DICT_KEY_POLICY["checkpoint"].reason,
    "data_types": "dtype names and fp32-module name patterns (runtime/config.py, runtime/keep_in_fp32.py)",
    "pipeline": (
        "pipeline-engine stage and partition settings, copied into a dict (runtime/config.py get_pipeline_config)"
    ),
    "torch_autocast": "autocast switch and dtype; its lower_precision_safe_modules is refused",
    "optimizer": "the optimizer's name and keyword arguments (runtime/engine.py _configure_basic_optimizer)",
    "scheduler": "the LR scheduler's name and keyword arguments (runtime/engine.py _scheduler_from_config)",
    "expert_parallel": (
        "AutoEP sizes, layer-name regexes, preset names looked up in PRESET_MODELS and fixed implementation "
        "choices (module_inject/auto_ep_config.py parse_autoep_config)"
    ),
}

# Top-level keys whose value is a number, bool, dtype or op name used in arithmetic or as a switch
# (runtime/config.py get_scalar_param); sequence_parallel_size and data_parallel_size are read by
# deepspeed.initialize itself (deepspeed/__init__.py).
SCALAR_TOP_LEVEL_KEYS: frozenset[str] = frozenset(
    {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "managed_gradient_accumulation",
        "steps_per_print",
        "dump_state",
        "disable_python_gc",
        "disable_allgather",
        "communication_data_type",
        "seq_parallel_communication_data_type",
        "prescale_gradients",
        "gradient_predivide_factor",
        "gradient_allreduce_op",
        "gradient_clipping",
        "zero_allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer",
        "wall_clock_breakdown",
        "memory_breakdown",
        "use_data_before_expert_parallelism",
        "dataloader_drop_last",
        "log_level",
        "vocabulary_size",
        "sequence_parallel_size",
        "data_parallel_size",
    }
)

# Top-level keys DeepSpeed 0.19.8 rejects itself with a DeepSpeedConfigError
# (runtime/config.py _reject_removed_config_keys); nothing to enforce here.
REMOVED_TOP_LEVEL_KEYS: frozenset[str] = frozenset(
    {
        "amp",
        "compression_training",
        "curriculum_learning",
        "eigenvalue",
        "elasticity",
        "graph_harvesting",
        "nebula",
        "progressive_layer_drop",
        "quantize_training",
        "sparse_attention",
        "sparse_gradients",
    }
)


# ---------------------------------------------------------------------------------------------
# Walking DeepSpeed
# ---------------------------------------------------------------------------------------------

# Words that make a field or key "path-like" when they are one of its underscore-separated words.
PATH_WORDS: frozenset[str] = frozenset(
    {
        "path", "paths", "dir", "dirs", "directory", "file", "files", "filename", "folder", "url", "urls",
        "uri", "endpoint", "host", "hostname", "module", "modules", "import", "backend", "class", "classes",
        "script", "cmd", "command", "key", "token", "project", "team", "workspace", "entity", "save", "load",
        "log", "logs", "output", "outputs", "result", "results", "exps", "exp", "experiment", "name", "names",
        "checkpoint", "checkpoints", "ckpt", "storage", "persistent", "nvme", "swap", "writer", "policy", "dump",
        "trace", "prefix", "plugin", "hook", "fn", "func", "callable", "server", "address", "port", "socket",
        "remote", "upload", "download", "credential", "credentials", "secret", "password", "user", "account",
        "location", "tmp", "cache",
    }
)  # fmt: skip
# Roots that make a name path-like wherever they appear in it ("log_dir", "ckptdir", "nvmepath").
PATH_SUBSTRINGS: tuple[str, ...] = (
    "path", "dir", "url", "module", "class", "import", "ckpt", "checkpoint", "secret", "passw",
    "endpoint", "script", "command", "storage", "folder", "filename",
)  # fmt: skip

# DeepSpeed modules whose upper-case string constants spell the keys of dict-parsed sections.
CONSTANTS_MODULES: tuple[str, ...] = (
    "deepspeed.runtime.constants",
    "deepspeed.profiling.constants",
    "deepspeed.autotuning.constants",
    "deepspeed.runtime.data_pipeline.constants",
    "deepspeed.runtime.model_checkpointing.constants",
    "deepspeed.runtime.swap_tensor.constants",
    "deepspeed.datastates.config",
    "deepspeed.runtime.activation_checkpointing.config",
)

_CONFIG_KEY = re.compile(r"^[a-z][a-z0-9_]*$")
_CLASS_STATEMENT = re.compile(r"^class\s+(\w+)\s*\(([^)]*)\)", re.MULTILINE)


def name_is_path_like(name: str) -> bool:
    low = name.lower()
    return bool(set(re.split(r"[_\W\d]+", low)) & PATH_WORDS) or any(root in low for root in PATH_SUBSTRINGS)


def _short(module: str) -> str:
    return module.removeprefix("deepspeed.")


def model_key(model: type) -> str:
    """``"monitor.config.TensorBoardConfig"`` for DeepSpeed's TensorBoardConfig."""
    return f"{_short(model.__module__)}.{model.__qualname__}"


@lru_cache(maxsize=1)
def config_model_modules() -> tuple[str, ...]:
    """Every DeepSpeed module that defines a DeepSpeedConfigModel subclass, found in the source.

    Scanning the source (to a fixpoint, so subclasses of subclasses count) rather than keeping a
    list means a new config module in a DeepSpeed upgrade is walked without anyone adding it.
    """
    import deepspeed

    root = pathlib.Path(deepspeed.__file__).parent
    sources: dict[str, str] = {}
    for file in sorted(root.rglob("*.py")):
        parts = file.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        sources[".".join(("deepspeed", *parts))] = file.read_text(encoding="utf-8", errors="replace")
    model_names = {"DeepSpeedConfigModel"}
    modules: set[str] = set()
    grew = True
    while grew:
        grew = False
        for module, text in sources.items():
            for match in _CLASS_STATEMENT.finditer(text):
                if set(re.findall(r"\w+", match.group(2))) & model_names:
                    modules.add(module)
                    if match.group(1) not in model_names:
                        model_names.add(match.group(1))
                        grew = True
    return tuple(sorted(modules))


@lru_cache(maxsize=1)
def config_models() -> dict[str, type[BaseModel]]:
    """model_key -> class, for every DeepSpeedConfigModel subclass and every pydantic model their
    fields' annotations reach. Import errors propagate: a module we cannot import hides fields."""
    for module in config_model_modules():
        importlib.import_module(module)
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    found: dict[str, type[BaseModel]] = {}
    pending: list[type[BaseModel]] = [DeepSpeedConfigModel]
    while pending:
        model = pending.pop()
        for sub in model.__subclasses__():
            pending.append(sub)
        if model is not DeepSpeedConfigModel and model_key(model) not in found:
            found[model_key(model)] = model
            for field in model.model_fields.values():
                pending += [
                    t for t in _leaf_types(field.annotation) if isinstance(t, type) and issubclass(t, BaseModel)
                ]
    return dict(sorted(found.items()))


def _leaf_types(annotation: Any) -> Iterator[Any]:
    """The plain types inside an annotation; containers yield their origin too (``list``, ``dict``)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        yield from (type(arg) for arg in args)
    elif origin is typing.Annotated:
        yield from _leaf_types(args[0])
    elif origin is not None:
        if isinstance(origin, type) and issubclass(origin, (list, tuple, dict, set, frozenset)):
            yield origin
            if not args:
                yield Any  # a bare container (typing.Dict) holds anything
        for arg in args:
            if arg is not Ellipsis:
                yield from _leaf_types(arg)
    elif annotation in (list, tuple, dict, set, frozenset):
        yield annotation
        yield Any
    else:
        yield annotation


def _annotation_kinds(annotation: Any) -> set[str]:
    """What a JSON value for this annotation can be: 'path', 'opaque', 'str', 'model'."""
    kinds: set[str] = set()
    for leaf in _leaf_types(annotation):
        if leaf is Any or leaf is object:
            kinds.add("opaque")
        elif not isinstance(leaf, type) or leaf is type(None):
            continue
        elif issubclass(leaf, pathlib.PurePath):
            kinds.add("path")
        elif issubclass(leaf, BaseModel):
            kinds.add("model")
        elif issubclass(leaf, enum.Enum):
            if any(isinstance(member.value, str) for member in leaf):
                kinds.add("str")
        elif issubclass(leaf, str):
            kinds.add("str")
        # bool/int/float and arbitrary classes (torch.dtype, checked with isinstance) carry no path
    return kinds


def field_is_path_like(names: list[str], annotation: Any) -> bool:
    """A Path, an unchecked value (Any, object, bare dict/list), or a string-carrying field whose
    name or alias looks like a path, module, service or credential. Nested models are not: their
    own fields are walked."""
    kinds = _annotation_kinds(annotation)
    if kinds & {"path", "opaque"}:
        return True
    return "str" in kinds and any(name_is_path_like(name) for name in names)


def _field_names(name: str, alias: str | None) -> list[str]:
    return [name] if not alias or alias == name else [name, alias]


def path_like_fields() -> set[str]:
    """``"<model_key>.<field>"`` for every path-like field of DeepSpeed's pydantic config models."""
    found: set[str] = set()
    for key, model in config_models().items():
        for name, field in model.model_fields.items():
            if field_is_path_like(_field_names(name, field.alias), field.annotation):
                found.add(f"{key}.{name}")
    return found


def model_fields() -> set[str]:
    """``"<model_key>.<field>"`` for every field of DeepSpeed's pydantic config models."""
    return {f"{key}.{name}" for key, model in config_models().items() for name in model.model_fields}


def model_field_locations() -> dict[str, set[str]]:
    """``"<model_key>.<field>"`` -> the dotted config locations a training config reaches it at,
    walking from ``SECTION_MODELS`` through nested models (by field name and by alias, since
    DeepSpeed's models accept both)."""
    models = config_models()
    locations: dict[str, set[str]] = {}
    pending = [(prefix, models[key]) for prefix, key in SECTION_MODELS.items()]
    seen: set[tuple[str, type[BaseModel]]] = set()
    while pending:
        prefix, model = pending.pop()
        if (prefix, model) in seen or prefix.count(".") > 12:
            continue
        seen.add((prefix, model))
        for name, field in model.model_fields.items():
            for spelling in _field_names(name, field.alias):
                loc = f"{prefix}.{spelling}" if prefix else spelling
                locations.setdefault(f"{model_key(model)}.{name}", set()).add(loc)
                leaves = list(_leaf_types(field.annotation))
                in_container = any(leaf in (list, tuple, dict, set, frozenset) for leaf in leaves)
                for leaf in leaves:
                    if isinstance(leaf, type) and issubclass(leaf, BaseModel):
                        pending.append((f"{loc}.*" if in_container else loc, leaf))
    return locations


def path_like_constants() -> dict[str, str]:
    """``"<module>.<NAME>"`` -> value, for every path-like config-key constant in CONSTANTS_MODULES."""
    found: dict[str, str] = {}
    for module_name in CONSTANTS_MODULES:
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if name.endswith("_DEFAULT") or not name.isupper() or not isinstance(value, str):
                continue  # *_DEFAULT constants are values, not keys
            if _CONFIG_KEY.match(value) and name_is_path_like(value):
                found[f"{_short(module_name)}.{name}"] = value
    return found


def deepspeed_top_level_keys() -> set[str]:
    """Every top-level key DeepSpeedConfig's parser asks a config for."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = RecordingDict({"train_batch_size": 1})
    DeepSpeedConfig(probe)
    return set(probe.seen)


def classified_top_level_keys() -> set[str]:
    """Top-level keys this module has a rule or a reason for."""
    keys = {loc.split(".")[0] for loc in SECTION_MODELS if loc}
    keys |= {loc.split(".")[0] for locs in model_field_locations().values() for loc in locs}
    return keys | set(REFUSED_SECTIONS) | set(DICT_SECTIONS) | SCALAR_TOP_LEVEL_KEYS | REMOVED_TOP_LEVEL_KEYS
