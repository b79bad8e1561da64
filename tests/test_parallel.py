"""Multi-device training on 8 fake CPU devices: sharded (data, data x fsdp) and pmap steps give
the one-device numbers; fsdp splits the state; bad meshes are refused; AOT compile runs nothing."""

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest
from conftest import SPEEDRUN, with_stand_in_prefixes

from jaxgpt.config import RunConfig, load_config
from jaxgpt.data import get_batch
from jaxgpt.process import distributed
from jaxgpt.train import sharding
from jaxgpt.train.step import batch_width, init_state, train_step, window_length

# adam_eps = 1e-4 rather than 1e-8: Adam's first update is lr * g / (|g| + eps), whose slope at
# g = 0 is lr / eps. With eps = 1e-8 the rounding of a different summation order in the few
# gradients below eps (some q/k weights at init have |g| ~ 1e-11) moves params by ~1e-6, which
# is Adam amplifying rounding noise, not a sharding error. A larger eps keeps the update a smooth
# function of the gradient, so comparing params checks the gradients and the update.
TINY = ["model.vocab_size=64", "model.context_length=16", "model.d_model=32", "model.n_layers=2",
        "model.n_heads=4", "train.steps=20", "train.warmup_steps=2", "train.batch_size=16",
        "train.adam_eps=1e-4"]
CONFIGS = {
    "day1": TINY,
    "modern": [*TINY, "model.position=rope", "model.norm=rmsnorm", "model.feed_forward=swiglu",
               "model.kv_heads=2", "model.tie_embeddings=false", "train.grad_accum=2"],
    "speedrun": [*TINY, *SPEEDRUN],
}
# Steps each config's modes take before they are compared. The speedrun block's zero-initialised
# projections and head pass no gradient back on the first step (only the head moves), and on the
# second its blocks still add nothing to the stream, which the final RMS norm makes the loss blind
# to the scale of: the x0 mixes' gradients are rounding alone. From the third every leaf learns.
STEPS = {"speedrun": 3}
# Muon's Newton-Schulz iteration lifts the update's small singular values to about 1, and with them
# the rounding of their directions: its matrices, moved by muon_lr = 0.02 a step, differ between
# the modes by up to 1.9e-7 (1e-5 of a step) after three steps; on AdamW the same model's stay
# within the other configs' 1e-7 (and 1e-5 relative).
PARAMS_ATOL = {"speedrun": 5e-7}
# a random 50-token phrase repeated: learnable within a few steps, so the loss curves move
TOKENS = np.tile(np.random.default_rng(0).integers(0, 64, size=50), 80).astype(np.uint16)


def with_fsdp(cfg: RunConfig, fsdp: int) -> RunConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fsdp=fsdp))


def batch_at(cfg: RunConfig, step: int) -> np.ndarray:
    return with_stand_in_prefixes(get_batch(TOKENS, seed=1, step=step, batch_size=cfg.train.batch_size,
                                            window=window_length(cfg.model)),
                                  cfg.model.context_length, cfg.train.prefix_token_weight)


# XLA's CPU backend compiles ~3x faster without LLVM optimisation; the partitioning (what these
# tests are about) is the same, and every mode, the reference included, is compiled alike.
FAST = {"xla_backend_optimization_level": 0}


def with_shardings(tree, shardings):
    return jax.tree_util.tree_map(
        lambda leaf, sh: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sh), tree, shardings)


@functools.lru_cache(maxsize=None)
def runners(name: str):
    """name -> (cfg, {mode: (place(host_state) -> state, step(state, host_batch) -> (state, metrics),
    to_host(state) -> host_state)}); compiled once per config and shared by the tests."""
    cfg = load_config(None, CONFIGS[name])
    shapes = sharding.state_shapes(cfg)
    B, W = cfg.train.batch_size, batch_width(cfg)
    single = jax.jit(functools.partial(train_step, cfg)).lower(
        shapes, jax.ShapeDtypeStruct((B, W), np.int32)).compile(FAST)
    out = {"single": (jax.device_put, single, jax.device_get)}
    for mode, fsdp in (("data8", 1), ("data2_fsdp4", 4)):
        sharded_cfg = with_fsdp(cfg, fsdp)
        mesh = sharding.make_mesh(sharded_cfg.train)
        shardings = sharding.state_shardings(mesh, shapes, fsdp)
        batch = jax.ShapeDtypeStruct((B, W), np.int32, sharding=sharding.batch_sharding(mesh))
        step = sharding.sharded_train_step(sharded_cfg, mesh, shardings).lower(
            with_shardings(shapes, shardings), batch).compile(FAST)
        out[mode] = (lambda host, sh=shardings: jax.device_put(host, sh),
                     lambda s, b, step=step, mesh=mesh: step(s, sharding.shard_batch(b, mesh)),
                     jax.device_get)
    n = jax.local_device_count()
    pmap_step = sharding.pmap_train_step(cfg).lower(
        jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype), shapes),
        jax.ShapeDtypeStruct((n, B // n, W), np.int32)).compile(FAST)
    out["pmap"] = (sharding.replicate,
                   lambda s, b: pmap_step(s, sharding.shard_for_pmap(b)),
                   lambda s: jax.device_get(sharding.unreplicate(s)))
    return cfg, out


@functools.lru_cache(maxsize=None)
def host_state(cfg: RunConfig):
    return jax.device_get(jax.jit(functools.partial(init_state, cfg))(jax.random.key(3)))


def max_abs_diff(a, b) -> float:
    diffs = jax.tree_util.tree_map(lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))), a, b)
    return max(jax.tree_util.tree_leaves(diffs))


def moments_as_gradients(opt_state):
    """The optimiser state with every second moment (optax's `nu`) replaced by its square root."""
    def leaf(path, x):
        x = np.asarray(x)
        return np.sqrt(x) if any(getattr(key, "name", None) == "nu" for key in path) else x
    return jax.tree_util.tree_map_with_path(leaf, opt_state)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_one_step_matches_one_device_in_every_mode(name):
    assert jax.device_count() == 8
    cfg, modes = runners(name)
    start = host_state(cfg)
    steps, results = STEPS.get(name, 1), {}
    for mode, (place, step, to_host) in modes.items():
        state = place(start)
        for i in range(steps):
            state, metrics = step(state, batch_at(cfg, i))
        results[mode] = (to_host(state), {k: float(np.asarray(v).reshape(-1)[0]) for k, v in metrics.items()})
    ref_state, ref_metrics = results.pop("single")
    for mode, (state, metrics) in results.items():
        print(f"{name} {mode}: loss rel {rel(metrics['loss'], ref_metrics['loss']):.1e}, "
              f"grad_norm rel {rel(metrics['grad_norm'], ref_metrics['grad_norm']):.1e}, "
              f"params abs {max_abs_diff(state.params, ref_state.params):.1e}, "
              f"optimiser state abs {max_abs_diff(state.opt_state, ref_state.opt_state):.1e}")
        np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
        np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-5)
        assert metrics["lr"] == ref_metrics["lr"]
        assert int(state.step) == steps
        atol = PARAMS_ATOL.get(name, 1e-7)
        jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=atol),
                               state.params, ref_state.params)
        # The moments are running averages of the gradient (Adam's nu of its square), compared as
        # gradients (the root of a second moment), each leaf against its own largest entry. A
        # gradient sums terms that cancel, so its rounding scales with the terms, not with itself:
        # the speedrun block's scalars that read the whole stream (the U-net skip weights, the x0
        # mixes, moments of 1e-6) round by up to 2e-5 of themselves, matrices by under 1e-6. Within
        # 1e-4 of the leaf's largest entry, and never looser than 1e-5 of the tree's largest.
        got, want = moments_as_gradients(state.opt_state), moments_as_gradients(ref_state.opt_state)
        largest = lambda leaf: float(np.abs(leaf).max()) if leaf.size and np.issubdtype(leaf.dtype, np.floating) else 0.0
        tree_scale = max(map(largest, jax.tree_util.tree_leaves(want)))
        for (path, want_leaf), got_leaf in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves(got)):
            np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-5, atol=min(1e-5 * tree_scale, 1e-4 * largest(want_leaf)),
                                       err_msg=f"{mode}: {jax.tree_util.keystr(path)}")
    # the step moved the params, every leaf of them, so agreeing is not trivial
    moved = np.abs(ref_state.params["token_embedding"]["embedding"]
                   - start.params["token_embedding"]["embedding"]).max()
    assert moved > 1e-4
    unmoved = [jax.tree_util.keystr(path) for path, gap in jax.tree_util.tree_leaves_with_path(
        jax.tree_util.tree_map(lambda x, y: np.abs(x - y).max(), ref_state.params, start.params)) if gap == 0]
    assert not unmoved, unmoved


def test_twenty_steps_loss_curves_agree():
    cfg, modes = runners("day1")
    curves = {}
    for mode in ("single", "data2_fsdp4"):
        place, step, _ = modes[mode]
        state, curve = place(host_state(cfg)), []
        for i in range(20):
            state, metrics = step(state, batch_at(cfg, i))
            curve.append(float(np.asarray(metrics["loss"]).reshape(-1)[0]))
        curves[mode] = np.array(curve)
    print({m: float(np.abs(c - curves["single"]).max()) for m, c in curves.items()})
    assert curves["single"][-1] < curves["single"][0] - 0.1  # it trains
    for mode in ("data2_fsdp4",):
        np.testing.assert_allclose(curves[mode], curves["single"], rtol=1e-4, atol=1e-4)


def test_fsdp_splits_params_and_adam_moments():
    cfg = with_fsdp(load_config(None, CONFIGS["day1"]), 4)
    mesh = sharding.make_mesh(cfg.train)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4}
    state = sharding.init_sharded_state(cfg, jax.random.key(3), mesh)
    # created sharded, with the one-device init's values (to rounding: the same random bits)
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6),
                           jax.device_get(state), host_state(load_config(None, CONFIGS["day1"])))

    def shard_shapes(x):
        return {tuple(s.data.shape) for s in x.addressable_shards}

    embedding = state.params["token_embedding"]["embedding"]  # [64, 32]: split along V
    qkv = state.params["blocks"]["attention"]["qkv"]["kernel"]  # [2, 32, 96]: split along 3C
    mu = state.opt_state[1][0].mu
    assert embedding.shape == (64, 32) and shard_shapes(embedding) == {(16, 32)}
    assert qkv.shape == (2, 32, 96) and shard_shapes(qkv) == {(2, 32, 24)}
    assert shard_shapes(mu["token_embedding"]["embedding"]) == {(16, 32)}
    assert shard_shapes(mu["blocks"]["attention"]["qkv"]["kernel"]) == {(2, 32, 24)}
    assert shard_shapes(state.params["blocks"]["attention_norm"]["scale"]) == {(2, 8)}
    assert shard_shapes(state.step) == {()} and shard_shapes(state.opt_state[1][0].count) == {()}
    # the four devices of one fsdp group hold different quarters; the two data rows the same ones
    row0 = {s.device: s.index for s in embedding.addressable_shards}
    quarters = [row0[d] for d in mesh.devices[0]]
    assert len(set(map(str, quarters))) == 4 and quarters == [row0[d] for d in mesh.devices[1]]

    info = sharding.describe(mesh, state)
    assert info["mesh"] == {"data": 2, "fsdp": 4} and info["devices"] == 8
    assert info["params_bytes_per_device"] * 4 == info["params_bytes"]  # every leaf splits here
    scalars = 2 * 4  # two int32 counts, replicated
    assert (info["opt_state_bytes_per_device"] - scalars) * 4 == info["opt_state_bytes"] - scalars


def test_bad_mesh_requests_are_refused():
    cfg = load_config(None, CONFIGS["day1"]).train
    with pytest.raises(ValueError, match=r"fsdp = 3 does not divide the 8"):
        sharding.make_mesh(dataclasses.replace(cfg, fsdp=3))
    with pytest.raises(ValueError, match=r"fsdp = 16 exceeds the 8"):
        sharding.make_mesh(dataclasses.replace(cfg, fsdp=16))
    with pytest.raises(ValueError, match=r"batch_size = 12 .* 12 rows.*data 8 x fsdp 1 = 8"):
        sharding.make_mesh(dataclasses.replace(cfg, batch_size=12))
    with pytest.raises(ValueError, match=r"grad_accum = 4 .* 4 rows.*data 2 x fsdp 4 = 8"):
        sharding.make_mesh(dataclasses.replace(cfg, batch_size=16, grad_accum=4, fsdp=4))
    with pytest.raises(ValueError, match=r"fsdp = 2 needs train.parallel = 'sharded'"):
        sharding.resolve_mode(dataclasses.replace(cfg, parallel="pmap", fsdp=2), 8)


def test_resolve_mode_and_mesh_on_given_devices():
    cfg = load_config(None, CONFIGS["day1"]).train
    assert sharding.resolve_mode(cfg, 8) == "sharded" and sharding.resolve_mode(cfg, 1) == "single"
    assert sharding.resolve_mode(dataclasses.replace(cfg, parallel="pmap"), 8) == "pmap"
    mesh = sharding.make_mesh(dataclasses.replace(cfg, fsdp=2), jax.devices()[:4])
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2}


def test_distributed_initialization_follows_the_environment(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                 "TPU_WORKER_HOSTNAMES", "CLOUD_TPU_TASK_ID", "JAXGPT_DISTRIBUTED",
                 "JAXGPT_HEARTBEAT_TIMEOUT_S"):
        monkeypatch.delenv(name, raising=False)
    calls, updates = [], []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(jax.config, "update", lambda name, value: updates.append((name, value)))
    assert distributed.maybe_initialize_distributed() is False and calls == [] and updates == []
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "only-host")
    assert distributed.distributed_env() is None
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-a,host-b")
    assert distributed.distributed_env() == {}
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES")
    monkeypatch.setenv("JAXGPT_DISTRIBUTED", "auto")
    assert distributed.distributed_env() == {}
    monkeypatch.delenv("JAXGPT_DISTRIBUTED")
    monkeypatch.setenv("COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    assert distributed.maybe_initialize_distributed() is True
    assert distributed.maybe_initialize_distributed() is True  # idempotent
    assert calls == [{"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1,
                      "heartbeat_timeout_seconds": distributed.HEARTBEAT_TIMEOUT_S}]
    assert updates == [("jax_cpu_collectives_implementation", "gloo")]  # the tests run on the CPU
    assert distributed.process_count() == 1 and distributed.process_index() == 0 and distributed.is_writer()


def test_pmap_helpers_round_trip():
    tree = {"w": np.arange(6.0).reshape(2, 3), "n": np.int32(5)}
    rep = sharding.replicate(tree)
    assert rep["w"].shape == (8, 2, 3) and len(rep["w"].addressable_shards) == 8
    back = sharding.unreplicate(rep)
    np.testing.assert_array_equal(back["w"], tree["w"])
    assert int(back["n"]) == 5
    assert sharding.shard_for_pmap(np.zeros((16, 5))).shape == (8, 2, 5)
    with pytest.raises(ValueError, match="12 rows does not divide over 8"):
        sharding.shard_for_pmap(np.zeros((12, 5)))
    cfg = load_config(None, CONFIGS["modern"])  # grad_accum = 2
    step = sharding.pmap_train_step(cfg)
    with pytest.raises(ValueError, match="3 rows do not divide into train.grad_accum = 2"):
        step(None, np.zeros((8, 3, window_length(cfg.model)), np.int32))
    with pytest.raises(ValueError, match=r"pmap batch must be \[8 devices, rows, 17\]"):
        step(None, np.zeros((16, 17), np.int32))


def test_dry_run_compile_reports_memory_per_device(capsys):
    from jaxgpt.cli.main import main

    assert main(["dry-run", "--set", "train.fsdp=4", "--set", "model.n_layers=1", "--compile"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["mode"] == "sharded" and record["devices"] == 8 and record["mesh"] == {"data": 2, "fsdp": 4}
    # float32 (4 bytes each), every leaf split over the 4 fsdp devices
    assert record["params_bytes_per_device"] == record["parameters"] * 4 // 4
    assert record["opt_state_bytes_per_device"] > record["params_bytes_per_device"]  # mu and nu
    compiled = record["compiled"]
    assert compiled["argument_bytes"] > 0 and compiled["temp_bytes"] > 0 and compiled["compile_s"] > 0
