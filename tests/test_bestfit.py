"""data.align = "bestfit": nanochat's rows (each opens at a document, documents placed best-fit,
one cropped only where none fits), equal to a rebuild of its dataloader written here, a function
of the step alone; and the nanochat data it reads: stores whose documents open with `<|bos|>`,
and folders of its Parquet shards, whose last shard is the validation split."""

import numpy as np
import pytest
from nanochat_files import train_encoding, write_tokenizer

from jaxgpt.config import load_config
from jaxgpt.data import batches
from jaxgpt.data.batches import RunData, train_batch, val_batch
from jaxgpt.data.bestfit import RowPlan
from jaxgpt.data.from_config import prepare_data
from jaxgpt.data.store import Tokens, TokenSplits
from jaxgpt.errors import UserError

BOS = 63
MODEL = ["model.vocab_size=64", "model.context_length=16", "model.d_model=32", "model.n_heads=4"]


def nanochat_rows(documents: list[list[int]], window: int, rows: int, buffer: int = 1000,
                  refill: int = 128) -> list[list[int]]:
    """What nanochat's BOS best-fit loader computes: a buffer topped up `refill` documents at a
    time (the documents again from the first after the last) while it holds fewer than `buffer`;
    for each row, while it has room, the longest buffered document that fits whole (a scan in
    buffer order keeping the first of the longest), else the shortest (the first of the
    shortest) cropped to the room."""
    pending, taken, out = [], 0, []
    while len(out) < rows:
        row = []
        while len(row) < window:
            while len(pending) < buffer:
                batch = documents[taken:taken + refill]
                pending += batch
                taken = (taken + len(batch)) % len(documents)
            room, best, best_len = window - len(row), -1, 0
            for i, doc in enumerate(pending):
                if best_len < len(doc) <= room:
                    best, best_len = i, len(doc)
            if best >= 0:
                row += pending.pop(best)
            else:
                shortest = min(range(len(pending)), key=lambda i: len(pending[i]))
                row += pending.pop(shortest)[:room]
        out.append(row)
    return out


def _stream(n_docs: int, longest: int, seed: int) -> tuple[np.ndarray, list[list[int]]]:
    rng = np.random.default_rng(seed)
    docs = [[BOS, *rng.integers(0, BOS, rng.integers(0, longest)).tolist()] for _ in range(n_docs)]
    return np.concatenate(docs).astype(np.uint16), docs


@pytest.mark.parametrize("n_docs", [300, 1500])  # fewer than the buffer holds, and more
def test_rows_are_those_of_nanochats_loader(n_docs):
    stream, docs = _stream(n_docs, 60, n_docs)
    window, rows = 33, 700  # past one pass over the documents: the second epoch follows the first
    plan = RowPlan(batches.document_starts(stream, BOS), len(stream), window)
    want = np.array(nanochat_rows(docs, window, rows))
    np.testing.assert_array_equal(plan.rows(stream, 0, rows), want)
    assert plan._arrivals > 2 * len(docs) if n_docs < 1000 else plan._arrivals > len(docs)  # it wrapped
    np.testing.assert_array_equal(plan.rows(Tokens([stream[:999], stream[999:]]), 650, 50), want[650:])
    starts, lengths = plan.pieces(3)
    assert lengths.sum() == window and all(stream[s] == BOS for s in starts)


class _Tokenizer:
    document_token = BOS


def _data() -> RunData:
    train, _ = _stream(400, 40, 1)
    val, _ = _stream(100, 40, 2)
    return RunData(_Tokenizer(), TokenSplits(train=Tokens([train]), val=Tokens([val]), fingerprint="",
                                             val_bytes=len(val)))


def test_a_best_fit_batch_is_its_rows_in_order_whatever_the_seed_process_or_history(monkeypatch):
    cfg = load_config(None, [*MODEL, "data.align=bestfit", "data.document_mask=true", "train.batch_size=4"])
    walked, fresh = _data(), _data()
    for step in range(6):
        train_batch(cfg, walked, step, seed=0, whole=True)
    batch = train_batch(cfg, fresh, 6, seed=9, whole=True)  # a resumed run's first batch, another seed
    np.testing.assert_array_equal(batch, train_batch(cfg, walked, 6, seed=0, whole=True))
    plan = fresh.tokens.train.row_plans[BOS, 17]
    np.testing.assert_array_equal(batch[:, :17], plan.rows(fresh.tokens.train, 24, 4))
    assert (batch[:, 0] == BOS).all()
    np.testing.assert_array_equal(batch[:, 17:], np.cumsum(batch[:, :16] == BOS, axis=1))
    alone, second_of_two = {"process_index": 0, "process_count": 1}, {"process_index": 1, "process_count": 2}
    monkeypatch.setattr(batches, "_process_slice", lambda whole=False: alone if whole else second_of_two)
    np.testing.assert_array_equal(train_batch(cfg, fresh, 6, seed=0), batch[2:])
    val = val_batch(cfg, fresh, 1, seed=5, whole=True)
    np.testing.assert_array_equal(val[:, :17], RowPlan(batches.document_starts(fresh.tokens.val, BOS),
                                                       len(fresh.tokens.val), 17).rows(fresh.tokens.val, 4, 4))


def test_nanochats_shards_hold_out_the_last_and_every_document_opens_with_bos(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"Document {i}: " + "more words, " * (i % 13) + "the end." for i in range(90)]
    encoding = train_encoding(" ".join(texts), 40)
    pickle = write_tokenizer(tmp_path / "tokenizer", encoding)
    shards = tmp_path / "base_data"
    shards.mkdir()
    for i in range(3):
        pq.write_table(pa.table({"text": texts[i * 30:(i + 1) * 30]}), shards / f"shard_{i:05d}.parquet",
                       row_group_size=8)
    (shards / "shard_00003.parquet.tmp").write_bytes(b"a download in progress")
    cfg = load_config(None, [f"data.source={shards}", f"data.tokenizer={pickle}", "model.context_length=16",
                             "model.vocab_size=320", "model.d_model=32", "model.n_heads=4"])
    data = prepare_data(cfg, cache_dir=tmp_path / "cache", progress=False)
    bos = encoding.encode_single_token("<|bos|>")
    framed = lambda part: [t for text in part for t in [bos, *encoding.encode_ordinary(text)]]  # noqa: E731
    assert np.asarray(data.tokens.train).tolist() == framed(texts[:60])
    assert np.asarray(data.tokens.val).tolist() == framed(texts[60:])
    assert data.tokenizer.document_token == bos and data.tokenizer.eot_id is None
    (shards / "shard_00001.parquet").unlink()
    (shards / "shard_00002.parquet").unlink()
    with pytest.raises(UserError, match="holds one nanochat shard: its last shard is the validation split"):
        prepare_data(cfg, cache_dir=tmp_path / "cache", progress=False)
