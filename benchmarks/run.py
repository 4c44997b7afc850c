"""``make bench``: run the benchmarks, write ``benchmarks/results/<date>.json``, print the table.

python -m benchmarks.run [--only B4,B5,B11a] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/run.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import results
from benchmarks.results import Result


def _b1_b6(repeats: int) -> list[Result]:
    from benchmarks import b1_training

    return b1_training.run(repeats)


def _b2(repeats: int) -> list[Result]:
    from benchmarks import b2_epoch

    return b2_epoch.run(repeats)


def _b3(repeats: int) -> list[Result]:
    from benchmarks import b3_startup

    return b3_startup.run(repeats)


def _b4(repeats: int) -> list[Result]:
    from benchmarks import b4_api

    return [b4_api.run(repeats)]


def _b5(repeats: int) -> list[Result]:
    from benchmarks import b5_events

    return b5_events.run(repeats)


def _b7(repeats: int) -> list[Result]:
    from benchmarks import b7_artifacts

    return b7_artifacts.run(repeats)


def _b8(repeats: int) -> list[Result]:
    from benchmarks import b8_multi_node

    return b8_multi_node.run(repeats)


def _b9(repeats: int) -> list[Result]:
    from benchmarks import b9_load

    return b9_load.run(repeats)


def _b10(repeats: int) -> list[Result]:
    from benchmarks import b10_dpo

    return b10_dpo.run(repeats)


def _b11a(repeats: int) -> list[Result]:
    from benchmarks import b11_jobs_list

    return b11_jobs_list.run(repeats)


def _b11b(repeats: int) -> list[Result]:
    from benchmarks import b11_followers

    return b11_followers.run(repeats)


# One entry per module: the ids it reports, and the function that runs it for N repeats.
BENCHMARKS: dict[str, tuple[tuple[str, ...], Callable[[int], list[Result]]]] = {
    "training": (("B1", "B6"), _b1_b6),
    "epoch": (("B2",), _b2),
    "startup": (("B3",), _b3),
    "api": (("B4",), _b4),
    "events": (("B5",), _b5),
    "artifacts": (("B7",), _b7),
    "multi_node": (("B8",), _b8),
    "load": (("B9",), _b9),
    "dpo": (("B10",), _b10),
    "jobs_list": (("B11a",), _b11a),
    "followers": (("B11b",), _b11b),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated ids, e.g. B4,B5 (default: all)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure; the median is reported (5)")
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default results/<date>.json)")
    args = parser.parse_args(argv)
    wanted = {s.strip().upper() for s in args.only.split(",") if s.strip()}  # any case: b11a is B11a
    known = {i.upper() for ids, _ in BENCHMARKS.values() for i in ids}
    unknown = wanted - known
    if unknown:
        parser.error(f"unknown benchmark ids: {', '.join(sorted(unknown))}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    collected: list[Result] = []
    for ids, function in BENCHMARKS.values():
        if wanted and not wanted & {i.upper() for i in ids}:
            continue
        try:
            rows = function(args.repeats)
        except Exception as e:  # one broken benchmark still leaves the others' rows
            traceback.print_exc()
            rows = [Result(id=i, title=i, checks=[], error=f"{type(e).__name__}: {e}") for i in ids]
        collected += [r for r in rows if not wanted or r.id.upper() in wanted]
    path = results.write(collected, repeats=args.repeats, path=args.output)
    results.print_table(collected)
    results.Console().print(f"written: {path}")
    return 0 if all(r.error is None for r in collected) else 1


if __name__ == "__main__":
    sys.exit(main())
