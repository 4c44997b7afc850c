"""Saving DeepSpeed checkpoints with a completion manifest, and exporting a Hugging Face model."""

from __future__ import annotations

import logging
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed import comm as dist

from shared.events import CheckpointEvent
from shared.storage import CheckpointManifest, RunLayout
from worker.reporting import EventWriter

logger = logging.getLogger(__name__)


def _now() -> str:
    return datetime.now(UTC).isoformat()


def save_checkpoint(
    engine: Any, *, layout: RunLayout, step: int, events: EventWriter, client_state: dict[str, Any]
) -> None:
    """Every rank saves its shard; rank 0 writes the manifest once all have returned."""
    tag = layout.checkpoint_tag(step)
    engine.save_checkpoint(str(layout.checkpoints_dir), tag=tag, client_state=client_state)
    dist.barrier()
    if dist.get_rank() == 0:
        directory = layout.checkpoints_dir / tag
        manifest = CheckpointManifest.describe(
            directory,
            step=step,
            tag=tag,
            kind="deepspeed",
            world_size=dist.get_world_size(),
            zero_stage=engine.zero_optimization_stage(),
            created_at=_now(),
        )
        manifest.write(directory)
        events.emit(CheckpointEvent(step=step, kind="deepspeed", uri=str(directory), bytes=manifest.bytes, time=_now()))


def _full_state_dict(engine: Any) -> dict[str, torch.Tensor] | None:
    """Full weights on rank 0 (None elsewhere), also under ZeRO-3.

    ZeRO-3 leaves empty placeholders in a plain state_dict; we gather one parameter at a time
    so that no rank ever needs memory for more than the full model on rank 0's CPU.
    """
    module = engine.module
    rank = dist.get_rank()
    if engine.zero_optimization_stage() < 3:
        if rank != 0:
            return None
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if rank == 0:
                state[name] = param.detach().cpu().clone()
    if rank != 0:
        return None
    for name, buffer in module.named_buffers():
        state[name] = buffer.detach().cpu().clone()
    return state


def export_model(engine: Any, tokenizer: Any, *, layout: RunLayout, step: int, events: EventWriter) -> None:
    """Write a Hugging Face directory (safetensors + tokenizer) that from_pretrained loads."""
    state = _full_state_dict(engine)
    if dist.get_rank() == 0:
        assert state is not None
        final: Path = layout.model_dir
        staging = final.with_name(final.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        engine.module.save_pretrained(str(staging), state_dict=state)
        tokenizer.save_pretrained(str(staging))
        manifest = CheckpointManifest.describe(
            staging, step=step, tag="model", kind="model", world_size=dist.get_world_size(), created_at=_now()
        )
        manifest.write(staging)
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        events.emit(CheckpointEvent(step=step, kind="model", uri=str(final), bytes=manifest.bytes, time=_now()))
    dist.barrier()
