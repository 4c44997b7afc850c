"""B11's pure parts: the jobs it writes, the pages it asks, the SSE it reads, the ids it answers to."""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from benchmarks import run as bench_run
from benchmarks.b11_jobs_list import COPY_COLUMNS, MODELS, SPAN, STATUS_SHARES, cases, job_rows
from benchmarks.results import Result
from benchmarks.sse_followers import ChunkedSseParser, SseMessage, metric_latency

NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


def _as_dicts(rows: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    return [dict(zip(COPY_COLUMNS, row, strict=True)) for row in rows]


def test_the_jobs_are_the_same_for_a_seed_and_span_the_year_oldest_first() -> None:
    rows = _as_dicts(list(job_rows("bench", 2000, now=NOW, seed=3)))
    assert _as_dicts(list(job_rows("bench", 2000, now=NOW, seed=3))) == rows
    assert _as_dicts(list(job_rows("bench", 2000, now=NOW, seed=4))) != rows
    created = [r["created_at"] for r in rows]
    assert created == sorted(created)
    assert NOW - SPAN <= created[0] < NOW - SPAN + timedelta(days=1) and created[-1] < NOW
    assert len({r["id"] for r in rows}) == 2000 and {r["owner"] for r in rows} == {"bench"}
    assert rows[42]["name"].endswith("-000042")


def test_the_jobs_mix_statuses_and_models_and_only_those_that_ran_have_run_columns() -> None:
    rows = _as_dicts(list(job_rows("bench", 5000, now=NOW, seed=0)))
    shares = Counter(r["status"] for r in rows)
    for status, share in STATUS_SHARES:
        assert shares[status] / len(rows) == pytest.approx(share, abs=0.02)
    assert {r["model"] for r in rows} == set(MODELS)
    for r in rows:
        ran = r["status"] != "queued"
        assert (r["started_at"] is not None) == ran and (r["latest_metrics"] is not None) == ran
        assert (r["finished_at"] is not None) == (r["status"] in ("succeeded", "failed", "cancelled"))
        assert (r["error_code"] is not None) == (r["status"] == "failed")
        json.loads(r["deepspeed_config"])
        json.loads(r["training"])


def test_a_tree_before_the_filters_is_asked_only_what_it_has() -> None:
    pages = cases(NOW)
    before = [c for c in pages if c.before_filters]
    assert [set(c.params) for c in before] == [set(), {"skip"}, {"status"}]
    assert {key for c in pages if not c.before_filters for key in c.params} == {
        "sort",
        "created_after",
        "model",
        "name",
    }
    (created_after,) = [c.params["created_after"] for c in pages if "created_after" in c.params]
    assert datetime.fromisoformat(created_after) == NOW - timedelta(days=30)


def _chunked(body: bytes, sizes: list[int]) -> bytes:
    """``body`` as HTTP/1.1 chunks of these sizes (the rest in one), then the last chunk."""
    out, at = b"", 0
    for size in [*sizes, len(body)]:
        piece = body[at : at + size]
        if piece:
            out += f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        at += len(piece)
    return out + b"0\r\n\r\n"


STREAM = (
    b": ping - 2026-12-07 12:00:00\r\n\r\n"
    b'id: 7\r\nevent: metric\r\ndata: {"type": "metric", "data": {"step": 1}}\r\n\r\n'
    b"id: 8\r\nevent: status\r\ndata: first\r\ndata: second\r\n\r\n"
)
MESSAGES = [
    SseMessage("metric", '{"type": "metric", "data": {"step": 1}}'),
    SseMessage("status", "first\nsecond"),
]


@pytest.mark.parametrize("sizes", [[], [1, 2, 3, 5, 8], [40, 1]])
def test_the_sse_parser_takes_chunks_split_anywhere(sizes: list[int]) -> None:
    wire = _chunked(STREAM, sizes)
    for step in (1, 7, len(wire)):  # fed a byte at a time, in odd pieces, all at once
        parser = ChunkedSseParser()
        messages = [m for at in range(0, len(wire), step) for m in parser.feed(wire[at : at + step])]
        assert messages == MESSAGES
        assert parser.ended


def test_the_sse_parser_waits_for_a_whole_message_and_reads_chunk_extensions() -> None:
    parser = ChunkedSseParser()
    assert parser.feed(b"5;name=value\r\nevent\r\n") == []
    assert parser.feed(b"8\r\n: x\n\ndat\r\n") == []
    assert parser.feed(b"5\r\na: 1\n\r\n") == []
    assert parser.feed(b"1\r\n\n\r\n") == [SseMessage("message", "1")]
    assert not parser.ended


def test_a_metric_latency_is_its_arrival_minus_the_lines_stamp() -> None:
    stamped = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
    message = SseMessage("metric", json.dumps({"type": "metric", "data": {"step": 3, "time": stamped.isoformat()}}))
    measured = metric_latency(message, stamped.timestamp() + 0.025)
    assert measured is not None
    assert measured[0] == 3 and measured[1] == pytest.approx(0.025, abs=1e-6)
    assert metric_latency(SseMessage("status", "{}"), stamped.timestamp()) is None


def test_only_picks_benchmarks_whatever_the_case_of_their_ids(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    ran: list[str] = []

    def fake(ids: tuple[str, ...]) -> Any:
        def measure(_repeats: int) -> list[Result]:
            ran.extend(ids)
            return [Result(id=i, title=i, checks=[]) for i in ids]

        return measure

    benchmarks = {"jobs_list": (("B11a",), fake(("B11a",))), "followers": (("B11b",), fake(("B11b",)))}
    monkeypatch.setattr(bench_run, "BENCHMARKS", {name: (ids, fn) for name, (ids, fn) in benchmarks.items()})
    assert bench_run.main(["--only", "b11a", "--repeats", "1", "--output", str(tmp_path / "r.json")]) == 0
    assert ran == ["B11a"]
    assert [r["id"] for r in json.loads((tmp_path / "r.json").read_text())["results"]] == ["B11a"]
