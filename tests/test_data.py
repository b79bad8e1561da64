import hashlib
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from jaxgpt import data
from jaxgpt.data import cached_tokenizer, get_batch, load_corpus, prepare_tokens
from jaxgpt.tokenizer import Tokenizer, build_tokenizer


def held_out(relative_path: str, val_fraction: float) -> bool:
    """The documented split rule, restated independently of data.py."""
    return int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % 1000 < val_fraction * 1000


def write_tree(root: Path, n: int) -> dict[str, str]:
    folders = ["", "sub/", "sub/deeper/"]
    files = {f"{folders[i % 3]}doc{i:02d}.txt": f"document {i}\nline two of {i}\n" for i in range(n)}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return files


# Corpora


def test_single_file_holds_out_the_last_fraction(tmp_path: Path) -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(1000)) + "\r\nend 🙂"
    (tmp_path / "input.txt").write_text(text, encoding="utf-8", newline="")
    corpus = load_corpus(str(tmp_path / "input.txt"), 0.1)
    cut = int(len(text) * 0.9)
    assert corpus.train == [text[:cut]] and corpus.val == [text[cut:]]


def test_directory_split_is_by_path_and_deterministic(tmp_path: Path) -> None:
    files = write_tree(tmp_path, 40)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "index").write_bytes(b"\xff\x00binary")  # hidden: must be ignored
    corpus = load_corpus(str(tmp_path), 0.25)
    names = sorted(files)
    assert corpus.val == [files[n] for n in names if held_out(n, 0.25)]
    assert corpus.train == [files[n] for n in names if not held_out(n, 0.25)]
    assert corpus.val and corpus.train
    assert load_corpus(str(tmp_path), 0.25) == corpus
    assert load_corpus(str(tmp_path), 0.5).fingerprint != corpus.fingerprint


def test_glob_source_splits_like_a_directory(tmp_path: Path) -> None:
    files = write_tree(tmp_path, 40)
    (tmp_path / "skip.md").write_text("not matched")
    corpus = load_corpus(str(tmp_path / "**" / "*.txt"), 0.25)
    names = sorted(files)  # relative to the matches' common folder, as for a directory
    assert corpus.val == [files[n] for n in names if held_out(n, 0.25)]
    assert corpus.train == [files[n] for n in names if not held_out(n, 0.25)]


def test_few_files_that_all_hash_to_train_still_hold_one_out(tmp_path: Path) -> None:
    names = [n for n in (f"f{i}.txt" for i in range(100)) if not held_out(n, 0.1)][:3]
    for name in names:
        (tmp_path / name).write_text(f"text of {name}")
    corpus = load_corpus(str(tmp_path), 0.1)
    lowest = min(names, key=lambda n: int(hashlib.sha256(n.encode()).hexdigest(), 16) % 1000)
    assert corpus.val == [f"text of {lowest}"] and len(corpus.train) == 2


def test_stdlib_corpus_is_deterministic_and_split_by_path() -> None:
    corpus = load_corpus("stdlib", 0.1)
    again = load_corpus("stdlib", 0.1)
    assert corpus == again and corpus.train == again.train and corpus.val == again.val
    assert len(corpus.train) > 100 and len(corpus.val) > 10
    # the default corpus is large: a first run announces its stages and shows the encoding bar
    assert sum(map(len, corpus.train + corpus.val)) >= data.LARGE_CORPUS_CHARS
    root = Path(sysconfig.get_paths()["stdlib"])
    val, train = set(corpus.val), set(corpus.train)
    checked = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_bytes().decode("utf-8")
        if text:
            assert text in (val if held_out(path.name, 0.1) else train), path.name
            checked += 1
    assert checked > 100
    test_module = (root / "unittest" / "test" / "test_case.py")
    if test_module.exists():
        assert test_module.read_bytes().decode() not in train | val  # test packages left out


def test_non_utf8_file_is_named_with_offset(tmp_path: Path) -> None:
    write_tree(tmp_path, 3)
    (tmp_path / "latin1.txt").write_bytes("abc café".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt is not UTF-8 text: byte 0xe9 at offset 7"):
        load_corpus(str(tmp_path), 0.1)


def test_empty_sources(tmp_path: Path) -> None:
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty.txt is empty"):
        load_corpus(str(tmp_path / "empty.txt"), 0.1)
    (tmp_path / "also_empty.txt").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        load_corpus(str(tmp_path), 0.1)
    (tmp_path / "tiny.txt").write_text("ab")
    (tmp_path / "one.txt").write_text("x")
    with pytest.raises(ValueError, match="train split is empty"):
        load_corpus(str(tmp_path / "one.txt"), 0.5)


def test_missing_sources(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="data source not found: .*nope"):
        load_corpus(str(tmp_path / "nope"), 0.1)
    with pytest.raises(FileNotFoundError, match="matches no files"):
        load_corpus(str(tmp_path / "*.txt"), 0.1)


def test_hf_dataset_from_disk_holds_out_last_rows(tmp_path: Path) -> None:
    import datasets
    rows = [f"row {i}" for i in range(20)] + [""]
    datasets.Dataset.from_dict({"text": rows}).save_to_disk(str(tmp_path / "ds"))
    corpus = load_corpus(f"hf:{tmp_path / 'ds'}", 0.1)
    assert corpus.train == [f"row {i}\n" for i in range(18)]  # empty rows dropped, newline ends a row
    assert corpus.val == ["row 18\n", "row 19\n"]


def test_hf_dataset_dict_uses_validation_split(tmp_path: Path) -> None:
    import datasets
    splits = {
        "train": datasets.Dataset.from_dict({"text": ["a\n", "b\n", "c\n"]}),
        "validation": datasets.Dataset.from_dict({"text": ["v\n"]}),
        "other": datasets.Dataset.from_dict({"text": ["o\n"]}),
    }
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    corpus = load_corpus(f"hf:{tmp_path / 'dd'}", 0.1)
    assert corpus.train == ["a\n", "b\n", "c\n"] and corpus.val == ["v\n"]
    assert load_corpus(f"hf:{tmp_path / 'dd'}:other", 0.1).train == ["o\n"]
    with pytest.raises(ValueError, match="no split 'nope' .*train, validation, other"):
        load_corpus(f"hf:{tmp_path / 'dd'}:nope", 0.1)


def test_hf_dataset_without_text_column(tmp_path: Path) -> None:
    import datasets
    datasets.Dataset.from_dict({"content": ["x"], "id": [1]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(ValueError, match=r"no 'text' column \(columns: content, id\)"):
        load_corpus(f"hf:{tmp_path / 'ds'}", 0.1)


def test_hf_empty_validation_split_is_an_error(tmp_path: Path) -> None:
    import datasets

    splits = {"train": ["a\n"], "validation": [""]}
    as_datasets = {k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}
    datasets.DatasetDict(as_datasets).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match="val split is empty"):
        load_corpus(f"hf:{tmp_path / 'dd'}", 0.1)


def test_hf_without_datasets_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match=r"pip install 'jaxgpt\[hf\]'"):
        load_corpus("hf:anything", 0.1)


# Token files


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> data.Corpus:
    root = tmp_path_factory.mktemp("corpus")
    write_tree(root, 40)
    return load_corpus(str(root), 0.25)


@pytest.fixture(scope="module")
def bpe(corpus: data.Corpus) -> Tokenizer:
    return build_tokenizer("bpe", corpus.train, 300)


def test_prepare_tokens_writes_once_and_reuses(corpus, bpe, tmp_path, monkeypatch) -> None:
    splits = prepare_tokens(corpus, bpe, tmp_path)
    assert splits.train.dtype == np.uint16 and isinstance(splits.train, np.memmap)
    assert not splits.train.flags.writeable
    assert bpe.decode(splits.train) == "".join(corpus.train)
    assert bpe.decode(splits.val) == "".join(corpus.val)
    assert splits.val_bytes == len("".join(corpus.val).encode())
    assert splits.val_bytes_per_token == splits.val_bytes / len(splits.val)

    def no_encoding(self, texts):
        raise AssertionError("token files were encoded again")

    monkeypatch.setattr(Tokenizer, "encode_many", no_encoding)
    again = prepare_tokens(corpus, bpe, tmp_path)
    assert again.fingerprint == splits.fingerprint
    np.testing.assert_array_equal(again.train, splits.train)


def test_prepare_tokens_rewrites_a_truncated_file(corpus, bpe, tmp_path) -> None:
    splits = prepare_tokens(corpus, bpe, tmp_path)
    expected = np.array(splits.train)
    train_file = tmp_path / "tokens" / splits.fingerprint / "train.bin"
    half = tmp_path / "half.bin"  # a new file, so the memmap above keeps its own
    half.write_bytes(train_file.read_bytes()[:10])
    half.replace(train_file)  # as if a writer without the atomic rename had died mid-way
    repaired = prepare_tokens(corpus, bpe, tmp_path)
    np.testing.assert_array_equal(repaired.train, expected)
    assert not list((tmp_path / "tokens" / splits.fingerprint).glob("*.tmp"))


def test_prepare_tokens_keys_by_tokenizer(corpus, bpe, tmp_path) -> None:
    char = build_tokenizer("char", corpus.train + corpus.val, 300)
    by_char = prepare_tokens(corpus, char, tmp_path)
    assert by_char.fingerprint != prepare_tokens(corpus, bpe, tmp_path).fingerprint
    assert len(by_char.train) == len("".join(corpus.train))


def test_cached_tokenizer_trains_once(corpus, tmp_path, monkeypatch) -> None:
    first = cached_tokenizer("bpe", corpus, 300, tmp_path)
    monkeypatch.setattr(data, "build_tokenizer", lambda *a: pytest.fail("trained again"))
    second = cached_tokenizer("bpe", corpus, 300, tmp_path)
    assert second.fingerprint == first.fingerprint and second.kind == "bpe"


def test_cached_char_tokenizer_covers_val_characters(tmp_path: Path) -> None:
    (tmp_path / "input.txt").write_text("aaaaaaaaab" * 10 + "XYZ")
    corpus = load_corpus(str(tmp_path / "input.txt"), 0.1)
    char = cached_tokenizer("char", corpus, 64, tmp_path)
    assert char.decode(char.encode(corpus.val[0])) == corpus.val[0]


def test_home_cache_is_overridable(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("JAXGPT_CACHE", str(tmp_path))
    assert data.default_cache_dir() == tmp_path


# Batches

TOKENS = np.arange(10_000, dtype=np.uint16)


def batch(**overrides) -> np.ndarray:
    kwargs = dict(seed=0, step=0, batch_size=8, window=17) | overrides
    return get_batch(TOKENS, **kwargs)


def test_batch_is_a_pure_function_of_seed_stream_step() -> None:
    assert batch().dtype == np.int32 and batch().shape == (8, 17)
    np.testing.assert_array_equal(batch(), batch())
    assert not np.array_equal(batch(), batch(step=1))
    assert not np.array_equal(batch(), batch(seed=1))
    assert not np.array_equal(batch(), batch(stream=1))


def test_windows_are_contiguous_slices() -> None:
    rows = batch(batch_size=64)
    np.testing.assert_array_equal(rows, rows[:, :1] + np.arange(17))
    assert rows.min() >= 0 and rows.max() < len(TOKENS)


def test_a_split_of_exactly_one_window_gives_that_window() -> None:
    rows = get_batch(TOKENS[:17], seed=3, step=5, batch_size=2, window=17)
    np.testing.assert_array_equal(rows, [TOKENS[:17]] * 2)


def test_process_slices_concatenate_to_the_global_batch() -> None:
    whole = batch(step=7)
    parts = [batch(step=7, process_index=i, process_count=4) for i in range(4)]
    assert parts[0].shape == (2, 17)
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_batch_errors() -> None:
    with pytest.raises(ValueError, match="the train split has 10 tokens, fewer than one window of 17"):
        get_batch(TOKENS[:10], seed=0, step=0, batch_size=8, window=17)
    with pytest.raises(ValueError, match="the val split has 10 tokens"):
        get_batch(TOKENS[:10], seed=0, step=0, batch_size=8, window=17, split="val")
    with pytest.raises(ValueError, match="not divisible by process count 3"):
        batch(process_count=3)


def test_slow_stages_say_what_they_do_once_with_a_progress_bar(corpus, tmp_path, monkeypatch, capsys) -> None:
    tokenizer = cached_tokenizer("bpe", corpus, 300, tmp_path / "small")
    prepare_tokens(corpus, tokenizer, tmp_path / "small")
    assert capsys.readouterr().err == ""  # a small corpus is ready at once: nothing to announce
    monkeypatch.setattr(data, "LARGE_CORPUS_CHARS", 1000)  # this corpus, 1,060 characters, is now large
    tokenizer = cached_tokenizer("bpe", corpus, 300, tmp_path)
    prepare_tokens(corpus, tokenizer, tmp_path)
    err = capsys.readouterr().err
    assert "building the bpe tokenizer (300 tokens)" in err
    assert "encoding the corpus into token files" in err
    assert "encoding: 100%" in err and "1.06k/1.06k" in err  # the bar ran to the end of 1,060 characters
    assert len("".join(corpus.train + corpus.val)) == 1060
    cached_tokenizer("bpe", corpus, 300, tmp_path)
    prepare_tokens(corpus, tokenizer, tmp_path)
    assert capsys.readouterr().err == ""  # found in the cache: nothing to announce
