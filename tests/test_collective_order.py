"""Multi-device programs are never queued in bursts: XLA:CPU deadlocks a collective once more than
32 programs wait per device (`jaxgpt.process.dispatch`; scripts/xla_cpu_burst.py shows it in plain
JAX). A long eval over a mesh, in pmap and sharded runs alike, finishes; every loop that dispatches
back to back keeps a few programs in flight; pmap's unreplicate runs on one device."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import xla_flags
from test_train import write_corpus

from jaxgpt.data import batches
from jaxgpt.process import dispatch
from jaxgpt.train import sharding

ROOT = Path(__file__).resolve().parents[1]


def test_unreplicate_reads_the_first_copy_on_one_device():
    replicated = sharding.replicate({"w": np.arange(6.0).reshape(2, 3), "n": np.int32(5)})
    assert len(replicated["w"].sharding.device_set) == jax.local_device_count() > 1
    back = sharding.unreplicate(replicated)
    assert back["w"].sharding.device_set == back["n"].sharding.device_set == {jax.local_devices()[0]}
    np.testing.assert_array_equal(back["w"], np.arange(6.0).reshape(2, 3))
    assert int(back["n"]) == 5


def test_in_flight_waits_for_the_oldest_beyond_its_limit(waits):
    window = dispatch.InFlight(limit=3)
    results = [window.add(jnp.full((2,), float(i))) for i in range(10)]
    assert waits == [id(r) for r in results[:7]]
    with pytest.raises(ValueError, match="limit must be >= 1"):
        dispatch.InFlight(limit=0)


def test_evaluate_keeps_a_few_batches_in_flight(waits, monkeypatch):
    monkeypatch.setattr(batches, "val_batch", lambda cfg, data, i, seed: i)
    monkeypatch.setattr(batches, "eval_summary", lambda losses, data: {"losses": losses.tolist()})
    sent, waited_before = [], []

    def batch_loss(i):
        waited_before.append(len(waits))
        sent.append(jnp.float32(i))
        return sent[-1]

    cfg = type("Cfg", (), {"train": type("Train", (), {"eval_batches": 12, "seed": 0})})()
    assert batches.evaluate(batch_loss, cfg, None) == {"losses": [float(i) for i in range(12)]}
    limit = dispatch.IN_FLIGHT
    # When batch i is sent, every batch up to i - limit - 1 has finished: never more than `limit` pending.
    assert waited_before == [max(0, i - limit) for i in range(12)]
    assert waits == [id(r) for r in sent[:12 - limit]]


def two_cores() -> None:
    """The child runs on two of the machine's cores: XLA:CPU's pool for 8 devices is then 8
    threads, as on the small machines where a burst deadlocks (on more cores its pool is larger,
    and a burst with no window would pass)."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])


def test_a_long_eval_on_a_mesh_finishes_in_pmap_and_sharded_runs(tmp_path):
    """160 eval batches over 8 devices, on two cores: a burst that deadlocks both modes without the
    window (from about 120 batches on), aborting in XLA's rendezvous (10 s here instead of 40)."""
    corpus = write_corpus(tmp_path / "corpus.txt")
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{xla_flags(8)} --xla_cpu_collective_call_terminate_timeout_seconds=10"}
    sets = ["train.steps=2", "train.eval_every=2", "train.eval_batches=160", "model.context_length=32",
            "model.d_model=32", "model.n_heads=4", "train.batch_size=8", "data.tokenizer=char",
            "model.vocab_size=64", "train.sample_tokens=0"]
    runs = {mode: subprocess.Popen(
        [sys.executable, "-m", "jaxgpt", "train", "--out", str(tmp_path / mode), "--no-progress", "--data", str(corpus),
         *[a for s in [*sets, f"train.parallel={mode}"] for a in ("--set", s)]],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=two_cores)
        for mode in ("pmap", "sharded")}
    for mode, process in runs.items():
        _, err = process.communicate(timeout=600)
        assert "rendezvous" not in err and process.returncode == 0, (mode, err[-3000:])
        assert f"{mode} on 8 device(s)" in err and "step 2: val loss" in err
