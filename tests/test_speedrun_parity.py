"""jaxgpt with the speedrun switches equals the two references they come from: modded-nanogpt's
model of January 2025 and nanochat's `GPT` (tests/speedrun_references.py rebuilds both in PyTorch
float32), loaded with the same random weights, logits within 1e-4, scanned and unscanned, and
modded-nanogpt's on rows that pack several documents.

Both references rotate by -theta where jaxgpt rotates by +theta; the scores depend only on the
angle between a query and a key, so the import negates the second half of every query and key
head, which turns one rotation into the other and which no RMS-norm sees.

nanochat's GPT is matched whole, through the import's own conversion of its state dict
(jaxgpt.nanochat): QK-norm (after the rotary: a rotation keeps the RMS, so the order does not
matter), the 1.2 query and key gains (model.attention_scale = 1.44 / sqrt(head_size)), ReLU², the
parameter-free norms (jaxgpt's RMSNorm gains held at 1), the embedding norm, resid and x0 lambdas
(model.x0_mix), its smear, its backout, its gated value tables on alternating layers, grouped KV
heads, RoPE base 100,000, the untied head, softcap 15, windows shorter than the input and a
vocabulary padded to a multiple of 64.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from speedrun_references import ModdedGPT, NanochatGPT

from jaxgpt.config import ModelConfig
from jaxgpt.errors import UserError
from jaxgpt.model.decoder import document_segments, forward, stack_blocks
from jaxgpt.model.layers import without_own_value
from jaxgpt.model.shortcuts import bigram_rows
from jaxgpt.nanochat import model_config, params_from_state, state_from_params

EPS = float(torch.finfo(torch.float32).eps)  # F.rms_norm's epsilon when none is given
V, T, C, HEADS = 128, 32, 64, 4
MODDED = ModelConfig(
    vocab_size=V, context_length=T, d_model=C, n_layers=6, n_heads=HEADS, position="rope", rope_truncated=True,
    rope_base=1024.0, norm="rmsnorm", norm_eps=EPS, qk_norm=True, embed_norm=True, feed_forward="relu2",
    tie_embeddings=False, logit_softcap=15.0, x0_mix=True, unet_skips=True, value_embeds=2, scan_layers=False)


def randomised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every weight drawn at random, at a spread that keeps the logits below the cap's flat part."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            spread = 0.3 if "lambda" in name or "skip" in name else (1.0 if "embed" in name or "wte" in name else 0.15)
            p.copy_(torch.randn(p.shape, generator=generator) * spread + (1.0 if "resid" in name else 0.0))
    return model


def flip_rotation(w_out_in: np.ndarray, heads: int) -> np.ndarray:
    """A query or key projection [heads * D, C] with the second half of each head negated."""
    w = w_out_in.reshape(heads, 2, -1, w_out_in.shape[-1]).copy()
    w[:, 1] *= -1
    return w.reshape(w_out_in.shape)


def t(x: torch.Tensor) -> np.ndarray:
    return x.detach().numpy().astype(np.float32)


def block_params(cfg, q, k, v, proj, fc, mlp_proj, x0_mix, value_mix=None):
    """One jaxgpt block from a reference's [out, in] matrices."""
    qkv = np.concatenate([flip_rotation(q, cfg.n_heads), flip_rotation(k, cfg.kv_heads), v]).T
    ones = np.ones(cfg.d_model, np.float32)
    attention = {"qkv": {"kernel": qkv}, "out": {"kernel": proj.T}}
    if value_mix is not None:
        attention["value_mix"] = value_mix
    return {"attention": attention, "feed_forward": {"up": {"kernel": fc.T}, "down": {"kernel": mlp_proj.T}},
            "attention_norm": {"scale": ones}, "feed_forward_norm": {"scale": ones}, "x0_mix": x0_mix}


def modded_params(ref: ModdedGPT, cfg: ModelConfig) -> dict:
    params = {f"block_{i}": block_params(
        cfg, t(ref.c_q[i].weight), t(ref.c_k[i].weight), t(ref.c_v[i].weight), t(ref.c_proj[i].weight),
        t(ref.c_fc[i].weight), t(ref.mlp_proj[i].weight), t(ref.block_lambdas[i]), t(ref.attn_lambdas[i]))
        for i in range(cfg.n_layers)}
    params.update(
        token_embedding={"embedding": t(ref.embed.weight)}, lm_head={"kernel": t(ref.lm_head.weight).T},
        final_norm={"scale": np.ones(cfg.d_model, np.float32)}, skip_weights=t(ref.skip_weights)[: cfg.n_layers // 2],
        value_embeds=np.stack([t(table.weight) for table in ref.value_embeds]))
    if cfg.exclusive_self_attention:
        for i in range(cfg.n_layers):
            params[f"block_{i}"]["attention"]["xsa_alpha"] = t(ref.xsa_alphas[i])
    if cfg.bigram_hash_rows:
        params["bigram_embed"] = t(ref.bigram_embed.weight)
        for i in range(cfg.n_layers):
            params[f"block_{i}"]["bigram_lambda"] = t(ref.bigram_lambdas[i:i + 1])
    return params


def check_equal(cfg: ModelConfig, params: dict, ref: torch.nn.Module, seed: int) -> None:
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (3, cfg.context_length))
    with torch.no_grad():
        want = ref(torch.from_numpy(tokens)).numpy()
    assert np.abs(want).max() > 1.0  # the logits carry the weights, not a near-constant
    for scan in (False, True):
        model = dataclasses.replace(cfg, scan_layers=scan)
        got = forward(stack_blocks(params, model) if scan else params, model, tokens)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0, err_msg=f"scan_layers={scan}")


def check_equal_on_documents(cfg: ModelConfig, params: dict, ref: torch.nn.Module, seed: int, eots: list,
                             scan: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Rows that hold the end-of-text token (V - 1) only at `eots` (per row, where it opens the
    next document): jaxgpt's logits (unscanned `params`, scanned with `scan`), with segment ids
    counted as data.document_mask counts them, equal the reference's. Returns (the rows, the
    reference's logits)."""
    eot = V - 1
    tokens = np.random.default_rng(seed).integers(0, eot, (len(eots), T))
    for row, places in enumerate(eots):
        tokens[row, places] = eot
    with torch.no_grad():
        want = ref(torch.from_numpy(tokens), eot).numpy()
    model = dataclasses.replace(cfg, scan_layers=scan)
    got = forward(stack_blocks(params, model) if scan else params, model, tokens,
                  segment_ids=document_segments(tokens, eot))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)
    return tokens, want


def test_equals_modded_nanogpt_of_january_2025():
    ref = randomised(ModdedGPT(V, MODDED.n_layers, HEADS, C, MODDED.value_embeds), seed=0)
    check_equal(MODDED, modded_params(ref, MODDED), ref, seed=1)


def test_equals_modded_nanogpt_with_its_bigram_hash_embedding_on_rows_and_packed_documents():
    cfg = dataclasses.replace(MODDED, bigram_hash_rows=5 * V)
    ref = randomised(ModdedGPT(V, cfg.n_layers, HEADS, C, cfg.value_embeds, cfg.bigram_hash_rows), seed=6)
    params = modded_params(ref, cfg)
    check_equal(cfg, params, ref, seed=7)
    tokens, want = check_equal_on_documents(cfg, params, ref, 8, [[6, 20], [11]])
    unread = {**params, "bigram_embed": np.zeros_like(params["bigram_embed"])}
    assert np.abs(np.asarray(forward(unread, cfg, tokens[:, :8])) - want[:, :8]).max() > 1e-2  # the table counts


def test_equals_modded_nanogpt_with_its_learnable_exclusive_self_attention():
    cfg = dataclasses.replace(MODDED, exclusive_self_attention=True)
    ref = randomised(ModdedGPT(V, cfg.n_layers, HEADS, C, cfg.value_embeds, xsa=True), seed=10)
    with torch.no_grad():
        ref.xsa_alphas.copy_(torch.randn(ref.xsa_alphas.shape, generator=torch.Generator().manual_seed(11)))
    params = modded_params(ref, cfg)
    check_equal(cfg, params, ref, seed=12)
    tokens = np.random.default_rng(12).integers(0, V, (3, T))
    plain = forward(modded_params(ref, MODDED), MODDED, tokens)
    assert np.abs(np.asarray(forward(params, cfg, tokens) - plain)).max() > 1e-2  # the heads lose their own values


def test_equals_modded_nanogpt_with_paired_head_attention_on_rows_and_packed_documents():
    """Blocks 0 and 3 of six pair their heads (the scanned stack picks per block), on whole rows
    and on rows that pack documents; the pairing changes the logits."""
    cfg = dataclasses.replace(MODDED, paired_head_layers=(0, 3))
    ref = randomised(ModdedGPT(V, cfg.n_layers, HEADS, C, cfg.value_embeds, paired=cfg.paired_head_layers), seed=14)
    params = modded_params(ref, cfg)
    check_equal(cfg, params, ref, seed=15)
    tokens, _ = check_equal_on_documents(cfg, params, ref, 16, [[5, 19], [12]], scan=True)
    plain = forward(params, MODDED, tokens)
    assert np.abs(np.asarray(forward(params, cfg, tokens) - plain)).max() > 1e-2  # the pairs read each other


def test_exclusive_self_attention_leaves_no_part_along_each_heads_own_value():
    """Grouped heads: each query head is cleared along its KV head's value for the token, wholly at
    strength 1, not at all at 0, in proportion between."""
    rng = np.random.default_rng(13)
    out, v = jnp.asarray(rng.normal(size=(2, 5, 4, 8)), jnp.float32), jnp.asarray(rng.normal(size=(2, 5, 2, 8)), jnp.float32)
    own = jnp.repeat(v, 2, axis=2)  # heads 0 and 1 read KV head 0, heads 2 and 3 KV head 1
    along = lambda y: jnp.sum(y * own, -1) / jnp.linalg.norm(own, axis=-1)  # noqa: E731
    np.testing.assert_allclose(along(without_own_value(out, v, jnp.ones(4))), 0.0, atol=1e-5)
    np.testing.assert_array_equal(without_own_value(out, v, jnp.zeros(4)), out)
    half = without_own_value(out, v, jnp.array([0.5, 1.0, 0.0, 0.5]))
    np.testing.assert_allclose(along(half), along(out) * jnp.array([0.5, 0.0, 1.0, 0.5]), atol=1e-5)


def test_the_bigram_hash_is_the_records_past_int32():
    """Ids whose products with the multipliers pass 2^31 wrap alike in both."""
    ref = ModdedGPT(V, 2, HEADS, C, 0, bigram_rows=251_903)
    tokens = np.random.default_rng(9).integers(0, 200_000, (3, 40))
    want = ref.bigram_hash(torch.from_numpy(tokens), None).numpy()
    got = bigram_rows(jnp.asarray(tokens), None, jnp.broadcast_to(jnp.arange(40), tokens.shape), 251_903)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert (36313 * tokens.astype(np.int64) >= 2**31).any()


def test_equals_modded_nanogpt_on_packed_documents():
    """Rows that pack several documents (end-of-text tokens inside them): jaxgpt's segment ids,
    counted as data.document_mask counts them, give modded-nanogpt's document mask. Its rotary
    counts positions from the row's start, jaxgpt's from each document's: a rotary score reads
    only the distance between query and key, the same both ways."""
    ref = randomised(ModdedGPT(V, MODDED.n_layers, HEADS, C, MODDED.value_embeds), seed=4)
    tokens, want = check_equal_on_documents(MODDED, modded_params(ref, MODDED), ref, 5, [[5, 17], [0], [9, 10, 30]])
    with torch.no_grad():
        plain = ref(torch.from_numpy(tokens)).numpy()
    assert np.abs(plain - want).max() > 1e-2  # the documents matter


def nanochat(seed: int) -> tuple[NanochatGPT, ModelConfig]:
    """nanochat's GPT of a vocabulary it pads (100 to 128), 5 layers (so 3 value tables), grouped
    KV heads and S windows of 7 (8 keys) on 32-token inputs, every weight random: the smear,
    backout, gates and tables all live."""
    gpt = {"sequence_len": T, "vocab_size": 100, "n_layer": 5, "n_head": HEADS, "n_kv_head": 2, "n_embd": C,
           "window_pattern": "SSL"}
    ref = NanochatGPT(gpt["vocab_size"], T, gpt["n_layer"], HEADS, gpt["n_kv_head"], C, "SSL", short_window=7)
    return randomised(ref, seed), model_config(gpt, short=7, scan_layers=False)


def test_equals_nanochat_with_every_feature_live():
    ref, cfg = nanochat(seed=2)
    assert [w for w in cfg.block_windows()] == [8, 8, 0, 8, 0] and ref.windows == [7, 7, T, 7, T]
    state = {key: t(value) for key, value in ref.state_dict().items()}
    assert state["transformer.wte.weight"].shape[0] == 128 and cfg.vocab_size == 100
    check_equal(cfg, params_from_state(state, cfg), ref, seed=3)


@pytest.mark.parametrize("feature", ["smear_lambda", "backout_lambda", "value_embeds", "ve_gate", "windows"])
def test_each_nanochat_feature_matters_to_the_match(feature):
    ref, cfg = nanochat(seed=2)
    state = {key: t(value) for key, value in ref.state_dict().items()}
    if feature == "windows":
        cfg = dataclasses.replace(cfg, attention_window=0)
    for key in state:
        if key.startswith(feature) or key.endswith(f"{feature}.weight"):
            state[key] = np.zeros_like(state[key])
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (3, T))
    with torch.no_grad():
        want = ref(torch.from_numpy(tokens)).numpy()
    assert np.abs(np.asarray(forward(params_from_state(state, cfg), cfg, tokens)) - want).max() > 1e-2


def test_nanochat_state_dicts_go_there_and_back():
    ref, cfg = nanochat(seed=4)
    state = {key: t(value) for key, value in ref.state_dict().items()}
    for scan in (False, True):
        model = dataclasses.replace(cfg, scan_layers=scan)
        back = state_from_params(params_from_state(state, model), model)
        assert set(back) == set(state)
        for key, value in state.items():
            if "wte" in key or "lm_head" in key or "value_embeds" in key:  # the padding rows: zeros, never read
                np.testing.assert_array_equal(back[key][: cfg.vocab_size], value[: cfg.vocab_size], err_msg=key)
                assert not back[key][cfg.vocab_size:].any()
            else:
                np.testing.assert_array_equal(back[key], value, err_msg=key)


def test_nanochat_windows_follow_its_rule():
    """S is a quarter of the context rounded up to 128 (FA3's left size; jaxgpt counts the query's
    own key too), the last layer always L; a window as long as the context is none."""
    gpt = {"vocab_size": 100, "n_head": 4, "n_kv_head": 4, "n_embd": 64, "window_pattern": "SSSL"}
    cfg = model_config({**gpt, "sequence_len": 2048, "n_layer": 6})
    assert cfg.block_windows() == (513, 513, 513, 0, 513, 0)
    assert model_config({**gpt, "sequence_len": 1000, "n_layer": 3}).block_windows() == (257, 257, 0)
    assert model_config({**gpt, "sequence_len": 256, "n_layer": 4}).block_windows() == (129, 129, 129, 0)
    assert model_config({**gpt, "sequence_len": 128, "n_layer": 4}).attention_window == 0


def test_a_state_dict_of_another_model_is_one_line():
    ref, cfg = nanochat(seed=2)
    state = {key: t(value) for key, value in ref.state_dict().items()}
    state["transformer.h.9.attn.c_q.weight"] = state.pop("transformer.h.0.attn.c_q.weight")
    with pytest.raises(UserError, match="unexpected transformer.h.9.attn.c_q.weight; missing transformer.h.0.attn.c_q"):
        params_from_state(state, cfg)


@pytest.mark.parametrize("switch", ["unet_skips", "x0_mix", "value_embeds"])
def test_each_shortcut_matters_to_the_match(switch):
    """The references differ from jaxgpt without each shortcut: the match is not vacuous."""
    ref = randomised(ModdedGPT(V, MODDED.n_layers, HEADS, C, MODDED.value_embeds), seed=0)
    params = modded_params(ref, MODDED)
    if switch == "unet_skips":
        params["skip_weights"] = np.zeros_like(params["skip_weights"])
    elif switch == "x0_mix":
        for i in range(MODDED.n_layers):
            params[f"block_{i}"]["x0_mix"] = np.array([1.0, 0.0], np.float32)
    else:
        params["value_embeds"] = np.zeros_like(params["value_embeds"])
    tokens = np.random.default_rng(1).integers(0, V, (3, T))
    with torch.no_grad():
        want = ref(torch.from_numpy(tokens)).numpy()
    assert np.abs(np.asarray(forward(params, MODDED, tokens)) - want).max() > 1e-2
