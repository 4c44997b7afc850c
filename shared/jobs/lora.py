"""LoRA adapters through peft, for the ranks (training) and the plan (counting) alike."""

from __future__ import annotations

import logging
from typing import Any

from shared.jobs.spec import LoraOptions

logger = logging.getLogger(__name__)


class LoraTargetError(ValueError):
    """``training.lora.target_modules`` names no layer of the model; ``str()`` lists the real ones."""


def add_lora(model: Any, options: LoraOptions) -> Any:
    """Wrap the model with LoRA adapters; every other weight is frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        task_type="CAUSAL_LM",
        r=options.r,
        lora_alpha=options.alpha,
        lora_dropout=options.dropout,
        target_modules=options.target_modules,
    )
    try:
        model = get_peft_model(model, config)
    except ValueError as e:
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if type(m).__name__ == "Linear"})
        raise LoraTargetError(
            f"training.lora.target_modules: {e}; this model's linear layers are named {', '.join(linear)}"
        ) from None
    logger.info("LoRA: %d trainable parameters", sum(p.numel() for p in model.parameters() if p.requires_grad))
    return model
