"""Saving DeepSpeed checkpoints with a completion manifest, and exporting a Hugging Face model."""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import deepspeed
import torch
from deepspeed import comm as dist

from shared.jobs.events import CheckpointEvent, UploadWaitEvent
from shared.jobs.run_layout import CheckpointManifest, RunLayout
from shared.jobs.spec import TrainingSpec
from worker.rank.reporting import EventWriter

logger = logging.getLogger(__name__)

PUBLISHED_POLL_SECONDS = 0.2


def _now() -> str:
    return datetime.now(UTC).isoformat()


# DeepSpeed names each data-parallel rank's shards ``[bf16_]zero_pp_rank_<rank>_mp_rank_..``;
# every other file of a checkpoint (``mp_rank_00_model_states.pt`` under ZeRO 0-2, ``latest``)
# is written alike by each node of a multi-node job (node-local storage).
_RANK_SHARD = re.compile(r"zero_pp_rank_(\d+)_")


def node_share(files: dict[str, int], *, node_rank: int, ranks_per_node: int) -> dict[str, int]:
    """The files of a checkpoint that node ``node_rank`` publishes: all of them on node 0; on
    another node, its own ranks' shards (node 0 publishes the files every node writes alike)."""
    if node_rank == 0:
        return files
    mine = range(node_rank * ranks_per_node, (node_rank + 1) * ranks_per_node)
    return {
        name: size
        for name, size in files.items()
        if (match := _RANK_SHARD.search(name)) is not None and int(match.group(1)) in mine
    }


def save_checkpoint(
    engine: Any,
    *,
    layout: RunLayout,
    step: int,
    events: EventWriter,
    client_state: dict[str, Any],
    frozen: bool = True,
    ranks_per_node: int | None = None,
) -> None:
    """Every rank saves its shard; once all have returned, the first rank of each node writes
    the node's manifest (what the node's worker publishes, ``node_share``) and reports it.

    ``frozen=False`` leaves out frozen weights (LoRA's base model): the checkpoint then holds
    what trains, and a resume takes the rest from the model the job names.
    """
    tag = layout.checkpoint_tag(step)
    engine.save_checkpoint(
        str(layout.checkpoints_dir), tag=tag, client_state=client_state, exclude_frozen_parameters=not frozen
    )
    dist.barrier()
    rank, per_node = dist.get_rank(), ranks_per_node or dist.get_world_size()
    if rank % per_node == 0:
        directory = layout.checkpoints_dir / tag
        if not frozen:
            _drop_frozen_aliases(directory, engine.module)
        manifest = CheckpointManifest.describe(
            directory,
            step=step,
            tag=tag,
            kind="deepspeed",
            world_size=dist.get_world_size(),
            zero_stage=engine.zero_optimization_stage(),
            created_at=_now(),
        )
        files = node_share(manifest.files, node_rank=rank // per_node, ranks_per_node=per_node)
        manifest = manifest.model_copy(update={"files": files, "bytes": sum(files.values())})
        manifest.write(directory)
        events.emit(CheckpointEvent(step=step, kind="deepspeed", uri=str(directory), bytes=manifest.bytes, time=_now()))


def wait_until_published(
    *, layout: RunLayout, tag: str, step: int, waiting_for: int, events: EventWriter, stop: Callable[[], bool]
) -> None:
    """Before saving ``step``: wait (every rank) until the worker has committed checkpoint
    ``tag`` to the artifact store, so at most one upload is ever in flight. A stop request
    ends the wait (the save that follows is the last of the attempt)."""
    marker = layout.published_marker(tag)
    if marker.exists():
        return
    if dist.get_rank() == 0:
        events.emit(UploadWaitEvent(step=step, waiting_for=waiting_for, time=_now()))
    started = time.monotonic()
    while not marker.exists() and not stop():
        time.sleep(PUBLISHED_POLL_SECONDS)
    logger.info("waited %.1fs for the upload of %s", time.monotonic() - started, tag)


def _drop_frozen_aliases(directory: Path, module: Any) -> None:
    """DeepSpeed leaves out frozen parameters by their names in ``named_parameters()``, which
    lists a tied weight once: the other name (a tied ``lm_head`` of a frozen embedding) stays
    in the saved state. Keep only what trains, so a LoRA checkpoint holds the adapters alone."""
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    for path in directory.glob("mp_rank_*_model_states.pt"):
        state = torch.load(path, map_location="cpu", weights_only=False)
        kept = {k: v for k, v in state["module"].items() if k in trainable}
        if len(kept) == len(state["module"]):
            continue
        state["module"] = kept
        partial = path.with_name(path.name + ".partial")
        torch.save(state, partial)
        partial.replace(path)


def _full_state_dict(engine: Any, *, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
    """Full weights on rank 0 (None elsewhere), also under ZeRO-3.

    ZeRO-3 leaves empty placeholders in a plain state_dict; we gather one parameter at a time
    so that no rank ever needs memory for more than the full model on rank 0's CPU.
    """
    module = engine.module
    rank = dist.get_rank()
    if engine.zero_optimization_stage() < 3 and not trainable_only:
        if rank != 0:
            return None
        return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    state: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        if trainable_only and not param.requires_grad:
            continue
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if rank == 0:
                state[name] = param.detach().cpu().clone()
    if rank != 0 or trainable_only:
        return state if rank == 0 else None
    for name, buffer in module.named_buffers():
        state[name] = buffer.detach().cpu().clone()
    return state


def _publish(staging: Path, final: Path, *, kind: Literal["model", "adapter"], step: int, events: EventWriter) -> None:
    """Manifest, then rename into place: a directory under its final name is complete."""
    manifest = CheckpointManifest.describe(
        staging, step=step, tag=kind, kind=kind, world_size=dist.get_world_size(), created_at=_now()
    )
    manifest.write(staging)
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    events.emit(CheckpointEvent(step=step, kind=kind, uri=str(final), bytes=manifest.bytes, time=_now()))


def _save_directory(
    module: Any,
    tokenizer: Any,
    state: dict[str, torch.Tensor] | None,
    final: Path,
    *,
    kind: Literal["model", "adapter"],
    step: int,
    events: EventWriter,
) -> None:
    """save_pretrained (with ``state`` when given) into a staging directory, then publish it."""
    staging = final.with_name(final.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    module.save_pretrained(str(staging), state_dict=state)
    tokenizer.save_pretrained(str(staging))
    _publish(staging, final, kind=kind, step=step, events=events)


def export_model(engine: Any, tokenizer: Any, *, layout: RunLayout, step: int, events: EventWriter) -> None:
    """Write a Hugging Face directory (safetensors + tokenizer) that from_pretrained loads."""
    state = _full_state_dict(engine)
    if dist.get_rank() == 0:
        assert state is not None
        _save_directory(engine.module, tokenizer, state, layout.model_dir, kind="model", step=step, events=events)
    dist.barrier()


def export_adapter(
    engine: Any, tokenizer: Any, *, spec: TrainingSpec, layout: RunLayout, step: int, events: EventWriter
) -> None:
    """The LoRA adapter as peft saves it and, when asked, the base model with it merged in.

    The merge loads the base model afresh on rank 0's CPU (not from the engine, which under
    ZeRO-3 holds a shard), so it works the same for every ZeRO stage.
    """
    state = _full_state_dict(engine, trainable_only=True)
    if dist.get_rank() == 0:
        assert state is not None
        _save_directory(engine.module, tokenizer, state, layout.adapter_dir, kind="adapter", step=step, events=events)
        if spec.training.lora is not None and spec.training.lora.merge:
            _export_merged(spec, tokenizer, layout=layout, step=step, events=events)
    dist.barrier()


def _export_merged(spec: TrainingSpec, tokenizer: Any, *, layout: RunLayout, step: int, events: EventWriter) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # or from_pretrained would build this one model across all ranks
    base = AutoModelForCausalLM.from_pretrained(
        spec.model, revision=spec.revision, use_safetensors=True, trust_remote_code=False
    )
    merged = PeftModel.from_pretrained(base, str(layout.adapter_dir)).merge_and_unload()
    _save_directory(merged, tokenizer, None, layout.model_dir, kind="model", step=step, events=events)
