"""The command line both reference scripts (``bare_loop.py``, ``hf_trainer_loop.py``) take for the
workload: the arguments ``workload.script_args`` passes them.

The standard library only: a reference script stays free of tuneq, and its ranks, whose memory
is measured against tuneq's, load nothing more for it.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def workload_parser() -> argparse.ArgumentParser:
    """A parser for the workload's arguments; a script adds its own before parsing."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, type=Path)
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--max-seq-length", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--times", required=True, type=Path)
    parser.add_argument("--local_rank", type=int, default=0)  # DeepSpeed's launcher passes it to each rank
    return parser
