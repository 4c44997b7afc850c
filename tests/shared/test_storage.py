from __future__ import annotations

from pathlib import Path

from shared.storage import CheckpointManifest, RunLayout, tail_lines, write_json_atomic


def test_tail_lines_reads_the_end_of_a_big_file(tmp_path: Path) -> None:
    path = tmp_path / "log"
    path.write_text("".join(f"line {i}\n" for i in range(50_000)))
    assert tail_lines(path, 3) == ["line 49997", "line 49998", "line 49999"]
    assert tail_lines(path, 0) == []
    assert tail_lines(tmp_path / "missing", 5) == []


def test_tail_lines_of_a_short_file(tmp_path: Path) -> None:
    path = tmp_path / "log"
    path.write_text("a\nb\n")
    assert tail_lines(path, 10) == ["a", "b"]


def test_manifest_round_trip_and_absence(tmp_path: Path) -> None:
    ckpt = tmp_path / "step-00000003"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "a.pt").write_bytes(b"12345")
    (ckpt / "sub" / "b.pt").write_bytes(b"12")
    assert CheckpointManifest.read(ckpt) is None  # no manifest: an incomplete checkpoint
    manifest = CheckpointManifest.describe(ckpt, step=3, tag=ckpt.name, kind="deepspeed", world_size=2, created_at="t")
    manifest.write(ckpt)
    again = CheckpointManifest.read(ckpt)
    assert again == manifest
    assert again is not None and again.files == {"a.pt": 5, "sub/b.pt": 2} and again.bytes == 7


def test_write_json_atomic_leaves_no_temporary_file(tmp_path: Path) -> None:
    write_json_atomic(tmp_path / "x" / "spec.json", {"a": 1})
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["spec.json"]


def test_run_layout(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path / "runs" / "abc")
    assert layout.spec.name == "spec.json"
    assert layout.checkpoint_tag(7) == "step-00000007"
