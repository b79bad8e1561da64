"""Sources: documents streamed from text files, folders, globs, JSONL, Parquet and hf: datasets,
each on its side of a split that is the same on every machine."""

import gzip
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import pytest

from jaxgpt.data import sources
from jaxgpt.data.documents import listing_changes
from jaxgpt.data.sources import open_source
from jaxgpt.data.tokenizer import build_tokenizer


def held_out(name: str, val_fraction: float) -> bool:
    """The documented split rule, restated independently of sources.py."""
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % 1000 < val_fraction * 1000


def write_tree(root: Path, n: int) -> dict[str, str]:
    folders = ["", "sub/", "sub/deeper/"]
    files = {f"{folders[i % 3]}doc{i:02d}.txt": f"document {i}\nline two of {i}\n" for i in range(n)}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return files


def split(spec: str, val_fraction: float = 0.1, **kwargs) -> tuple[list[str], list[str]]:
    docs = list(open_source(spec, val_fraction, **kwargs).documents())
    return [d.text for d in docs if not d.val], [d.text for d in docs if d.val]


def test_a_single_file_holds_out_its_last_fraction_read_in_pieces(tmp_path, monkeypatch) -> None:
    text = "".join(f"line {i}: é and more.\nWord" for i in range(300)) + "\r\nend 🙂"
    (tmp_path / "input.txt").write_text(text, encoding="utf-8", newline="")
    monkeypatch.setattr(sources, "PIECE_BYTES", 512)  # many pieces
    docs = list(open_source(str(tmp_path / "input.txt"), 0.1).documents())
    raw = text.encode("utf-8")
    cut = int(len(raw) * 0.9)
    while raw[cut] & 0xC0 == 0x80:  # the cut lands on the start of a character
        cut += 1
    train, val = [d for d in docs if not d.val], [d for d in docs if d.val]
    assert "".join(d.text for d in train) == raw[:cut].decode() and "".join(d.text for d in val) == raw[cut:].decode()
    assert len(train) > 5 and [d.ends for d in train] == [False] * (len(train) - 1) + [True]
    assert [d.starts for d in train] == [True] + [False] * (len(train) - 1) and val[0].starts
    assert val[-1].ends and all(d.size() == len(d.text.encode()) for d in docs)
    # each piece ends where byte-level BPE gives the same ids as the whole text
    bpe = build_tokenizer("bpe", [text], 300)
    whole = bpe.encode(raw[:cut].decode()).tolist()
    assert [i for d in train for i in bpe.encode(d.text).tolist()] == whole


def test_a_directory_splits_by_path_and_ignores_hidden_files(tmp_path) -> None:
    files = write_tree(tmp_path, 40)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "index").write_bytes(b"\xff\x00binary")
    train, val = split(str(tmp_path), 0.25)
    names = sorted(files)
    assert val == [files[n] for n in names if held_out(n, 0.25)]
    assert train == [files[n] for n in names if not held_out(n, 0.25)]
    assert val and train and split(str(tmp_path), 0.25) == (train, val)


def test_a_glob_splits_like_a_directory(tmp_path) -> None:
    files = write_tree(tmp_path, 40)
    (tmp_path / "skip.md").write_text("not matched")
    train, val = split(str(tmp_path / "**" / "*.txt"), 0.25)
    names = sorted(files)  # relative to the matches' common folder, as for a directory
    assert val == [files[n] for n in names if held_out(n, 0.25)]
    assert train == [files[n] for n in names if not held_out(n, 0.25)]


def test_few_files_that_all_hash_to_train_still_hold_one_out(tmp_path) -> None:
    names = [n for n in (f"f{i}.txt" for i in range(100)) if not held_out(n, 0.1)][:3]
    for name in names:
        (tmp_path / name).write_text(f"text of {name}")
    train, val = split(str(tmp_path), 0.1)
    lowest = min(names, key=lambda n: int(hashlib.sha256(n.encode()).hexdigest(), 16) % 1000)
    assert val == [f"text of {lowest}"] and len(train) == 2


def test_the_stdlib_is_split_by_path_without_its_tests() -> None:
    source = open_source("stdlib", 0.1)
    assert source.size() > 4 << 20  # large: a first run announces its stages
    docs = {}
    for doc in source.documents():
        docs[doc.text] = doc.val
    root = Path(sysconfig.get_paths()["stdlib"])
    checked = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_bytes().decode("utf-8")
        if text and len(text) < sources.PIECE_BYTES:
            assert docs[text] == held_out(path.name, 0.1), path.name
            checked += 1
    assert checked > 100 and sum(docs.values()) > 10
    test_module = root / "unittest" / "test" / "test_case.py"
    if test_module.exists():
        assert test_module.read_bytes().decode() not in docs  # test packages left out
    assert source.listing() == open_source("stdlib", 0.1).listing()


def test_a_non_utf8_file_is_named_with_its_offset(tmp_path, monkeypatch) -> None:
    write_tree(tmp_path, 3)
    (tmp_path / "latin1.txt").write_bytes(b"x" * 700 + "abc café".encode("latin-1"))
    monkeypatch.setattr(sources, "PIECE_BYTES", 256)  # the bad byte past the first reads
    with pytest.raises(ValueError, match=r"latin1\.txt is not UTF-8 text: byte 0xe9 at offset 707"):
        split(str(tmp_path))


def test_missing_and_empty_sources(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="data source not found: .*nope"):
        open_source(str(tmp_path / "nope"), 0.1)
    with pytest.raises(FileNotFoundError, match="matches no files"):
        open_source(str(tmp_path / "*.txt"), 0.1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is empty: it holds no files"):
        open_source(str(tmp_path / "empty"), 0.1)
    with pytest.raises(ValueError, match=r"val_fraction = 1.0 must be in \(0, 1\)"):
        open_source("stdlib", 1.0)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    lines = "".join(json.dumps(row) + "\n" for row in rows)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")
    return path


def test_jsonl_rows_are_documents_held_out_by_file_and_index(tmp_path) -> None:
    rows = [{"text": f"story {i} é", "id": i} for i in range(60)]
    write_jsonl(tmp_path / "a.jsonl", rows[:30])
    write_jsonl(tmp_path / "b.jsonl.gz", [*rows[30:45], {"text": ""}, *rows[45:]])  # an empty row is no document
    (tmp_path / "notes.txt").write_text("a text file beside them")
    docs = list(open_source(str(tmp_path), 0.2).documents())
    expected = [(r["text"], held_out(f"a.jsonl#{i}", 0.2)) for i, r in enumerate(rows[:30])]
    expected += [(r["text"], held_out(f"b.jsonl.gz#{i}", 0.2)) for i, r in enumerate([*rows[30:45], None, *rows[45:]])
                 if r is not None]
    expected += [("a text file beside them", held_out("notes.txt", 0.2))]
    assert [(d.text, d.val) for d in docs] == expected
    assert any(val for _, val in expected) and all(d.ends for d in docs)


def test_jsonl_text_field_and_its_errors(tmp_path) -> None:
    write_jsonl(tmp_path / "c.jsonl", [{"body": "x"}, {"body": "y"}])
    assert sorted(sum(split(str(tmp_path / "c.jsonl"), text_field="body"), [])) == ["x", "y"]
    with pytest.raises(ValueError, match=r"c\.jsonl:1 has no 'text' field \(it has: body\)"):
        split(str(tmp_path / "c.jsonl"))
    (tmp_path / "d.jsonl").write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: 'text' is a int, not a string"):
        split(str(tmp_path / "d.jsonl"))
    (tmp_path / "e.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"e\.jsonl:2 is not a JSON line"):
        split(str(tmp_path / "e.jsonl"))
    (tmp_path / "f.jsonl.gz").write_bytes(gzip.compress(b'{"text": "ok"}\n')[:-8])
    with pytest.raises(ValueError, match=r"f\.jsonl\.gz is not a complete gzip file"):
        split(str(tmp_path / "f.jsonl.gz"))


def test_parquet_rows_are_documents_and_a_missing_column_is_named(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"row {i}" for i in range(50)]
    pq.write_table(pa.table({"text": texts, "n": list(range(50))}), tmp_path / "p.parquet", row_group_size=7)
    docs = list(open_source(str(tmp_path / "p.parquet"), 0.2).documents())
    assert [(d.text, d.val) for d in docs] == [(t, held_out(f"p.parquet#{i}", 0.2)) for i, t in enumerate(texts)]
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "q.parquet")
    with pytest.raises(ValueError, match=r"q\.parquet has no 'text' column \(columns: content\)"):
        split(str(tmp_path / "q.parquet"))


def test_an_hf_dataset_on_disk_holds_out_rows_by_index(tmp_path) -> None:
    import datasets

    rows = [f"row {i}" for i in range(40)] + [""]
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / "ds"))
    docs = list(open_source(f"hf:{tmp_path / 'ds'}", 0.2).documents())
    assert [(d.text, d.val) for d in docs] == [(r, held_out(f"#{i}", 0.2)) for i, r in enumerate(rows) if r]


def test_an_hf_dataset_dict_holds_out_its_validation_split(tmp_path) -> None:
    import datasets

    splits = {"train": ["a", "b", "c"], "validation": ["v"], "other": ["o"]}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(
        str(tmp_path / "dd"))
    assert split(f"hf:{tmp_path / 'dd'}") == (["a", "b", "c"], ["v"])
    assert split(f"hf:{tmp_path / 'dd'}:other") == (["o"], ["v"])
    with pytest.raises(ValueError, match="no split 'nope' .*train, validation, other"):
        split(f"hf:{tmp_path / 'dd'}:nope")
    datasets.Dataset.from_dict({"content": ["x"], "id": [1]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(ValueError, match=r"no 'text' column \(columns: content, id\)"):
        split(f"hf:{tmp_path / 'ds'}")


def test_hf_without_datasets_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match=r"pip install 'jaxgpt\[hf\]'"):
        open_source("hf:anything", 0.1)


def test_a_changed_listing_is_named(tmp_path) -> None:
    write_tree(tmp_path, 4)
    before = open_source(str(tmp_path), 0.1).listing()
    (tmp_path / "doc00.txt").write_text("longer than it was before\n")
    (tmp_path / "new.txt").write_text("x")
    (tmp_path / "sub" / "doc01.txt").unlink()
    after = open_source(str(tmp_path), 0.1).listing()
    assert listing_changes(before, after) == (
        "doc00.txt (size 25 -> 26 bytes), new.txt (new), sub/doc01.txt (gone)")
