from pathlib import Path

import pytest

from jaxgpt.runs.rundir import RunDir, atomic_file, write_atomic


def test_run_dir_names_the_documented_layout() -> None:
    files = RunDir("runs/a")
    assert (files.config, files.tokenizer, files.metrics, files.checkpoints, files.tensorboard, files.loss_plot) == (
        Path("runs/a/config.toml"), Path("runs/a/tokenizer.json"), Path("runs/a/metrics.jsonl"),
        Path("runs/a/checkpoints"), Path("runs/a/tensorboard"), Path("runs/a/loss.png"))
    assert not Path("runs/a").exists()  # naming paths creates nothing


def test_has_checkpoints_only_when_the_folder_holds_something(tmp_path: Path) -> None:
    files = RunDir(tmp_path)
    assert not files.has_checkpoints()
    files.checkpoints.mkdir()
    assert not files.has_checkpoints()
    (files.checkpoints / "5").mkdir()
    assert files.has_checkpoints()


def test_write_atomic_replaces_text_and_bytes(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    write_atomic(path, "old ✓\n")
    assert path.read_text(encoding="utf-8") == "old ✓\n"
    write_atomic(path, memoryview(b"\x00\x01new"))
    assert path.read_bytes() == b"\x00\x01new"
    assert [p.name for p in tmp_path.iterdir()] == ["config.toml"]


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "loss.png"
    path.write_bytes(b"old plot")
    with pytest.raises(RuntimeError, match="renderer died"), atomic_file(path) as f:
        f.write(b"half a new pl")
        raise RuntimeError("renderer died")
    assert path.read_bytes() == b"old plot"
    assert [p.name for p in tmp_path.iterdir()] == ["loss.png"]


def test_a_failed_first_write_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    with pytest.raises(TypeError):
        write_atomic(path, 12345)  # type: ignore[arg-type]  # not str or bytes: fails inside the write
    assert list(tmp_path.iterdir()) == []
