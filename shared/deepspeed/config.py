"""Checking a user's DeepSpeed config with DeepSpeed's own parser, for the job's world size.

DeepSpeed is imported lazily here: the API imports this module at start-up, and DeepSpeed
pulls in torch, which the API only pays for on the first submit.
"""

from __future__ import annotations

import logging
from collections.abc import KeysView, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from shared.spelling import did_you_mean

logger = logging.getLogger(__name__)

# Top-level sections that DeepSpeed reads outside DeepSpeedConfig's own parser (the engine,
# the launcher, the autotuner...), so that a recording of the parser's reads misses them.
_SECTIONS_READ_ELSEWHERE = frozenset(
    {
        "scheduler",
        "activation_checkpointing",
        "flops_profiler",
        "aio",
        "autotuning",
        "zero_allow_comm_data_type_fp32",
        "sequence_parallel_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
    }
)

# pydantic model title -> the config section it parses, for error locations.
_SECTION_OF_MODEL = {
    "DeepSpeedZeroConfig": "zero_optimization",
    "DeepSpeedFP16Config": "fp16",
    "DeepSpeedBF16Config": "bf16",
    "DeepSpeedActivationCheckpointingConfig": "activation_checkpointing",
    "DeepSpeedFlopsProfilerConfig": "flops_profiler",
    "CompileConfig": "compile",
}


class DeepSpeedConfigError(ValueError):
    """The config cannot run. ``loc`` is the path inside ``deepspeed_config``."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message


@dataclass(frozen=True)
class ResolvedBatch:
    """What DeepSpeed made of the config for this world size."""

    world_size: int
    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int
    zero_stage: int
    fp16: bool
    bf16: bool


class RecordingDict(dict[str, Any]):
    """A dict that remembers which keys DeepSpeed's parser asked for (copies share the record)."""

    seen: set[str]

    def __init__(self, data: Mapping[str, Any]) -> None:
        super().__init__(data)
        self.seen = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.seen.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.seen.add(key)
        return super().__contains__(key)

    def keys(self) -> KeysView[str]:  # type: ignore[override]
        # KeysView's `in` goes through our __contains__, so "x in d.keys()" is recorded too.
        return KeysView(self)


def _config_for_world_size(config: dict[str, Any], world_size: int) -> Any:
    from deepspeed.runtime.config import DeepSpeedConfig

    class WorldSizedConfig(DeepSpeedConfig):
        # DeepSpeedConfig takes its world size from an initialised process group; at submit
        # there is none, so we set the job's world size just before the batch arithmetic.
        def __init__(self, cfg: dict[str, Any], size: int) -> None:
            self._tuneq_world_size = size
            super().__init__(cfg)

        def _configure_train_batch_size(self) -> None:
            self.world_size = self._tuneq_world_size
            super()._configure_train_batch_size()

    return WorldSizedConfig(config, world_size)


@lru_cache(maxsize=1)
def known_top_level_keys() -> frozenset[str]:
    """Every top-level key DeepSpeed reads: its parser's reads of a full config, plus the rest."""
    import deepspeed.runtime.constants as constants

    probe = RecordingDict({"train_batch_size": 1})
    _quiet_deepspeed()
    _config_for_world_size(probe, 1)
    named = {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str) and v.islower()}
    return frozenset(probe.seen | named | _SECTIONS_READ_ELSEWHERE)


def _quiet_deepspeed() -> None:
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def _first_lines(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    kept = [ln for ln in lines if not ln.startswith("For further information visit")]
    return " ".join(kept)


def check_unknown_keys(config: dict[str, Any]) -> None:
    known = known_top_level_keys()
    for key in config:
        if key not in known:
            hint = did_you_mean(key, known) or "remove it or check DeepSpeed's config reference"
            raise DeepSpeedConfigError((key,), f"DeepSpeed does not know the key '{key}': {hint}")


@lru_cache(maxsize=1)
def known_optimizer_types() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The ``optimizer.type`` values DeepSpeed's engine builds an optimizer from: its own
    names, in any case (``DEEPSPEED_OPTIMIZERS``), and the classes of ``torch.optim`` by their
    exact names (``_configure_basic_optimizer``: ``getattr(torch.optim, type)``)."""
    import torch.optim  # loaded by DeepSpeed's parser already; its engine looks the name up here
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    torch_names = sorted(
        name
        for name, value in vars(torch.optim).items()
        if isinstance(value, type) and issubclass(value, torch.optim.Optimizer) and value is not torch.optim.Optimizer
    )
    return tuple(DEEPSPEED_OPTIMIZERS), tuple(torch_names)


@lru_cache(maxsize=1)
def known_scheduler_types() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The ``scheduler.type`` values DeepSpeed's engine builds a scheduler from, by their exact
    names (``_scheduler_from_config``): its own (``VALID_LR_SCHEDULES``), then the schedulers
    of ``torch.optim.lr_scheduler``."""
    import torch.optim.lr_scheduler as torch_schedulers  # as for known_optimizer_types
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

    base = torch_schedulers.LRScheduler
    torch_names = sorted(
        name
        for name, value in vars(torch_schedulers).items()
        if isinstance(value, type) and issubclass(value, base) and value is not base and not name.startswith("_")
    )
    return tuple(VALID_LR_SCHEDULES), tuple(torch_names)


def check_optimizer_and_scheduler(config: Mapping[str, Any]) -> None:
    """``optimizer.type`` and ``scheduler.type`` name what DeepSpeed's engine can build: else it
    fails after the job was queued, with a traceback, once the model has loaded."""
    optimizer = config.get("optimizer")
    if isinstance(optimizer, Mapping) and "type" in optimizer:
        deepspeed_names, torch_names = known_optimizer_types()
        name = optimizer["type"]
        if not (isinstance(name, str) and (name.lower() in deepspeed_names or name in torch_names)):
            raise _unknown_type_error(
                "optimizer",
                name,
                deepspeed_names,
                torch_names,
                f"DeepSpeed's {', '.join(deepspeed_names)} (any case), or a torch.optim optimizer: "
                f"{', '.join(torch_names)}",
            )
    scheduler = config.get("scheduler")
    if isinstance(scheduler, Mapping) and "type" in scheduler:
        deepspeed_names, torch_names = known_scheduler_types()
        name = scheduler["type"]
        if not (isinstance(name, str) and (name in deepspeed_names or name in torch_names)):
            raise _unknown_type_error(
                "scheduler",
                name,
                deepspeed_names,
                torch_names,
                f"DeepSpeed's {', '.join(deepspeed_names)}, or a torch.optim.lr_scheduler scheduler: "
                f"{', '.join(torch_names)}",
            )


def _unknown_type_error(
    section: str, name: object, deepspeed_names: tuple[str, ...], torch_names: tuple[str, ...], known: str
) -> DeepSpeedConfigError:
    if not isinstance(name, str):
        return DeepSpeedConfigError((section, "type"), f"{section}.type must be a name, not {name!r}: one of {known}")
    hint = did_you_mean(name, (*deepspeed_names, *torch_names), ignore_case=True)
    suggestion = f"{hint} " if hint else ""
    return DeepSpeedConfigError(
        (section, "type"),
        f"DeepSpeed does not know the {section} '{name}': {suggestion}{section}.type is one of {known}",
    )


def _pydantic_message(error: Mapping[str, Any]) -> str:
    """A pydantic error of DeepSpeed's config models as a sentence. An enum's choices are
    listed once each: pydantic lists an alias twice (ZeRO's stage: "0, 1, 2, 3 or 3", its
    max_stage being 3)."""
    expected = (error.get("ctx") or {}).get("expected")
    if error.get("type") != "enum" or not isinstance(expected, str):
        return str(error["msg"])
    choices = list(dict.fromkeys(part.strip() for part in expected.replace(" or ", ", ").split(",")))
    listed = f"{', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else choices[0]
    return f"must be {listed}, not {error.get('input')!r}"


def check_switches(config: Mapping[str, Any], loc: tuple[str | int, ...] = ()) -> None:
    """Every ``enabled`` in a DeepSpeed config is a switch, true or false. Sections DeepSpeed
    reads without pydantic take any value and fail later with a message that names no field
    (``flops_profiler.enabled: "yes"`` gives ``unsupported operand type(s) for |``)."""
    for key, value in config.items():
        if key == "enabled" and not isinstance(value, bool):
            shown = ".".join(str(part) for part in (*loc, key))
            raise DeepSpeedConfigError((*loc, key), f"{shown} must be true or false, not {value!r}")
        if isinstance(value, Mapping):
            check_switches(value, (*loc, key))


def _named_section(config: Mapping[str, Any], message: str) -> tuple[str | int, ...]:
    """The place in ``config`` a parser message names in quotes ('nebula',
    'zero_optimization.mics_shard_size'), else the whole config."""
    for key, value in config.items():
        if isinstance(value, Mapping):
            for inner in value:
                if f"'{key}.{inner}'" in message:
                    return (key, inner)
        if f"'{key}'" in message:
            return (key,)
    return ()


def resolve_deepspeed_config(config: dict[str, Any], *, world_size: int) -> ResolvedBatch:
    """Parse ``config`` as ``deepspeed.initialize`` would on ``world_size`` ranks.

    Raises DeepSpeedConfigError with DeepSpeed's own message and the field it concerns.
    """
    from pydantic import ValidationError

    _quiet_deepspeed()
    check_unknown_keys(config)
    check_switches(config)
    check_optimizer_and_scheduler(config)
    try:
        parsed = _config_for_world_size(dict(config), world_size)
    except ValidationError as e:
        err = e.errors()[0]
        section = _SECTION_OF_MODEL.get(e.title)
        field_loc: tuple[str | int, ...] = ((section,) if section else ()) + tuple(err["loc"])
        raise DeepSpeedConfigError(field_loc, f"DeepSpeed refused this config: {_pydantic_message(err)}") from None
    except Exception as e:
        # Whatever DeepSpeed's parser raises on a config (its asserts, its own
        # DeepSpeedConfigError for a section it removed: nebula, elasticity, ...): the user's
        # config is all it read, so it is the user's to change, not a server error.
        message = _first_lines(str(e)) or type(e).__name__
        batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
        loc = _named_section(config, message)  # a section the message names in quotes
        if not loc and "batch" in message.lower():
            loc = next(((k,) for k in batch_keys if k in config), ("train_batch_size",))
            message += (
                f" (world size {world_size} = num_nodes x num_gpus: make train_batch_size equal"
                " train_micro_batch_size_per_gpu x gradient_accumulation_steps x num_nodes x num_gpus)"
            )
        raise DeepSpeedConfigError(loc, f"DeepSpeed refused this config: {message}") from None
    return ResolvedBatch(
        world_size=world_size,
        train_batch_size=int(parsed.train_batch_size),
        micro_batch_per_gpu=int(parsed.train_micro_batch_size_per_gpu),
        gradient_accumulation_steps=int(parsed.gradient_accumulation_steps),
        zero_stage=int(parsed.zero_optimization_stage),
        fp16=bool(parsed.float16_config.enabled),
        bf16=bool(parsed.bfloat16_config.enabled),
    )


# Sections whose DeepSpeed code imports a package tuneq does not install (DeepSpeed imports it
# only when the section is enabled, in every rank, after the model has loaded).
_SECTION_PACKAGES = {"tensorboard": "tensorboard"}


def missing_packages(config: Mapping[str, Any]) -> list[DeepSpeedConfigError]:
    """Enabled sections this installation could not run, each naming the package it lacks."""
    import importlib.util

    problems = []
    for section, package in _SECTION_PACKAGES.items():
        part = config.get(section)
        if isinstance(part, Mapping) and part.get("enabled") is True and importlib.util.find_spec(package) is None:
            message = (
                f"{section}.enabled needs the '{package}' package, which this deployment does not have: "
                f"install it in the worker image (pip install {package}), or use csv_monitor, or turn {section} off"
            )
            problems.append(DeepSpeedConfigError((section, "enabled"), message))
    return problems


def wants_fp16(config: dict[str, Any]) -> bool:
    section = config.get("fp16")
    return isinstance(section, dict) and section.get("enabled") is True


def wants_half_precision(config: dict[str, Any]) -> bool:
    """fp16 or bf16 (DeepSpeed reads bf16's section as "bf16" or "bfloat16")."""
    sections = (config.get(name) for name in ("bf16", "bfloat16"))
    return wants_fp16(config) or any(isinstance(s, dict) and s.get("enabled") is True for s in sections)
