"""The shared results writer: repeats → median/min/max, one row per benchmark, JSON and a table."""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.markup import escape
from rich.table import Table

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Stat:
    """One figure over repeats: the median, with the spread."""

    median: float
    min: float
    max: float
    runs: list[float]

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        if not values:
            raise ValueError("no runs")
        return cls(median=statistics.median(values), min=min(values), max=max(values), runs=list(values))


@dataclass
class Check:
    """One target of a benchmark: a figure compared with a bound, or (``Check.reported``) a
    figure the issue gives no target for, reported as it is."""

    name: str  # what the figure is, e.g. "rps ratio"
    stat: Stat
    op: Literal[">=", "<="] | None  # None: no target
    target: float | None
    unit: str = ""

    @classmethod
    def reported(cls, name: str, stat: Stat, *, unit: str = "") -> Check:
        """A figure without a target: never met nor missed (``met`` is None), shown as "(reported)"."""
        return cls(name, stat, None, None, unit)

    @property
    def met(self) -> bool | None:
        """Whether the median is within the target; None for a figure without one."""
        if self.op is None or self.target is None:
            return None
        value = self.stat.median
        return value >= self.target if self.op == ">=" else value <= self.target

    @property
    def missed_by(self) -> str | None:
        """How far the median is from the target, when it misses: absolute and relative."""
        if self.met is not False or self.target is None:
            return None
        gap = abs(self.stat.median - self.target)
        share = gap / self.target * 100 if self.target else float("inf")
        return f"{gap:.4g}{self.unit} ({share:.1f} %)"

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "met": self.met, "missed_by": self.missed_by}


@dataclass
class Result:
    """One benchmark's row(s): its checks and whatever raw figures explain them."""

    id: str
    title: str
    checks: list[Check]
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "checks": [c.as_json() for c in self.checks],
            "met": self.error is None and all(c.met is not False for c in self.checks),
            "details": self.details,
            "error": self.error,
        }


def machine() -> dict[str, Any]:
    import psutil

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": _gpu_name(),
    }


def _gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # no torch, no driver: no GPU to name
        return None


def write(results: list[Result], *, repeats: int, path: Path | None = None) -> Path:
    """Write ``results/<YYYY-MM-DD>.json``, merging rows of earlier runs on the same day by id."""
    now = datetime.now(UTC)
    path = path or RESULTS_DIR / f"{now.date().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows: dict[str, Any] = {}
    if path.exists():
        try:
            rows = {r["id"]: r for r in json.loads(path.read_text()).get("results", [])}
        except (json.JSONDecodeError, AttributeError, KeyError, TypeError):
            rows = {}
    for r in results:
        rows[r.id] = {**r.as_json(), "repeats": repeats, "measured_at": now.isoformat(timespec="seconds")}
    document = {
        "written_at": now.isoformat(timespec="seconds"),
        "machine": machine(),
        "results": [rows[k] for k in sorted(rows)],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def print_table(results: list[Result], *, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="tuneq benchmarks (median of repeats, \\[min, max])")
    for column in ("id", "figure", "measured", "target", "met", "missed by"):
        table.add_column(column)
    for r in results:
        for c in r.checks:
            s = c.stat
            table.add_row(
                r.id,
                c.name,
                f"{_fmt(s.median)}{c.unit} [{_fmt(s.min)}, {_fmt(s.max)}]",
                "(reported)" if c.target is None else f"{c.op} {_fmt(c.target)}{c.unit}",
                "" if c.met is None else "[green]yes[/green]" if c.met else "[red]no[/red]",
                c.missed_by or "",
            )
        if r.error is not None:
            table.add_row(r.id, r.title, "[red]error[/red]", "", "[red]no[/red]", escape(r.error[:160]))
    console.print(table)
