"""Sliding-window attention (model.attention_window, model.window_pattern): what a query reads,
the pattern over the blocks, cached decoding equal to the windowed forward pass."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SPEEDRUN

from jaxgpt.config import ConfigError, load_config
from jaxgpt.errors import UserError
from jaxgpt.evaluation import generate as generate_module
from jaxgpt.evaluation.generate import generate, lower_decoding
from jaxgpt.kernels import PORTABLE, choose_kernels
from jaxgpt.model import layers as layers_module
from jaxgpt.model.cache import init_cache
from jaxgpt.model.decoder import forward, forward_cached, init_params
from jaxgpt.model.shortcuts import window_plan
from jaxgpt.train.runtime import make_runtime
from jaxgpt.train.step import compile_steps
from jaxgpt.train.window_warmup import window_at

TINY = ["model.vocab_size=64", "model.d_model=32", "model.n_heads=4", "model.context_length=32"]


def model(*overrides):
    cfg = load_config(None, [*TINY, *overrides]).model
    params = init_params(cfg, jax.random.key(0))
    return cfg, jax.tree_util.tree_map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(2), p.shape), params)


def moved(cfg, params, kernels=PORTABLE):
    """[T]: whether each position's logits move when the first token changes."""
    tokens = jax.random.randint(jax.random.key(1), (1, 24), 1, 64)
    a = forward(params, cfg, tokens, kernels=kernels)
    b = forward(params, cfg, tokens.at[0, 0].set(0), kernels=kernels)
    return np.abs(np.asarray(a - b)).max(axis=(0, 2)) > 1e-6


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_a_window_of_w_hides_every_key_w_or_more_positions_back(position):
    cfg, params = model("model.n_layers=1", f"model.position={position}", "model.attention_window=4")
    for kernels in (PORTABLE, choose_kernels(cfg)):
        np.testing.assert_array_equal(moved(cfg, params, kernels), np.arange(24) < 4)
    full = dataclasses.replace(cfg, attention_window=0)
    assert moved(full, params).all()
    # Two windowed layers reach twice as far back (less one); a whole-context layer reaches everything.
    cfg, params = model("model.n_layers=2", f"model.position={position}", "model.attention_window=4")
    np.testing.assert_array_equal(moved(cfg, params), np.arange(24) < 7)
    assert moved(dataclasses.replace(cfg, window_pattern="SL"), params).all()


def test_the_pattern_cycles_over_the_blocks_and_a_long_window_is_the_whole_context():
    cfg = load_config(None, [*TINY, "model.n_layers=6", "model.attention_window=8", "model.window_pattern=SSL"]).model
    np.testing.assert_array_equal(window_plan(cfg), [8, 8, 0, 8, 8, 0])
    cfg, params = model("model.n_layers=2", "model.attention_window=32")
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 64)
    np.testing.assert_allclose(forward(params, cfg, tokens), forward(params, dataclasses.replace(cfg, attention_window=0),
                                                                     tokens), rtol=0, atol=1e-6)


@pytest.mark.parametrize("case", ["rope", "speedrun"])
def test_cached_decoding_equals_the_windowed_forward_pass(case):
    overrides = SPEEDRUN if case == "speedrun" else ["model.position=rope", "model.n_layers=2"]
    cfg, params = model(*[o for o in overrides if o.startswith("model.")], "model.attention_window=5",
                        "model.window_pattern=SL")
    tokens = jax.random.randint(jax.random.key(1), (2, 20), 0, 64)
    want = forward(params, cfg, tokens)
    cache = init_cache(cfg, 2, 24)
    first, cache = forward_cached(params, cfg, tokens[:, :6], cache, fresh=True)  # a prefill, then one at a time
    steps, step = [first], jax.jit(lambda tokens, cache: forward_cached(params, cfg, tokens, cache))
    prefilled = cache
    for t in range(6, 20):
        logits, cache = step(tokens[:, t:t + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), want, rtol=0, atol=2e-5)
    chunk, _ = step(tokens[:, 6:20], prefilled)
    np.testing.assert_allclose(chunk, want[:, 6:], rtol=0, atol=2e-5)  # several new tokens against the cache


def test_a_windowed_model_decodes_past_its_context_on_a_ring_of_its_window():
    """Every block windowed (W 4, RoPE): the cache is a ring of W slots (plus the draft's) whatever
    the length asked for, rings wrap over prefills and blocks of several tokens, and the sampler
    decodes past context_length (32) without sliding, plain and speculative, each token the
    windowed forward pass's greedy one."""
    cfg, params = model("model.position=rope", "model.n_layers=2", "model.attention_window=4", "model.mtp_depth=1")
    for n in (100, 10_000):
        state = lower_decoding(params, cfg, max_new_tokens=n)["advance"].args_info[0][1]
        assert state["cache"]["k"].shape == (2, 1, 4, 4, 8)  # [L, B, K, W, D]: the bytes do not follow n
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 64)
    want = forward(params, cfg, tokens)
    got, cache = forward_cached(params, cfg, tokens[:, :9], init_cache(cfg, 2, 5, ring=True), fresh=True)
    pieces, step = [got], jax.jit(lambda tokens, cache: forward_cached(params, cfg, tokens, cache))
    for a, b in ((9, 10), (10, 15), (15, 20), (20, 21), (21, 24)):  # the ring wraps inside blocks and between them
        logits, cache = step(tokens[:, a:b], cache)
        pieces.append(logits)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), want, rtol=0, atol=2e-5)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 10]]
    plain = generate(params, cfg, prompts, 40, temperature=0.0)
    assert generate(params, cfg, prompts, 40, temperature=0.0, speculative=True) == plain
    for prompt, new in zip(prompts, plain):
        row = jnp.array([prompt + new])
        np.testing.assert_array_equal(forward(params, cfg, row)[0, len(prompt) - 1:-1].argmax(-1), new)
    with pytest.raises(UserError, match=r"6 new tokens do not fit a ring cache of 5 slots"):
        forward_cached(params, cfg, tokens[:, :6], cache)
    long_short, _ = model("model.position=rope", "model.attention_window=4", "model.window_pattern=SL")
    with pytest.raises(UserError, match=r"a ring cache needs every block windowed"):
        init_cache(long_short, 1, 4, ring=True)
    with pytest.raises(UserError, match=r"window_slots=\.\.\.\) needs whole-context and windowed blocks both"):
        init_cache(cfg, 1, 4, window_slots=4)


@pytest.mark.parametrize("scan", [True, False])
def test_a_long_short_model_caches_each_block_as_far_as_it_reads(monkeypatch, scan):
    """Pattern SSL, W 4, learned positions: the whole-context block keeps the context, the two
    windowed ones rings of W slots (plus the draft's, when speculative); cached passes equal the forward pass, and
    the sampler's tokens equal those it decodes with whole-context caches for every block, plain,
    speculative and by documents, through slides past the context."""
    cfg, params = model("model.n_layers=3", "model.attention_window=4", "model.window_pattern=SSL", "model.mtp_depth=1",
                        f"model.scan_layers={str(scan).lower()}")
    state = lower_decoding(params, cfg, max_new_tokens=100)["advance"].args_info[0][1]
    cache = jax.tree_util.tree_map(lambda x: x.shape, state["cache"])
    assert cache["k"] == (1, 1, 4, 32, 8) and cache["ring"]["k"] == (2, 1, 4, 4, 8)  # [L, B, K, S or W, D]
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, 64)
    got, cache = forward_cached(params, cfg, tokens[:, :9], init_cache(cfg, 2, 24, window_slots=5), fresh=True)
    pieces, step = [got], jax.jit(lambda tokens, cache: forward_cached(params, cfg, tokens, cache))
    for a, b in ((9, 10), (10, 15), (15, 20), (20, 21), (21, 24)):
        logits, cache = step(tokens[:, a:b], cache)
        pieces.append(logits)
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), forward(params, cfg, tokens), rtol=0, atol=2e-5)
    with pytest.raises(UserError, match=r"6 new tokens do not fit a ring cache of 5 slots"):
        forward_cached(params, cfg, tokens[:, :6], cache)

    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 10]]
    # Plain, speculative, and documents (token 3 opens one: prompt 0 starts its second document).
    runs = [dict(speculative=False), dict(speculative=True), dict(document_token=3)]
    layered = [generate(params, cfg, prompts, 50, temperature=0.0, **run) for run in runs]
    # The sampler's two programs traced anew with whole-context caches, and dropped again after:
    # they are cached by the config, which the patch leaves as it is.
    sampler = (generate_module._start, generate_module._advance, generate_module._slide)
    for program in sampler:
        program.clear_cache()
    monkeypatch.setattr(generate_module, "layered_cache_slots", lambda cfg, draft=0: 0)
    try:
        state = lower_decoding(params, cfg, max_new_tokens=100)["advance"].args_info[0][1]
        assert "ring" not in state["cache"] and state["cache"]["k"].shape == (3, 1, 4, 32, 8)
        assert layered == [generate(params, cfg, prompts, 50, temperature=0.0, **run) for run in runs]
    finally:
        for program in sampler:
            program.clear_cache()
    assert layered[2] != layered[0]  # the document mask matters


def test_bad_windows_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"model.attention_window = -1 must be >= 0"):
        load_config(None, ["model.attention_window=-1"])
    with pytest.raises(ConfigError, match=r"model.window_pattern = 'SXL' must be letters L"):
        load_config(None, ["model.attention_window=8", "model.window_pattern=SXL"])
    with pytest.raises(ConfigError, match=r"train.window_warmup_steps = 10 with model.attention_window = 0: there"):
        load_config(None, ["train.window_warmup_steps=10"])
    with pytest.raises(ConfigError, match=r"train.window_warmup_steps = -1 must be >= 0"):
        load_config(None, ["model.attention_window=8", "train.window_warmup_steps=-1"])


def test_the_window_warms_up_in_four_stages_of_their_own_programs():
    """The window grows W/4, W/2, 3W/4, W over the warm-up steps; the runtime runs each stage's
    own program (three beside the full window's), then the full one."""
    cfg = load_config(None, [*TINY, "model.n_layers=1", "model.attention_window=8", "train.window_warmup_steps=8",
                             "train.batch_size=8"])
    assert [window_at(cfg, s) for s in range(10)] == [2, 2, 4, 4, 6, 6, 8, 8, 8, 8]
    big = cfg.replace("model", attention_window=128).replace("train", window_warmup_steps=100)
    assert [window_at(big, s) for s in (0, 24, 25, 50, 75, 99, 100)] == [32, 32, 64, 96, 128, 128, 128]
    runtime = make_runtime(cfg)
    state = runtime.init_state()
    batch = np.asarray(jax.random.randint(jax.random.key(3), (8, 33), 0, 64), np.int32)
    losses = {}
    for step in (0, 2, 4, 6, 9):
        _, metrics = runtime.train_step(state, batch, step)  # the state is donated: each call from a fresh one
        state = runtime.init_state()
        losses[window_at(cfg, step)] = float(metrics["loss"])
    assert len(runtime._steps.stages) == 3 and len(set(losses.values())) == 4
    for window, loss in losses.items():
        staged = cfg.replace("model", attention_window=window)
        np.testing.assert_allclose(loss, float(compile_steps(staged)[1](state.params, batch)), rtol=1e-6)


def test_export_hf_refuses_a_windowed_model_in_one_line(tmp_path):
    from jaxgpt.errors import UserError
    from jaxgpt.hf.exporter import _check_exportable

    cfg = load_config(None, ["model.attention_window=8"]).model
    with pytest.raises(UserError, match=r"^cannot export to Hugging Face: model.attention_window = 8 \(Hugging Face"):
        _check_exportable(cfg)
    assert _check_exportable(dataclasses.replace(cfg, attention_window=0)) == "gpt2"


WRITTEN_FIRST = dataclasses.replace(PORTABLE, cache_written_first=True)
EOT = 63


@pytest.mark.parametrize("case, slots, documents, written_first", [
    ("whole", 24, False, {1, 3, 4}), ("unscanned", 24, True, {1, 3, 4}), ("ring", 6, True, {1, 3}),
    ("ring", 4, False, {1}), ("long-short", 6, False, {1, 3})])
def test_blocks_that_write_the_cache_before_reading_it_decode_as_the_forward_pass(case, slots, documents, written_first,
                                                                                  monkeypatch):
    """Kernels.cache_written_first (the GPU set's sampler's): each block writes its new keys and
    values into the stack of caches it carries, then reads its row alone. A prefill then blocks of
    1, 3 and 4 tokens, one of them with its last two taken back (a speculative block's rejected
    drafts, where the cache has the draft's slots), give the forward pass's logits and the cache
    the blocks write after reading it. A ring takes the write first only for blocks no longer
    than its slots beyond the window, plus one (`written_first`, the blocks' lengths): a longer
    one would write over keys its first queries read, so its blocks write after; a long-short
    model writes each block's keys into its own kind's stack. Some blocks of each case pair their
    heads, which read their row as twice the positions (`written_first` doubled)."""
    windows = {"whole": [*[o for o in SPEEDRUN if o.startswith("model.")], "model.attention_window=5",
                         "model.window_pattern=SL"],
               "unscanned": ["model.position=rope", "model.kv_heads=2", "model.scan_layers=false", "model.n_layers=2",
                             "model.paired_head_layers=[1]"],
               "ring": ["model.position=rope", "model.n_layers=2", "model.attention_window=4",
                        "model.paired_head_layers=[0]"],
               "long-short": ["model.position=rope", "model.n_layers=3", "model.attention_window=4",
                              "model.window_pattern=SSL", "model.paired_head_layers=[0, 2]"]}
    cfg, params = model(*windows[case])
    tokens = jax.random.randint(jax.random.key(4), (2, 20), 0, EOT)
    options, segments = {}, None
    if documents:  # none among the tokens taken back, so the floor after them stands
        tokens = tokens.at[0, 3].set(EOT).at[0, 11].set(EOT).at[1, 12].set(EOT).at[1, 13].set(EOT)
        options, segments = {"document_token": EOT}, jnp.cumsum(tokens == EOT, axis=1)
    want = forward(params, cfg, tokens, segment_ids=segments)
    taken_back = 2 if case in ("whole", "unscanned") or slots - cfg.attention_window >= 2 else 0
    passes = []
    real_read = layers_module.written_attention
    monkeypatch.setattr(layers_module, "written_attention", lambda q, *args: passes.append(q.shape[1]) or real_read(q, *args))
    caches = {}
    for name, kernels in (("after", PORTABLE), ("first", WRITTEN_FIRST)):
        empty = (init_cache(cfg, 2, 24, window_slots=slots) if case == "long-short" else
                 init_cache(cfg, 2, slots, ring=case == "ring", documents=documents))
        got, cache = forward_cached(params, cfg, tokens[:, :9], empty, fresh=True, kernels=kernels, **options)
        pieces, at = [got], 9
        step = jax.jit(lambda tokens, cache: forward_cached(params, cfg, tokens, cache, kernels=kernels, **options))
        for T, back in ((1, 0), (4, 0), (3, taken_back), (3, 0), (1, 0), (1, 0)):  # a ring of 4 or 6 wraps
            if at < tokens.shape[1]:
                logits, cache = step(tokens[:, at:at + T], cache)
                pieces.append(logits[:, :T - back])
                cache, at = {**cache, "index": cache["index"] - back}, at + T - back
        np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), want, rtol=0, atol=2e-5)
        caches[name] = cache
    assert set(passes) == written_first | {2 * T for T in written_first}
    assert jax.tree_util.tree_structure(caches["first"]) == jax.tree_util.tree_structure(caches["after"])
    jax.tree_util.tree_map_with_path(lambda path, first, after: np.testing.assert_allclose(
        first, after, rtol=0, atol=2e-5, err_msg=jax.tree_util.keystr(path)), caches["first"], caches["after"])
