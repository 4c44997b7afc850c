"""The warm start's zygote: ``python -m worker.rank.zygote``, started by ``worker.warm_start``.

It imports what every rank imports before its first step (``PRELOAD``) and loads DeepSpeed's
optimizer ops once, while the worker is idle, then forks one rank per ``RankStart`` it reads on
stdin; as the ranks' parent it reaps them and reports their exits (see ``worker.warm_start``
for the protocol and why it is single-threaded).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import sys
import traceback
from typing import IO

import setproctitle

from worker.deepspeed_ops import preload_ops
from worker.warm_start import RankStart

# What the zygote imports once: everything a rank imports before its first step. The model
# class of a given architecture (e.g. modeling_gpt_neo) is still imported per job.
PRELOAD = (
    "torch",
    "deepspeed",
    "transformers",
    "transformers.modeling_utils",
    "transformers.integrations.deepspeed",
    "peft",
    "worker.rank.train",
    "worker.rank.recipe",
    "worker.rank.checkpointing",
    "worker.rank.batches",
    "worker.rank.model_loading",
    "shared.data.prepared",
)
# Imported once more on the CPU accelerator only: DeepSpeed imports its Muon optimizer (whose
# torch.compile decorators import torch's inductor) in every engine's optimizer check, about 2 s
# of CPU per rank. Not on a GPU host: inductor's import may ask the CUDA runtime about devices,
# which a parent of forked CUDA ranks must not do.
CPU_PRELOAD = ("deepspeed.runtime.zero.muon.muon_optimizer",)


def preload_modules() -> list[str]:
    """Import PRELOAD, and CPU_PRELOAD on the CPU accelerator; the modules imported."""
    from deepspeed.accelerator import get_accelerator

    modules = list(PRELOAD)
    if get_accelerator().device_name() == "cpu":
        modules += CPU_PRELOAD
    for module in modules:
        __import__(module)
    return modules


def serve() -> None:
    """Import PRELOAD, say so, then fork a rank per request until the worker closes stdin."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the imports (and anything else) print goes to the log, not the protocol
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the worker, which decides
    # The worker's idle pool process ignores SIGTERM (worker/tasks.py), and an ignored signal stays
    # ignored across exec: this process and its ranks take SIGTERM's default, as the launcher's do.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    preload_modules()
    import torch

    preload_ops()

    protocol.write(json.dumps({"ready": True, "cuda_initialised": torch.cuda.is_initialized()}) + "\n")
    ranks: dict[int, RankStart] = {}
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.2)
        if readable:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return  # the worker is gone; its ranks stop themselves (worker.rank.train.watch_worker)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                start = RankStart(**json.loads(line))
                pid = os.fork()
                if pid == 0:
                    _become_rank(start, protocol)
                ranks[pid] = start
                protocol.write(json.dumps({"started": pid}) + "\n")
        _reap(ranks, protocol)


def _reap(ranks: dict[int, RankStart], protocol: IO[str]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        if (start := ranks.pop(pid, None)) is not None:
            # The job log's last word on the rank, as DeepSpeed's launch.py writes one.
            with contextlib.suppress(OSError), open(start.log_path, "a", encoding="utf-8") as log:
                log.write(f"tuneq warm start: rank {start.local_rank} (pid {pid}) exited with status {code}\n")
        protocol.write(json.dumps({"exited": pid, "code": code}) + "\n")


def _become_rank(start: RankStart, protocol: IO[str]) -> None:
    """In the forked child: become what DeepSpeed's launcher would have started, then exit."""
    code = 1
    try:
        os.close(protocol.fileno())  # not .close(): that would flush the zygote's buffer twice
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()  # its own group, as the launcher's ranks are, so stop() reaches its children
        setproctitle.setproctitle(start.title)  # `ps` shows which job's rank this is
        log = os.open(start.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.chdir(start.cwd)
        os.environ.clear()
        os.environ.update(start.env)
        import torch

        # OMP_NUM_THREADS was read when the zygote imported torch; this job's share may differ.
        if threads := start.env.get("OMP_NUM_THREADS"):
            torch.set_num_threads(int(threads))
        from worker.rank.train import main

        main(["--spec", start.spec_path, f"--local_rank={start.local_rank}"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()  # what a normal interpreter exit would run
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def exit_at_once() -> None:
    """Exit without the interpreter's teardown: the zygote holds nothing to clean up (its ranks
    are processes of their own), and tearing down torch, DeepSpeed and inductor took ~1.7 s of
    CPU per worker stop, and seconds longer on a busy host, while the worker waited."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    serve()
    exit_at_once()
