"""The kernels seam: the tuned kernels equal the portable ones, the choice, its switch and its fallback."""

import dataclasses
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt.cli.main import main as cli_main
from jaxgpt.config import ConfigError, ModelConfig, RunConfig, load_config
from jaxgpt.kernels import PORTABLE, Kernels, choose_kernels, usable
from jaxgpt.model.decoder import forward, init_params

DAY1 = str(Path(__file__).resolve().parent.parent / "experiments/day1.toml")
BASE = ModelConfig(vocab_size=64, context_length=64, d_model=32, n_layers=2, n_heads=4, hidden_size=48)

# A pairwise covering array over ten two-valued switches: every value of every pair of switches
# meets in some row. Row 0 is all first values; the other five rows' columns are the ten 5-bit
# vectors with three ones (any two of them share a one, and each has a one the other lacks).
SWITCHES = [
    ("position", ("learned", "rope")), ("norm", ("layernorm", "rmsnorm")), ("residual", ("pre", "post")),
    ("feed_forward", ("gelu", "swiglu")), ("kv_heads", (4, 2)), ("tie_embeddings", (True, False)),
    ("scan_layers", (True, False)), ("remat", (False, True)), ("mtp_depth", (0, 2)),
    ("dtype", ("float32", "bfloat16")),
]
_COLUMNS = [[1 if i in ones else 0 for i in range(5)]
            for ones in [(a, b, c) for a in range(5) for b in range(a + 1, 5) for c in range(b + 1, 5)]]
COMBOS = [{name: values[0] for name, values in SWITCHES}] + [
    {name: values[_COLUMNS[j][row]] for j, (name, values) in enumerate(SWITCHES)} for row in range(5)]


def test_the_rows_cover_every_pair_of_switch_values():
    for i, (a, a_values) in enumerate(SWITCHES):
        for b, b_values in SWITCHES[i + 1:]:
            met = {(combo[a], combo[b]) for combo in COMBOS}
            assert met == {(x, y) for x in a_values for y in b_values}, (a, b)


def _outputs(cfg: ModelConfig, kernels: Kernels, params, tokens, cotangent):
    """Logits at every depth of a train step's forward pass and the gradient they feed back."""
    def loss(p):
        logits = forward(p, cfg, tokens, all_depths=True, train=True, kernels=kernels)
        return jnp.sum(logits * cotangent), logits
    (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return logits, grads


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_tuned_kernels_equal_the_portable_ones(combo):
    # float32: within 1e-5 (gradients: 1e-5 of their largest entry where that exceeds 1).
    # bfloat16: the portable kernels round every activation to bfloat16, the CPU ones only matmul
    # operands, so they differ by bfloat16 rounding: within 0.05 on the logits (about 1, the bound
    # of bfloat16 against float32 in test_model.py) and 5 % of each gradient's largest entry.
    cfg = dataclasses.replace(BASE, **combo)
    tuned = choose_kernels(cfg)
    assert tuned != PORTABLE
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, cfg.context_length), 0, cfg.vocab_size)
    cotangent = jax.random.normal(jax.random.key(2), (1 + cfg.mtp_depth, 2, cfg.context_length, cfg.vocab_size))
    both = jax.jit(lambda p: (_outputs(cfg, PORTABLE, p, tokens, cotangent),
                              _outputs(cfg, tuned, p, tokens, cotangent)),
                   compiler_options={"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True})
    (want_logits, want_grads), (got_logits, got_grads) = both(params)
    f32 = cfg.dtype == "float32"
    np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=1e-5 if f32 else 0.05)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree_util.tree_leaves(want_grads)):
        scale = float(jnp.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, scale) if f32 else 0.05 * scale,
                                   err_msg=jax.tree_util.keystr(path))


def test_choice_follows_backend_dtype_and_the_switch():
    assert choose_kernels(BASE, "cpu").name == "cpu"
    assert choose_kernels(dataclasses.replace(BASE, dtype="bfloat16"), "cpu").name == "cpu-bf16"
    assert choose_kernels(BASE, "tpu", interpret=True).name == "tpu-interpret"
    for backend in ("cpu", "gpu", "tpu"):
        assert choose_kernels(dataclasses.replace(BASE, kernels="xla"), backend) is PORTABLE


def test_a_kernel_that_fails_to_compile_falls_back_to_the_portable_ones_with_one_warning(caplog):
    def refusing(q, k, v, *, train=False, remat=False):
        raise NotImplementedError("no such kernel here\nsecond line")

    broken = dataclasses.replace(PORTABLE, name="broken", attention=refusing)
    with caplog.at_level(logging.WARNING, logger="jaxgpt.kernels"):
        assert usable(broken, BASE) is PORTABLE
        assert usable(PORTABLE, BASE) is PORTABLE
    assert [r.getMessage() for r in caplog.records] == [
        "jaxgpt: broken kernels unavailable (NotImplementedError: no such kernel here); "
        "using the portable xla kernels"]


def test_gpu_kernels_without_cudnn_fall_back_through_the_real_library(caplog):
    # Here (no GPU) jax refuses cuDNN's attention; in bfloat16 the GPU set asks for it.
    cfg = dataclasses.replace(BASE, dtype="bfloat16", n_layers=1)
    with caplog.at_level(logging.WARNING, logger="jaxgpt.kernels"):
        assert choose_kernels(cfg, "gpu") is PORTABLE
    assert len(caplog.records) == 1 and "gpu kernels unavailable" in caplog.records[0].getMessage()


def test_a_sampler_kernel_that_does_not_compile_leaves_the_gpu_sets_other_decoding_options(caplog):
    # Here (no GPU) Pallas compiles no Triton kernel: the sampler keeps the XLA ops, and the rest.
    from jaxgpt.kernels import gpu, sampler_usable

    with caplog.at_level(logging.WARNING, logger="jaxgpt.kernels"):
        kept = sampler_usable(gpu.KERNELS, BASE)
    assert dict(kept.decoding) == {k: v for k, v in gpu.KERNELS.decoding if k != "written_attention"}
    assert dict(gpu.KERNELS.decoding)["written_attention"] is not None and kept.attention is gpu.KERNELS.attention
    assert len(caplog.records) == 1 and "sampler's attention kernel unavailable (ValueError" in caplog.records[0].getMessage()
    assert sampler_usable(kept, BASE) is kept


@pytest.mark.parametrize("dtype, asked", [(jnp.bfloat16, ["cudnn"]), (jnp.float16, ["cudnn"]), (jnp.float32, [None])])
def test_gpu_attention_asks_cudnn_in_half_precision_only(monkeypatch, random_qkv, dtype, asked):
    from jaxgpt.kernels import gpu

    calls = []

    def recording(q, k, v, *, is_causal, implementation=None):
        assert is_causal
        calls.append(implementation)
        return q

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    q, k, v = random_qkv(2, 16, 4, 2, 8, dtype)
    gpu.KERNELS.attention(q, k, v, train=True)
    assert calls == asked


def test_the_kernels_key_is_checked_and_leaves_the_fingerprint_alone():
    with pytest.raises(ConfigError, match=r"model\.kernels = 'fast' is not one of auto, xla"):
        load_config(None, ["model.kernels=fast"])
    portable = load_config(None, ["model.kernels=xla"])
    assert portable.model.kernels == "xla"
    assert portable.fingerprint() == RunConfig().fingerprint()


@pytest.mark.parametrize("overrides, name", [([], "cpu"), (["--set", "model.kernels=xla"], "xla")])
def test_dry_run_names_the_kernels(capsys, overrides, name):
    assert cli_main(["dry-run", "--config", DAY1, *overrides]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["kernels"] == name


def test_the_kernels_compiler_options_reach_the_compiled_steps():
    from jaxgpt.train.step import compile_steps, init_state

    cfg = RunConfig(model=BASE)
    state = init_state(cfg, jax.random.key(0))
    batch = jnp.zeros((2, BASE.context_length + 1), jnp.int32)
    bogus = dataclasses.replace(PORTABLE, compiler_options=(("xla_no_such_option", True),))
    assert PORTABLE.jit_options() is None and bogus.jit_options() == {"xla_no_such_option": True}
    train, evaluate = compile_steps(cfg, bogus)
    with pytest.raises(Exception, match="xla_no_such_option"):
        train(state, batch)
    with pytest.raises(Exception, match="xla_no_such_option"):
        evaluate(state.params, batch)


def test_an_unrolled_layer_scan_computes_the_same_model_on_the_same_params():
    from jaxgpt.model.cache import init_cache
    from jaxgpt.model.decoder import forward_cached

    cfg = BASE
    unrolled = dataclasses.replace(PORTABLE, scan_unroll=8)  # more than the layers: no loop at all
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)

    def outputs(kernels):
        loss = lambda p: forward(p, cfg, tokens, train=True, kernels=kernels).astype(jnp.float32).std()
        cached, _ = forward_cached(params, cfg, tokens, init_cache(cfg, 2, 32), kernels=kernels)
        return forward(params, cfg, tokens, kernels=kernels), jax.grad(loss)(params), cached

    (want, want_grads, want_cached), (got, got_grads, got_cached) = jax.jit(
        lambda: (outputs(PORTABLE), outputs(unrolled)))()
    lowered = lambda train: jax.jit(lambda p: forward(p, cfg, tokens, train=train, kernels=unrolled)).lower(params)
    assert "while" not in lowered(True).as_text()  # a train step's pass unrolls; decoding keeps its loop
    assert "while" in lowered(False).as_text()
    # With no loop between them, XLA would merge a remat's recomputation with the forward pass
    # unless each is kept apart (`in_a_loop`): the backward of a full remat recomputes behind barriers.
    remat = dataclasses.replace(cfg, remat="full")
    grad = jax.jit(jax.grad(lambda p: forward(p, remat, tokens, train=True, kernels=unrolled).std()))
    assert "optimization_barrier" in grad.lower(params).as_text()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got_cached, want_cached, rtol=0, atol=1e-5)
    for got_leaf, want_leaf in zip(jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=0, atol=1e-6)


@pytest.mark.parametrize("pattern, remat", [("S", False), ("SL", True)])
def test_windowed_models_run_banded_kernels_equal_to_the_portable_ones(pattern, remat):
    # 256 positions: the train step's query blocks without remat, two tiles under it; "SL" picks
    # the banded or the causal kernel per block by the traced window (lax.cond).
    cfg = dataclasses.replace(BASE, context_length=256, attention_window=48, window_pattern=pattern, remat=remat,
                              position="rope")
    tuned = choose_kernels(cfg, "cpu")
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, cfg.context_length), 0, cfg.vocab_size)
    cotangent = jax.random.normal(jax.random.key(2), (1, 2, cfg.context_length, cfg.vocab_size))
    (want_logits, want_grads), (got_logits, got_grads) = jax.jit(
        lambda p: (_outputs(cfg, PORTABLE, p, tokens, cotangent), _outputs(cfg, tuned, p, tokens, cotangent)))(params)
    np.testing.assert_allclose(got_logits, want_logits, rtol=0, atol=1e-5)
    for got, want in zip(jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, float(jnp.abs(want).max())))
    # Neither kernel of the set (blocks, tiles) holds the whole [T, T] square of scores that XLA's
    # masked attention, the set's fallback for windows, holds.
    q = jnp.zeros((2, 256, 4, 8))
    square = lambda attend: ",256,256]" in str(jax.make_jaxpr(
        lambda q: attend(q, q[:, :, :2], q[:, :, :2], train=True, remat=remat, window=jnp.int32(48)))(q))
    assert not square(tuned.attention) and square(choose_kernels(BASE, "cpu").attention)


@pytest.mark.parametrize("window", [1, 8, 13])
def test_gpu_windowed_blocks_ask_cudnn_for_the_window_xla_masks(random_qkv, window):
    """The GPU set's call, unmocked, through jax's reference implementation of cuDNN's attention
    (the same arguments, its sliding window included), equals XLA's windowed attention; the
    compiled h100 program carries that window to cuDNN's kernel (test_plan.py)."""
    from jaxgpt.kernels import gpu, xla

    q, k, v = random_qkv(2, 32, 4, 2, 8, jnp.bfloat16)
    got = gpu.causal_attention(q, k, v, window=window, implementation="xla")
    want = xla.attention(q, k, v, window=window)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0, atol=2e-2)
    assert np.abs(np.asarray(got, np.float32) - np.asarray(xla.attention(q, k, v), np.float32)).max() > 0.1


def _written_pass(layout: str, T: int, dtype=jnp.float32, documents: bool = False, K: int = 2):
    """A cached pass that writes first (`jaxgpt.model.cache.CacheStack`): random stacks of 3
    layers (a long-short model's: 2 linear rows of 16 positions, 3 ring rows of 10 slots), 4
    query heads over K KV heads (D 8), two rows at different indices (a ring's second row's pass
    wraps round its slots), the ring's slots holding the positions before each row's index."""
    from jaxgpt.model.cache import CachePlace, CacheStack, ring_held

    rng = np.random.default_rng(T)
    B, H, D, S, R = 2, 4, 8, 16, 10
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    index = jnp.asarray([3, 11], jnp.int32) if layout == "linear" else jnp.asarray([5, 38], jnp.int32)
    held = None
    if layout != "linear":
        before = index[:, None] - R + jnp.arange(R)
        empty = jnp.full((B, R), -1, jnp.int32)
        held = ring_held(jax.vmap(lambda h, s, p: h.at[s].set(jnp.where(p >= 0, p, -1)))(empty, before % R, before),
                         index, T)
    floors = index[:, None] - jnp.asarray([[2], [4]]) + jnp.arange(T) // 2 if documents else None
    place = CachePlace(index, floors, held)
    if layout == "long-short":
        stack = CacheStack(normal(2, B, K, S, D), normal(2, B, K, D, S), ring=(normal(3, B, K, R, D), normal(3, B, K, D, R)))
    else:
        size = S if layout == "linear" else R
        stack = CacheStack(normal(3, B, K, size, D), normal(3, B, K, D, size))
    return normal(B, T, H, D), stack, (normal(B, T, K, D), normal(B, T, K, D)), place


@pytest.mark.parametrize("layout, T, window, row, documents, K", [
    ("linear", 1, None, 1, False, 2), ("linear", 3, 5, 2, True, 1), ("ring", 1, 6, 0, False, 4),
    ("ring", 3, 6, 2, True, 2), ("long-short", 1, 0, 1, False, 2), ("long-short", 3, 6, 2, False, 2),
    ("long-short", 2, 0, 0, True, 4)])
def test_the_gpu_samplers_one_kernel_writes_and_reads_the_cache_as_the_two_xla_ops(layout, T, window, row, documents,
                                                                                   K, monkeypatch):
    """`jaxgpt.kernels.gpu_decode.written_attention` (Pallas, interpret mode) equals
    `write_layer` then `written_attention`: the same outputs, the same cache bit for bit, in a
    linear cache, a ring and a long-short model's two stacks (a window of 0 writes and reads the
    linear row, else the ring's), with windows, documents, groups of 1, 2 and 4 query heads and
    a block of several queries; the read in steps of 4 positions (a ring's 10 slots: two, then
    one of 2), so that its softmax spans several."""
    from jaxgpt.kernels import gpu_decode
    from jaxgpt.model.cache import write_layer, written_attention

    monkeypatch.setattr(gpu_decode, "MAX_BLOCK", 4)
    assert gpu_decode._segments(10, 2, 8) == ((0, 4, 2), (8, 2, 1))
    q, stack, new, place = _written_pass(layout, T, documents=documents, K=K)
    stack = stack._replace(layer=jnp.asarray(row, jnp.int32))
    w = None if window is None else jnp.asarray(window, jnp.int32)
    assert gpu_decode.applies(q, new)
    want_stack = write_layer(stack, new, place, w)
    want = written_attention(q, want_stack, place, w)
    got, got_stack = jax.jit(lambda *args: gpu_decode.written_attention(*args, interpret=True))(q, stack, new, place, w)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-6)
    for a, b in zip(jax.tree_util.tree_leaves(got_stack), jax.tree_util.tree_leaves(want_stack)):
        np.testing.assert_array_equal(a, b)
    assert not all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(got_stack),
                                                        jax.tree_util.tree_leaves(stack)))  # the pass wrote


def test_the_gpu_samplers_kernel_in_bfloat16_and_where_triton_cannot_take_the_heads():
    """bfloat16: within a rounding of the XLA ops (its probabilities weigh the values unnormalised);
    a group of 3 query heads (not a power of two) is left to the XLA ops."""
    from jaxgpt.kernels import gpu_decode
    from jaxgpt.model.cache import write_layer, written_attention

    q, stack, new, place = _written_pass("linear", 1, jnp.bfloat16)
    stack = stack._replace(layer=jnp.asarray(1, jnp.int32))
    want_stack = write_layer(stack, new, place)
    got, got_stack = gpu_decode.written_attention(q, stack, new, place, interpret=True)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(written_attention(q, want_stack, place), np.float32),
                               atol=2e-2)
    np.testing.assert_array_equal(got_stack.k, want_stack.k)
    q6 = jnp.concatenate([q, q[:, :, :2]], axis=2)  # 6 query heads over 2 KV heads
    assert not gpu_decode.applies(q6, new)
    assert gpu_decode.written_attention(q6, stack, new, place, interpret=True) is None
    # A speculative sampler's ring of 258 slots: 4 steps of 64 (D 64, one query head a group), then one of 2.
    assert gpu_decode._segments(258, 1, 64) == ((0, 64, 4), (256, 2, 1))
    assert gpu_decode._segments(7, 1, 64) == ((0, 4, 1), (4, 2, 1), (6, 1, 1))


def test_on_a_mesh_the_gpu_sampler_keeps_the_xla_ops_xla_can_split():
    from jaxgpt.kernels import gpu

    decoding = gpu.KERNELS.for_decoding()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    on_mesh = decoding.on_mesh(mesh, batch_axes=())
    assert decoding.written_attention is not None and on_mesh.written_attention is None
    assert on_mesh.cache_written_first and on_mesh.attention is not decoding.attention
