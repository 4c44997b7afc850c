from __future__ import annotations

from pathlib import Path

from shared.jobs.run_layout import CheckpointManifest, RunLayout, tail_lines, write_json_atomic


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


def test_a_failed_atomic_write_leaves_neither_file_nor_temporary(tmp_path: Path) -> None:
    import pytest

    circular: dict[str, object] = {}
    circular["self"] = circular  # json.dump fails half way through, as a full disk would
    with pytest.raises(ValueError):
        write_json_atomic(tmp_path / "spec.json", circular)
    assert list(tmp_path.iterdir()) == []


def test_incomplete_saves_are_removed_and_complete_ones_kept(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path)
    complete = layout.checkpoints_dir / layout.checkpoint_tag(5)
    torn = layout.checkpoints_dir / layout.checkpoint_tag(10)  # a save the disk filled up under
    for directory in (complete, torn, layout.model_dir.with_name("model.partial"), layout.model_dir):
        directory.mkdir(parents=True)
        (directory / "weights.pt").write_bytes(b"x" * 10)
    CheckpointManifest.describe(
        complete, step=5, tag=complete.name, kind="deepspeed", world_size=1, created_at="t"
    ).write(complete)
    CheckpointManifest.describe(
        layout.model_dir, step=10, tag="model", kind="model", world_size=1, created_at="t"
    ).write(layout.model_dir)
    removed = layout.remove_incomplete_saves()
    assert sorted(p.name for p in removed) == ["model.partial", "step-00000010"]
    assert complete.is_dir() and layout.model_dir.is_dir() and not torn.exists()
    assert layout.remove_incomplete_saves() == []
