"""Import of Hugging Face GPT-2 and Llama checkpoints (config.json + model.safetensors); the export
is `jaxgpt.hf.exporter`.

    cfg, params = import_hf("path/to/hf_dir")           # ModelConfig, scanned-layout params

Weights are read with `safetensors.numpy`; torch is never needed. Flax Dense kernels are
[in, out]; torch Linear weights are [out, in] (transposed here); GPT-2's Conv1D weights are
already [in, out]. Options this model cannot reproduce are refused with a ValueError naming them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from jaxgpt.config import INIT_FROM, ModelConfig, keys_with
from jaxgpt.errors import UserError

Params = dict[str, Any]
WEIGHTS = "model.safetensors"


def safetensors_numpy():
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
    stn = safetensors_numpy()
    files = [hf_dir / WEIGHTS] if (hf_dir / WEIGHTS).is_file() else sorted(hf_dir.glob("model-*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no {WEIGHTS} in {hf_dir} (only safetensors weights are supported)")
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        tensors.update(stn.load_file(str(path)))
    return config, {k: np.asarray(v, np.float32) for k, v in tensors.items()}


def _refuse(arch: str, option: str, value: Any, why: str) -> None:
    raise UserError(f"unsupported {arch} option {option} = {value!r}: {why}")


def _get(tensors: dict[str, np.ndarray], name: str, *prefixes: str) -> np.ndarray:
    prefixes = prefixes or ("",)
    for prefix in prefixes:
        if prefix + name in tensors:
            return tensors[prefix + name]
    raise UserError(f"missing weight {prefixes[0] + name} in the safetensors file")


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
        raise UserError(f"unsupported model_type {model_type!r} in {hf_dir}/config.json "
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
    from jaxgpt.data.tokenizer import has_vocab_and_merges

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




def load_into(model: ModelConfig, hf_dir: str | Path, fresh: Params) -> Params:
    """The checkpoint's weights in `model`'s layout; MTP adapters it lacks are taken from `fresh`."""
    import dataclasses

    import jax
    from flax.traverse_util import flatten_dict, unflatten_dict

    from jaxgpt.model.decoder import unstack_blocks

    imported_cfg, imported = import_hf(hf_dir)
    # The keys a fine-tune may set freely (INIT_FROM). The rest define the function the weights
    # compute and must equal the checkpoint's; context_length may shrink (a learned position
    # table is cropped, as nanoGPT's crop_block_size does) and mtp_depth adds fresh adapters.
    free = keys_with(INIT_FROM, "model")
    differ = [f"model.{f.name} = {getattr(model, f.name)!r} here, {getattr(imported_cfg, f.name)!r} in the checkpoint"
              for f in dataclasses.fields(ModelConfig)
              if f.name not in free and getattr(model, f.name) != getattr(imported_cfg, f.name)]
    if imported_cfg.position == "learned" and model.context_length > imported_cfg.context_length:
        differ.append(f"model.context_length = {model.context_length} here, more than the checkpoint's "
                      f"{imported_cfg.context_length} learned positions")
    if differ:
        raise UserError(f"--init-from {hf_dir}: the config does not match the checkpoint: " + "; ".join(differ))
    if model.position == "learned":
        table = imported["position_embedding"]["embedding"]
        imported["position_embedding"] = {"embedding": table[: model.context_length]}
    if not model.scan_layers:
        imported = unstack_blocks(imported, model)
    have, want = flatten_dict(imported, sep="/"), flatten_dict(jax.device_get(fresh), sep="/")
    for name, leaf in want.items():
        if name not in have and not name.startswith("mtp_"):
            raise UserError(f"--init-from {hf_dir}: the checkpoint has no weight for {name}")
        if name in have and have[name].shape != leaf.shape:
            raise UserError(f"--init-from {hf_dir}: {name} has shape {have[name].shape} in the "
                             f"checkpoint, {leaf.shape} here")
    return unflatten_dict({name: have.get(name, leaf) for name, leaf in want.items()}, sep="/")
