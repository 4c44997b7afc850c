"""The weights a job starts from when its ``model`` names another job's LoRA adapter or DeepSpeed
checkpoint, written as a Hugging Face directory that the ranks load as they load any model: the
adapter merged into the base it was trained on, or the checkpoint's weights put into the model
that job trained (and merged, for a LoRA job's checkpoint, which holds the adapter alone).

The worker runs it in a process of its own (``worker.base_model``), as it runs DeepSpeed's
``ds_to_universal``: it needs torch, which the worker never imports. The tokenizer, and with it
the chat template, is the base's, which is what the named job trained with.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import torch

from shared.jobs.lora import add_lora
from shared.jobs.run_layout import CheckpointManifest
from shared.jobs.spec import LoraOptions

logger = logging.getLogger(__name__)


def load_base(base: str, revision: str | None) -> Any:
    """The base model, whole, on the CPU: this process builds one model, not one per rank."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, revision=revision, use_safetensors=True, trust_remote_code=False)


def save(model: Any, *, base: str, revision: str | None, out: Path) -> None:
    from transformers import AutoTokenizer

    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(base, revision=revision, trust_remote_code=False).save_pretrained(str(out))


def merge_adapter(*, base: str, revision: str | None, adapter: Path, out: Path) -> None:
    """A LoRA job's exported adapter merged into its base."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(load_base(base, revision), str(adapter)).merge_and_unload()
    save(merged, base=base, revision=revision, out=out)
    logger.info("merged the adapter %s into %s: %s", adapter, base, out)


def checkpoint_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The trained weights a DeepSpeed checkpoint holds, by parameter name: under ZeRO 1-3 the
    optimizer's fp32 master copies (DeepSpeed's ``zero_to_fp32``, whatever the ranks' count), under
    ZeRO 0 the module's own, whole in each rank's model states."""
    manifest = CheckpointManifest.read(checkpoint)
    if manifest is None:
        raise ValueError(f"the DeepSpeed checkpoint {checkpoint} has no manifest")
    if not manifest.zero_stage:
        (states, *_) = sorted(checkpoint.glob("mp_rank_*_model_states.pt"))
        module: dict[str, torch.Tensor] = torch.load(states, map_location="cpu", weights_only=False)["module"]
        return {name: tensor.float() for name, tensor in module.items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state: dict[str, torch.Tensor] = get_fp32_state_dict_from_zero_checkpoint(
        str(checkpoint.parent), tag=checkpoint.name
    )
    return state


def load_trained(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Put the checkpoint's weights into ``model``: every weight that trains (all of them, or
    LoRA's adapters) must be in it, and nothing in it may be foreign to the model."""
    loaded = model.load_state_dict(state, strict=False)
    trains = {name for name, p in model.named_parameters() if p.requires_grad}
    missing = sorted(trains - state.keys())
    if loaded.unexpected_keys or missing:
        foreign = ", ".join(loaded.unexpected_keys[:5]) or "none"
        raise ValueError(
            f"the checkpoint does not fit the model it names: weights it lacks: {', '.join(missing[:5]) or 'none'}; "
            f"weights the model does not have: {foreign}"
        )


def checkpoint_weights(
    *, base: str, revision: str | None, checkpoint: Path, lora: LoraOptions | None, out: Path
) -> None:
    """A DeepSpeed checkpoint's weights in the model its job trained: ``base`` (that job's own
    base model) with them loaded, and for a LoRA job (``lora``: its adapters) merged."""
    model = load_base(base, revision)
    if lora is not None:
        model = add_lora(model, lora)
    load_trained(model, checkpoint_state(checkpoint))
    if lora is not None:
        model = model.merge_and_unload()
    save(model, base=base, revision=revision, out=out)
    logger.info("put the weights of %s into %s: %s", checkpoint, base, out)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s base_weights: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m worker.rank.base_weights", description=__doc__)
    parser.add_argument("--base", required=True, help="the named job's own base model: a directory or a hub id")
    parser.add_argument("--revision", default=None)
    parser.add_argument("--out", required=True, type=Path)
    sources = parser.add_mutually_exclusive_group(required=True)
    sources.add_argument("--adapter", type=Path, help="an exported LoRA adapter to merge into the base")
    sources.add_argument("--checkpoint", type=Path, help="a DeepSpeed checkpoint's directory (its tag)")
    parser.add_argument("--lora", default=None, help="the checkpoint's job's training.lora, as JSON")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.adapter is not None:
        merge_adapter(base=args.base, revision=args.revision, adapter=args.adapter, out=args.out)
        return
    lora = LoraOptions.model_validate_json(args.lora) if args.lora else None
    checkpoint_weights(base=args.base, revision=args.revision, checkpoint=args.checkpoint, lora=lora, out=args.out)


if __name__ == "__main__":
    main()
