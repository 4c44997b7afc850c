"""Checking a user's DeepSpeed config with DeepSpeed's own parser, for the job's world size.

DeepSpeed is imported lazily here: the API imports this module at start-up, and DeepSpeed
pulls in torch, which the API only pays for on the first submit.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import KeysView, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

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
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else "remove it or check DeepSpeed's config reference"
            raise DeepSpeedConfigError((key,), f"DeepSpeed does not know the key '{key}': {hint}")


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
    try:
        parsed = _config_for_world_size(dict(config), world_size)
    except ValidationError as e:
        err = e.errors()[0]
        section = _SECTION_OF_MODEL.get(e.title)
        field_loc: tuple[str | int, ...] = ((section,) if section else ()) + tuple(err["loc"])
        raise DeepSpeedConfigError(field_loc, f"DeepSpeed refused this config: {err['msg']}") from None
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
