"""Export to Hugging Face: config.json and model.safetensors that transformers loads as GPT-2
(learned positions) or Llama (RoPE), with the run's tokenizer beside them.

    export_hf(cfg, params, "path/to/out_dir", tokenizer="runs/a/tokenizer.json")

Flax Dense kernels are [in, out]; torch Linear weights are [out, in] (transposed here); GPT-2's
Conv1D weights are [in, out]. A model neither architecture can hold is refused with a ValueError
naming the option.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.errors import UserError
from jaxgpt.hf.importer import WEIGHTS, Params, safetensors_numpy


def _check_exportable(cfg: ModelConfig) -> str:
    """'gpt2' (learned positions) or 'llama' (RoPE); a ValueError naming an option neither holds."""
    def refuse(option: str, why: str) -> None:
        raise UserError(f"cannot export to Hugging Face: model.{option} = {getattr(cfg, option)!r} {why}")

    if cfg.residual != "pre":
        refuse("residual", "(Hugging Face GPT-2 and Llama are pre-norm)")
    if cfg.qk_norm:
        refuse("qk_norm", "(Hugging Face GPT-2 and Llama do not normalise queries and keys)")
    if cfg.embed_norm:
        refuse("embed_norm", "(Hugging Face GPT-2 and Llama do not normalise the embedding)")
    if cfg.logit_softcap:
        refuse("logit_softcap", "(Hugging Face GPT-2 and Llama do not cap their logits)")
    if cfg.x0_mix:
        refuse("x0_mix", "(Hugging Face GPT-2 and Llama do not mix the embedding into each block)")
    if cfg.unet_skips:
        refuse("unet_skips", "(Hugging Face GPT-2 and Llama have no skips between blocks)")
    if cfg.value_embeds:
        refuse("value_embeds", "(Hugging Face GPT-2 and Llama have no value embeddings)")
    if cfg.smear:
        refuse("smear", "(Hugging Face GPT-2 and Llama do not mix the previous token's embedding in)")
    if cfg.exclusive_self_attention:
        refuse("exclusive_self_attention", "(Hugging Face GPT-2 and Llama keep each head's whole output)")
    if cfg.bigram_hash_rows:
        refuse("bigram_hash_rows", "(Hugging Face GPT-2 and Llama read no table of token pairs)")
    if cfg.backout:
        refuse("backout", "(Hugging Face GPT-2 and Llama do not subtract a middle block's stream)")
    if cfg.attention_scale:
        refuse("attention_scale", "(Hugging Face GPT-2 and Llama scale attention by 1 / sqrt(head size))")
    if cfg.rope_truncated:
        refuse("rope_truncated", "(Hugging Face Llama rotates every pair of a head)")
    if cfg.attention_window:
        refuse("attention_window", "(Hugging Face GPT-2 and Llama attend over the whole context)")
    if cfg.paired_head_layers:
        refuse("paired_head_layers", "(Hugging Face GPT-2 and Llama attend with each head alone)")
    if cfg.position == "sinusoidal":
        refuse("position", "(GPT-2 learns its positions, Llama rotates; neither has a fixed sinusoidal table)")
    if cfg.width_multiplier() != 1 and cfg.tie_embeddings:
        refuse("parametrization", f"at d_model {cfg.d_model} with a tied head (muP's output multiplier 1 / "
               f"{cfg.width_multiplier():g} cannot be folded into an embedding that the input reads too)")
    for multiplier in ("output_multiplier", "input_multiplier"):
        if getattr(cfg, multiplier) != 1 and cfg.tie_embeddings:
            refuse(multiplier, "with a tied head (it cannot be folded into an embedding that both ends read)")
    if cfg.position == "learned":
        if cfg.norm != "layernorm":
            refuse("norm", "with learned positions (GPT-2 needs layernorm)")
        if cfg.feed_forward != "gelu":
            refuse("feed_forward", "with learned positions (GPT-2 needs gelu)")
        return "gpt2"
    if cfg.norm != "rmsnorm":
        refuse("norm", "with rope positions (Llama needs rmsnorm)")
    if cfg.feed_forward != "swiglu":
        refuse("feed_forward", "with rope positions (Llama needs swiglu)")
    return "llama"


def mup_folded(cfg: ModelConfig, params: Params) -> Params:
    """`params` with muP's multipliers folded into the weights they follow, so that the standard
    parametrisation computes the same function: the output multipliers (muP's 1 / m, then
    model.output_multiplier) into an untied head's kernel, model.input_multiplier into the
    embeddings the first block reads (untied: the head does not read them), the attention's
    sqrt(D_base / D) into the query projection (RoPE is linear, so the factor passes through it).
    Unchanged under "sp" with the multipliers at 1."""
    out, into = 1 / cfg.width_multiplier() * cfg.output_multiplier, cfg.input_multiplier
    if cfg.parametrization != "mup" and out == into == 1:
        return params
    params = dict(params)
    if out != 1 and not cfg.tie_embeddings:
        params["lm_head"] = {"kernel": np.asarray(params["lm_head"]["kernel"], np.float32) / cfg.width_multiplier()
                             * cfg.output_multiplier}
    if into != 1 and not cfg.tie_embeddings:
        for table in ("token_embedding", "position_embedding"):
            if table in params:
                params[table] = {"embedding": np.asarray(params[table]["embedding"], np.float32) * into}
    if cfg.parametrization == "mup" and cfg.mup_base_head_size:
        q_width, factor = cfg.n_heads * cfg.head_size, (cfg.mup_base_head_size / cfg.head_size) ** 0.5
        qkv = {name: np.array(value, np.float32) for name, value in params["blocks"]["attention"]["qkv"].items()}
        for value in qkv.values():
            value[..., :q_width] *= factor
        attention = {**params["blocks"]["attention"], "qkv": qkv}
        params["blocks"] = {**params["blocks"], "attention": attention}
    return params


def dropped_on_export(params: Params) -> list[str]:
    """The parameter groups export_hf leaves out: MTP adapters, which GPT-2 and Llama cannot hold."""
    return sorted(name for name in params if name.startswith("mtp_"))


def _np(x: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, np.float32))


def _layer_bias(dense: Params, layer: int, width: int) -> np.ndarray:
    """A stacked dense layer's bias in `layer`, or zeros for a model without biases (GPT-2 has them)."""
    return np.asarray(dense["bias"][layer], np.float32) if "bias" in dense else np.zeros(width, np.float32)


def _gpt2_qkv(cfg: ModelConfig, qkv: np.ndarray) -> np.ndarray:
    """[..., (H + 2K) * D] -> [..., 3 * H * D]: each K/V head repeated for its H / K query heads.

    Query head h attends with K/V head h // (H / K), so repeating each K/V head H / K times in a
    row gives GPT-2's plain multi-head attention the same function.
    """
    H, K, D = cfg.n_heads, cfg.kv_heads, cfg.head_size
    q, k, v = np.split(qkv, [H * D, (H + K) * D], axis=-1)
    lead = qkv.shape[:-1]

    def repeat(x: np.ndarray) -> np.ndarray:
        return np.repeat(x.reshape(*lead, K, D), H // K, axis=-2).reshape(*lead, H * D)

    return np.concatenate([q, repeat(k), repeat(v)], axis=-1)


def _export_gpt2(cfg: ModelConfig, p: Params) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
        "n_positions": cfg.context_length, "n_ctx": cfg.context_length, "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.hidden_size,
        "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": cfg.tie_embeddings,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "torch_dtype": "float32",
    }
    b = p["blocks"]
    qkv_width = (cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_size
    t = {"transformer.wte.weight": _np(p["token_embedding"]["embedding"]),
         "transformer.wpe.weight": _np(p["position_embedding"]["embedding"]),
         "transformer.ln_f.weight": _np(p["final_norm"]["scale"]),
         "transformer.ln_f.bias": _np(p["final_norm"]["bias"])}
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = _np(np.asarray(p["lm_head"]["kernel"]).T)
    for i in range(cfg.n_layers):
        pre = f"transformer.h.{i}."
        qkv = b["attention"]["qkv"]
        t[pre + "attn.c_attn.weight"] = _np(_gpt2_qkv(cfg, np.asarray(qkv["kernel"][i])))  # Conv1D: [in, out]
        t[pre + "attn.c_attn.bias"] = _np(_gpt2_qkv(cfg, _layer_bias(qkv, i, qkv_width)))
        for name, dense, width in (("attn.c_proj", b["attention"]["out"], cfg.d_model),
                                   ("mlp.c_fc", b["feed_forward"]["up"], cfg.hidden_size),
                                   ("mlp.c_proj", b["feed_forward"]["down"], cfg.d_model)):
            t[pre + f"{name}.weight"] = _np(dense["kernel"][i])
            t[pre + f"{name}.bias"] = _np(_layer_bias(dense, i, width))
        for name, norm in (("ln_1", b["attention_norm"]), ("ln_2", b["feed_forward_norm"])):
            t[pre + f"{name}.weight"] = _np(norm["scale"][i])
            t[pre + f"{name}.bias"] = _np(norm["bias"][i])
    return config, t


def _export_llama(cfg: ModelConfig, p: Params) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    H, K, D = cfg.n_heads, cfg.kv_heads, cfg.head_size
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.context_length, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.hidden_size, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": H, "num_key_value_heads": K, "head_dim": D, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base, "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias, "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
        "rope_scaling": None if cfg.rope_scale == 1.0 else {"rope_type": "linear", "factor": cfg.rope_scale},
    }
    b = p["blocks"]
    t = {"model.embed_tokens.weight": _np(p["token_embedding"]["embedding"]),
         "model.norm.weight": _np(p["final_norm"]["scale"])}
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = _np(np.asarray(p["lm_head"]["kernel"]).T)
    splits = [H * D, (H + K) * D]
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}."
        qkv = b["attention"]["qkv"]
        for name, w in zip("qkv", np.split(np.asarray(qkv["kernel"][i]), splits, axis=1)):
            t[pre + f"self_attn.{name}_proj.weight"] = _np(w.T)
        if cfg.bias:
            for name, bias in zip("qkv", np.split(np.asarray(qkv["bias"][i]), splits)):
                t[pre + f"self_attn.{name}_proj.bias"] = _np(bias)
        dense = {"self_attn.o_proj": b["attention"]["out"],
                 **{f"mlp.{name}_proj": b["feed_forward"][name] for name in ("up", "gate", "down")}}
        for name, weights in dense.items():
            t[pre + f"{name}.weight"] = _np(np.asarray(weights["kernel"][i]).T)
            if cfg.bias:
                t[pre + f"{name}.bias"] = _np(weights["bias"][i])
        t[pre + "input_layernorm.weight"] = _np(b["attention_norm"]["scale"][i])
        t[pre + "post_attention_layernorm.weight"] = _np(b["feed_forward_norm"]["scale"][i])
    return config, t


# What an export writes. With `force`, these files of an earlier export are replaced or removed,
# so that no stale one (a tokenizer of another run) is left beside the new weights.
EXPORT_FILES = ("config.json", WEIGHTS, "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def check_export_dir(out_dir: str | Path, force: bool = False) -> Path:
    """`out_dir` if an export may write there: absent, empty, or (with `force`) any folder."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--out {out} exists and is not empty; choose another folder or pass --force "
                         "to overwrite its Hugging Face files")
    return out


def _end_of_text(tokenizer_json: Path | None) -> tuple[str, int] | None:
    """The tokenizer's one special token (GPT-2's <|endoftext|>) and its id, if it has exactly one."""
    if tokenizer_json is None:
        return None
    added = json.loads(Path(tokenizer_json).read_text(encoding="utf-8")).get("added_tokens") or []
    specials = [(token["content"], token["id"]) for token in added if token.get("special")]
    return specials[0] if len(specials) == 1 else None


def _tokenizer_config(end_of_text: tuple[str, int] | None, context_length: int) -> dict[str, Any]:
    """The tokenizer_config.json that makes AutoTokenizer load tokenizer.json as it is.

    Without it AutoTokenizer picks the class of the model type (GPT-2's drops the whitespace
    tokens of a char tokenizer; Llama's adds a BOS token), so its ids differ from the run's.
    """
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context_length,
                              "clean_up_tokenization_spaces": False, "add_bos_token": False,
                              "add_eos_token": False}
    return {**config, **_special_tokens(end_of_text)}


def _special_tokens(end_of_text: tuple[str, int] | None) -> dict[str, str]:
    """special_tokens_map.json: as GPT-2's <|endoftext|> does, the end-of-text token begins, ends
    and stands in for unknown texts (the harness's `hf` backend reads eos_token to stop and to
    start an empty context)."""
    if end_of_text is None:
        return {}
    return {"bos_token": end_of_text[0], "eos_token": end_of_text[0], "unk_token": end_of_text[0]}


def export_hf(cfg: ModelConfig, params: Params, out_dir: str | Path, *, tokenizer: str | Path | None = None,
              force: bool = False) -> Path:
    """Write config.json and model.safetensors (float32) that transformers loads as GPT-2 or Llama.

    Learned positions export as GPT-2 (zero biases where the model has none, grouped K/V heads
    repeated), RoPE as Llama. MTP adapters are left out (see `dropped_on_export`). With
    `tokenizer` (a tokenizer.json) the folder also gets it and a tokenizer_config.json, so that
    `AutoTokenizer` gives the same ids. An existing non-empty `out_dir` is refused unless `force`.
    """
    out = check_export_dir(out_dir, force)
    kind = _check_exportable(cfg)
    if "blocks" not in params:
        raise UserError("export_hf expects the scanned parameter layout (a `blocks` entry)")
    config, tensors = (_export_gpt2 if kind == "gpt2" else _export_llama)(cfg, mup_folded(cfg, params))
    end_of_text = _end_of_text(tokenizer)
    # Left unset, transformers' defaults (GPT-2: 50256; Llama: 1 and 2) would name ordinary tokens
    # of this vocabulary, and `generate` would stop at them.
    end_id = end_of_text[1] if end_of_text is not None else None
    config.update(bos_token_id=end_id, eos_token_id=end_id)
    out.mkdir(parents=True, exist_ok=True)
    for name in EXPORT_FILES:
        (out / name).unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    safetensors_numpy().save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        tokenizer_config = _tokenizer_config(end_of_text, cfg.context_length)
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
        (out / "special_tokens_map.json").write_text(json.dumps(_special_tokens(end_of_text), indent=2) + "\n",
                                                     encoding="utf-8")
    return out
