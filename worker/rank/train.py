"""The training entrypoint: one process per rank, started by DeepSpeed's own launcher.

    deepspeed --num_gpus N --master_port P --module worker.rank.train --spec RUN_DIR/spec.json

The training itself is ``worker.rank.recipe.FineTuneRecipe``; this module is what every rank
starts with: its log lines name the rank, it dies with its worker (``watch_worker``), and a
failure becomes ``errors/rank-N.json`` for the worker (invalid input, or a training error).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from shared.jobs.run_layout import RunLayout
from shared.jobs.spec import TrainingSpec
from shared.jobs.status import ErrorCode
from worker.deepspeed_ops import abandoned_build_locks_removed, remember_cpu_info
from worker.errors import InvalidInputError
from worker.process_table import process_running
from worker.rank.recipe import FineTuneRecipe
from worker.rank.reporting import write_rank_error

logger = logging.getLogger("worker.rank.train")

# Set by the worker: the ranks exit when that process is gone (see watch_worker).
WORKER_PID_ENV = "TUNEQ_WORKER_PID"
WATCH_INTERVAL_SECONDS = 2.0


def watch_worker(heartbeat: Path) -> None:
    """Kill this rank's whole launcher group when the worker that started it dies, and touch
    ``heartbeat`` while this process runs.

    The launcher runs in its own session so the worker can signal it as one group; the
    price is that nothing kills it when the worker is SIGKILLed. Orphaned ranks would hold
    the GPUs the next job needs, so every rank polls its worker and takes the group down.
    The heartbeat is the worker's sign that the rank lives: a thread keeps touching it while
    the training thread waits in a collective, but not in a stopped (SIGSTOP) process, whose
    peers would wait in their next collective for as long as the collective timeout.
    """
    pid = int(os.environ.get(WORKER_PID_ENV, "0"))
    heartbeat.parent.mkdir(parents=True, exist_ok=True)

    def loop() -> None:
        while pid <= 0 or process_running(pid):
            heartbeat.touch()
            time.sleep(WATCH_INTERVAL_SECONDS)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=loop, name="watch-worker", daemon=True).start()


def run(spec: TrainingSpec, layout: RunLayout) -> None:
    """One rank's run, as torchtune's recipes run: setup, train, export, clean up. A stop
    agreed after a step (cancel, pause, the worker stopping) skips the export and exits 0."""
    recipe = FineTuneRecipe(spec, layout)
    # DeepSpeed loads its ops in setup (the comm op, the optimizer's) where the warm start did not.
    with abandoned_build_locks_removed():
        recipe.setup()
    if recipe.train():
        recipe.export()
    recipe.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", required=True, type=Path)
    parser.add_argument("--local_rank", type=int, default=0, help="set by DeepSpeed's launcher")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(rank)s %(levelname)s %(message)s")
    rank = int(os.environ.get("RANK", "0"))
    old_factory = logging.getLogRecordFactory()

    def record_factory(*a: Any, **k: Any) -> logging.LogRecord:
        record = old_factory(*a, **k)
        record.rank = rank
        return record

    logging.setLogRecordFactory(record_factory)
    spec = TrainingSpec.model_validate_json(args.spec.read_text(encoding="utf-8"))
    layout = RunLayout(Path(spec.run_dir))
    watch_worker(layout.heartbeat(rank))
    remember_cpu_info()  # a rank DeepSpeed's launcher started (a forked one has it already)
    try:
        run(spec, layout)
    except InvalidInputError as e:
        logger.error("invalid input: %s", e)
        write_rank_error(layout, rank=rank, code=ErrorCode.invalid_input, message=str(e))
        sys.exit(1)
    except Exception as e:
        traceback.print_exc()
        write_rank_error(layout, rank=rank, code=ErrorCode.training_error, message=f"{type(e).__name__}: {e}")
        sys.exit(1)


if __name__ == "__main__":
    main()
