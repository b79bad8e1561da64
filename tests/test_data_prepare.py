"""The token store: llm.c shards prepared once, in order, by 1 or N workers alike, resumable after
SIGKILL, found again from the source's listing without reading text; bad input is one line."""

import gzip
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import xla_flags

from jaxgpt.cli.main import main
from jaxgpt.config import load_config
from jaxgpt.data import in_val_split, open_source, prepare_data, sources
from jaxgpt.data import store_builder as prepare_module
from jaxgpt.data.encoding import HF, TIKTOKEN
from jaxgpt.data.shards import HEADER_BYTES, ShardWriter

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "it", "was", "red", "naïve", "🙂"]


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) + rng.choice([".", ".\n", "!\nNext"])
            for _ in range(n)]


def write_jsonl_corpus(folder: Path, n_files: int = 4, per_file: int = 60) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    texts = documents(n_files * per_file)
    for f in range(n_files):
        rows = "".join(json.dumps({"text": t}) + "\n" for t in texts[f * per_file:(f + 1) * per_file])
        (folder / f"part{f}.jsonl").write_text(rows, encoding="utf-8")
    return texts


def config(source: Path | str, *extra: str):
    return load_config(None, [f"data.source={json.dumps(str(source))}", "model.vocab_size=300",
                              "model.context_length=16", "data.shard_tokens=1000", *extra])


def store_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.bin"))}


def split_at_eot(ids: np.ndarray, eot: int) -> list[list[int]]:
    docs, current = [], []
    for i in ids.tolist():
        if i == eot:
            docs.append(current)
            current = []
        else:
            current.append(i)
    assert current == [], "the split does not end with end-of-text"
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("jsonl")
    return folder, write_jsonl_corpus(folder)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    """The corpus prepared by one worker and by two, each in a cache of its own."""
    folder, _ = corpus
    return {n: prepare_data(config(folder), workers=n, cache_dir=tmp_path_factory.mktemp(f"cache{n}"))
            for n in (1, 2)}


def test_one_and_two_workers_write_the_same_shards(prepared) -> None:
    one, two = prepared[1].tokens, prepared[2].tokens
    assert len(list(one.folder.glob("train_*.bin"))) > 3  # several shards of 1,000 tokens
    assert store_bytes(one.folder) == store_bytes(two.folder)
    assert one.fingerprint == two.fingerprint


def test_every_document_is_followed_by_end_of_text_in_source_order(prepared, corpus) -> None:
    folder, texts = corpus
    data = prepared[2]
    tokenizer, eot = data.tokenizer, data.tokenizer.eot_id
    assert eot == tokenizer.vocab_size - 1
    docs = list(open_source(str(folder), 0.1).documents())
    for split, tokens in (("train", data.tokens.train), ("val", data.tokens.val)):
        expected = [tokenizer.encode(d.text).tolist() for d in docs if d.val == (split == "val")]
        assert split_at_eot(np.asarray(tokens), eot) == expected
    val_text = [d.text for d in docs if d.val]
    assert data.tokens.val_bytes == sum(len(t.encode()) for t in val_text) and val_text


def test_shards_are_llm_c_files_cut_at_the_shard_size(prepared) -> None:
    folder = prepared[1].tokens.folder
    index = json.loads((folder / "index.json").read_text())
    shards = index["splits"]["train"]["shards"]
    assert [s["tokens"] for s in shards[:-1]] == [1000] * (len(shards) - 1) and 0 < shards[-1]["tokens"] <= 1000
    raw = (folder / shards[0]["name"]).read_bytes()
    head = np.frombuffer(raw[:HEADER_BYTES], np.int32)
    assert head[:3].tolist() == [20240520, 1, 1000] and not head[3:].any() and len(raw) == HEADER_BYTES + 2000
    assert index["encoder"] == TIKTOKEN  # its ids were checked against the tokenizer's own


@pytest.mark.parametrize("form", ["gzip", "parquet", "text"])
def test_gzip_parquet_and_text_sources_read_back_to_their_ids(form, corpus, prepared, tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, texts = corpus
    tokenizer = prepared[1].tokenizer
    texts = texts[:120]
    if form == "gzip":
        path = tmp_path / "c.jsonl.gz"
        path.write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode()))
        names = [f"c.jsonl.gz#{i}" for i in range(len(texts))]
    elif form == "parquet":
        path = tmp_path / "c.parquet"
        pq.write_table(pa.table({"text": texts}), path, row_group_size=50)
        names = [f"c.parquet#{i}" for i in range(len(texts))]
    else:
        path = tmp_path / "texts"
        path.mkdir()
        names = [f"t{i:03d}.txt" for i in range(len(texts))]
        for name, text in zip(names, texts):
            (path / name).write_text(text, encoding="utf-8")
    own = tmp_path / "run"
    tokenizer.save(own / "tokenizer.json")  # the run's own tokenizer, as on resume
    data = prepare_data(config(path), own, cache_dir=tmp_path / "cache")
    for split in ("train", "val"):
        expected = [tokenizer.encode(t).tolist() for t, name in zip(texts, names)
                    if in_val_split(name, 0.1) == (split == "val")]
        assert split_at_eot(np.asarray(getattr(data.tokens, split)), tokenizer.eot_id) == expected


def write_shard(path: Path, ids: np.ndarray) -> None:
    writer = ShardWriter(path, np.dtype(np.uint16))
    writer.write(ids)
    writer.finish()


def test_a_folder_of_llm_c_shards_is_a_source_as_it_is(prepared, tmp_path) -> None:
    tokenizer = prepared[1].tokenizer
    tokenizer.save(tmp_path / "tokenizer.json")
    shards = tmp_path / "fineweb"
    shards.mkdir()
    rng = np.random.default_rng(0)
    parts = {name: rng.integers(0, tokenizer.vocab_size, size, dtype=np.uint16)
             for name, size in (("fineweb_val_000000.bin", 300), ("fineweb_train_000001.bin", 500),
                                ("fineweb_train_000002.bin", 400))}
    for name, ids in parts.items():
        write_shard(shards / name, ids)
    cfg = config(shards, f"data.tokenizer={json.dumps(str(tmp_path / 'tokenizer.json'))}")
    data = prepare_data(cfg, cache_dir=tmp_path / "cache")
    np.testing.assert_array_equal(np.asarray(data.tokens.val), parts["fineweb_val_000000.bin"])
    np.testing.assert_array_equal(np.asarray(data.tokens.train), np.concatenate(
        [parts["fineweb_train_000001.bin"], parts["fineweb_train_000002.bin"]]))
    lengths = [len(tokenizer.token_bytes(i)) for i in parts["fineweb_val_000000.bin"].tolist()
               if i != tokenizer.eot_id]
    assert data.tokens.val_bytes == sum(lengths)
    again = prepare_data(cfg, cache_dir=tmp_path / "cache")  # worked out once, then found by the listing
    assert again.tokens.fingerprint == data.tokens.fingerprint
    # a jaxgpt store is such a folder too
    store = prepare_data(config(shards.parent / "fineweb", f"data.tokenizer={json.dumps(str(tmp_path / 'tokenizer.json'))}"),
                         cache_dir=tmp_path / "cache").tokens
    own = prepare_data(config(prepared[1].tokens.folder, f"data.tokenizer={json.dumps(str(tmp_path / 'tokenizer.json'))}"),
                       cache_dir=tmp_path / "cache2").tokens
    assert own.fingerprint == prepared[1].tokens.fingerprint and store.fingerprint == data.tokens.fingerprint


def test_a_start_with_the_store_present_reads_no_text(prepared, corpus, monkeypatch) -> None:
    folder, _ = corpus
    cache = prepared[2].tokens.folder.parent.parent
    monkeypatch.setattr(sources.Files, "documents", lambda self: pytest.fail("the text was read"))
    again = prepare_data(config(folder), cache_dir=cache)
    assert again.tokens.folder == prepared[2].tokens.folder
    assert again.tokenizer.fingerprint == prepared[2].tokenizer.fingerprint


def test_a_changed_source_file_is_named_and_prepared_again(corpus, tmp_path, capsys) -> None:
    folder, texts = corpus
    copy = tmp_path / "copy"
    write_jsonl_corpus(copy)
    first = prepare_data(config(copy), cache_dir=tmp_path / "cache")
    capsys.readouterr()
    with open(copy / "part2.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    second = prepare_data(config(copy), cache_dir=tmp_path / "cache")
    err = capsys.readouterr().err
    assert "changed since it was last prepared: part2.jsonl (size " in err
    assert second.tokens.fingerprint != first.tokens.fingerprint
    assert not first.tokens.folder.exists()  # the stale store is gone


def test_a_source_that_changes_during_preparation_is_one_error_and_leaves_no_store(corpus, tmp_path,
                                                                                  monkeypatch) -> None:
    """Bad input removes the shard being written (and the folder where no finished shard is left),
    never a finished shard; the store is not complete, so nothing reads it."""
    copy = tmp_path / "copy"
    write_jsonl_corpus(copy)
    real = sources.Files.documents

    def changing(self):
        for number, doc in enumerate(real(self)):
            if number == 1:
                with open(copy / "part3.jsonl", "a") as f:
                    f.write(json.dumps({"text": "late"}) + "\n")
            yield doc

    monkeypatch.setattr(sources.Files, "documents", changing)
    with pytest.raises(ValueError, match=r"changed while it was being prepared: part3\.jsonl \(size"):
        prepare_data(config(copy), cache_dir=tmp_path / "cache")
    for folder in (tmp_path / "cache" / "stores").iterdir():
        assert not (folder / "index.json").exists() and not list(folder.glob("*.partial"))
        assert list(folder.glob("train_*.bin"))  # the finished shards stay


def write_bad(kind: str, folder: Path, prepared) -> str:
    """A source of the bad `kind`; its config overrides."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    sets = []
    if kind == "a JSONL line without the field":
        (folder / "a.jsonl").write_text('{"text": "fine"}\n' * 50 + '{"body": "no text"}\n')
    elif kind == "a Parquet file without the column":
        pq.write_table(pa.table({"body": ["x", "y"]}), folder / "a.parquet")
    else:
        prepared[1].tokenizer.save(folder.parent / "tokenizer.json")
        sets = [f"--set=data.tokenizer={json.dumps(str(folder.parent / 'tokenizer.json'))}"]
        write_shard(folder / "x_val.bin", np.arange(50, dtype=np.uint16))
        write_shard(folder / "x_train.bin", np.arange(500, dtype=np.uint16))
        raw = bytearray((folder / "x_train.bin").read_bytes())
        if kind == "a shard with a wrong magic":
            raw[:4] = np.int32(20240521).tobytes()
        else:  # a truncated body
            raw = raw[:-10]
        (folder / "x_train.bin").write_bytes(bytes(raw))
    return sets


BAD = {"a JSONL line without the field": r"a\.jsonl:51 has no 'text' field \(it has: body\)",
       "a Parquet file without the column": r"a\.parquet has no 'text' column \(columns: body\)",
       "a shard with a wrong magic": r"x_train\.bin is not an llm\.c token shard: magic 20240521",
       "a truncated body": r"x_train\.bin is truncated or damaged: its header says 500 tokens \(2,024 bytes\), "
                           r"the file has 2,014 bytes"}


@pytest.mark.parametrize("kind", BAD)
def test_bad_input_is_one_line_exit_2_and_nothing_half_written(kind, prepared, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("JAXGPT_CACHE", str(tmp_path / "cache"))
    sets = write_bad(kind, tmp_path / "src", prepared)
    code = main(["prepare", "--data", str(tmp_path / "src"), "--set", "model.vocab_size=300", *sets])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("jaxgpt prepare: error: ")
    import re
    assert re.search(BAD[kind], err[0]), err[0]
    stores = tmp_path / "cache" / "stores"
    assert not stores.exists() or not list(stores.iterdir())


def prepare_command(source: Path, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jaxgpt", "prepare", "--no-progress", "--data", str(source), "--set",
            "model.vocab_size=300", "--set", "data.shard_tokens=20000", *extra]


@pytest.fixture(scope="module")
def big(prepared, tmp_path_factory):
    """A corpus of 8 JSONL files that two workers take seconds to prepare, its tokenizer fixed, and
    its store prepared once, undisturbed: (corpus, command options, environment, reference folder)."""
    tmp_path = tmp_path_factory.mktemp("big")
    corpus = tmp_path / "big"
    corpus.mkdir()
    texts = documents(24000, seed=1)
    for f in range(8):
        (corpus / f"p{f}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[f::8]))
    prepared[1].tokenizer.save(tmp_path / "tokenizer.json")
    sets = ["--set", f"data.tokenizer={json.dumps(str(tmp_path / 'tokenizer.json'))}", "--workers", "2"]
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    reference = subprocess.run(prepare_command(corpus, tmp_path / "ref", *sets), cwd=ROOT, capture_output=True,
                               text=True, env={**env, "JAXGPT_CACHE": str(tmp_path / "ref")}, timeout=600)
    assert reference.returncode == 0, reference.stderr
    return corpus, sets, env, Path(json.loads(reference.stdout)["store"])


def _started_killed_and_resumed(big, cache: Path, kill) -> subprocess.CompletedProcess:
    """A preparation into `cache`, `kill(process)` once its first train shard is finished; then
    checks that a rerun ends with the reference's bytes. The stopped run's outcome."""
    corpus, sets, env, ref_folder = big
    killed_env = {**env, "JAXGPT_CACHE": str(cache)}
    process = subprocess.Popen(prepare_command(corpus, cache, *sets), cwd=ROOT, env=killed_env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def progress() -> dict | None:
        found = list(cache.glob("stores/*/progress.json"))
        try:
            return json.loads(found[0].read_text()) if found else None
        except ValueError:  # read while it was replaced
            return None

    while (state := progress()) is None or not state["splits"]["train"]["shards"]:
        assert process.poll() is None, process.communicate()
        time.sleep(0.005)
    kill(process)
    out, err = process.communicate(timeout=120)
    folder = cache / "stores" / ref_folder.name
    assert not (folder / "index.json").exists(), "the preparation ended before it was stopped"
    assert (folder / state["splits"]["train"]["shards"][0]["name"]).exists()  # what was finished stays
    again = subprocess.run(prepare_command(corpus, cache, *sets), cwd=ROOT, capture_output=True, text=True,
                           env=killed_env, timeout=600)
    assert again.returncode == 0, again.stderr
    assert store_bytes(folder) == store_bytes(ref_folder)
    assert json.loads((folder / "index.json").read_text()) == json.loads((ref_folder / "index.json").read_text())
    assert not list(folder.glob("*.partial")) and not (folder / "progress.json").exists()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def test_a_preparation_killed_mid_way_continues_to_the_same_bytes(big, tmp_path) -> None:
    def kill(process):
        process.kill()

    _started_killed_and_resumed(big, tmp_path / "killed", kill)


def test_a_killed_encoding_worker_is_one_line_exit_1_and_the_rerun_continues(big, tmp_path) -> None:
    def kill_a_worker(process):
        workers = subprocess.run(["pgrep", "-P", str(process.pid), "-f", "jaxgpt.data.encoding"], capture_output=True,
                                 text=True).stdout.split()
        assert workers, "no encoding worker found"
        os.kill(int(workers[0]), signal.SIGKILL)  # as the kernel's OOM killer does

    stopped = _started_killed_and_resumed(big, tmp_path / "cache", kill_a_worker)
    assert stopped.returncode == 1
    lines = stopped.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(
        r"jaxgpt prepare: error: encoding worker \d was killed by SIGKILL; what was prepared is kept: run the "
        r"command again to continue", lines[0]), stopped.stderr


def test_two_processes_preparing_one_store_take_turns_and_read_the_same_bytes(big, tmp_path) -> None:
    corpus, sets, env, ref_folder = big
    cache = tmp_path / "shared"
    shared_env = {**env, "JAXGPT_CACHE": str(cache)}
    both = [subprocess.Popen(prepare_command(corpus, cache, *sets), cwd=ROOT, env=shared_env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.communicate(timeout=600), p.returncode) for p in both]
    assert [code for _, code in results] == [0, 0], [err for (_, err), _ in results]
    records = [json.loads(out) for (out, _), _ in results]
    assert records[0]["data_sha256"] == records[1]["data_sha256"] and records[0]["store"] == records[1]["store"]
    waited = [err for (_, err), _ in results if "note: waiting for process " in err]
    assert len(waited) == 1 and "which is preparing the token store" in waited[0]
    assert store_bytes(Path(records[0]["store"])) == store_bytes(ref_folder)


def test_sigint_stops_a_preparation_in_one_line_and_a_rerun_finishes_it(prepared, corpus, tmp_path,
                                                                       monkeypatch, capsys) -> None:
    from jaxgpt.process import signals

    folder, _ = corpus
    monkeypatch.setenv("JAXGPT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prepare_module, "TASK_BYTES", 200)  # many tasks
    real = prepare_module._tasks

    def interrupted(*args):
        for number, task in enumerate(real(*args)):
            if number == 5:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler runs between two bytecodes of the main thread
            yield task

    monkeypatch.setattr(prepare_module, "_tasks", interrupted)
    args = ["prepare", "--data", str(folder), "--set", "model.vocab_size=300", "--set", "data.shard_tokens=1000"]
    assert main(args) == 130
    err = capsys.readouterr().err.splitlines()
    assert err == ["jaxgpt prepare: stopped by SIGINT while preparing the token store (run the command again "
                   "to continue it)"]
    store = next((tmp_path / "cache" / "stores").iterdir())
    assert (store / "progress.json").is_file() and not (store / "index.json").exists()
    monkeypatch.setattr(prepare_module, "_tasks", real)
    assert signals.received() is None
    assert main(args) == 0
    assert store_bytes(store) == store_bytes(prepared[1].tokens.folder)


def test_the_tokenizer_sample_is_bounded_and_deterministic(corpus) -> None:
    from jaxgpt.data.tokenizer_cache import sample_texts

    folder, texts = corpus
    source = open_source(str(folder), 0.1)
    sample = list(sample_texts(source, 2000))
    assert sample == list(sample_texts(source, 2000))
    train = [d.text for d in source.documents() if not d.val]
    assert set(sample) <= set(train)
    # at most the budget (and the document that crosses it); the rate fills it from the files' size,
    # which counts the JSON around the text too
    assert 1000 <= sum(len(t.encode()) for t in sample) < 2000 + max(len(t.encode()) for t in train)
    assert sample != train[:len(sample)]  # spread over the corpus, not its beginning
    assert list(sample_texts(source, 10 ** 9)) == train


def test_slow_stages_say_what_they_do_with_a_progress_bar(corpus, tmp_path, monkeypatch, capsys) -> None:
    folder, _ = corpus
    prepare_data(config(folder), cache_dir=tmp_path / "small")
    assert capsys.readouterr().err == ""  # a small corpus is ready at once: nothing to announce
    monkeypatch.setattr(prepare_module, "LARGE_SOURCE_BYTES", 1000)
    prepare_data(config(folder), cache_dir=tmp_path / "large", workers=1)
    err = capsys.readouterr().err
    assert "building the bpe tokenizer (300 tokens) from a sample of at most 64 MB of " in err
    assert "preparing the token store in " in err and "(1 worker, tiktoken)" in err
    assert "preparing: 100%" in err
    prepare_data(config(folder), cache_dir=tmp_path / "large")
    assert capsys.readouterr().err == ""  # found in the cache: nothing to announce
    prepare_data(config(folder), cache_dir=tmp_path / "quiet", workers=1, progress=False)  # --no-progress
    err = capsys.readouterr().err
    assert "building the bpe tokenizer" in err and "preparing the token store in " in err and "preparing:" not in err


def test_a_tokenizer_that_tiktoken_differs_from_falls_back_with_one_line(corpus, prepared, tmp_path,
                                                                        monkeypatch, capsys) -> None:
    from jaxgpt.data import encoding

    folder, _ = corpus
    real = encoding.Encoder.ids

    def off_by_one(self, texts):  # a tiktoken form that gives other ids
        ids = real(self, texts)
        return [[i + 1 for i in row] for row in ids] if self.kind == TIKTOKEN else ids

    monkeypatch.setattr(encoding.Encoder, "ids", off_by_one)
    data = prepare_data(config(folder), cache_dir=tmp_path / "cache")
    err = capsys.readouterr().err.splitlines()
    assert err == ["note: tiktoken's ids differ from the tokenizer's on document 0; encoding with Hugging Face "
                   "tokenizers"]
    assert json.loads((data.tokens.folder / "index.json").read_text())["encoder"] == HF
    assert store_bytes(data.tokens.folder) == store_bytes(prepared[1].tokens.folder)


class Killed(BaseException):
    """Stands for the process dying: nothing of the preparation catches it."""


@pytest.mark.parametrize("then", ["continue", "lose the shard being written"])
def test_a_preparation_that_dies_between_a_shard_and_its_ledger_ends_the_same(then, prepared, corpus, tmp_path,
                                                                            monkeypatch) -> None:
    folder, _ = corpus
    cache = tmp_path / "cache"
    real, finished = prepare_module._Split._finish_shard, []

    def dying(self):
        real(self)
        finished.append(self.writer.path.name)
        if len(finished) == 4:  # a shard is done; the ledger written after the task is not
            raise Killed

    monkeypatch.setattr(prepare_module, "TASK_BYTES", 3000)
    monkeypatch.setattr(prepare_module._Split, "_finish_shard", dying)
    with pytest.raises(Killed):
        prepare_data(config(folder), cache_dir=cache, workers=1)
    store = next((cache / "stores").iterdir())
    ledger = json.loads((store / "progress.json").read_text())
    assert finished[-1] not in [s["name"] for s in ledger["splits"]["train"]["shards"]]
    assert (store / finished[-1]).exists()  # finished on disk, not in the ledger
    if then == "lose the shard being written":  # the ledger counts on it: the preparation starts over
        for partial in [*store.glob("*.partial"), store / finished[-1]]:
            partial.unlink()
    monkeypatch.setattr(prepare_module._Split, "_finish_shard", real)
    from jaxgpt.data import encoding

    encode, encoded = encoding.Encoder.encode, []
    monkeypatch.setattr(encoding.Encoder, "encode",
                        lambda self, texts, *a: encoded.extend(texts) or encode(self, texts, *a))
    again = prepare_data(config(folder), cache_dir=cache, workers=1)
    assert store_bytes(again.tokens.folder) == store_bytes(prepared[1].tokens.folder)
    assert not list(store.glob("*.partial")) and not (store / "progress.json").exists()
    documents = sum(1 for _ in open_source(str(folder), 0.1).documents())
    if then == "continue":  # from the ledger's document on, not from the start
        assert len(encoded) == documents - ledger["documents"] and ledger["documents"] > 0
    else:
        assert len(encoded) == documents
