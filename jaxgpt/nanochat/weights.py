"""nanochat's `GPT` (nanochat/gpt.py) as a jaxgpt model: its config's keys and its state dict's
tensors to jaxgpt's and back, as numpy arrays (no PyTorch here).

    nanochat                                   jaxgpt
    transformer.wte.weight [V64, C]            token_embedding.embedding [V, C] (the padding cropped)
    lm_head.weight [V64, C]                    lm_head.kernel [C, V]
    transformer.h.i.attn.c_q/c_k/c_v.weight    block_i.attention.qkv.kernel [C, (H + 2K) D]
    transformer.h.i.attn.c_proj.weight         block_i.attention.out.kernel
    transformer.h.i.attn.ve_gate.weight [K,12] block_i.attention.value_gate.kernel [12, K] (zeros where none)
    transformer.h.i.mlp.c_fc / c_proj.weight   block_i.feed_forward.up / down.kernel
    resid_lambdas[i], x0_lambdas[i]            block_i.x0_mix [2]
    value_embeds.i.weight                      value_embeds [n, V, K D] (model.value_embeds_layout = "alternating")
    smear_gate.weight [1, 24], smear_lambda    smear_gate.kernel [24, 1], smear_lambda
    backout_lambda                             backout_lambda

V64 is the vocabulary padded to a multiple of 64: its rows past V are never looked up and its
logits past V are cropped, so the import drops them and the export pads them with zeros.
nanochat rotates by -theta where jaxgpt rotates by +theta: the second half of every query and
key head is negated, which turns one rotation into the other and which no RMS-norm sees. Its
norms have no gains: jaxgpt's RMSNorm gains are 1 on import and are folded into the matrices that
read them on export. Its window (FA3's left size W) reads W + 1 keys (jaxgpt's
model.attention_window = W + 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.errors import UserError
from jaxgpt.model.shortcuts import value_table_plan

Params = dict[str, Any]
VOCAB_MULTIPLE = 64  # nanochat's GPT(pad_vocab_size_to=64)
FLOAT32_EPS = float(np.finfo(np.float32).eps)  # F.rms_norm's epsilon when none is given
CONFIG_KEYS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "window_pattern")


def short_window(sequence_len: int) -> int:
    """nanochat's S window (FA3's left size): a quarter of the context, rounded up to 128."""
    return -(-sequence_len // 4 // 128) * 128


def layer_letters(pattern: str, n_layer: int) -> str:
    """Each layer's letter: `pattern` tiled over the layers, the last one L (nanochat's last layer
    always reads the whole context)."""
    return (pattern.upper() * n_layer)[:n_layer - 1] + "L"


def padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def model_config(gpt_config: Mapping[str, Any], *, scan_layers: bool = True, short: int | None = None,
                 **more: Any) -> ModelConfig:
    """jaxgpt's model for nanochat's `GPTConfig` (meta.json's `model_config`). `short` overrides
    nanochat's S window (FA3's left size; tests use windows shorter than their inputs)."""
    missing = [key for key in CONFIG_KEYS if key not in gpt_config]
    if missing:
        raise UserError(f"nanochat's model_config lacks {', '.join(missing)}")
    n_layer, T, C, H = (int(gpt_config[k]) for k in ("n_layer", "sequence_len", "n_embd", "n_head"))
    pattern = str(gpt_config["window_pattern"]).upper()
    if not pattern or set(pattern) - {"S", "L"}:
        raise UserError(f"nanochat's window_pattern {pattern!r} must be letters S and L")
    letters = layer_letters(pattern, n_layer)
    window = (short_window(T) if short is None else short) + 1
    if window >= T or "S" not in letters:  # a window as long as the context is none (the letters kept for export)
        window = 0
    if C % H:
        raise UserError(f"nanochat's n_embd {C} is not divisible by n_head {H}")
    return ModelConfig(
        vocab_size=int(gpt_config["vocab_size"]), context_length=T, d_model=C, n_layers=n_layer, n_heads=H,
        kv_heads=int(gpt_config["n_kv_head"]), position="rope", rope_base=100000.0, norm="rmsnorm",
        norm_eps=FLOAT32_EPS, qk_norm=True, attention_scale=1.2**2 / (C // H) ** 0.5, embed_norm=True,
        feed_forward="relu2", tie_embeddings=False, logit_softcap=15.0, x0_mix=True,
        value_embeds=(n_layer + 1) // 2, value_embeds_layout="alternating", value_gate=True, smear=True,
        backout=True, init_scheme="nanochat", attention_window=window, window_pattern=letters,
        scan_layers=scan_layers, **more)


# What nanochat's GPT computes that a ModelConfig may change: its value, key by key (the shape keys
# and the windows are nanochat's own: vocab_size ... n_layers, and its rule for the window).
HOW_IT_RUNS = ("scan_layers", "remat", "kernels", "dtype", "init_scheme", "init_std", "dropout", "zero_init",
               "hidden_init_scale", "zero_init_readout", "zero_init_query")


def gpt_config(cfg: ModelConfig) -> dict[str, Any]:
    """nanochat's GPTConfig fields (meta.json's `model_config`) of `cfg`'s shape: `model_config`
    read backwards. The window letters are each block's, or the config's own where they hold one
    per layer at a context nanochat's S window covers whole (no window to read them from)."""
    letters = "".join("S" if w else "L" for w in cfg.block_windows())
    if not cfg.attention_window and len(cfg.window_pattern) == cfg.n_layers:
        letters = cfg.window_pattern
    return {"sequence_len": cfg.context_length, "vocab_size": cfg.vocab_size, "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads, "n_kv_head": cfg.kv_heads, "n_embd": cfg.d_model, "window_pattern": letters}


def refusal(cfg: ModelConfig) -> str:
    """"" where nanochat's GPT holds `cfg`'s model, else what it cannot hold, naming the key."""
    if cfg.d_model < 24:
        return f"model.d_model = {cfg.d_model}: nanochat's smear reads 24 channels"
    theirs = model_config(gpt_config(cfg), scan_layers=cfg.scan_layers)
    for f in dataclasses.fields(ModelConfig):
        if f.name in HOW_IT_RUNS or f.name in ("attention_window", "window_pattern"):
            continue
        if getattr(cfg, f.name) != getattr(theirs, f.name):
            return f"model.{f.name} = {getattr(cfg, f.name)!r} (nanochat's GPT has {getattr(theirs, f.name)!r})"
    if cfg.block_windows() != theirs.block_windows():
        return (f"model.attention_window = {cfg.attention_window} over window_pattern {cfg.window_pattern!r} "
                f"(nanochat's GPT at context {cfg.context_length} has windows {list(theirs.block_windows())})")
    return ""


def _flip_rotation(w_out_in: np.ndarray, heads: int) -> np.ndarray:
    """A query or key projection [heads * D, C] with the second half of each head negated (its
    own inverse)."""
    w = w_out_in.reshape(heads, 2, -1, w_out_in.shape[-1]).copy()
    w[:, 1] *= -1
    return w.reshape(w_out_in.shape)


def _value_layers(n_layer: int) -> list[int]:
    """The layers nanochat gives a value table: every other one, the last always."""
    _, feeds = value_table_plan(n_layer, n_layer, "alternating")
    return [int(i) for i in np.flatnonzero(feeds)]


def expected_keys(cfg: ModelConfig) -> set[str]:
    """The state dict keys of nanochat's GPT of `cfg`'s shape."""
    keys = {"transformer.wte.weight", "lm_head.weight", "resid_lambdas", "x0_lambdas", "smear_gate.weight",
            "smear_lambda", "backout_lambda"}
    for i in range(cfg.n_layers):
        keys |= {f"transformer.h.{i}.attn.{m}.weight" for m in ("c_q", "c_k", "c_v", "c_proj")}
        keys |= {f"transformer.h.{i}.mlp.{m}.weight" for m in ("c_fc", "c_proj")}
    for i in _value_layers(cfg.n_layers):
        keys |= {f"value_embeds.{i}.weight", f"transformer.h.{i}.attn.ve_gate.weight"}
    return keys


def params_from_state(state: Mapping[str, np.ndarray], cfg: ModelConfig) -> Params:
    """jaxgpt's params (float32, the layout `cfg.scan_layers` names) from nanochat's state dict
    (its `_orig_mod.` prefix, torch.compile's, dropped); a key too many or too few is one line."""
    state = {key.removeprefix("_orig_mod."): np.asarray(value, np.float32) for key, value in state.items()}
    want = expected_keys(cfg)
    unknown, missing = sorted(set(state) - want), sorted(want - set(state))
    if unknown or missing:
        raise UserError("nanochat's state dict does not hold a GPT of this config: "
                        + "; ".join(part for part in (f"unexpected {', '.join(unknown[:4])}" if unknown else "",
                                                      f"missing {', '.join(missing[:4])}" if missing else "") if part))
    V, C, K, L = cfg.vocab_size, cfg.d_model, cfg.kv_heads, cfg.n_layers
    wte = state["transformer.wte.weight"]
    if wte.shape[0] < V or wte.shape[1] != C:
        raise UserError(f"nanochat's token embedding is {list(wte.shape)}, the config's [{V} (padded), {C}]")
    resid, x0 = state["resid_lambdas"], state["x0_lambdas"]
    ones = np.ones(C, np.float32)
    params: Params = {}
    for i in range(L):
        at = f"transformer.h.{i}."
        qkv = np.concatenate([_flip_rotation(state[at + "attn.c_q.weight"], cfg.n_heads),
                              _flip_rotation(state[at + "attn.c_k.weight"], K), state[at + "attn.c_v.weight"]]).T
        gate = state.get(at + "attn.ve_gate.weight", np.zeros((K, 12), np.float32)).T
        params[f"block_{i}"] = {
            "attention": {"qkv": {"kernel": qkv}, "out": {"kernel": state[at + "attn.c_proj.weight"].T},
                          "value_gate": {"kernel": gate}},
            "feed_forward": {"up": {"kernel": state[at + "mlp.c_fc.weight"].T},
                             "down": {"kernel": state[at + "mlp.c_proj.weight"].T}},
            "attention_norm": {"scale": ones}, "feed_forward_norm": {"scale": ones},
            "x0_mix": np.array([resid[i], x0[i]], np.float32)}
    params.update(
        token_embedding={"embedding": wte[:V]}, lm_head={"kernel": state["lm_head.weight"][:V].T},
        final_norm={"scale": ones}, smear_gate={"kernel": state["smear_gate.weight"].T},
        smear_lambda=state["smear_lambda"].reshape(1), backout_lambda=state["backout_lambda"].reshape(1),
        value_embeds=np.stack([state[f"value_embeds.{i}.weight"][:V] for i in _value_layers(L)]))
    if cfg.scan_layers:
        blocks = [params.pop(f"block_{i}") for i in range(L)]
        params["blocks"] = _stacked(blocks)
    return params


def _stacked(trees: list[Any]) -> Any:
    if isinstance(trees[0], dict):
        return {key: _stacked([tree[key] for tree in trees]) for key in trees[0]}
    return np.stack(trees)


def _layer(params: Params, cfg: ModelConfig, i: int) -> Params:
    if not cfg.scan_layers:
        return params[f"block_{i}"]

    def take(tree: Any) -> Any:
        return {key: take(value) for key, value in tree.items()} if isinstance(tree, dict) else np.asarray(tree)[i]

    return take(params["blocks"])


def state_from_params(params: Params, cfg: ModelConfig, fold_gains: bool = True) -> dict[str, np.ndarray]:
    """nanochat's state dict (float32 numpy, the vocabulary padded with zero rows to a multiple of
    64) from jaxgpt's params of a model `model_config` describes (`refusal` says ""). The RMSNorm
    gains jaxgpt trains are folded into the matrices that read the norms (nanochat's norms have
    none), so the state dict computes what the params do; `fold_gains=False` for a tree that is
    not weights (gradients, updates), converted entry by entry."""
    gain = (lambda norm: np.asarray(norm["scale"], np.float32)) if fold_gains else (
        lambda norm: np.ones(cfg.d_model, np.float32))
    V, K, D, L = cfg.vocab_size, cfg.kv_heads, cfg.head_size, cfg.n_layers
    pad = padded_vocab(V) - V
    final_gain = gain(params["final_norm"])

    def rows(x: Any) -> np.ndarray:
        x = np.asarray(x, np.float32)
        return np.concatenate([x, np.zeros((pad, *x.shape[1:]), np.float32)])

    state = {"transformer.wte.weight": rows(params["token_embedding"]["embedding"]),
             "lm_head.weight": rows((final_gain[:, None] * np.asarray(params["lm_head"]["kernel"], np.float32)).T),
             "smear_gate.weight": np.asarray(params["smear_gate"]["kernel"], np.float32).T,
             "smear_lambda": np.asarray(params["smear_lambda"], np.float32).reshape(1),
             "backout_lambda": np.asarray(params["backout_lambda"], np.float32).reshape(1)}
    lambdas = np.stack([np.asarray(_layer(params, cfg, i)["x0_mix"], np.float32) for i in range(L)])
    state.update(resid_lambdas=lambdas[:, 0].copy(), x0_lambdas=lambdas[:, 1].copy())
    H = cfg.n_heads
    for i in range(L):
        block, at = _layer(params, cfg, i), f"transformer.h.{i}."
        # The gains of the norms before the projections folded into the matrices they feed
        # (nanochat's norms have none): W (g * x) = (W diag(g)) x.
        attention_gain = gain(block["attention_norm"])[:, None]
        feed_forward_gain = gain(block["feed_forward_norm"])[:, None]
        qkv = (attention_gain * np.asarray(block["attention"]["qkv"]["kernel"], np.float32)).T
        state[at + "attn.c_q.weight"] = _flip_rotation(qkv[:H * D], H)
        state[at + "attn.c_k.weight"] = _flip_rotation(qkv[H * D:(H + K) * D], K)
        state[at + "attn.c_v.weight"] = qkv[(H + K) * D:].copy()
        state[at + "attn.c_proj.weight"] = np.asarray(block["attention"]["out"]["kernel"], np.float32).T
        state[at + "mlp.c_fc.weight"] = (feed_forward_gain * np.asarray(block["feed_forward"]["up"]["kernel"], np.float32)).T
        state[at + "mlp.c_proj.weight"] = np.asarray(block["feed_forward"]["down"]["kernel"], np.float32).T
    for table, i in enumerate(_value_layers(L)):
        state[f"value_embeds.{i}.weight"] = rows(np.asarray(params["value_embeds"])[table])
        block = _layer(params, cfg, i)
        gate_gain = gain(block["attention_norm"])[:12, None]  # the gate reads the normed input's first 12
        gate = gate_gain * np.asarray(block["attention"]["value_gate"]["kernel"], np.float32)
        state[f"transformer.h.{i}.attn.ve_gate.weight"] = gate.T.copy()
    return state


def without_gain_gradients(grads: Params) -> Params:
    """Gradients from nanochat's (`params_from_state` of its gradient tensors) with the RMSNorm
    gains', which nanochat's GPT does not have, at zero: the gains then stay at 1."""
    def zeroed(tree: Any, name: str = "") -> Any:
        if isinstance(tree, dict):
            return {key: zeroed(value, key) for key, value in tree.items()}
        return np.zeros_like(tree) if name == "scale" else tree
    return zeroed(grads)
