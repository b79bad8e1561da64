"""Run configuration: frozen dataclasses, TOML loading, `section.key=value` overrides.

Config is data. Every key has one default, written here; a resolved config (all derived values
filled in) is what runs, what is saved beside a run and what the sha256 fingerprint covers.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from jaxgpt.errors import UserError, did_you_mean


class ConfigError(UserError):
    """A config value or key that cannot run; the message names the key and why."""


def _choice(section: str, name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{section}.{name} = {value!r} is not one of {', '.join(allowed)}")


def _finite(section: str, obj: Any) -> None:
    """Refuse nan and inf in every float key: each would run, compile and only then diverge."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{section}.{f.name} = {value!r} must be a finite number")


def _positive(section: str, obj: Any, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{section}.{name} = {value!r} must be {bound}")


# The roles a key plays, declared once beside each field (`entry`) and read wherever a rule asks
# which keys may differ: `keys_with(role)`.
IDENTITY = "identity"  # in the fingerprint: part of what a run computes and records
RESUME = "resume"  # free on --resume: how long a run goes, how often it reports, how it is laid out
FORCE = "force"  # accepted by --resume --force (never the model, the tokenizer or the optimiser)
INIT_FROM = "init_from"  # free on --init-from HF_DIR: the function the weights compute stays theirs
SWEEP = "sweep"  # varied between the members of one vmapped sweep group (jaxgpt.tools.sweep)
ROLES = (IDENTITY, RESUME, FORCE, INIT_FROM, SWEEP)

REMAT_POLICIES = ("none", "dots", "full")
PARALLEL_MODES = ("auto", "single", "sharded", "pmap")
ALIGNMENTS = ("none", "document", "bestfit")


def entry(default: Any, *roles: str, bool_names: tuple[str, str] | None = None) -> Any:
    """A config field with its default and its roles (`ROLES`); `bool_names`: the values TOML's
    false and true stand for, for a key that was a switch before it named a choice."""
    unknown = set(roles) - set(ROLES)
    if unknown:
        raise ValueError(f"unknown roles {sorted(unknown)}")
    metadata: dict[str, Any] = {"roles": frozenset(roles)}
    if bool_names:
        metadata["bool"] = bool_names
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class ModelConfig:
    """The decoder. Defaults are the Day 1 baseline (541,952 parameters)."""

    vocab_size: int = entry(1024, IDENTITY)
    context_length: int = entry(128, IDENTITY, INIT_FROM)
    d_model: int = entry(128, IDENTITY)
    n_layers: int = entry(2, IDENTITY)
    n_heads: int = entry(4, IDENTITY)
    kv_heads: int | None = entry(None, IDENTITY)  # None: as many as n_heads (plain multi-head attention)
    hidden_size: int | None = entry(None, IDENTITY)  # None: 4 * d_model, or the matched width (ffn_match_params)
    # SwiGLU's three matrices at the parameters of GELU's two: hidden_size 2/3 x 4 x d_model, to the
    # nearest multiple of 8 (at least 8); 680 at d_model 256. GELU's stays 4 x d_model.
    ffn_match_params: bool = entry(False, RESUME, INIT_FROM)
    position: str = entry("learned", IDENTITY)  # "learned" | "rope" | "sinusoidal" (a fixed sin/cos table, no parameters)
    rope_base: float = entry(10000.0, IDENTITY)
    rope_scale: float = entry(1.0, IDENTITY)
    # The speedrun's half-truncated RoPE: head_size / 4 frequencies from 1 down to 1 / rope_base
    # (a geometric series, both ends included), the other head_size / 4 pairs unrotated.
    rope_truncated: bool = entry(False, IDENTITY)
    norm: str = entry("layernorm", IDENTITY)
    norm_eps: float = entry(1e-5, IDENTITY)
    residual: str = entry("pre", IDENTITY)
    feed_forward: str = entry("gelu", IDENTITY)  # "gelu" (tanh) | "swiglu" | "relu2" (ReLU squared, GELU's two matrices)
    # Each head's queries and keys RMS-normalised without parameters, before RoPE.
    qk_norm: bool = entry(False, IDENTITY)
    # The first block's input (token plus position embedding) RMS-normalised without parameters.
    embed_norm: bool = entry(False, IDENTITY)
    # logits = cap * tanh(logits / cap) wherever logits are made (0: off).
    logit_softcap: float = entry(0.0, IDENTITY)
    # The attention and feed-forward output projections, and an untied head, start at zero.
    zero_init: bool = entry(False, IDENTITY, INIT_FROM)
    # Each block starts from a * x + b * x0 (x0: the first block's input), a and b learned per
    # block, 1 and 0 at init.
    x0_mix: bool = entry(False, IDENTITY)
    # U-net skips: block i's output (i < n_layers // 2), times a learned weight (1 at init), is
    # added to the input of block n_layers - 1 - i, before its x0 mix. With an odd n_layers the
    # middle block neither gives nor takes a skip.
    unet_skips: bool = entry(False, IDENTITY)
    # N more embedding tables [V, kv_heads * head_size] whose lookups are mixed into the
    # attention values of the first N and the last N blocks (tables 0..N-1 twice): each block's
    # values become l0 * v + l1 * ve (l0, l1 learned, 0.5 at init; l0 * v where no table feeds
    # the block). 0: off.
    value_embeds: int = entry(0, IDENTITY)
    # Which blocks the value tables feed: "ends" (as above) or "alternating" (one table per block
    # on every other block counted back from the last, which always has one: value_embeds must be
    # (n_layers + 1) // 2).
    value_embeds_layout: str = entry("ends", IDENTITY)
    # A table's lookup joins the values as v + 3 * sigmoid(x[..., :12] @ W) * ve, one learned gate
    # per KV head read from the block's input, instead of the mix l0 * v + l1 * ve.
    value_gate: bool = entry(False, IDENTITY)
    # Each position adds the previous position's embedding (as the first block would read it)
    # times lambda * sigmoid(x[..., :24] @ w), both learned, lambda 0 at init; a sequence's or a
    # document's first position adds nothing.
    smear: bool = entry(False, IDENTITY)
    # The residual stream after block n_layers // 2, times a learned lambda (0.2 at init), is
    # subtracted before the final norm.
    backout: bool = entry(False, IDENTITY)
    # A table of bigram_hash_rows rows [N, d_model], zeros at init, read at a hash of each
    # position's (previous token, token) pair (modded-nanogpt's, mod N - 1), its last row where a
    # sequence or a document starts; each block adds it times its own learned lambda (0.1 at
    # init) after its x0 mix. 0: off.
    bigram_hash_rows: int = entry(0, IDENTITY)
    # Exclusive self-attention, learned: each head's output y loses tanh(a) times its component
    # along the token's own value v, y - tanh(a) <y, v/|v|> v/|v|, one a per block and head (0 at
    # init: plain attention).
    exclusive_self_attention: bool = entry(False, IDENTITY)
    # The attention logits' scale; 0: 1 / sqrt(head_size).
    attention_scale: float = entry(0.0, IDENTITY)
    # Sliding-window attention: in the blocks window_pattern marks S, a query at t attends to keys
    # t - W + 1 .. t only; 0: every block attends over the whole context.
    attention_window: int = entry(0, IDENTITY)
    # L (the whole context) and S (the window) cycled over the blocks, first block first.
    window_pattern: str = entry("S", IDENTITY)
    # The blocks (by index, first 0) whose heads attend in pairs: head h and head h + H/2 (and
    # their KV heads k and k + K/2) interleave into one sequence of 2T positions, 2t + 0 and
    # 2t + 1, so a query reads both heads' keys under one causal softmax, each rotated at its
    # interleaved position (jaxgpt/model/paired_heads.py). A window counts interleaved positions.
    paired_head_layers: tuple[int, ...] = entry((), IDENTITY)
    # "sp": every weight at init_std and the optimiser's rates whatever the width; "mup": muP
    # (Tensor Programs V), which agrees with "sp" at d_model = mup_base_width and keeps the best
    # learning rate as the width grows (docs/mup.md).
    parametrization: str = entry("sp", IDENTITY)
    mup_base_width: int = entry(128, IDENTITY)
    # muP's attention scale sqrt(D_base) / D for heads D wide, D_base this (0: D itself, so the
    # scale stays 1 / sqrt(D): widths that grow by heads at a fixed head width, as `coordcheck` grows them).
    mup_base_head_size: int = entry(0, IDENTITY)
    # The knobs muP tunes at its base width and keeps as the width grows (docs/mup.md, "The
    # knobs"); at their defaults the model is what it was. The head reads its input times
    # output_multiplier (beside muP's 1 / m); the first block reads the embedding times
    # input_multiplier; the hidden matrices start at hidden_init_scale times their spread; an
    # untied head starts at zero under zero_init_readout, the query projection under zero_init_query.
    output_multiplier: float = entry(1.0, IDENTITY, SWEEP)
    input_multiplier: float = entry(1.0, IDENTITY, SWEEP)
    hidden_init_scale: float = entry(1.0, IDENTITY, INIT_FROM, SWEEP)
    zero_init_readout: bool = entry(False, IDENTITY, INIT_FROM)
    zero_init_query: bool = entry(False, IDENTITY, INIT_FROM)
    bias: bool = entry(False, IDENTITY)
    tie_embeddings: bool = entry(True, IDENTITY)
    dropout: float = entry(0.0, IDENTITY, INIT_FROM)
    mtp_depth: int = entry(0, IDENTITY, INIT_FROM)
    init_std: float = entry(0.02, IDENTITY, INIT_FROM)
    # "normal": every weight N(0, init_std) (zero_init and muP aside); "nanochat": nanochat's own
    # draw of every weight (jaxgpt/model/nanochat_init.py), init_std unused.
    init_scheme: str = entry("normal", IDENTITY, INIT_FROM)
    dtype: str = entry("float32", IDENTITY, INIT_FROM)
    scan_layers: bool = entry(True, IDENTITY, INIT_FROM)
    # What a train step's backward pass recomputes instead of keeping from the forward pass:
    # "none" (keeps every block's activations), "dots" (keeps the matmul outputs, recomputes the
    # norms, activations and attention), "full" (keeps each block's input only). TOML false / true
    # are "none" / "full". How the step runs, not what it computes: a run may change it on resume.
    remat: str = entry("none", RESUME, INIT_FROM, bool_names=("none", "full"))
    kernels: str = entry("auto", RESUME, INIT_FROM)  # "auto": tuned for the backend (jaxgpt.kernels); "xla": the portable ones

    def __post_init__(self) -> None:
        s = "model"
        _finite(s, self)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.n_heads)
        if isinstance(self.remat, bool):
            object.__setattr__(self, "remat", REMAT_POLICIES[2 if self.remat else 0])
        if self.ffn_match_params:
            matched = matched_hidden_size(self.d_model) if self.feed_forward == "swiglu" else 4 * self.d_model
            if self.hidden_size not in (None, matched):
                raise ConfigError(
                    f"model.hidden_size = {self.hidden_size} contradicts model.ffn_match_params = true, which "
                    f"sets it to {matched} for {self.feed_forward} at d_model {self.d_model}; drop one of them"
                )
            object.__setattr__(self, "hidden_size", matched)
        if self.hidden_size is None:
            object.__setattr__(self, "hidden_size", 4 * self.d_model)
        _positive(s, self, "vocab_size", "context_length", "d_model", "n_layers", "n_heads", "mup_base_width")
        _positive(s, self, "mup_base_head_size", allow_zero=True)
        _positive(s, self, "kv_heads", "hidden_size", "rope_base", "rope_scale", "norm_eps")
        _positive(s, self, "output_multiplier", "input_multiplier", "hidden_init_scale")
        _positive(s, self, "mtp_depth", "init_std", "logit_softcap", "value_embeds", "attention_scale",
                  "attention_window", "bigram_hash_rows", allow_zero=True)
        if self.bigram_hash_rows == 1:
            raise ConfigError("model.bigram_hash_rows = 1 leaves no row for the pairs: 0 (off) or at least 2 (the "
                              "last row is a sequence's first position's)")
        if not self.window_pattern or set(self.window_pattern) - {"L", "S"}:
            raise ConfigError(f"model.window_pattern = {self.window_pattern!r} must be letters L (whole context) "
                              "and S (window), e.g. 'SSSL'")
        _choice(s, "position", self.position, ("learned", "rope", "sinusoidal"))
        _choice(s, "norm", self.norm, ("layernorm", "rmsnorm"))
        _choice(s, "residual", self.residual, ("pre", "post"))
        _choice(s, "feed_forward", self.feed_forward, ("gelu", "swiglu", "relu2"))
        _choice(s, "dtype", self.dtype, ("float32", "bfloat16"))
        _choice(s, "parametrization", self.parametrization, ("sp", "mup"))
        _choice(s, "kernels", self.kernels, ("auto", "xla"))
        _choice(s, "remat", self.remat, REMAT_POLICIES)
        _choice(s, "value_embeds_layout", self.value_embeds_layout, ("ends", "alternating"))
        _choice(s, "init_scheme", self.init_scheme, ("normal", "nanochat"))
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model = {self.d_model} is not divisible by model.n_heads = {self.n_heads}"
            )
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_heads = {self.n_heads} is not divisible by model.kv_heads = {self.kv_heads}"
            )
        if self.position == "rope" and self.head_size % 2:
            raise ConfigError(f"model.position = 'rope' needs an even head size, got {self.head_size}")
        if self.position == "sinusoidal" and self.d_model % 2:
            raise ConfigError(f"model.position = 'sinusoidal' needs an even d_model, got {self.d_model}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout = {self.dropout!r} must be in [0, 1)")
        if self.value_embeds_layout == "alternating" and self.value_embeds not in (0, (self.n_layers + 1) // 2):
            raise ConfigError(
                f"model.value_embeds = {self.value_embeds} with value_embeds_layout = 'alternating' must be "
                f"(n_layers + 1) // 2 = {(self.n_layers + 1) // 2}: one table for every other block, the last included")
        if self.value_gate and not self.value_embeds:
            raise ConfigError("model.value_gate gates the value tables' lookups: it needs model.value_embeds > 0")
        for switch, channels in (("value_gate", 12), ("smear", 24)):
            if getattr(self, switch) and self.d_model < channels:
                raise ConfigError(f"model.{switch} reads the first {channels} channels: it needs d_model >= "
                                  f"{channels}, got {self.d_model}")
        if self.zero_init_readout and self.tie_embeddings:
            raise ConfigError("model.zero_init_readout starts an untied head at zero: with tie_embeddings the "
                              "head is the token embedding, which the input reads too")
        if self.init_scheme == "nanochat" and (self.hidden_init_scale != 1 or self.zero_init_readout
                                               or self.zero_init_query):
            raise ConfigError("model.init_scheme = 'nanochat' draws its own spreads: it does not take "
                              "model.hidden_init_scale, zero_init_readout or zero_init_query")
        if self.init_scheme == "nanochat" and self.parametrization == "mup":
            raise ConfigError("model.init_scheme = 'nanochat' draws its own spreads: it does not take "
                              "model.parametrization = 'mup'")
        if self.value_embeds_layout == "ends" and 2 * self.value_embeds > self.n_layers:
            raise ConfigError(
                f"model.value_embeds = {self.value_embeds} feeds the first and the last {self.value_embeds} "
                f"blocks, more than model.n_layers = {self.n_layers} holds (2 x value_embeds <= n_layers)"
            )
        if self.unet_skips and self.n_layers < 2:
            raise ConfigError("model.unet_skips needs n_layers >= 2 (the first half's outputs skip to the second half)")
        if self.paired_head_layers:
            self._check_paired_head_layers()
        if self.rope_truncated and (self.position != "rope" or self.head_size % 4):
            raise ConfigError(
                f"model.rope_truncated needs position = 'rope' and a head size divisible by 4, got "
                f"position = {self.position!r}, head size {self.head_size}"
            )

    def _check_paired_head_layers(self) -> None:
        layers = list(self.paired_head_layers)
        if len(set(layers)) != len(layers) or not all(0 <= i < self.n_layers for i in layers):
            raise ConfigError(f"model.paired_head_layers = {layers} must name distinct blocks 0 .. "
                              f"{self.n_layers - 1} (model.n_layers = {self.n_layers})")
        if self.n_heads % 2 or self.kv_heads % 2:
            raise ConfigError(f"model.paired_head_layers pairs heads h and h + H/2: it needs an even n_heads and "
                              f"kv_heads, got {self.n_heads} and {self.kv_heads}")

    def width_multiplier(self) -> float:
        """muP's m = d_model / mup_base_width (1 under "sp"): hidden matrices start at init_std /
        sqrt(m) and learn at AdamW's rate / m, the head reads its input times 1 / m (docs/mup.md)."""
        return self.d_model / self.mup_base_width if self.parametrization == "mup" else 1.0

    def block_windows(self) -> tuple[int, ...]:
        """Per block: its attention window, window_pattern cycled over the blocks (S: the window,
        L: 0, the whole context)."""
        pattern = self.window_pattern * -(-self.n_layers // len(self.window_pattern))
        return tuple(self.attention_window if letter == "S" else 0 for letter in pattern[:self.n_layers])

    @property
    def head_size(self) -> int:
        return self.d_model // self.n_heads


def matched_hidden_size(d_model: int) -> int:
    """SwiGLU's hidden width with about the parameters of a GELU layer of 4 x d_model: 3 matrices
    of d_model x F against 2 of d_model x 4 d_model, so F = 2/3 x 4 x d_model, to the nearest
    multiple of 8 (at least 8). d_model / 3 is never a half, so round() is plain nearest."""
    return max(8, 8 * round(d_model / 3))


@dataclass(frozen=True)
class DataConfig:
    # "stdlib" | a text, JSONL (.jsonl, .jsonl.gz) or Parquet file, or a folder or glob of them |
    # a folder of llm.c token shards | "hf:NAME[@REVISION][:SPLIT]"
    source: str = entry("stdlib", IDENTITY, FORCE, INIT_FROM)
    tokenizer: str = entry("bpe", IDENTITY, INIT_FROM)  # "bpe" | "char" | a path to a tokenizer.json
    val_fraction: float = entry(0.1, IDENTITY, FORCE, INIT_FROM)
    text_field: str = entry("text", IDENTITY, FORCE, INIT_FROM)  # the field (JSONL) or column (Parquet, hf:) that holds a document
    tokenizer_sample_bytes: int = entry(64_000_000, IDENTITY, FORCE, INIT_FROM)  # BPE learns from at most this much train text
    shard_tokens: int = entry(100_000_000, IDENTITY, FORCE, INIT_FROM)  # tokens per shard of the token store (llm.c's size)
    # Packed rows: a token attends only within its document, its position counted from the
    # document's start; the end-of-text token opens the document after it (docs/data.md).
    document_mask: bool = entry(False, IDENTITY, FORCE, INIT_FROM)
    # "document": every train row starts at a document's start; "bestfit": nanochat's rows, documents
    # packed best-fit from their start, train and val (docs/data.md)
    align: str = entry("none", IDENTITY, FORCE, INIT_FROM)

    def __post_init__(self) -> None:
        _finite("data", self)
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction = {self.val_fraction!r} must be in (0, 1)")
        if not self.source:
            raise ConfigError("data.source is empty")
        if not self.text_field:
            raise ConfigError("data.text_field is empty")
        _positive("data", self, "tokenizer_sample_bytes", "shard_tokens")
        _choice("data", "align", self.align, ALIGNMENTS)


GROUP_LRS = ("lr_embed", "lr_head", "lr_scalar")
TRACKERS = ("tensorboard", "wandb")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = entry(1500, IDENTITY, RESUME, FORCE, INIT_FROM)
    batch_size: int = entry(32, IDENTITY, FORCE, INIT_FROM)  # global, summed over devices and micro-batches
    grad_accum: int = entry(1, IDENTITY, FORCE, INIT_FROM)
    optimizer: str = entry("adamw", IDENTITY, INIT_FROM)  # or "muon": Muon for the hidden matrices, AdamW for the rest
    lr: float = entry(3e-3, IDENTITY, FORCE, INIT_FROM, SWEEP)  # AdamW's peak (with "muon": that of embeddings, head, norms and biases)
    min_lr: float = entry(3e-4, IDENTITY, FORCE, INIT_FROM, SWEEP)
    muon_lr: float = entry(0.02, IDENTITY, FORCE, INIT_FROM, SWEEP)  # Muon's peak, on the same schedule shape (min_lr / lr of it at the end)
    # Per-group peaks on lr's schedule (scaled by lr_X / lr, min_lr with it); None: lr itself.
    # embed: the token and position embeddings (and the head, when tied); head: an untied head;
    # scalar: norm gains and biases. With "muon", the hidden matrices stay on muon_lr.
    lr_embed: float | None = entry(None, IDENTITY, FORCE, INIT_FROM, SWEEP)
    lr_head: float | None = entry(None, IDENTITY, FORCE, INIT_FROM, SWEEP)
    lr_scalar: float | None = entry(None, IDENTITY, FORCE, INIT_FROM, SWEEP)
    warmup_steps: int = entry(100, IDENTITY, FORCE, INIT_FROM, SWEEP)
    window_warmup_steps: int = entry(0, IDENTITY, FORCE, INIT_FROM)  # model.attention_window grows to its size over these steps (jaxgpt/train/window_warmup.py)
    weight_decay: float = entry(0.1, IDENTITY, FORCE, INIT_FROM, SWEEP)
    beta1: float = entry(0.9, IDENTITY, FORCE, INIT_FROM, SWEEP)
    beta2: float = entry(0.99, IDENTITY, FORCE, INIT_FROM, SWEEP)
    adam_eps: float = entry(1e-8, IDENTITY, FORCE, INIT_FROM)
    # muP's knobs of the optimiser (docs/mup.md, "The knobs"). hidden_eps_by_width: AdamW's epsilon
    # for the hidden matrices is adam_eps / m, as their gradients shrink with the width.
    # decay_independent_of_lr: AdamW's decayed weights shrink by weight_decay times the schedule's
    # multiplier (1 at the peak) each step, whatever their group's rate or muP's 1 / m, instead of
    # by the rate times weight_decay.
    hidden_eps_by_width: bool = entry(False, IDENTITY, FORCE, INIT_FROM)
    decay_independent_of_lr: bool = entry(False, IDENTITY, FORCE, INIT_FROM)
    clip_norm: float = entry(1.0, IDENTITY, FORCE, INIT_FROM)  # 0 disables clipping
    # The learning rates' shape over the steps: "cosine" (nanoGPT's warm-up then cosine to
    # min_lr) or "warmdown" (nanochat's: warm-up to the peak, flat, then down in a line over the
    # last warmdown_ratio of the steps to final_lr_frac of the peak).
    schedule: str = entry("cosine", IDENTITY, INIT_FROM)
    warmdown_ratio: float = entry(0.65, IDENTITY, INIT_FROM)
    final_lr_frac: float = entry(0.05, IDENTITY, INIT_FROM)
    # Muon's parts (jaxgpt/train/muon_parts.py), each an option: the orthogonaliser
    # ("newton_schulz", optax's Muon, or "polar_express"), MuonEq's row equilibration, Muon+'s
    # renormalisation, NorMuon's second moment (its decay; 0: off), cautious weight decay, and
    # the query, key and value columns of the fused qkv kernel orthogonalised apart.
    muon_orthogonalizer: str = entry("newton_schulz", IDENTITY, INIT_FROM)
    muon_equilibrate_rows: bool = entry(False, IDENTITY, INIT_FROM)
    muon_renormalize: bool = entry(False, IDENTITY, INIT_FROM)
    muon_beta2: float = entry(0.0, IDENTITY, INIT_FROM)
    muon_cautious_decay: bool = entry(False, IDENTITY, INIT_FROM)
    muon_qkv_apart: bool = entry(False, IDENTITY, INIT_FROM)
    # "constant" (0.95) or "nanochat" (0.85 up to 0.97 over the first 400 steps, down to 0.90 over
    # the warm-down); Muon's weight decay "constant" or "cosine" (down to 0 at the last step).
    muon_momentum_schedule: str = entry("constant", IDENTITY, INIT_FROM)
    muon_decay_schedule: str = entry("constant", IDENTITY, INIT_FROM)
    # AdamW's groups: "jaxgpt" (lr and the group peaks, beta1, beta2, weight_decay for all) or
    # "nanochat" (its table, jaxgpt/train/adam_groups.py: its own betas and decay per group, the
    # value tables at half lr_embed, the resid lambdas at lr_scalar / 100, the smear's at 0.2).
    adam_groups: str = entry("jaxgpt", IDENTITY, INIT_FROM)
    # The embeddings', value tables' and untied head's AdamW peaks are those of a model this wide:
    # at d_model they are scaled by (d_model / this)^-0.5 (nanochat: 768); 0: not scaled.
    adam_reference_width: int = entry(0, IDENTITY, INIT_FROM)
    mtp_weight: float = entry(0.3, IDENTITY, FORCE, INIT_FROM)  # weight of the multi-token-prediction losses beside the next-token loss
    # The next-token logits also scored against the tokens 2, 3, ... ahead at these weights,
    # each falling to 0 in its stage of the run (modded-nanogpt's [0.5, 0.25];
    # jaxgpt/train/extra_targets.py). []: the next token alone.
    future_token_weights: tuple[float, ...] = entry((), IDENTITY, FORCE, INIT_FROM)
    # The next-token logits also scored against the token whose bytes are the longest proper
    # prefix of the next token's, at this weight, falling to 0 over the run's second third
    # (modded-nanogpt's 0.25). 0: off.
    prefix_token_weight: float = entry(0.0, IDENTITY, FORCE, INIT_FROM)
    seed: int = entry(0, IDENTITY, FORCE, INIT_FROM, SWEEP)
    log_every: int = entry(10, IDENTITY, RESUME, FORCE, INIT_FROM)
    eval_every: int = entry(250, IDENTITY, RESUME, FORCE, INIT_FROM)
    eval_batches: int = entry(20, IDENTITY, RESUME, FORCE, INIT_FROM)
    sample_tokens: int = entry(200, IDENTITY, RESUME, FORCE, INIT_FROM)  # generated at each eval; 0 disables the samples
    checkpoint_every: int = entry(500, IDENTITY, RESUME, FORCE, INIT_FROM)
    keep_checkpoints: int = entry(3, IDENTITY, RESUME, FORCE, INIT_FROM)
    parallel: str = entry("auto", IDENTITY, RESUME, FORCE, INIT_FROM)
    fsdp: int = entry(1, IDENTITY, RESUME, FORCE, INIT_FROM)
    # lm-evaluation-harness tasks on the live parameters, logged beside the val loss (jaxgpt[eval]):
    eval_tasks: str = entry("", IDENTITY, RESUME, FORCE, INIT_FROM)  # task names, comma-separated; "" runs none
    eval_tasks_every: int | None = entry(None, IDENTITY, RESUME, FORCE, INIT_FROM)  # None: at every eval_every steps
    eval_tasks_path: str = entry("", IDENTITY, RESUME, FORCE, INIT_FROM)  # a folder of task YAML files, as `jaxgpt eval --include-path` takes
    eval_tasks_limit: int = entry(0, IDENTITY, RESUME, FORCE, INIT_FROM)  # documents per task; 0: all of them
    # nanochat's CORE score on the live parameters, logged beside the val loss (jaxgpt.evaluation.core):
    core_bundle: str = entry("", IDENTITY, RESUME, FORCE, INIT_FROM)  # an eval bundle folder, as `jaxgpt eval --core` takes; "" scores none
    core_every: int | None = entry(None, IDENTITY, RESUME, FORCE, INIT_FROM)  # None: at every eval_every steps
    core_max_per_task: int = entry(0, IDENTITY, RESUME, FORCE, INIT_FROM)  # examples per task after the shuffle; 0: all
    # Where the metrics go beside metrics.jsonl (always written): any of TRACKERS (jaxgpt/runs/trackers.py).
    trackers: tuple[str, ...] = entry(("tensorboard",), RESUME, FORCE, INIT_FROM)
    wandb_project: str = entry("jaxgpt", RESUME, FORCE, INIT_FROM)  # with "wandb": W&B's project (WANDB_ENTITY, WANDB_MODE, WANDB_DIR as W&B reads them)

    def muon_parts(self) -> list[str]:
        """The Muon options set away from optax's Muon (whose keys these are)."""
        defaults = TrainConfig.__dataclass_fields__
        names = ("muon_orthogonalizer", "muon_equilibrate_rows", "muon_renormalize", "muon_beta2",
                 "muon_cautious_decay", "muon_qkv_apart", "muon_momentum_schedule", "muon_decay_schedule")
        return [name for name in names if getattr(self, name) != defaults[name].default]

    def __post_init__(self) -> None:
        s = "train"
        _finite(s, self)
        for name in self.trackers:
            _choice(s, "trackers", name, TRACKERS)
        if len(set(self.trackers)) < len(self.trackers):
            raise ConfigError(f"train.trackers = {list(self.trackers)} names a tracker twice")
        if not self.wandb_project.strip():
            raise ConfigError("train.wandb_project = '' must name a project")
        if self.eval_tasks_every is None:
            object.__setattr__(self, "eval_tasks_every", self.eval_every)
        names_list(self.eval_tasks, "train.eval_tasks")
        _positive(s, self, "eval_tasks_every")
        if self.core_every is None:
            object.__setattr__(self, "core_every", self.eval_every)
        _positive(s, self, "core_every")
        _positive(s, self, "core_max_per_task", allow_zero=True)
        _positive(s, self, "eval_tasks_limit", allow_zero=True)
        _positive(s, self, "steps", "batch_size", "grad_accum", "lr", "muon_lr", "log_every", "eval_every")
        _positive(s, self, "eval_batches", "checkpoint_every", "keep_checkpoints", "fsdp", "adam_eps")
        _positive(s, self, "min_lr", "warmup_steps", "weight_decay", "clip_norm", "sample_tokens",
                  "seed", "mtp_weight", "window_warmup_steps", "prefix_token_weight", allow_zero=True)
        for weight in self.future_token_weights:
            if not (math.isfinite(weight) and weight > 0):
                raise ConfigError(f"train.future_token_weights = {list(self.future_token_weights)} holds "
                                  f"{weight!r}: each weight must be a finite number > 0")
        _choice(s, "parallel", self.parallel, PARALLEL_MODES)
        _choice(s, "optimizer", self.optimizer, ("adamw", "muon"))
        _choice(s, "schedule", self.schedule, ("cosine", "warmdown"))
        _choice(s, "muon_orthogonalizer", self.muon_orthogonalizer, ("newton_schulz", "polar_express"))
        _choice(s, "muon_momentum_schedule", self.muon_momentum_schedule, ("constant", "nanochat"))
        _choice(s, "muon_decay_schedule", self.muon_decay_schedule, ("constant", "cosine"))
        _choice(s, "adam_groups", self.adam_groups, ("jaxgpt", "nanochat"))
        _positive(s, self, "adam_reference_width", allow_zero=True)
        for name in ("warmdown_ratio", "final_lr_frac", "muon_beta2"):
            if not 0.0 <= getattr(self, name) <= (1.0 if name != "muon_beta2" else 0.999999):
                raise ConfigError(f"train.{name} = {getattr(self, name)!r} must be in [0, 1"
                                  f"{']' if name != 'muon_beta2' else ')'}")
        if self.hidden_eps_by_width and self.optimizer != "adamw":
            raise ConfigError("train.hidden_eps_by_width sets AdamW's epsilon for the hidden matrices, which "
                              "train.optimizer = 'muon' updates: it needs train.optimizer = 'adamw'")
        for name in ("hidden_eps_by_width", "decay_independent_of_lr"):
            if getattr(self, name) and self.adam_groups == "nanochat":
                raise ConfigError(f"train.{name} is a rule of jaxgpt's AdamW groups: train.adam_groups = "
                                  "'nanochat' sets its own epsilon and decay")
        if self.optimizer != "muon" and self.muon_parts():
            raise ConfigError(f"train.{self.muon_parts()[0]} is one of Muon's parts: it needs train.optimizer = 'muon'")
        for name in GROUP_LRS:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"train.{name} = {value!r} must be > 0 (or left out: train.lr)")
        if self.min_lr > self.lr:
            raise ConfigError(f"train.min_lr = {self.min_lr} exceeds train.lr = {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"train.{name} = {getattr(self, name)!r} must be in [0, 1)")
        if self.batch_size % self.grad_accum:
            raise ConfigError(
                f"train.batch_size = {self.batch_size} is not divisible by "
                f"train.grad_accum = {self.grad_accum}"
            )


def names_list(text: str, what: str) -> tuple[str, ...]:
    """The names of a comma-separated list ("" holds none); an empty name is an error naming `what`."""
    if not text.strip():
        return ()
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise ConfigError(f"{what} = {text!r} has an empty name: separate names with single commas")
    return names


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if self.train.window_warmup_steps and not self.model.attention_window:
            raise ConfigError(f"train.window_warmup_steps = {self.train.window_warmup_steps} with "
                              "model.attention_window = 0: there is no window to grow")
        if self.model.tie_embeddings and self.train.lr_head is not None:
            raise ConfigError(f"train.lr_head = {self.train.lr_head!r} with model.tie_embeddings = true: the head is "
                              "the embedding, which takes train.lr_embed")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def replace(self, section: str, **values: Any) -> RunConfig:
        """This config with `values` changed in one section ("model", "data" or "train"), checked again."""
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **values)})

    def fingerprint(self, exclude: tuple[str, ...] = ()) -> str:
        """sha256 of the resolved config's IDENTITY keys that differ from the default config's;
        `exclude` drops `section.key` entries (`keys_with(RESUME)`: what a resumed run may change).
        A key added later at a default that keeps what the code did leaves every fingerprint, and
        so every sweep's records, as they were; two configs still share one only when equal."""
        data, defaults = self.to_dict(), _default_values()
        for dotted in (*(name for name in all_keys() if IDENTITY not in roles_of(name)), *exclude):
            section, key = dotted.split(".", 1)
            data[section].pop(key, None)
        data = {section: {key: value for key, value in values.items() if value != defaults[section][key]}
                for section, values in data.items()}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()

    def to_toml(self) -> str:
        lines: list[str] = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            # None (a key that follows another, as lr_embed follows lr) has no TOML form: left out,
            # it loads as its default, None again.
            lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items() if value is not None)
            lines.append("")
        return "\n".join(lines)


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}


@functools.cache
def _default_values() -> dict[str, dict[str, Any]]:
    return RunConfig().to_dict()


def all_keys() -> list[str]:
    """Every key, as `section.key`."""
    return [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in fields(cls)]


def roles_of(dotted: str) -> frozenset[str]:
    """The roles `section.key` declares."""
    section, name = dotted.split(".", 1)
    return next(f.metadata["roles"] for f in fields(SECTIONS[section]) if f.name == name)


def keys_with(role: str, section: str | None = None) -> tuple[str, ...]:
    """The keys (`section.key`, or bare names within `section`) that play `role`."""
    names = [name for name in all_keys() if role in roles_of(name)]
    if section is None:
        return tuple(names)
    return tuple(name.split(".", 1)[1] for name in names if name.startswith(section + "."))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # a JSON string is a valid TOML basic string, a JSON list of them a TOML array


_KIND_NAMES = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
               "tuple[str, ...]": "a list of strings", "tuple[float, ...]": "a list of numbers",
               "tuple[int, ...]": "a list of integers"}


def _coerce(section: str, name: str, value: Any, spec: dataclasses.Field) -> Any:
    """Check a TOML value against the field's annotation; ints are accepted for floats, and
    true / false for a string key that names their meaning (`metadata["bool"]`). A list key
    takes a TOML array of strings or one comma-separated string (`--set train.trackers=a,b`); a
    list of numbers (or integers), a TOML array of them or one number."""
    wanted = {"int": int, "float": float, "str": str, "bool": bool}
    base = str(spec.type).replace(" | None", "")
    if base == "tuple[str, ...]":
        if isinstance(value, str):
            return names_list(value, f"{section}.{name}")
        if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
            raise ConfigError(f"{section}.{name} = {value!r} must be {_KIND_NAMES[base]}")
        return tuple(value)
    if base in ("tuple[float, ...]", "tuple[int, ...]"):
        kind, accepted = (float, (int, float)) if base == "tuple[float, ...]" else (int, int)
        numbers = value if isinstance(value, (list, tuple)) else [value]
        if not all(isinstance(item, accepted) and not isinstance(item, bool) for item in numbers):
            raise ConfigError(f"{section}.{name} = {value!r} must be {_KIND_NAMES[base]}")
        return tuple(kind(item) for item in numbers)
    if isinstance(value, bool) and "bool" in spec.metadata:
        return spec.metadata["bool"][value]
    kind = wanted[base]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise ConfigError(f"{section}.{name} = {value!r} must be {_KIND_NAMES[base]}")
    return value


def _parse_override(item: str) -> tuple[str, str, Any]:
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    dotted, raw = item.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word such as rope or hf:tiny is taken as a string
    return section, key, value


def build_config(raw: dict[str, Any]) -> RunConfig:
    """Validate a nested {section: {key: value}} mapping into a RunConfig."""
    sections: dict[str, Any] = {}
    for section, values in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section {section!r}{did_you_mean(section, list(SECTIONS))}")
        if not isinstance(values, dict):
            raise ConfigError(f"config section [{section}] must be a table")
        known = {f.name: f for f in fields(SECTIONS[section])}
        kwargs = {}
        for key, value in values.items():
            if key not in known:
                raise ConfigError(
                    f"unknown config key {section}.{key}{did_you_mean(key, list(known))}"
                )
            if value is None:
                continue
            kwargs[key] = _coerce(section, key, value, known[key])
        sections[section] = SECTIONS[section](**kwargs)
    return RunConfig(**sections)


def read_toml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """The parsed TOML file; a missing file or bad TOML is a ConfigError naming it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                base: RunConfig | None = None) -> RunConfig:
    """Load a TOML config and apply `section.key=value` overrides.

    Keys the file and the overrides leave out take the built-in defaults, or `base`'s values
    when given (`train --init-from` starts from the imported checkpoint's model section).
    """
    raw: dict[str, dict[str, Any]] = base.to_dict() if base is not None else {}
    if path is not None:
        for section, values in read_toml(path).items():
            if isinstance(values, dict) and isinstance(raw.get(section), dict):
                raw[section].update(values)
            else:
                raw[section] = values
    for item in overrides:
        section, key, value = _parse_override(item)
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section {section!r}{did_you_mean(section, list(SECTIONS))}")
        raw.setdefault(section, {})[key] = value
    return build_config(raw)
