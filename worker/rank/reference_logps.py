"""The reference model's log-probabilities of every preference pair's answers, computed once.

DPO compares the policy with a frozen reference, the job's starting weights. Rather than keep a
second model in memory and run it every step (TRL's default), the ranks score every chosen and
rejected answer of the data once, before the first step, with the starting weights (LoRA: the
base with the adapter disabled) on the same ranks and ZeRO stage as training, and then look the
scores up by pair (TRL's ``precompute_ref_log_probs``).

The scores are kept in three places, so that they are never computed from trained weights:

- in every DeepSpeed checkpoint of the job (its client state): a resume, after a pause or a lost
  worker on any host, reads them there with the weights they belong beside;
- in the host's cache (``<cache_dir>/reference/<key>.pt``), for a later job with the same inputs;
- in memory, for the run.

The key is what determines the scores: the model (its name, revision and files, or the
checkpoint started from), the precision it runs in, and each file's tokenized cache key (the
data, the tokenizer, the format and ``max_seq_length``: ``shared.data.tokenized.cache_key``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from deepspeed import comm as dist

from shared.data.prepared import pair_rows
from shared.data.tokenized import TokenizedSamples
from shared.jobs.events import PhaseEvent
from shared.jobs.spec import TrainingSpec
from worker.rank.batches import PairRows, make_loader
from worker.rank.preference_loss import concatenated_forward
from worker.rank.reporting import EventWriter

logger = logging.getLogger(__name__)

# Bump when the way the scores are computed changes: old cache entries are then unused.
REFERENCE_VERSION = 1
CLIENT_STATE_KEY = "reference_logps"  # in a DeepSpeed checkpoint's client state
PROGRESS_SECONDS = 2.0  # at most one progress event this often
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".json")


@dataclass(frozen=True)
class ReferenceLogps:
    """Per data file (by its tokenized cache key), a float32 tensor [pairs, 2]: each pair's
    chosen and rejected answer's summed log-probability under the reference."""

    key: str
    files: dict[str, torch.Tensor]

    def of(self, samples: TokenizedSamples, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) reference log-probabilities of ``pairs`` (indices in ``samples``' file)."""
        assert samples.key is not None
        scores = self.files[samples.key][pairs]
        return scores[:, 0], scores[:, 1]

    def client_state(self) -> dict[str, Any]:
        return {"key": self.key, "files": self.files}

    @staticmethod
    def from_client_state(state: Any, key: str) -> ReferenceLogps | None:
        """The scores a checkpoint holds, if they are this job's (the same key)."""
        if not isinstance(state, dict) or state.get("key") != key:
            return None
        return ReferenceLogps(key=key, files={name: scores.float().cpu() for name, scores in state["files"].items()})


def reference_key(spec: TrainingSpec, *, files: list[TokenizedSamples], dtype: torch.dtype, lora: bool) -> str:
    """What determines the scores. With LoRA the reference is the base model alone, whatever
    checkpoint the adapters start from; otherwise that checkpoint's weights are the start."""
    start = spec.start_from
    parts = {
        "version": REFERENCE_VERSION,
        "model": spec.model,
        "revision": spec.revision,
        "model_files": _model_files(Path(spec.model)),
        "start_from": None if start is None or lora else [start.checkpoints_dir, start.tag],
        "dtype": str(dtype),
        "files": [samples.key for samples in files],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _model_files(directory: Path) -> list[tuple[str, int, int]]:
    """A local model directory's weights and configs by name, size and modification time (a
    hub model is its name and revision)."""
    if not directory.is_dir():
        return []
    return sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns)
        for p in directory.iterdir()
        if p.is_file() and p.suffix in MODEL_FILE_SUFFIXES
    )


def score_pairs(
    engine: Any,
    samples: TokenizedSamples,
    *,
    micro_batch: int,
    pad_token_id: int,
    lora: bool,
    progress: Callable[[int], None],
) -> torch.Tensor:
    """Every pair of ``samples``' file scored by the model as it is now, without gradient: a
    [pairs, 2] float32 tensor, the same on every rank.

    The pairs are shared out as evaluation shares rows: every rank runs the same number of
    forwards (ZeRO-3 gathers each layer's weights in step), the last ones repeating a few
    pairs; each pair's scores are averaged over the ranks that computed it, then summed across.
    """
    pairs = len(samples) // 2
    rows = PairRows(samples, pair_rows(range(pairs)))
    loader, _ = make_loader(
        rows,
        micro_batch=micro_batch,
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        seed=0,
        pad_token_id=pad_token_id,
        shuffle=False,
        drop_last=False,
    )
    sums = torch.zeros(pairs, 2, dtype=torch.float64)
    counts = torch.zeros(pairs, dtype=torch.float64)
    engine.eval()
    with torch.no_grad(), _adapter_disabled(engine.module) if lora else nullcontext():
        for done, batch in enumerate(loader, start=1):
            chosen, rejected = batch.sides_on(engine.device)
            scored = concatenated_forward(engine, chosen, rejected, pad_token_id=pad_token_id)
            both = torch.stack([scored.chosen, scored.rejected], dim=1).double().cpu()
            sums.index_add_(0, batch.pairs, both)
            counts.index_add_(0, batch.pairs, torch.ones(len(batch.pairs), dtype=torch.float64))
            progress(min(pairs, done * micro_batch * dist.get_world_size()))
    engine.train()
    totals = torch.cat([sums, counts[:, None]], dim=1).to(engine.device)
    dist.all_reduce(totals)
    totals = totals.cpu()
    return (totals[:, :2] / totals[:, 2:].clamp(min=1)).float()


@contextmanager
def _adapter_disabled(module: Any) -> Iterator[None]:
    """peft's model without its adapters: the base model, LoRA's reference."""
    with module.disable_adapter():
        yield


def prepare_reference(
    engine: Any,
    *,
    key: str,
    files: list[TokenizedSamples],
    resumed_state: Any,
    cache_dir: Path,
    micro_batch: int,
    pad_token_id: int,
    lora: bool,
    events: EventWriter,
) -> ReferenceLogps:
    """The scores of every file's pairs: from the checkpoint resumed from, the host's cache, or
    computed now (on every rank, which must then all be at the starting weights)."""
    total = sum(len(samples) // 2 for samples in files)
    found = ReferenceLogps.from_client_state(resumed_state, key) or _cached(cache_dir, key)
    if _everywhere(found is not None, engine.device):
        assert found is not None
        events.emit(_phase(total, total, cached=True))
        logger.info("reference log-probabilities found (%s)", key)
        return found
    if resumed_state is not None:
        # Trained weights are no reference: the checkpoint should have held the scores.
        raise RuntimeError("the checkpoint resumed from holds no reference log-probabilities for this job")
    started = time.monotonic()
    reporter = _ProgressReporter(events, total)
    scored: dict[str, torch.Tensor] = {}
    for samples in files:
        assert samples.key is not None
        offset = reporter.done
        scored[samples.key] = score_pairs(
            engine,
            samples,
            micro_batch=micro_batch,
            pad_token_id=pad_token_id,
            lora=lora,
            progress=lambda done, offset=offset: reporter.report(offset + done),  # type: ignore[misc]
        )
        reporter.done = offset + len(samples) // 2
    events.emit(_phase(total, total))
    logger.info("reference log-probabilities of %d pairs in %.1fs (%s)", total, time.monotonic() - started, key)
    reference = ReferenceLogps(key=key, files=scored)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one writer a host
        _store(cache_dir, reference)
    return reference


class _ProgressReporter:
    def __init__(self, events: EventWriter, total: int) -> None:
        self.events, self.total, self.done = events, total, 0
        self.last = 0.0
        events.emit(_phase(0, total))

    def report(self, done: int) -> None:
        if time.monotonic() - self.last >= PROGRESS_SECONDS:
            self.last = time.monotonic()
            self.events.emit(_phase(done, self.total))


def _phase(done: int, total: int, *, cached: bool = False) -> PhaseEvent:
    return PhaseEvent(name="reference_logps", done=done, total=total, cached=cached, time=datetime.now(UTC).isoformat())


def _everywhere(flag: bool, device: torch.device) -> bool:
    """True when it is true on every rank (the nodes of a job have caches of their own)."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item() == 1.0)


def _entry(cache_dir: Path, key: str) -> Path:
    return cache_dir / "reference" / f"{key}.pt"


def _cached(cache_dir: Path, key: str) -> ReferenceLogps | None:
    entry = _entry(cache_dir, key)
    if not entry.is_file():
        return None
    try:
        state = torch.load(entry, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as e:  # a damaged entry is computed again
        logger.warning("reference cache entry %s unreadable (%s): computing again", entry, e)
        return None
    return ReferenceLogps.from_client_state(state, key)


def _store(cache_dir: Path, reference: ReferenceLogps) -> None:
    """Written whole or not at all (a staging file renamed), under a lock for the ranks of
    concurrent jobs of the same inputs."""
    entry = _entry(cache_dir, reference.key)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with entry.with_suffix(".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        staging = entry.with_suffix(f".{os.getpid()}.tmp")
        try:
            torch.save(reference.client_state(), staging)
            os.replace(staging, entry)
        except OSError as e:  # a full cache disk costs the next job a recompute, not this job
            logger.warning("could not keep the reference log-probabilities in %s: %s", entry, e)
            staging.unlink(missing_ok=True)
