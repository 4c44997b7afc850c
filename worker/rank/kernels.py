"""Fused kernels (``training.kernels``) and torch.compile (``training.compile``) for a job's model.

Kernels come from Liger Kernel (``pip install 'tuneq[gpu]'``: Triton kernels, CUDA only). For a
model type in Liger's own table (``MODEL_TYPE_TO_APPLY_LIGER_FN``), its ``apply_liger_kernel_to_*``
function patches the loaded instance with the kernels it turns on by default (RMSNorm, SwiGLU or
GeGLU, RoPE, LayerNorm: each a parameter of that function, so what is applied is read from it,
never from a second list here). GPT-Neo, which Liger does not cover, gets Liger's LayerNorm.

The loss is tuneq's own, the same for every type listed in ``PLAIN_HEAD_MODEL_TYPES``: the
base model's hidden states go straight into Liger's fused linear cross-entropy with the LM
head's weight, chunk by chunk, accumulated in fp32, so the batch x sequence x vocabulary
logits never exist; it computes what transformers' ``ForCausalLMLoss`` computes from those
logits (shifted labels, -100 ignored, the mean over the rest). Liger's own per-model forwards
are not used: they pass arguments by transformers' names of the day and accumulate in the
weights' dtype.

Every choice is made in :func:`choose_kernels` from plain facts (the setting, the device, the
ZeRO stage, the model type, what LoRA adapts), so it is the same on every rank and testable
without a GPU; :func:`apply_kernels` only carries it out.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MethodType
from typing import Any

from shared.jobs.spec import TrainingOptions

logger = logging.getLogger(__name__)

FUSED_LOSS = "fused_linear_cross_entropy"
LAYER_NORM = "layer_norm"
# Liger's loss switches: never Liger's own (tuneq's fused loss replaces both; see above).
_LIGER_LOSS_SWITCHES = ("cross_entropy", FUSED_LOSS)

# Model types whose causal LM forward is: the base model's last hidden state -> lm_head (a
# bias-free Linear, no logit scaling or soft-capping) -> transformers' causal LM loss. Checked
# against transformers' modeling files; granite (logits_scaling) or gemma2 (soft-capping) are not.
PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo2", "gpt_neo"})
# Model types Liger's table misses, and the kernels tuneq applies to them with Liger's modules.
_OWN_MODULE_KERNELS: Mapping[str, tuple[str, ...]] = {"gpt_neo": (LAYER_NORM,)}
HEAD_NAME = "lm_head"


@dataclass(frozen=True)
class KernelChoice:
    """What to apply, and a word on what was not: ``note`` says why (logged), and when
    ``warn`` is set it reaches the user as the job's ``warning`` event (something expected
    that does not happen)."""

    kernels: tuple[str, ...] = ()
    note: str | None = None
    warn: bool = False


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def liger_kernels_of(model_type: str) -> tuple[str, ...] | None:
    """The kernels Liger applies to ``model_type`` by default (its apply function's boolean
    parameters that default to True), without the loss ones; None when Liger has no function
    for the type. Needs Liger installed."""
    apply = _liger_apply_function(model_type)
    if apply is None:
        return None
    return tuple(
        name
        for name, parameter in inspect.signature(apply).parameters.items()
        if parameter.default is True and name not in _LIGER_LOSS_SWITCHES
    )


def _liger_apply_function(model_type: str) -> Callable[..., None] | None:
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    function: Callable[..., None] | None = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    return function


def offered_kernels(model_type: str) -> tuple[str, ...]:
    """Every kernel tuneq would apply to ``model_type`` (Liger's, its own modules', the fused loss)."""
    own = _OWN_MODULE_KERNELS.get(model_type)
    modules = own if own is not None else (liger_kernels_of(model_type) or ())
    return modules + ((FUSED_LOSS,) if model_type in PLAIN_HEAD_MODEL_TYPES else ())


def choose_kernels(
    options: TrainingOptions,
    *,
    model_type: str,
    device_type: str,
    zero_stage: int,
    liger_available: bool,
    offered: Callable[[str], tuple[str, ...]] = offered_kernels,
) -> KernelChoice:
    """The kernels for this run of a ``model_type`` model on ``device_type`` ranks.

    ``offered`` is asked only once Liger is known to be there (it reads Liger's table)."""
    if options.kernels == "off":
        return KernelChoice(note="training.kernels is off")
    if device_type != "cuda":
        return KernelChoice(note=f"Liger's kernels are Triton kernels for CUDA; this job runs on {device_type}")
    if not liger_available:
        return KernelChoice(
            note="liger-kernel is not installed on this worker (pip install 'tuneq[gpu]'): "
            "training.kernels auto trains without fused kernels",
            warn=True,
        )
    try:
        kernels = offered(model_type)
    except ImportError as e:  # installed, but it (or Triton) does not load here
        return KernelChoice(note=f"liger-kernel does not import ({e}): training without fused kernels", warn=True)
    if not kernels:
        return KernelChoice(note=f"Liger Kernel has no kernels for model type '{model_type}'")
    if FUSED_LOSS not in kernels:
        return KernelChoice(kernels)
    blocker = None
    if zero_stage == 3:
        blocker = (
            "under ZeRO-3, where each rank holds only a partition of the LM head's weight and it is "
            "gathered only inside the head's own forward, which the fused loss does not call"
        )
    elif options.lora is not None and any(
        target.split(".")[-1] == HEAD_NAME for target in options.lora.target_modules or ()
    ):
        blocker = "with a LoRA adapter on lm_head, whose update the fused loss would not see"
    if blocker is None:
        return KernelChoice(kernels)
    rest = tuple(kernel for kernel in kernels if kernel != FUSED_LOSS)
    return KernelChoice(
        rest,
        note=f"training.kernels: the fused linear cross-entropy is not applied {blocker}; the loss is "
        "computed from the full logits, as without kernels",
        warn=True,
    )


def apply_kernels(model: Any, kernels: Sequence[str]) -> None:
    """Patch the loaded (not yet LoRA-wrapped) ``model`` in place with ``kernels``, as
    :func:`choose_kernels` chose them for its type."""
    if not kernels:
        return
    model_type = model.config.model_type
    modules = [kernel for kernel in kernels if kernel != FUSED_LOSS]
    if model_type in _OWN_MODULE_KERNELS:
        if LAYER_NORM in modules:
            _patch_layer_norms(model)
    elif modules:
        apply = _liger_apply_function(model_type)
        assert apply is not None, f"no Liger kernels for {model_type}"
        offered = liger_kernels_of(model_type) or ()
        # Every switch given explicitly: those not chosen off, Liger's loss always off.
        switches = {name: name in modules for name in offered} | dict.fromkeys(_LIGER_LOSS_SWITCHES, False)
        apply(model=model, **switches)
    if FUSED_LOSS in kernels:
        from liger_kernel.transformers.model.loss_utils import LigerForCausalLMLoss

        install_fused_loss(model, LigerForCausalLMLoss)
    logger.info("kernels applied to %s: %s", model_type, ", ".join(kernels))


def _patch_layer_norms(model: Any) -> None:
    import torch
    from liger_kernel.transformers.monkey_patch import _patch_layer_norm_module

    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            _patch_layer_norm_module(module)


def install_fused_loss(model: Any, linear_cross_entropy: Callable[..., Any]) -> None:
    """Train this ``model`` instance through ``linear_cross_entropy`` (Liger's
    ``LigerForCausalLMLoss``: the loss from the last hidden states and the head's weight, with
    the labels as the model takes them). Evaluation, and any call without labels, runs the
    class's own forward (the logits are what it is for); the class itself is left as it is."""
    import torch
    from transformers.modeling_outputs import CausalLMOutputWithPast

    original = type(model).forward

    def forward(self: Any, input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        if labels is None or not self.training:
            return original(self, input_ids=input_ids, labels=labels, **kwargs)
        base = getattr(self, self.base_model_prefix)
        outputs = base(input_ids=input_ids, **kwargs)
        loss = linear_cross_entropy(
            hidden_states=outputs[0],
            lm_head_weight=self.get_output_embeddings().weight,
            labels=labels,
            hidden_size=self.config.hidden_size,
            accum_dtype=torch.float32,
        )
        return CausalLMOutputWithPast(loss=loss, logits=None)

    model.forward = MethodType(forward, model)


@dataclass(frozen=True)
class CompileChoice:
    compile: bool
    note: str


def choose_compile(options: TrainingOptions, *, device_type: str, zero_stage: int) -> CompileChoice:
    """Whether the engine compiles (``training.compile``).

    ``auto`` compiles on CUDA, where inductor fuses what runs eagerly as many small kernels
    (GPT-Neo's gelu_new, the attention's masking and softmax, the residual adds), and not under
    ZeRO-3, whose per-layer gather and release hooks break the graph at every layer. On a CPU
    the compile time (minutes) outweighs what inductor gains there; ``on`` asks for it anyway.
    """
    if options.compile == "off":
        return CompileChoice(False, "training.compile is off")
    if options.compile == "on":
        return CompileChoice(True, "training.compile is on")
    if device_type != "cuda":
        return CompileChoice(False, f"training.compile auto compiles on CUDA only; this job runs on {device_type}")
    if zero_stage == 3:
        return CompileChoice(False, "training.compile auto does not compile under ZeRO-3 (graph breaks at every layer)")
    return CompileChoice(True, "training.compile auto: CUDA, ZeRO stage below 3")
