"""The DeepSpeed key policy: what is refused, what is rewritten, and the guard that fails when a
DeepSpeed upgrade brings a path-like key nobody classified in shared/deepspeed/safety.py."""

from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any

import pytest

from cli.samples import SEED_DEEPSPEED_CONFIG
from shared.deepspeed import safety
from shared.deepspeed.safety import UnsafeKey, sanitize_deepspeed_config
from tests.shared.deepspeed import deepspeed_inventory as inventory

RUN_DIR = "/runs/job-1"

REFERENCE_CONFIG: dict[str, Any] = SEED_DEEPSPEED_CONFIG  # the core issue's config, as given

FIX_HINT = "classify them in shared/deepspeed/safety.py"
INVENTORY = "tests/shared/deepspeed/deepspeed_inventory.py"


def locs(problems: list[UnsafeKey]) -> list[tuple[str | int, ...]]:
    return [p.loc for p in problems]


def dig(config: dict[str, Any], loc: tuple[str | int, ...]) -> Any:
    node: Any = config
    for part in loc:
        node = node[part]
    return node


def nest(loc: tuple[str, ...], value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} for ("a", "b")."""
    node: Any = value
    for part in reversed(loc):
        node = {part: node}
    assert isinstance(node, dict)
    return node


# --- enforcement ----------------------------------------------------------------------------


def test_reference_config_passes_unchanged() -> None:
    sanitized, problems = sanitize_deepspeed_config(REFERENCE_CONFIG, run_dir=RUN_DIR)
    assert problems == []
    assert sanitized == REFERENCE_CONFIG
    assert sanitized is not REFERENCE_CONFIG


NVME = {"device": "nvme", "nvme_path": "/home/worker/.aws"}


@pytest.mark.parametrize(
    ("config", "expected_loc"),
    [
        ({"wandb": {"enabled": True, "project": "p"}}, ("wandb",)),
        ({"wandb": {"enabled": "false"}}, ("wandb",)),  # dict sections treat any string as on
        ({"wandb": {"enabled": False, "team": "acme"}}, ("wandb", "team")),
        ({"comet": {"enabled": True, "api_key": "k"}}, ("comet",)),
        ({"comet": {"enabled": False, "api_key": "k"}}, ("comet", "api_key")),
        ({"autotuning": {"enabled": True}}, ("autotuning",)),
        ({"autotuning": {"enabled": False, "results_dir": "/etc"}}, ("autotuning", "results_dir")),
        ({"autotuning": {"enabled": False, "metric_path": "/etc/passwd"}}, ("autotuning", "metric_path")),
        ({"nebula": {"enabled": True, "persistent_storage_path": "/x"}}, ("nebula",)),
        ({"curriculum_learning": {"enabled": True}}, ("curriculum_learning",)),
        ({"data_efficiency": {"enabled": True}}, ("data_efficiency",)),
        # DeepSpeed switches data sampling on independently of data_efficiency.enabled.
        ({"data_efficiency": {"enabled": False, "data_sampling": {"enabled": True}}}, ("data_efficiency",)),
        ({"datastates_ckpt": {}}, ("datastates_ckpt",)),  # DeepSpeed: on unless literally false
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": NVME}},
            ("zero_optimization", "offload_optimizer", "nvme_path"),
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": NVME}},
            ("zero_optimization", "offload_param", "nvme_path"),
        ),
        (
            {"torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["os.system"]}},
            ("torch_autocast", "lower_precision_safe_modules"),
        ),
    ],
)
def test_refused(config: dict[str, Any], expected_loc: tuple[str, ...]) -> None:
    _, problems = sanitize_deepspeed_config(config, run_dir=RUN_DIR)
    assert locs(problems) == [expected_loc]
    message = problems[0].message
    assert message.startswith("deepspeed_config." + ".".join(expected_loc) + " ")
    assert "remove it" in message


def test_outside_service_message_points_to_tuneq_metrics() -> None:
    _, problems = sanitize_deepspeed_config({"wandb": {"enabled": True}}, run_dir=RUN_DIR)
    assert problems[0].message.startswith("deepspeed_config.wandb sends training metrics to Weights & Biases")
    assert problems[0].message.endswith("remove it (tuneq records metrics itself: GET /jobs/{id}/metrics)")


@pytest.mark.parametrize(
    "config",
    [
        {"wandb": {"enabled": False}},
        {"wandb": {}},
        {"comet": {"enabled": False, "project": None}},
        {"data_efficiency": {"enabled": False}},
        {"datastates_ckpt": False},
        {"autotuning": {"enabled": False, "results_dir": "autotuning_results"}},
        {"aio": {"block_size": 1048576, "queue_depth": 8}},
        {"checkpoint": {"load_universal": True, "writer": {"type": "fast", "decoupled": True}}},
        {"zero_optimization": {"stage": 3, "leaf_module": {"classes": ["MixtralSparseMoeBlock"]}}},
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "nvme_path": None}}},
        {"data_types": {"keep_in_fp32_modules": ["rotary"]}},
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}},
    ],
)
def test_allowed(config: dict[str, Any]) -> None:
    sanitized, problems = sanitize_deepspeed_config(config, run_dir=RUN_DIR)
    assert problems == []
    assert sanitized == config


@pytest.mark.parametrize(
    ("config", "loc", "expected"),
    [
        (
            {"tensorboard": {"enabled": True, "output_path": "/etc/evil"}},
            ("tensorboard", "output_path"),
            f"{RUN_DIR}/monitor/tensorboard",
        ),
        ({"tensorboard": {"enabled": True}}, ("tensorboard", "output_path"), f"{RUN_DIR}/monitor/tensorboard"),
        ({"tensorboard": {"enabled": True, "job_name": "/etc"}}, ("tensorboard", "job_name"), "DeepSpeedJobName"),
        (
            {"csv_monitor": {"enabled": True, "output_path": "../../etc"}},
            ("csv_monitor", "output_path"),
            f"{RUN_DIR}/monitor/csv",
        ),
        ({"csv_monitor": {"enabled": True, "job_name": "../x"}}, ("csv_monitor", "job_name"), "DeepSpeedJobName"),
        (
            {"flops_profiler": {"enabled": True, "output_file": "/root/.ssh/authorized_keys"}},
            ("flops_profiler", "output_file"),
            f"{RUN_DIR}/flops_profiler.txt",
        ),
        ({"flops_profiler": {"enabled": True}}, ("flops_profiler", "output_file"), f"{RUN_DIR}/flops_profiler.txt"),
        # A switched-off section that still names a path gets the path rewritten too.
        (
            {"tensorboard": {"enabled": False, "output_path": "/etc"}},
            ("tensorboard", "output_path"),
            f"{RUN_DIR}/monitor/tensorboard",
        ),
    ],
)
def test_rewritten_under_run_dir(config: dict[str, Any], loc: tuple[str, ...], expected: str) -> None:
    given = copy.deepcopy(config)
    sanitized, problems = sanitize_deepspeed_config(config, run_dir=RUN_DIR + "/")
    assert problems == []
    assert dig(sanitized, loc) == expected
    assert config == given  # the input is not mutated


@pytest.mark.parametrize(
    "config",
    [{}, {"tensorboard": {"enabled": False}}, {"flops_profiler": {}}, {"csv_monitor": {}}],
)
def test_rewrite_adds_nothing_the_user_did_not_enable(config: dict[str, Any]) -> None:
    sanitized, problems = sanitize_deepspeed_config(config, run_dir=RUN_DIR)
    assert problems == []
    assert sanitized == config


def test_run_dir_must_be_absolute() -> None:
    with pytest.raises(ValueError, match="absolute"):
        sanitize_deepspeed_config({}, run_dir="runs/job-1")


def enforced_locations() -> list[Any]:
    pairs = [(loc, p) for p in safety.MODEL_FIELD_POLICY.values() for loc in p.locations]
    pairs += list(safety.DICT_KEY_POLICY.items())
    return [pytest.param(loc, policy, id=loc) for loc, policy in pairs if policy.policy != "safe"]


@pytest.mark.parametrize(("location", "policy"), enforced_locations())
def test_every_enforced_location_is_enforced(location: str, policy: safety.FieldPolicy) -> None:
    """Setting any rewrite/refuse key to a hostile value is rewritten or refused (at the key or
    at a refused section that contains it)."""
    loc = tuple("x" if part == "*" else part for part in location.split("."))
    sanitized, problems = sanitize_deepspeed_config(nest(loc, "/etc/evil"), run_dir=RUN_DIR)
    if policy.policy == "rewrite":
        assert problems == []
        assert dig(sanitized, loc) != "/etc/evil"
    else:
        assert any(loc[: len(p.loc)] == p.loc for p in problems), problems


def test_module_imports_neither_torch_nor_deepspeed() -> None:
    probe = "import sys, shared.deepspeed.safety; print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- the guard: DeepSpeed's models and constants against the tables --------------------------


def test_path_like_fields_is_not_vacuous() -> None:
    found = inventory.path_like_fields()
    assert "monitor.config.TensorBoardConfig.output_path" in found
    assert "monitor.config.CSVConfig.output_path" in found
    assert "runtime.zero.offload_config.DeepSpeedZeroOffloadOptimizerConfig.nvme_path" in found
    assert "runtime.zero.offload_config.DeepSpeedZeroOffloadParamConfig.nvme_path" in found
    assert "monitor.config.CometConfig.api_key" in found
    assert len(inventory.config_models()) > 30


def test_every_path_like_model_field_is_classified() -> None:
    unclassified = sorted(inventory.path_like_fields() - set(safety.MODEL_FIELD_POLICY))
    assert not unclassified, (
        f"DeepSpeed's config models have path-like fields nobody classified: {unclassified}. "
        f"Read how DeepSpeed uses each one and {FIX_HINT} (MODEL_FIELD_POLICY: rewrite, refuse or safe, "
        "with a reason)."
    )


def test_classified_model_fields_still_exist() -> None:
    stale = sorted(set(safety.MODEL_FIELD_POLICY) - inventory.model_fields())
    assert not stale, (
        f"MODEL_FIELD_POLICY names fields DeepSpeed no longer has: {stale}; update shared/deepspeed/safety.py"
    )


def test_classified_locations_match_deepspeed() -> None:
    """Each entry's locations are where a training config reaches the field, so that a field that
    becomes reachable (a new section, a new alias) cannot stay unenforced."""
    reachable = inventory.model_field_locations()
    wrong = {
        key: (sorted(policy.locations), sorted(reachable.get(key, set())))
        for key, policy in safety.MODEL_FIELD_POLICY.items()
        if sorted(policy.locations) != sorted(reachable.get(key, set()))
    }
    assert not wrong, f"MODEL_FIELD_POLICY locations (declared, DeepSpeed's) differ: {wrong}"


def test_section_models_exist() -> None:
    models = inventory.config_models()
    missing = sorted(key for key in inventory.SECTION_MODELS.values() if key not in models)
    assert not missing, f"SECTION_MODELS names models DeepSpeed no longer has: {missing}"


def test_refuse_defaults_match_deepspeed() -> None:
    models = inventory.config_models()
    wrong = {}
    for key, policy in safety.MODEL_FIELD_POLICY.items():
        model_name, field_name = key.rsplit(".", 1)
        default = models[model_name].model_fields[field_name].default
        if policy.policy == "refuse" and policy.default != default:
            wrong[key] = (policy.default, default)
    assert not wrong, f"refuse defaults (declared, DeepSpeed's) differ: {wrong}"


def test_parsed_config_holds_only_models_reachable_from_section_models() -> None:
    """A new pydantic section in DeepSpeedConfig shows up here even before it has a path field."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    parsed = DeepSpeedConfig({"train_batch_size": 1, "comms_logger": {}, "weight_quantization": {}})
    found: set[str] = set()
    pending: list[Any] = [vars(parsed)]
    visited: set[int] = set()
    while pending:
        node = pending.pop()
        if id(node) in visited:
            continue
        visited.add(id(node))
        if isinstance(node, DeepSpeedConfigModel):
            found.add(inventory.model_key(type(node)))
            pending += list(vars(node).values())
        elif isinstance(node, dict):
            pending += list(node.values())
        elif isinstance(node, list | tuple):
            pending += list(node)
        elif hasattr(node, "__dict__") and type(node).__module__.startswith("deepspeed."):
            pending += list(vars(node).values())
    reachable = {key.rsplit(".", 1)[0] for key in inventory.model_field_locations()}
    assert "runtime.zero.config.DeepSpeedZeroConfig" in found
    assert not found - reachable, f"add these models' config sections to SECTION_MODELS: {sorted(found - reachable)}"


def test_every_path_like_constant_is_classified() -> None:
    classified = (
        {c for p in safety.DICT_KEY_POLICY.values() for c in p.constants}
        | {c for r in safety.REFUSED_SECTIONS.values() for c in r.constants}
        | set(inventory.NON_CONFIG_CONSTANTS)
    )
    found = inventory.path_like_constants()
    assert "profiling.constants.FLOPS_PROFILER_OUTPUT_FILE" in found
    unclassified = sorted(f"{name} = {value!r}" for name, value in found.items() if name not in classified)
    assert not unclassified, (
        f"DeepSpeed's dict-parsed sections have path-like keys nobody classified: {unclassified}. "
        f"Read how DeepSpeed uses each one and {FIX_HINT} (DICT_KEY_POLICY), or in {INVENTORY} "
        "(NON_CONFIG_CONSTANTS)."
    )


def test_classified_constants_still_exist_and_spell_their_key() -> None:
    import importlib

    wrong = []
    named: list[tuple[str | None, str]] = [(loc, c) for loc, p in safety.DICT_KEY_POLICY.items() for c in p.constants]
    named += [(section, c) for section, r in safety.REFUSED_SECTIONS.items() for c in r.constants]
    named += [(None, c) for c in inventory.NON_CONFIG_CONSTANTS]
    for location, constant in named:
        module_name, name = constant.rsplit(".", 1)
        value = getattr(importlib.import_module(f"deepspeed.{module_name}"), name, None)
        if value is None or (location is not None and value != location.split(".")[-1]):
            wrong.append((constant, location, value))
    assert not wrong, f"classified constants DeepSpeed no longer has, or that spell another key: {wrong}"


def test_every_top_level_key_is_classified() -> None:
    unclassified = sorted(inventory.deepspeed_top_level_keys() - inventory.classified_top_level_keys())
    assert not unclassified, (
        f"DeepSpeedConfig reads top-level keys nobody classified: {unclassified}. Read how DeepSpeed uses each "
        f"one and {FIX_HINT} (REFUSED_SECTIONS), or in {INVENTORY} (SECTION_MODELS, DICT_SECTIONS or "
        "SCALAR_TOP_LEVEL_KEYS)."
    )


def test_removed_keys_are_rejected_by_deepspeed() -> None:
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    for key in sorted(inventory.REMOVED_TOP_LEVEL_KEYS):
        with pytest.raises(DeepSpeedConfigError):
            DeepSpeedConfig({"train_batch_size": 1, key: {}})


def test_sanitized_config_still_parses() -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    config = {**REFERENCE_CONFIG, "fp16": {"enabled": False}, "csv_monitor": {"enabled": True, "output_path": "/x"}}
    sanitized, problems = sanitize_deepspeed_config(config, run_dir=RUN_DIR)
    assert problems == []
    parsed = DeepSpeedConfig(sanitized)
    assert parsed.monitor_config.csv_monitor.output_path == f"{RUN_DIR}/monitor/csv"
