"""jaxgpt with the speedrun switches equals the two references they come from: modded-nanogpt's
model of January 2025 and nanochat's `GPT` (tests/speedrun_references.py rebuilds both in PyTorch
float32), loaded with the same random weights, logits within 1e-4, scanned and unscanned, and
modded-nanogpt's on rows that pack several documents.

Both references rotate by -theta where jaxgpt rotates by +theta; the scores depend only on the
angle between a query and a key, so the import negates the second half of every query and key
head, which turns one rotation into the other and which no RMS-norm sees.

nanochat options covered: QK-norm (after the rotary: a rotation keeps the RMS, so the order does
not matter), the 1.2 query and key gains (model.attention_scale = 1.44 / sqrt(head_size)), ReLU²,
the parameter-free norms (jaxgpt's RMSNorm gains held at 1), the embedding norm, resid and x0
lambdas (model.x0_mix), grouped KV heads, RoPE base 100,000, the untied head, softcap 15, windows
wider than the input. Not covered: its smear, its backout and its gated value embeddings, which
these weights switch off (smear_lambda 0, backout_lambda 0, value tables 0).
"""

import dataclasses

import jax
import numpy as np
import pytest
import torch
from speedrun_references import ModdedGPT, NanochatGPT

from jaxgpt.config import ModelConfig
from jaxgpt.model.decoder import document_segments, forward, stack_blocks

EPS = float(torch.finfo(torch.float32).eps)  # F.rms_norm's epsilon when none is given
V, T, C, HEADS = 128, 32, 64, 4
MODDED = ModelConfig(
    vocab_size=V, context_length=T, d_model=C, n_layers=6, n_heads=HEADS, position="rope", rope_truncated=True,
    rope_base=1024.0, norm="rmsnorm", norm_eps=EPS, qk_norm=True, embed_norm=True, feed_forward="relu2",
    tie_embeddings=False, logit_softcap=15.0, x0_mix=True, unet_skips=True, value_embeds=2, scan_layers=False)
NANOCHAT = ModelConfig(
    vocab_size=V, context_length=T, d_model=C, n_layers=4, n_heads=HEADS, kv_heads=2, position="rope",
    rope_base=100000.0, norm="rmsnorm", norm_eps=EPS, qk_norm=True, attention_scale=1.44 / (C // HEADS) ** 0.5,
    embed_norm=True, feed_forward="relu2", tie_embeddings=False, logit_softcap=15.0, x0_mix=True, scan_layers=False)


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
    return params


def nanochat_params(ref: NanochatGPT, cfg: ModelConfig) -> dict:
    params = {f"block_{i}": block_params(
        cfg, t(ref.c_q[i].weight), t(ref.c_k[i].weight), t(ref.c_v[i].weight), t(ref.c_proj[i].weight),
        t(ref.c_fc[i].weight), t(ref.mlp_proj[i].weight),
        np.array([t(ref.resid_lambdas)[i], t(ref.x0_lambdas)[i]], np.float32)) for i in range(cfg.n_layers)}
    params.update(token_embedding={"embedding": t(ref.wte.weight)}, lm_head={"kernel": t(ref.lm_head.weight).T},
                  final_norm={"scale": np.ones(cfg.d_model, np.float32)})
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


def test_equals_modded_nanogpt_of_january_2025():
    ref = randomised(ModdedGPT(V, MODDED.n_layers, HEADS, C, MODDED.value_embeds), seed=0)
    check_equal(MODDED, modded_params(ref, MODDED), ref, seed=1)


def test_equals_modded_nanogpt_on_packed_documents():
    """Rows that pack several documents (end-of-text tokens inside them): jaxgpt's segment ids,
    counted as data.document_mask counts them, give modded-nanogpt's document mask. Its rotary
    counts positions from the row's start, jaxgpt's from each document's: a rotary score reads
    only the distance between query and key, the same both ways."""
    eot = V - 1
    ref = randomised(ModdedGPT(V, MODDED.n_layers, HEADS, C, MODDED.value_embeds), seed=4)
    tokens = np.random.default_rng(5).integers(0, eot, (3, T))
    tokens[0, [5, 17]] = tokens[1, 0] = tokens[2, [9, 10, 30]] = eot
    with torch.no_grad():
        want = ref(torch.from_numpy(tokens), eot).numpy()
        plain = ref(torch.from_numpy(tokens)).numpy()
    got = np.asarray(forward(modded_params(ref, MODDED), MODDED, tokens, segment_ids=document_segments(tokens, eot)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.abs(plain - want).max() > 1e-2  # the documents matter


def test_equals_nanochat_where_its_block_uses_jaxgpt_switches():
    ref = randomised(NanochatGPT(V, T, NANOCHAT.n_layers, HEADS, NANOCHAT.kv_heads, C), seed=2)
    with torch.no_grad():  # what jaxgpt does not express, switched off
        ref.smear_lambda.zero_()
        ref.backout_lambda.zero_()
        for table in ref.value_embeds.values():
            table.weight.zero_()
    check_equal(NANOCHAT, nanochat_params(ref, NANOCHAT), ref, seed=3)


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
