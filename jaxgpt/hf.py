"""Import and export of Hugging Face GPT-2 and Llama checkpoints (config.json + model.safetensors).

    cfg, params = import_hf("path/to/hf_dir")           # ModelConfig, scanned-layout params
    export_hf(cfg, params, "path/to/out_dir")           # loadable by AutoModelForCausalLM
    import_hf_run("path/to/hf_dir", "runs/imported")    # a run directory for generate/eval/train

Weights are read and written with `safetensors.numpy`; torch is never needed. Flax Dense kernels
are [in, out]; torch Linear weights are [out, in] (transposed here); GPT-2's Conv1D weights are
already [in, out]. Options this model cannot reproduce are refused with a ValueError naming them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.rundir import RunDir, write_atomic

Params = dict[str, Any]
WEIGHTS = "model.safetensors"


def _safetensors():
    try:
        import safetensors.numpy as stn
    except ImportError:
        raise ImportError("Hugging Face import/export needs `safetensors` (pip install 'jaxgpt[hf]')") from None
    return stn


def _read(hf_dir: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    stn = _safetensors()
    files = [hf_dir / WEIGHTS] if (hf_dir / WEIGHTS).is_file() else sorted(hf_dir.glob("model-*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no {WEIGHTS} in {hf_dir} (only safetensors weights are supported)")
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        tensors.update(stn.load_file(str(path)))
    return config, {k: np.asarray(v, np.float32) for k, v in tensors.items()}


def _refuse(arch: str, option: str, value: Any, why: str) -> None:
    raise ValueError(f"unsupported {arch} option {option} = {value!r}: {why}")


def _get(tensors: dict[str, np.ndarray], name: str, *prefixes: str) -> np.ndarray:
    prefixes = prefixes or ("",)
    for prefix in prefixes:
        if prefix + name in tensors:
            return tensors[prefix + name]
    raise ValueError(f"missing weight {prefixes[0] + name} in the safetensors file")


def _stack(arrays: list[np.ndarray]) -> np.ndarray:
    return np.stack(arrays).astype(np.float32)


# ---------------------------------------------------------------------------------------- GPT-2

def _gpt2_config(c: dict[str, Any]) -> ModelConfig:
    arch = "GPT-2"
    act = c.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        _refuse(arch, "activation_function", act, "only the tanh GELU (gelu_new) is supported")
    for option, wanted in (("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True),
                           ("add_cross_attention", False)):
        if c.get(option, wanted) != wanted:
            _refuse(arch, option, c[option], f"only {wanted} is supported")
    d_model = c["n_embd"]
    return ModelConfig(
        vocab_size=c["vocab_size"], context_length=c["n_positions"], d_model=d_model,
        n_layers=c["n_layer"], n_heads=c["n_head"], hidden_size=c.get("n_inner") or 4 * d_model,
        position="learned", norm="layernorm", norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
        residual="pre", feed_forward="gelu", bias=True,
        tie_embeddings=bool(c.get("tie_word_embeddings", True)), dropout=0.0,
    )


def _gpt2_params(cfg: ModelConfig, t: dict[str, np.ndarray]) -> Params:
    pre = ("transformer.", "")
    layers = range(cfg.n_layers)

    def per_layer(name: str) -> np.ndarray:
        return _stack([_get(t, f"h.{i}.{name}", *pre) for i in layers])

    def norm(name: str) -> dict[str, np.ndarray]:
        return {"scale": per_layer(f"{name}.weight"), "bias": per_layer(f"{name}.bias")}

    blocks = {
        "attention": {
            "qkv": {"kernel": per_layer("attn.c_attn.weight"), "bias": per_layer("attn.c_attn.bias")},
            "out": {"kernel": per_layer("attn.c_proj.weight"), "bias": per_layer("attn.c_proj.bias")},
        },
        "feed_forward": {
            "up": {"kernel": per_layer("mlp.c_fc.weight"), "bias": per_layer("mlp.c_fc.bias")},
            "down": {"kernel": per_layer("mlp.c_proj.weight"), "bias": per_layer("mlp.c_proj.bias")},
        },
        "attention_norm": norm("ln_1"),
        "feed_forward_norm": norm("ln_2"),
    }
    params: Params = {
        "token_embedding": {"embedding": _get(t, "wte.weight", *pre)},
        "position_embedding": {"embedding": _get(t, "wpe.weight", *pre)},
        "blocks": blocks,
        "final_norm": {"scale": _get(t, "ln_f.weight", *pre), "bias": _get(t, "ln_f.bias", *pre)},
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = {"kernel": _get(t, "lm_head.weight").T.copy()}
    return params


# ---------------------------------------------------------------------------------------- Llama

def _rope_settings(c: dict[str, Any]) -> tuple[float, float]:
    """(rope_base, rope_scale) from `rope_theta`/`rope_scaling` or the newer `rope_parameters`."""
    params = c.get("rope_parameters") or {}
    base = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    scaling = c.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return base, 1.0
    if kind != "linear":
        _refuse("Llama", "rope_scaling", scaling, "only linear RoPE scaling is supported")
    return base, float(scaling["factor"])


def _llama_config(c: dict[str, Any]) -> ModelConfig:
    arch = "Llama"
    if c.get("hidden_act", "silu") != "silu":
        _refuse(arch, "hidden_act", c["hidden_act"], "only silu (SwiGLU) is supported")
    bias = bool(c.get("attention_bias", False))
    if bool(c.get("mlp_bias", False)) != bias:
        _refuse(arch, "attention_bias, mlp_bias", (c.get("attention_bias"), c.get("mlp_bias")),
                "this model has biases on every linear layer or on none")
    d_model, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or d_model // heads
    if head_dim * heads != d_model:
        _refuse(arch, "head_dim", head_dim, f"must equal hidden_size / num_attention_heads = {d_model / heads}")
    base, scale = _rope_settings(c)
    return ModelConfig(
        vocab_size=c["vocab_size"], context_length=c["max_position_embeddings"], d_model=d_model,
        n_layers=c["num_hidden_layers"], n_heads=heads, kv_heads=c.get("num_key_value_heads") or heads,
        hidden_size=c["intermediate_size"], position="rope", rope_base=base, rope_scale=scale,
        norm="rmsnorm", norm_eps=float(c.get("rms_norm_eps", 1e-6)), residual="pre", feed_forward="swiglu",
        bias=bias, tie_embeddings=bool(c.get("tie_word_embeddings", False)), dropout=0.0,
    )


def _llama_params(cfg: ModelConfig, t: dict[str, np.ndarray]) -> Params:
    layers = range(cfg.n_layers)

    def per_layer(name: str, transpose: bool = True) -> np.ndarray:
        return _stack([_get(t, f"model.layers.{i}.{name}").T if transpose
                       else _get(t, f"model.layers.{i}.{name}") for i in layers])

    def qkv(part: str) -> np.ndarray:  # "weight" (torch's [out, in], transposed) or "bias"
        def one(i: int, name: str) -> np.ndarray:
            w = _get(t, f"model.layers.{i}.self_attn.{name}_proj.{part}")
            return w.T if part == "weight" else w

        return _stack([np.concatenate([one(i, name) for name in "qkv"], axis=-1) for i in layers])

    def dense(name: str) -> dict[str, np.ndarray]:
        weights = {"kernel": per_layer(f"{name}.weight")}
        if cfg.bias:
            weights["bias"] = per_layer(f"{name}.bias", transpose=False)
        return weights

    attention = {"qkv": {"kernel": qkv("weight")}, "out": dense("self_attn.o_proj")}
    if cfg.bias:
        attention["qkv"]["bias"] = qkv("bias")
    params: Params = {
        "token_embedding": {"embedding": _get(t, "model.embed_tokens.weight")},
        "blocks": {
            "attention": attention,
            "feed_forward": {name: dense(f"mlp.{name}_proj") for name in ("up", "gate", "down")},
            "attention_norm": {"scale": per_layer("input_layernorm.weight", transpose=False)},
            "feed_forward_norm": {"scale": per_layer("post_attention_layernorm.weight", transpose=False)},
        },
        "final_norm": {"scale": _get(t, "model.norm.weight")},
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = {"kernel": _get(t, "lm_head.weight").T.copy()}
    return params


# --------------------------------------------------------------------------------------- public

_IMPORTERS = {"gpt2": (_gpt2_config, _gpt2_params), "llama": (_llama_config, _llama_params)}


def _importer(hf_dir: Path, config: dict[str, Any]):
    model_type = config.get("model_type")
    if model_type not in _IMPORTERS:
        raise ValueError(f"unsupported model_type {model_type!r} in {hf_dir}/config.json "
                         f"(supported: {', '.join(_IMPORTERS)})")
    return _IMPORTERS[model_type]


def model_config(hf_dir: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face GPT-2 or Llama dir, from its config.json alone."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    config = json.loads(path.read_text(encoding="utf-8"))
    return _importer(Path(hf_dir), config)[0](config)


def import_hf(hf_dir: str | Path) -> tuple[ModelConfig, Params]:
    """The ModelConfig and params (scanned layout, float32) of a Hugging Face GPT-2 or Llama dir."""
    import jax
    import jax.numpy as jnp

    config, tensors = _read(Path(hf_dir))
    make_config, make_params = _importer(Path(hf_dir), config)
    cfg = make_config(config)
    params = make_params(cfg, tensors)
    return cfg, jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), params)


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt")


def tokenizer_source(hf_dir: str | Path) -> str | None:
    """What `data.tokenizer` names for the folder's own tokenizer: its tokenizer.json, or the folder
    itself when it holds GPT-2's vocab.json + merges.txt (`Tokenizer.load` reads either); else None."""
    from jaxgpt.tokenizer import has_vocab_and_merges

    folder = Path(hf_dir).absolute()
    if (folder / "tokenizer.json").is_file():
        return str(folder / "tokenizer.json")
    return str(folder) if has_vocab_and_merges(folder) else None


def resolve_source(source: str | Path) -> Path:
    """A local Hugging Face model directory, downloading `source` from the hub if it names no directory.

    The download (config.json, safetensors weights, tokenizer files) goes through
    `huggingface_hub.snapshot_download` into its usual cache, so it needs network access to the
    hub; offline, a local directory is the only way in.
    """
    path = Path(source)
    if path.is_dir():
        return path
    if path.exists():
        raise NotADirectoryError(f"{source} is not a Hugging Face model directory")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ImportError(f"{source} is no local directory, and downloading it from the hub needs "
                          "`huggingface_hub` (pip install huggingface_hub)") from None
    try:
        return Path(snapshot_download(str(source), allow_patterns=["config.json", "*.safetensors", *TOKENIZER_FILES]))
    except Exception as err:  # the hub raises many kinds (offline, not found, gated, HTTP)
        raise FileNotFoundError(f"{source} is no local directory and could not be downloaded from the "
                                f"Hugging Face hub ({type(err).__name__}: {err})") from None


# Keys a fine-tune may set freely. The rest define the function the weights compute and must
# equal the checkpoint's; context_length may shrink (a learned position table is cropped, as
# nanoGPT's crop_block_size does) and mtp_depth adds fresh adapters.
FREE_KEYS = ("dropout", "scan_layers", "remat", "dtype", "init_std", "mtp_depth", "context_length")


def load_into(model: ModelConfig, hf_dir: str | Path, fresh: Params) -> Params:
    """The checkpoint's weights in `model`'s layout; MTP adapters it lacks are taken from `fresh`."""
    import dataclasses

    import jax
    from flax.traverse_util import flatten_dict, unflatten_dict

    from jaxgpt.model import unstack_blocks

    imported_cfg, imported = import_hf(hf_dir)
    differ = [f"model.{f.name} = {getattr(model, f.name)!r} here, {getattr(imported_cfg, f.name)!r} in the checkpoint"
              for f in dataclasses.fields(ModelConfig)
              if f.name not in FREE_KEYS and getattr(model, f.name) != getattr(imported_cfg, f.name)]
    if imported_cfg.position == "learned" and model.context_length > imported_cfg.context_length:
        differ.append(f"model.context_length = {model.context_length} here, more than the checkpoint's "
                      f"{imported_cfg.context_length} learned positions")
    if differ:
        raise ValueError(f"--init-from {hf_dir}: the config does not match the checkpoint: " + "; ".join(differ))
    if model.position == "learned":
        table = imported["position_embedding"]["embedding"]
        imported["position_embedding"] = {"embedding": table[: model.context_length]}
    if not model.scan_layers:
        imported = unstack_blocks(imported, model)
    have, want = flatten_dict(imported, sep="/"), flatten_dict(jax.device_get(fresh), sep="/")
    for name, leaf in want.items():
        if name not in have and not name.startswith("mtp_"):
            raise ValueError(f"--init-from {hf_dir}: the checkpoint has no weight for {name}")
        if name in have and have[name].shape != leaf.shape:
            raise ValueError(f"--init-from {hf_dir}: {name} has shape {have[name].shape} in the "
                             f"checkpoint, {leaf.shape} here")
    return unflatten_dict({name: have.get(name, leaf) for name, leaf in want.items()}, sep="/")


def _check_exportable(cfg: ModelConfig) -> str:
    """'gpt2' (learned positions) or 'llama' (RoPE); a ValueError naming an option neither holds."""
    def refuse(option: str, why: str) -> None:
        raise ValueError(f"cannot export to Hugging Face: model.{option} = {getattr(cfg, option)!r} {why}")

    if cfg.residual != "pre":
        refuse("residual", "(Hugging Face GPT-2 and Llama are pre-norm)")
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
EXPORT_FILES = ("config.json", WEIGHTS, "tokenizer.json", "tokenizer_config.json")


def check_export_dir(out_dir: str | Path, force: bool = False) -> Path:
    """`out_dir` if an export may write there: absent, empty, or (with `force`) any folder."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} exists and is not empty; choose another folder or pass --force "
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
    if end_of_text is not None:  # as GPT-2's <|endoftext|> does, it begins, ends and pads texts
        config.update(bos_token=end_of_text[0], eos_token=end_of_text[0], unk_token=end_of_text[0])
    return config


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
        raise ValueError("export_hf expects the scanned parameter layout (a `blocks` entry)")
    config, tensors = (_export_gpt2 if kind == "gpt2" else _export_llama)(cfg, params)
    end_of_text = _end_of_text(tokenizer)
    # Left unset, transformers' defaults (GPT-2: 50256; Llama: 1 and 2) would name ordinary tokens
    # of this vocabulary, and `generate` would stop at them.
    end_id = end_of_text[1] if end_of_text is not None else None
    config.update(bos_token_id=end_id, eos_token_id=end_id)
    out.mkdir(parents=True, exist_ok=True)
    for name in EXPORT_FILES:
        (out / name).unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    _safetensors().save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    if tokenizer is not None:
        shutil.copyfile(tokenizer, out / "tokenizer.json")
        tokenizer_config = _tokenizer_config(end_of_text, cfg.context_length)
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
    return out


def import_hf_run(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """A run directory (config.toml, tokenizer.json if the HF dir has one, a step-0 checkpoint)."""
    from jaxgpt.checkpoint import Checkpointer
    from jaxgpt.config import DataConfig, RunConfig
    from jaxgpt.step import state_from_params

    hf_dir, run_dir, files = Path(hf_dir), Path(out_dir), RunDir(out_dir)
    if files.checkpoints.exists() or files.config.exists():
        raise ValueError(f"{run_dir} already holds a run; choose another --out")
    from jaxgpt.tokenizer import Tokenizer

    model, params = import_hf(hf_dir)
    source = tokenizer_source(hf_dir)
    tokenizer = Tokenizer.load(source) if source is not None else None
    data = DataConfig(tokenizer=str(files.tokenizer.absolute())) if tokenizer else DataConfig()
    cfg = RunConfig(model=model, data=data)
    state = state_from_params(cfg, params)
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"config": cfg.to_dict(), "imported_from": str(hf_dir.absolute())}
    if tokenizer is not None:
        tokenizer.save(files.tokenizer)
        manifest["tokenizer_sha256"] = tokenizer.fingerprint
    write_atomic(files.config, cfg.to_toml())
    checkpointer = Checkpointer(run_dir, keep=cfg.train.keep_checkpoints)
    try:
        checkpointer.save(state, manifest)
    finally:
        checkpointer.close()
    return run_dir
