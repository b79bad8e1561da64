"""Generation: cached decoding equals the plain forward, batching, sliding window, sampling rules."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SPEEDRUN

from jaxgpt.config import ModelConfig, RunConfig, TrainConfig, load_config
from jaxgpt.data import window_length
from jaxgpt.evaluation import generate as generate_module
from jaxgpt.evaluation.generate import FINISHED, bucket_length, generate, generate_tokens, sample_logits, slide_length
from jaxgpt.kernels import choose_kernels
from jaxgpt.kernels import gpu as gpu_kernels
from jaxgpt.model import layers as layers_module
from jaxgpt.model.decoder import forward, init_params
from jaxgpt.train.state_layout import leaf_names
from jaxgpt.train.step import compile_steps, init_state

# init_std 0.3 sharpens the random model's logits, so greedy choices are far from float ties and
# its output wanders instead of settling on one repeated token.
LEARNED = ModelConfig(vocab_size=64, context_length=32, d_model=32, n_layers=2, n_heads=4, init_std=0.3)
ROPE_GQA = dataclasses.replace(LEARNED, position="rope", kv_heads=2, norm="rmsnorm", feed_forward="swiglu")
# Every switch of the speedrun block, one MTP head among them.
SPEEDRUN_BLOCK = load_config(None, ["model.vocab_size=64", "model.context_length=32", "model.d_model=32",
                                    "model.n_heads=4", "model.init_std=0.3", *SPEEDRUN]).model
GREEDY = dict(temperature=0.0)


@functools.cache
def params_for(cfg: ModelConfig):
    params = init_params(cfg, jax.random.key(0))
    if cfg.zero_init:  # a model that outputs zeros, its x0 mixes off: every leaf moved, as training would
        leaves, tree = jax.tree_util.tree_flatten(params)
        keys = jax.random.split(jax.random.key(1), len(leaves))
        params = tree.unflatten([leaf + cfg.init_std * jax.random.normal(key, leaf.shape)
                                 for leaf, key in zip(leaves, keys)])
    return params


@functools.partial(jax.jit, static_argnums=1)
def _forward(params, cfg, tokens_BT):
    return forward(params, cfg, tokens_BT, kernels=choose_kernels(cfg))  # the kernels generate runs


def naive_greedy(cfg: ModelConfig, prompt: list[int], n: int) -> tuple[list[int], int]:
    """Greedy by calling `forward` on the whole window each step, no cache; also counts slides.

    The window is the rule jaxgpt/evaluation/generate.py documents (a prompt holds at most context_length tokens):
    when the window would exceed context_length it restarts from the sequence's last
    context_length // 2 tokens. Until the first slide the window is the whole sequence, so this is
    then exactly the plain, uncropped greedy loop.
    """
    C, W = cfg.context_length, slide_length(cfg)
    seq = list(prompt)
    start, slides, out = max(0, len(seq) - C), 0, []
    for _ in range(n):
        if len(seq) - start > C:
            start, slides = len(seq) - W, slides + 1
        window = seq[start:]
        padded = np.zeros((1, C), np.int32)  # right padding cannot reach earlier positions (causal)
        padded[0, : len(window)] = window
        t = int(np.argmax(_forward(params_for(cfg), cfg, padded)[0, len(window) - 1]))
        out.append(t)
        seq.append(t)
    return out, slides


def prompt(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, LEARNED.vocab_size, length).tolist()


@pytest.mark.parametrize("cfg, prompt_length", [(LEARNED, 5), (ROPE_GQA, 32), (SPEEDRUN_BLOCK, 7)],
                         ids=["learned", "rope_gqa_full_prompt", "speedrun_block"])
def test_greedy_equals_naive_loop_across_slides(cfg, prompt_length):
    p, n = prompt(prompt_length, 1), 60
    expected, slides = naive_greedy(cfg, p, n)
    assert slides >= 2, "the run should cross the sliding-window re-prefill more than once"
    assert len(set(expected)) > 5, "a degenerate (constant) continuation would prove little"
    got = generate(params_for(cfg), cfg, [p], n, **GREEDY)[0]
    assert got == expected


def test_batched_prompts_equal_each_prompt_alone():
    # Different lengths in one bucket (8): padding is exercised, and each row reaches a full
    # cache at a different step, so each slides alone.
    prompts = [prompt(5, 2), prompt(8, 3), prompt(6, 4)]
    batched = generate(params_for(LEARNED), LEARNED, prompts, 45, **GREEDY)
    alone = [generate(params_for(LEARNED), LEARNED, [p], 45, **GREEDY)[0] for p in prompts]
    assert batched == alone
    assert len({tuple(r) for r in batched}) == 3


def test_numpy_prompts_accepted_and_equal_lists():
    p = prompt(6, 4)
    assert (generate(params_for(LEARNED), LEARNED, [np.array(p, np.int64)], 4, **GREEDY)
            == generate(params_for(LEARNED), LEARNED, [p], 4, **GREEDY))


def test_seed_fixes_the_samples():
    cfg, prompts = LEARNED, [prompt(3, 5), prompt(7, 6)]
    run = lambda seed: generate(params_for(cfg), cfg, prompts, 12, temperature=1.0, seed=seed)
    assert run(0) == run(0)
    assert run(0) != run(1)


def test_stop_token_finishes_rows_and_ends_generation():
    prompts = [prompt(5, 2), prompt(8, 3), prompt(6, 4)]
    full = generate(params_for(LEARNED), LEARNED, prompts, 45, **GREEDY)
    stop = full[0][3]
    first = full[0].index(stop)
    steps = np.stack(list(generate_tokens(params_for(LEARNED), LEARNED, prompts, 45, stop_token=stop, **GREEDY)))
    for row, tokens in enumerate(full):
        end = tokens.index(stop) + 1 if stop in tokens else len(tokens)
        assert steps[:end, row].tolist() == tokens[:end]  # up to and including the stop token
        assert (steps[end:, row] == FINISHED).all()
    # Generation ends as soon as every row is finished.
    ends = [t.index(stop) + 1 if stop in t else 45 for t in full]
    assert len(steps) == max(ends)
    # One row alone: the generator stops right after the stop token.
    assert generate(params_for(LEARNED), LEARNED, [prompts[0]], 45, stop_token=stop, **GREEDY) == [
        full[0][: first + 1]]


MTP = dataclasses.replace(LEARNED, mtp_depth=2)
MTP_ROPE = dataclasses.replace(ROPE_GQA, mtp_depth=3)


@pytest.mark.parametrize("cfg", [MTP, MTP_ROPE, SPEEDRUN_BLOCK],
                         ids=["learned_depth2", "rope_gqa_depth3", "speedrun_block"])
def test_speculative_equals_plain_greedy_across_slides_and_stops(cfg):
    # Rows of different lengths (one longer than the context) slide at different steps; the
    # random model's drafts are mostly wrong, so every acceptance count is exercised.
    prompts = [prompt(5, 2), prompt(8, 3), prompt(32, 4)]
    plain = generate(params_for(cfg), cfg, prompts, 70, **GREEDY)
    stats = {}
    assert generate(params_for(cfg), cfg, prompts, 70, speculative=True, stats=stats, **GREEDY) == plain
    assert 0 <= stats["accepted"] <= stats["drafted"]
    stop = plain[1][10]
    with_stop = generate(params_for(cfg), cfg, prompts, 70, stop_token=stop, **GREEDY)
    assert generate(params_for(cfg), cfg, prompts, 70, stop_token=stop, speculative=True, **GREEDY) == with_stop
    assert with_stop[1] == plain[1][: plain[1].index(stop) + 1]


def test_streamed_chunks_equal_one_call_and_reuse_one_compile():
    cfg, prompts = LEARNED, [prompt(5, 2), prompt(7, 3)]
    whole = generate(params_for(cfg), cfg, prompts, 40, temperature=1.0, seed=4)
    compiled = generate_module._advance._cache_size()
    for chunk in (1, 7, 16):
        steps = list(generate_tokens(params_for(cfg), cfg, prompts, 40, temperature=1.0, seed=4, chunk=chunk))
        assert np.stack(steps).T.tolist() == whole
    # Another prompt length in the same bucket and another count in the same buffer size.
    generate(params_for(cfg), cfg, [prompt(6, 5), prompt(8, 6)], 38, temperature=1.0, seed=4)
    assert generate_module._advance._cache_size() == compiled


@pytest.mark.parametrize("cfg, kwargs, match", [
    (LEARNED, dict(temperature=0.0), "mtp_depth"),
    (MTP, dict(temperature=0.7), "greedy"),
    (LEARNED, dict(chunk=0), "chunk"),
])
def test_bad_decoding_modes_raise(cfg, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate_tokens(params_for(cfg), cfg, [[1, 2]], 3, speculative="chunk" not in kwargs, **kwargs)


def _trained_mtp_model():
    """A depth-2 MTP model trained on a short repeating text, where drafting ahead is learnable."""
    text = "the quick brown fox jumps over the lazy dog; " * 40 + "pack my box with five dozen jugs. " * 40
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], np.int32)
    model = ModelConfig(vocab_size=len(chars), context_length=32, d_model=64, n_layers=2, n_heads=4, mtp_depth=2)
    cfg = RunConfig(model=model, train=TrainConfig(steps=100, batch_size=16, lr=3e-3, warmup_steps=10))
    state = init_state(cfg, jax.random.key(0))
    train_step, _ = compile_steps(cfg)
    rng = np.random.default_rng(0)
    W = window_length(model)
    for _ in range(cfg.train.steps):
        starts = rng.integers(0, len(ids) - W, cfg.train.batch_size)
        state, metrics = train_step(state, np.stack([ids[i: i + W] for i in starts]))
    return model, state.params, ids, float(metrics["loss"])


def test_trained_mtp_model_speculates_the_same_greedy_text_in_fewer_passes():
    model, params, ids, loss = _trained_mtp_model()
    assert loss < 0.5, "the model should have learned the text"
    rng = np.random.default_rng(1)
    prompts = [ids[i: i + n] for i, n in zip(rng.integers(0, len(ids) - 20, 20), rng.integers(1, 20, 20))]
    plain = generate(params, model, prompts, 48, **GREEDY)
    stats = {}
    assert generate(params, model, prompts, 48, speculative=True, stats=stats, **GREEDY) == plain
    assert stats["acceptance_rate"] > 0.5
    assert stats["forward_passes"] < 48 * 0.75


@pytest.mark.parametrize("cfg", [LEARNED, MTP], ids=["plain", "speculative"])
def test_a_few_tokens_after_a_short_prompt(cfg):
    # The sequence buffer is then shorter than a sliding window, which the compiled (never
    # taken) slide branch still has to fit.
    spec = cfg.mtp_depth > 0
    one = generate(params_for(cfg), cfg, [[1, 2]], 1, speculative=spec, **GREEDY)
    six = generate(params_for(cfg), cfg, [[1, 2]], 6, speculative=spec, **GREEDY)
    assert len(one[0]) == 1 and len(six[0]) == 6 and six[0][0] == one[0][0]


def test_bucket_length():
    assert [bucket_length(n, 32) for n in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 32, 32]
    assert bucket_length(20, 24) == 24  # capped at context_length


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.5), dict(temperature=float("nan")), dict(top_k=0), dict(top_k=2.5),
    dict(top_p=0.0), dict(top_p=1.5), dict(stop_token=64), dict(max_new_tokens=-1),
])
def test_bad_options_raise(kwargs):
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError):
        generate_tokens(params_for(LEARNED), LEARNED, [[1, 2]], **kwargs)  # raises at the call


@pytest.mark.parametrize("prompts, match", [
    ([], "at least one prompt"), ([[]], "at least one token"), ([[1, 64]], "outside"), ([[-1, 2]], "outside"),
    ([[1.5, 2.0]], "integer"), ([[[1, 2]]], "1-D"), ([[1] * 33], "more than model.context_length = 32"),
], ids=["no_prompts", "empty_prompt", "id_too_large", "negative_id", "floats", "2d", "longer_than_context"])
def test_bad_prompts_raise(prompts, match):
    with pytest.raises(ValueError, match=match):
        generate_tokens(params_for(LEARNED), LEARNED, prompts, 3)


def test_sample_logits_rejects_bad_options():
    logits = jnp.zeros((1, 4))
    for bad in (dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.01)):
        options = {"temperature": 1.0, "top_k": None, "top_p": None, **bad}
        with pytest.raises(ValueError):
            sample_logits(logits, jax.random.key(0), **options)


# sample_logits: many draws at once, one per row of a broadcast [N, V] batch.
N = 4000


def draws(logits_V, **options) -> np.ndarray:
    logits_NV = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (N, len(logits_V)))
    options = {"temperature": 1.0, "top_k": None, "top_p": None, **options}
    return np.asarray(sample_logits(logits_NV, jax.random.key(7), **options))


def test_temperature_zero_and_top_k_one_are_greedy():
    logits = jax.random.normal(jax.random.key(1), (16, 64))
    argmax = np.asarray(jnp.argmax(logits, -1))
    greedy = sample_logits(logits, jax.random.key(2), temperature=0.0, top_k=None, top_p=None)
    top1 = sample_logits(logits, jax.random.key(2), temperature=1.0, top_k=1, top_p=None)
    np.testing.assert_array_equal(greedy, argmax)
    np.testing.assert_array_equal(top1, argmax)


def test_top_k_draws_only_and_all_of_the_k_largest():
    logits = np.random.default_rng(0).normal(size=64)
    top5 = set(np.argsort(logits)[-5:].tolist())
    assert set(draws(logits, top_k=5).tolist()) == top5
    assert len(set(draws(logits).tolist())) > 5  # without top_k, more tokens are drawn


def test_top_p_keeps_exactly_the_nucleus():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    nucleus = draws(logits, top_p=0.8)  # 0.5 + 0.3 reaches 0.8: tokens 0 and 1 only
    assert set(nucleus.tolist()) == {0, 1}
    assert abs((nucleus == 0).mean() - 0.5 / 0.8) < 0.04  # renormalised within the nucleus
    assert set(draws(logits, top_p=0.81).tolist()) == {0, 1, 2}
    assert set(draws(logits, top_p=0.1).tolist()) == {0}  # the most likely token always stays
    assert set(draws(logits, top_p=1.0).tolist()) == {0, 1, 2, 3}


def test_temperature_sharpens_the_distribution():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    expected = 0.5**2 / np.sum(np.array([0.5, 0.3, 0.15, 0.05]) ** 2)  # p^(1/T), T = 0.5
    assert abs((draws(logits, temperature=0.5) == 0).mean() - expected) < 0.04
    assert abs((draws(logits) == 0).mean() - 0.5) < 0.04


def test_vocab_limit_keeps_samples_inside_the_tokenizer():
    cfg = ModelConfig(vocab_size=64, context_length=16, d_model=16, n_layers=1, n_heads=2, init_std=1.0)
    params = init_params(cfg, jax.random.key(0))
    free = generate(params, cfg, [[1, 2]], 30, temperature=1.0, seed=3)[0]
    limited = generate(params, cfg, [[1, 2]], 30, temperature=1.0, seed=3, vocab_limit=10)[0]
    assert max(free) >= 10  # without the limit, a random model wanders over the whole vocab
    assert max(limited) < 10
    with pytest.raises(ValueError, match="vocab_limit"):
        generate(params, cfg, [[1]], 2, vocab_limit=0)


def sorted_reference(logits_BV, rng, top_k, top_p):
    """The sampling rule with a full sort of the vocabulary (`lax.top_k` for the k-th, a descending
    sort for the nucleus), written here from its definition: the tokens it draws are the rule's."""
    if top_k is not None:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    if top_p is not None:
        sorted_BV = -jnp.sort(-logits_BV, axis=-1)
        probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
        n_keep_B = jnp.sum(jnp.cumsum(probs_BV, axis=-1) - probs_BV < top_p - 1e-6, axis=-1)
        logits_BV = jnp.where(logits_BV < jnp.take_along_axis(sorted_BV, n_keep_B[:, None] - 1, axis=-1), -jnp.inf,
                              logits_BV)
    return jax.random.categorical(rng, logits_BV, axis=-1)


# A cache of every layout: the whole context (the speedrun block: swiglu's gate, value gates), a ring
# (every block windowed) and a long-short model's (both LayerNorm), each with drafts from its MTP adapters.
RING = dataclasses.replace(MTP_ROPE, attention_window=6, norm="layernorm")
LONG_SHORT = dataclasses.replace(MTP_ROPE, n_layers=3, attention_window=6, window_pattern="SSL", norm="layernorm")


# RMSNorm, and LayerNorm: the blocks' folded into their products, the final one in one pass.
LAYER_NORMS = {"written_attention", "one_pass_layer_norm", "layer_norm_statistics"}


# The speedrun block's first block pairs its heads: it reads its row's interleaved copy with XLA's ops.
@pytest.mark.parametrize("cfg, runs", [(SPEEDRUN_BLOCK, {"written_attention", "written_attention (xla)"}),
                                       (RING, LAYER_NORMS), (LONG_SHORT, LAYER_NORMS)],
                         ids=["whole", "ring", "long-short"])
def test_the_gpu_sets_decoding_kernels_decode_the_same_greedy_tokens(cfg, runs, monkeypatch):
    """The GPU set's decoding kernels (transposed matrices, the cache written before it is read
    by one Pallas kernel, in interpret mode here, one-pass LayerNorm, each block's LayerNorm
    folded into its products, its gains and shifts drawn away from 1 and 0) get every dense
    layer's kernel as `kernel_t` [features, in], run what applies to the model (`runs`), and
    decode, plainly and speculatively (rejected drafts in a ring), across slides, what this
    machine's kernels decode."""
    from test_model import with_norms_off_their_init

    from jaxgpt.kernels import gpu_decode

    prompts, n, params = [prompt(5, 7), prompt(20, 8)], 50, with_norms_off_their_init(params_for(cfg))
    expected = [generate(params, cfg, prompts, n, speculative=speculative, **GREEDY) for speculative in (False, True)]
    gpu = {name: getattr(gpu_kernels.KERNELS.for_decoding(), name)
           for name in ("transposed_decoding", "cache_written_first", "one_pass_layer_norm", "folded_layer_norm",
                        "written_attention")}
    # The set's own passes (train, eval, the harness's scoring) keep the two-pass norm, unfolded,
    # and the cache read before it is written.
    own = gpu_kernels.KERNELS
    assert all(gpu.values()) and not (own.cache_written_first or own.one_pass_layer_norm or own.folded_layer_norm)
    assert gpu["written_attention"] is gpu_decode.written_attention and gpu_kernels.KERNELS.written_attention is None
    took = set()  # whether the Pallas kernel took each pass

    def kernel(q, stack, new, place, window=None):
        ran.add("written_attention")
        written.add(q.shape[1])
        took.add(gpu_decode.applies(q, new))
        return gpu_decode.written_attention(q, stack, new, place, window, interpret=True)

    gpu["written_attention"] = kernel
    real_kernels, real_weights, read = generate_module._kernels, generate_module.decoding_weights, []
    monkeypatch.setattr(generate_module, "_kernels", lambda cfg, mesh: dataclasses.replace(real_kernels(cfg, mesh), **gpu))
    monkeypatch.setattr(generate_module, "decoding_weights",
                        lambda *args, **kwargs: read.append(real_weights(*args, **kwargs)) or read[-1])
    ran, written = set(), set()  # what ran; the lengths of the passes that wrote the cache first

    def spy(name, real, *args):
        ran.add(name)
        return real(*args)

    # The XLA ops of the cache written first run no plain block's pass: the kernel above takes them all.
    for name, label in (("written_attention", "written_attention (xla)"),
                        ("one_pass_layer_norm", "one_pass_layer_norm"),
                        ("layer_norm_statistics", "layer_norm_statistics")):
        monkeypatch.setattr(layers_module, name, functools.partial(spy, label, getattr(layers_module, name)))
    got = [generate(params, cfg, prompts, n, speculative=speculative, **GREEDY) for speculative in (False, True)]
    plain, drafting = (dict(leaf_names(weights.params)) for weights in read)
    down, C = plain["blocks.feed_forward.down.kernel_t"].shape, cfg.d_model
    assert down == (cfg.n_layers, C, cfg.hidden_size) and not any(name.endswith(".kernel") and "blocks" in name
                                                                   for name in plain)
    assert ("blocks.attention.qkv.norm_sum" in plain) == (cfg.norm == "layernorm")
    # Plain decoding never reads the adapters: their matrices keep their layout; drafting reads them transposed.
    assert any(name.startswith("mtp_0.") and name.endswith(".kernel") for name in plain)
    assert not any(name.startswith("mtp_0.") and name.endswith(".kernel") for name in drafting)
    assert got == expected and len(set(expected[0][1])) > 5 and ran == runs
    assert {1, 1 + cfg.mtp_depth} <= written  # a token, and a speculative block of it and its drafts
    assert took == {True}


@pytest.mark.parametrize("top_k, top_p", [(40, None), (40, 0.9), (3000, 0.5), (None, 0.9), (1, 0.5)])
def test_top_k_and_top_p_over_slices_of_a_large_vocabulary_draw_as_a_full_sort(top_k, top_p):
    """A vocabulary of 50,304 (and 50,299) ranked slice by slice (`largest`): the k largest values equal
    lax.top_k's, ties and excluded ids included, and every draw equals the full sort's."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50_304)).astype(np.float32) * 3
    logits[0, rng.choice(50_304, 300, replace=False)] = logits[0].max()  # ties with the largest
    logits[1, 1000:] = -np.inf  # a vocab limit below k's slices
    logits[2, :64] = np.round(logits[2, :64])  # ties with the k-th
    logits = jnp.asarray(logits)
    # 50,304 splits into slices of 1,048 (k = 1, 40) or 3,144 (k = 3,000); 50,299 into none, so
    # its slices are padded.
    for V, k in itertools.product((50_304, 50_299), (1, 40, 3000)):
        np.testing.assert_array_equal(generate_module.largest(logits[:, :V], k), jax.lax.top_k(logits[:, :V], k)[0])
    for seed in range(3):
        key = jax.random.key(seed)
        options = dict(temperature=1.0, top_k=top_k, top_p=top_p)
        np.testing.assert_array_equal(sample_logits(logits, key, **options), sorted_reference(logits, key, top_k, top_p))


@pytest.mark.parametrize("cfg", [dataclasses.replace(LEARNED, dtype="bfloat16"),
                                 dataclasses.replace(ROPE_GQA, dtype="bfloat16", tie_embeddings=False)],
                         ids=["tied", "untied"])
def test_decoding_weights_are_cast_once_and_decode_the_same_logits(cfg):
    """A bfloat16 model's matrices reach the decode programs in bfloat16 (each converted once,
    before the loop), a tied embedding keeps its float32 table for the lookups beside a bfloat16
    copy for the head, the norms stay float32; the logits of a cached pass are bitwise those of
    the params as trained. The CPU set, which promotes its weights to float32 before its own
    bfloat16 matmul, keeps every leaf as it is."""
    from jaxgpt.kernels import PORTABLE
    from jaxgpt.model.cache import init_cache
    from jaxgpt.model.decoder import forward_cached

    params = params_for(cfg)
    weights = generate_module.decoding_weights(params, cfg, kernels=PORTABLE)
    cast = dict(leaf_names(weights.params))
    dtypes = {name: leaf.dtype for name, leaf in cast.items()}
    assert dtypes["blocks.attention.qkv.kernel"] == dtypes["blocks.feed_forward.down.kernel"] == jnp.bfloat16
    assert dtypes["blocks.attention_norm.scale"] == dtypes["token_embedding.embedding"] == jnp.float32
    assert (weights.tied_head is not None) == cfg.tie_embeddings
    if cfg.tie_embeddings:
        assert weights.tied_head.dtype == jnp.bfloat16
    else:
        assert dtypes["lm_head.kernel"] == jnp.bfloat16
    tokens = jnp.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    cached = init_cache(cfg, 2, 16)
    want = forward_cached(params, cfg, tokens, cached, kernels=PORTABLE)[0]
    got = forward_cached(weights.params, cfg, tokens, cached, kernels=PORTABLE, tied_head=weights.tied_head)[0]
    np.testing.assert_array_equal(got, want)
    # Transposed for a set that reads its matrices so: each cast and transposed in one conversion.
    transposing = dataclasses.replace(PORTABLE, transposed_decoding=True)
    laid_out = generate_module.decoding_weights(params, cfg, kernels=transposing)
    down = dict(leaf_names(laid_out.params))["blocks.feed_forward.down.kernel_t"]
    assert down.dtype == jnp.bfloat16
    np.testing.assert_array_equal(down, jnp.swapaxes(cast["blocks.feed_forward.down.kernel"], 1, 2))
    got = forward_cached(laid_out.params, cfg, tokens, cached, kernels=transposing, tied_head=laid_out.tied_head)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # With the blocks' LayerNorms folded in too (the GPU sampler's): every leaf the fold keeps is
    # cast as above, a folded matrix is cast alike, its sums and bias stay float32.
    folding = dataclasses.replace(transposing, folded_layer_norm=True)
    folded = dict(leaf_names(generate_module.decoding_weights(params, cfg, kernels=folding).params))
    layers = tuple(name.removesuffix("norm_sum") for name in folded if name.endswith(".norm_sum"))
    made = {name for name in folded if name.startswith(layers)}  # the folded layers' leaves
    assert sorted(layers) == (["blocks.attention.qkv.", "blocks.feed_forward.up."] if cfg.norm == "layernorm" else [])
    assert {name: folded[name].dtype for name in set(folded) - made} == {
        name: leaf.dtype for name, leaf in leaf_names(laid_out.params) if name not in made}
    for name in made:
        assert folded[name].dtype == (jnp.bfloat16 if name.endswith("kernel_t") else jnp.float32), name
    cpu = choose_kernels(cfg)
    assert cpu.float32_activations  # this machine's set: its dense layers promote to float32
    kept = generate_module.decoding_weights(params, cfg, kernels=cpu).params
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(kept)} == {jnp.dtype(jnp.float32)}
