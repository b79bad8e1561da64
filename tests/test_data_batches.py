"""Batches: a pure function of (seed, stream, step), each process's rows a slice of the global
batch, windows read across shard boundaries as from one array."""

import numpy as np
import pytest

from jaxgpt.data import get_batch
from jaxgpt.data.batches import _checked
from jaxgpt.data.shards import ShardWriter, open_shard
from jaxgpt.data.store import Tokens

TOKENS = np.arange(1000, dtype=np.uint16)


def batch(tokens=TOKENS, **overrides) -> np.ndarray:
    kwargs = dict(seed=0, step=0, batch_size=8, window=17) | overrides
    return get_batch(tokens, **kwargs)


def sharded(tmp_path, sizes=(333, 1, 250, 416)) -> Tokens:
    """TOKENS written as llm.c shards of `sizes`, memory-mapped back."""
    shards, start = [], 0
    for i, size in enumerate(sizes):
        writer = ShardWriter(tmp_path / f"train_{i:06d}.bin", np.dtype(np.uint16))
        writer.write(TOKENS[start:start + size])
        writer.finish()
        shards.append(open_shard(tmp_path / f"train_{i:06d}.bin"))
        start += size
    assert start == len(TOKENS)
    return Tokens(shards)


def test_a_batch_is_a_pure_function_of_seed_stream_step() -> None:
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


def test_windows_across_shards_equal_those_of_one_array(tmp_path) -> None:
    tokens = sharded(tmp_path)
    assert len(tokens) == len(TOKENS)
    for step in range(20):  # 64 windows a step: many cross a boundary
        np.testing.assert_array_equal(batch(tokens, step=step, batch_size=64), batch(step=step, batch_size=64))
    np.testing.assert_array_equal(tokens[330:340], TOKENS[330:340])
    np.testing.assert_array_equal(np.asarray(tokens), TOKENS)
    with pytest.raises(TypeError, match="contiguous slices"):
        tokens[::2]


def test_process_slices_are_disjoint_and_together_the_global_batch(tmp_path) -> None:
    tokens = sharded(tmp_path)
    whole = batch(tokens, step=7)
    parts = [batch(tokens, step=7, process_index=i, process_count=4) for i in range(4)]
    # each process reads its own quarter of the rows, in order: none is read twice, none is missed
    assert [p.shape for p in parts] == [(2, 17)] * 4
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_batch_errors() -> None:
    with pytest.raises(ValueError, match="the train split has 10 tokens, fewer than one window of 17"):
        get_batch(TOKENS[:10], seed=0, step=0, batch_size=8, window=17)
    with pytest.raises(ValueError, match="the val split has 10 tokens"):
        get_batch(TOKENS[:10], seed=0, step=0, batch_size=8, window=17, split="val")
    with pytest.raises(ValueError, match="not divisible by process count 3"):
        batch(process_count=3)


def test_an_id_outside_the_model_vocabulary_is_refused() -> None:
    assert _checked(np.array([[1, 299]]), 300, "train").shape == (1, 2)
    with pytest.raises(ValueError, match="token id 300, outside model.vocab_size = 300"):
        _checked(np.array([[1, 300]]), 300, "train")
