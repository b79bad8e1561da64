"""The decoder's building blocks: norms, RoPE and sinusoidal tables, causal attention (grouped KV heads), feed-forward.

Shapes follow the legend in `jaxgpt.model.decoder`. Parameters are float32; matmul operands and the KV
cache are in the compute dtype (`model.dtype`); statistics (norms, softmax) in float32. The
dense layers' matmul, the attention and the GELU are the `Kernels` each module is handed
(`jaxgpt.kernels`; the portable ones by default).

Where attention runs (`CausalSelfAttention`, its one door): a pass with no cache calls
`kernels.attention`, which is, per kernel set,

    xla (portable)   jaxgpt/kernels/xla.py         attention: XLA's dot-product attention, masks as XLA ops
    cpu, cpu-bf16    jaxgpt/kernels/cpu.py         f32_attention / bf16_attention (cpu_attention.py:
                                                   blocked_causal_attention, windowed tiles)
    gpu              jaxgpt/kernels/gpu.py         causal_attention: cuDNN's, its sliding window
    tpu              jaxgpt/kernels/tpu.py         attention: Pallas splash attention
    (windows)        jaxgpt/kernels/xla.py         with_banded: a block's window picks the banded kernel

Cached passes (prefill into a cache, decoding) read the cache through `jaxgpt.model.cache`:
`cached_attention`, `layered_attention` for a long-short model's two kinds of cache, and
`written_attention` where each block writes its row first (`Kernels.cache_written_first`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any, Callable

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import ModelConfig
from jaxgpt.kernels.base import Kernels
from jaxgpt.kernels.choose import PORTABLE
from jaxgpt.model.cache import (
    BlockCache,
    CachePlace,
    CacheStack,
    LayerCaches,
    cached_attention,
    layered_attention,
    write_layer,
    written_attention,
)
from jaxgpt.model.dtypes import activation_dtype
from jaxgpt.model.paired_heads import Pairing, block_cache_view, doubled, doubled_place, interleaved

Rope = tuple[jax.Array, jax.Array]  # (cos, sin), each [B, T, D/2] float32
# What model.value_embeds hands one block: every table's lookup of the tokens [N, B, T, K*D],
# the index of this block's table, and 1.0 where a table feeds the block (0.0 where none does).
ValueEmbeds = tuple[jax.Array, jax.Array, jax.Array]


def dense_init(cfg: ModelConfig, output: bool = False, hidden: bool = False) -> nn.initializers.Initializer:
    """N(0, init_std); zeros for an `output` (a projection into the residual stream, or an untied
    head) under `model.zero_init`. A `hidden` matrix (fan-in growing with d_model) under muP:
    N(0, init_std / sqrt(m)), m = `ModelConfig.width_multiplier`."""
    if output and cfg.zero_init:
        return nn.initializers.zeros
    m = cfg.width_multiplier()
    return nn.initializers.normal(stddev=cfg.init_std / m**0.5 if hidden and m != 1 else cfg.init_std)


class Dense(nn.Dense):
    """`nn.Dense`; where the params hold `kernel_t` [features, in] in place of `kernel` (the
    sampler's weights, `transposed_matrices`), the same product read from the transposed matrix;
    where they hold `norm_sum` (`folded_layer_norms`), the product of the LayerNorm before it,
    from the raw inputs and the norm's statistics (`norm`: `layer_norm_statistics`)."""

    @nn.compact
    def __call__(self, inputs: jax.Array, norm: tuple[jax.Array, ...] | None = None) -> jax.Array:
        if self.has_variable("params", "norm_sum"):
            return self._after_folded_norm(inputs, norm)
        if not self.has_variable("params", "kernel_t"):
            return super().__call__(inputs)
        kernel_t = self.get_variable("params", "kernel_t")
        bias = self.get_variable("params", "bias") if self.use_bias else None
        inputs, kernel_t, bias = self.promote_dtype(inputs, kernel_t, bias, dtype=self.dtype)
        y = self.dot_general(inputs, kernel_t, (((inputs.ndim - 1,), (1,)), ((), ())), precision=self.precision)
        return y if bias is None else y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))

    def _after_folded_norm(self, inputs: jax.Array, norm: tuple[jax.Array, ...] | None) -> jax.Array:
        """LayerNorm(x) W + b = rstd ((x - x0) W' - mean s) + c, W' = diag(gain) W, s its column
        sums, c = shift W + b, x0 the first feature and mean that of x - x0 (so that a mean far
        from 0 does not cancel): the float32 product, then one elementwise epilogue."""
        if norm is None:
            raise ValueError(f"dense layer {self.name!r} holds a folded LayerNorm (norm_sum): "
                             "it needs the norm's statistics")
        first, mean, rstd = norm
        transposed = self.has_variable("params", "kernel_t")
        kernel = self.get_variable("params", "kernel_t" if transposed else "kernel")
        inputs = (inputs.astype(jnp.float32) - first).astype(self.dtype or inputs.dtype)
        inputs, kernel = self.promote_dtype(inputs, kernel, dtype=self.dtype)
        y = self.dot_general(inputs, kernel, (((inputs.ndim - 1,), (1 if transposed else 0,)), ((), ())),
                             precision=self.precision, preferred_element_type=jnp.float32)
        y = rstd * (y - mean * self.get_variable("params", "norm_sum")) + self.get_variable("params", "bias")
        return y.astype(self.dtype or inputs.dtype)


# The `dense` layers of a block, by name: the matrices `transposed_matrices` lays out for decoding.
DENSE_NAMES = frozenset({"qkv", "out", "up", "gate", "down"})


def param_names(path: tuple[Any, ...]) -> tuple[str, ...]:
    """A params leaf's path (`jax.tree_util`'s keys) as the names of the modules down to it."""
    return tuple(str(getattr(key, "key", key)) for key in path)


def dense(cfg: ModelConfig, kernels: Kernels, features: int, name: str, output: bool = False) -> nn.Dense:
    """`Dense` (params `kernel` [in, features], `bias`) multiplying with the kernels' dot_general.
    `output`: a projection back into the residual stream, zero at init under `model.zero_init`."""
    assert name in DENSE_NAMES, name
    return Dense(features, use_bias=cfg.bias, dtype=activation_dtype(cfg, kernels),
                 kernel_init=dense_init(cfg, output, hidden=True), dot_general=kernels.dot_general, name=name)


def transposed_matrices(params: Any, convert: Callable[[int, Any], Any] | None = None, keep: tuple[str, ...] = ()) -> Any:
    """`params` with every `dense` layer's `kernel` [..., in, features] held as `kernel_t`
    [..., features, in] (a `jax.ShapeDtypeStruct` keeps its sharding, its last two axes swapped):
    a product with one token then reads each output's weights from one contiguous row.
    `convert(i, leaf)` first converts each leaf (a dtype cast; `i`: its place in the flattened
    tree), one leaf at a time, so that no
    second converted tree is ever alive; the top-level entries named in `keep` (matrices the pass
    does not read) are converted but keep their layout."""
    def is_matrix(names: tuple[str, ...]) -> bool:
        return len(names) >= 2 and names[-1] == "kernel" and names[-2] in DENSE_NAMES and names[0] not in keep

    def laid_out(i: int, path: Any, leaf: Any) -> Any:
        leaf = leaf if convert is None else convert(i, leaf)
        return _swapped(leaf) if is_matrix(param_names(path)) else leaf

    def renamed(tree: Any, names: tuple[str, ...]) -> Any:
        if not isinstance(tree, Mapping):
            return tree
        return {(f"{key}_t" if is_matrix((*names, key)) else key): renamed(value, (*names, key))
                for key, value in tree.items()}

    flat, tree = jax.tree_util.tree_flatten_with_path(params)
    return renamed(tree.unflatten([laid_out(i, path, leaf) for i, (path, leaf) in enumerate(flat)]), ())


def _swapped(leaf: Any) -> Any:
    """`leaf` with its last two axes swapped (a `jax.ShapeDtypeStruct`: its shape and sharding)."""
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        return jnp.swapaxes(leaf, -1, -2)
    shape = (*leaf.shape[:-2], leaf.shape[-1], leaf.shape[-2])
    return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=_resharded(leaf, lambda a: (*a[:-2], a[-1], a[-2])))


def _resharded(leaf: jax.ShapeDtypeStruct, pick: Callable[[tuple[Any, ...]], tuple[Any, ...]]) -> Any:
    """`leaf`'s sharding over the mesh axes `pick` makes of its array axes' (a sharding without a
    spec, which holds any shape, as it is)."""
    spec = getattr(leaf.sharding, "spec", None)
    if spec is None:
        return leaf.sharding
    return leaf.sharding.update(spec=type(spec)(*pick((*spec, *(None,) * (len(leaf.shape) - len(spec))))))


# Each pre-norm LayerNorm, and the dense layers that read its output (`folded_layer_norms`).
FOLDED_NORMS = (("attention_norm", "attention", ("qkv",)), ("feed_forward_norm", "feed_forward", ("up", "gate")))


def folds_layer_norms(cfg: ModelConfig) -> bool:
    """Whether `folded_layer_norms` applies to the model: pre-norm LayerNorm blocks whose norms
    feed only dense layers (a value gate reads the attention norm's output too)."""
    return cfg.norm == "layernorm" and cfg.residual == "pre" and not cfg.value_gate


def folded_layer_norms(params: Any, dtype: Callable[[tuple[str, ...]], Any], transposed: bool = False) -> Any:
    """`params` with each block's LayerNorm gain and shift folded into the dense layers that read
    it (`Kernels.folded_layer_norm`): `kernel` becomes diag(gain) kernel, converted to
    `dtype(names)` (its names in the tree: the dtype the sampler reads it in; None: float32),
    `transposed`: held as `kernel_t` (as `transposed_matrices` lays it out); `bias` becomes
    shift kernel + bias, and `norm_sum` holds the converted kernel's column sums, so that `Dense`
    computes LayerNorm(x) kernel + bias from x itself (the blocks' own stacks, scanned or not;
    `jax.ShapeDtypeStruct` leaves keep their shardings, less the folded axis)."""
    def block(name: str, tree: Mapping[str, Any]) -> dict[str, Any]:
        tree = dict(tree)
        for norm, module, denses in FOLDED_NORMS:
            tree[module] = {key: _folded_dense(layer, tree[norm]["scale"], tree[norm]["bias"],
                                               dtype((name, module, key, "kernel")), transposed)
                            if key in denses else layer for key, layer in tree[module].items()}
        return tree

    return {key: block(key, value) if key == "blocks" or re.fullmatch(r"block_\d+", key) else value
            for key, value in params.items()}


def _folded_dense(layer: Mapping[str, Any], gain: Any, shift: Any, dtype: Any, transposed: bool) -> dict[str, Any]:
    def fold(kernel, gain, shift, bias):
        kernel32 = kernel.astype(jnp.float32)
        folded = (gain[..., :, None] * kernel32).astype(dtype or jnp.float32)
        added = jnp.einsum("...c,...cf->...f", shift, kernel32, precision=jax.lax.Precision.HIGHEST)
        return folded, folded.astype(jnp.float32).sum(-2), added if bias is None else added + bias

    arguments = (layer["kernel"], gain, shift, layer.get("bias"))
    if isinstance(layer["kernel"], jax.ShapeDtypeStruct):
        shapes = jax.eval_shape(fold, *arguments)
        features = _resharded(layer["kernel"], lambda axes: (*axes[:-2], axes[-1]))  # less the folded axis
        kernel, norm_sum, bias = (jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding) for shape, sharding
                                  in zip(shapes, (layer["kernel"].sharding, features, features)))
    else:
        kernel, norm_sum, bias = fold(*arguments)
    rest = {key: value for key, value in layer.items() if key != "kernel"}
    matrix = {"kernel_t": _swapped(kernel)} if transposed else {"kernel": kernel}
    return {**rest, **matrix, "bias": bias, "norm_sum": norm_sum}


def in_a_loop(cfg: ModelConfig, kernels: Kernels) -> bool:
    """Whether a train step runs the blocks inside a loop: a scanned stack unrolled less than its
    depth (`Kernels.scan_unroll`). The loop keeps XLA from merging a recomputation with the
    forward pass, so `jax.checkpoint` needs no `prevent_cse` there; without one it must have it,
    or the recomputation is merged away and the backward keeps what it was to recompute."""
    return cfg.scan_layers and (kernels.scan_unroll == 1 or kernels.scan_unroll < cfg.n_layers)  # lax.scan's rule


def recomputed(fn: Any, recompute: bool = True, prevent_cse: bool = True) -> Any:
    """`fn` (elementwise work between matmuls) under `jax.checkpoint` when `recompute`
    (`Kernels.recompute_elementwise`): the backward pass keeps only its inputs and recomputes its
    float32 intermediates, which are several times their size (a LayerNorm's centred and scaled
    copies, the tanh GELU's cube and tanh) and cheap to compute again. `prevent_cse` keeps XLA
    from merging the recomputation away, which a scanned stack's loop does by itself
    (`in_a_loop`)."""
    return jax.checkpoint(fn, prevent_cse=prevent_cse) if recompute else fn


def recomputed_as_kernels_ask(cfg: ModelConfig, kernels: Kernels, fn: Any, when: bool = True) -> Any:
    """`recomputed(fn)` where the kernels recompute elementwise work (and `when`), kept apart from
    the forward pass wherever no loop does (`in_a_loop`)."""
    return recomputed(fn, when and kernels.recompute_elementwise, not in_a_loop(cfg, kernels))


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """GPT-2's LayerNorm in float32: biased variance over the last axis, gain and bias."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    return (x32 - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def one_pass_layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """`layer_norm` with both statistics from one pass over the features (Kernels.one_pass_layer_norm):
    the variance as E[d^2] - E[d]^2 of d = x less its first feature, so that a mean far from 0
    does not cancel (the error in the variance stays within about the features' count of float32
    roundings, as one feature lies at most sqrt(n) deviations from the mean)."""
    shifted, mean, var = _shifted_moments(x)
    return (shifted - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def layer_norm_statistics(x: jax.Array, eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """LayerNorm's statistics of x from one pass, as `one_pass_layer_norm` takes them, each
    [..., 1] float32: x's first feature x0, the mean of x - x0, and the reciprocal deviation.
    What a dense layer folded with the norm (`folded_layer_norms`) applies around its product."""
    _, mean, var = _shifted_moments(x)
    return x[..., :1].astype(jnp.float32), mean, jax.lax.rsqrt(var + eps)


def _shifted_moments(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x in float32 less its first feature, that difference's mean and the features' variance."""
    shifted = x.astype(jnp.float32)
    shifted = shifted - shifted[..., :1]
    mean = shifted.mean(-1, keepdims=True)
    return shifted, mean, jnp.maximum(jnp.square(shifted).mean(-1, keepdims=True) - jnp.square(mean), 0.0)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """x divided by its root mean square over the last axis, in float32, times the gain."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps) * scale


def rms_normalize(x: jax.Array) -> jax.Array:
    """x divided by its root mean square over the last axis, without parameters, in x's dtype:
    QK-norm's and the embedding norm's. Epsilon is float32's machine epsilon, as PyTorch's
    `F.rms_norm` takes it when none is given (the speedrun's and nanochat's norm)."""
    return rms_norm(x, jnp.float32(1.0), float(jnp.finfo(jnp.float32).eps)).astype(x.dtype)


class _Norm(nn.Module):
    """What both norms hold: epsilon, the output dtype, and whether the norm is recomputed in the
    backward pass (`recomputed`'s arguments)."""

    eps: float
    dtype: Any = jnp.float32
    recompute: bool = True
    prevent_cse: bool = True

    def _normed(self, norm: Callable[..., jax.Array], *arguments: jax.Array) -> jax.Array:
        fn = lambda *arguments: norm(*arguments, self.eps).astype(self.dtype)
        return recomputed(fn, self.recompute, self.prevent_cse)(*arguments)


class LayerNorm(_Norm):
    """GPT-2's LayerNorm: biased variance over the features of one vector, learned gain and bias;
    `one_pass`: its statistics from one pass (`one_pass_layer_norm`)."""

    one_pass: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (features,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (features,), jnp.float32)
        return self._normed(one_pass_layer_norm if self.one_pass else layer_norm, x, scale, bias)


class RMSNorm(_Norm):
    """LayerNorm without the mean: divide by the root mean square, learned gain, no bias."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        return self._normed(rms_norm, x, scale)


def make_norm(cfg: ModelConfig, kernels: Kernels, name: str | None = None) -> nn.Module:
    options = dict(eps=cfg.norm_eps, dtype=activation_dtype(cfg, kernels), recompute=kernels.recompute_elementwise,
                   prevent_cse=not in_a_loop(cfg, kernels), name=name)
    if cfg.norm == "layernorm":
        return LayerNorm(one_pass=kernels.one_pass_layer_norm, **options)
    return RMSNorm(**options)


def rope_tables(positions_BT: jax.Array, head_size: int, scale: float, base: float, truncated: bool = False) -> Rope:
    """cos and sin for each position; `scale` > 1 interpolates positions (divides them by scale).
    `truncated` (model.rope_truncated): head_size / 4 frequencies from 1 to 1 / base, both ends
    included, then head_size / 4 zero ones, whose pairs stay unrotated."""
    if truncated:
        quarter = head_size // 4
        inv_freq = jnp.concatenate([(1.0 / base) ** jnp.linspace(0.0, 1.0, quarter, dtype=jnp.float32),
                                    jnp.zeros(head_size // 2 - quarter, jnp.float32)])
    else:
        inv_freq = 1.0 / (base ** (jnp.arange(0, head_size, 2, dtype=jnp.float32) / head_size))
    angles = (positions_BT.astype(jnp.float32) / scale)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def sinusoidal_positions(positions_BT: jax.Array, width: int, base: float = 10000.0) -> jax.Array:
    """The fixed table of "Attention Is All You Need" [B, T, width]: feature 2i is sin, 2i + 1 cos,
    of position / base^(2i / width). No parameters, so it holds at any position."""
    angles = positions_BT.astype(jnp.float32)[..., None] / base ** (jnp.arange(0, width, 2, dtype=jnp.float32) / width)
    return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*positions_BT.shape, width)


def apply_rope(x_BTHD: jax.Array, rope: Rope) -> jax.Array:
    """Rotate the two halves of each head (Hugging Face Llama's `rotate_half` layout)."""
    cos, sin = (t[:, :, None, :] for t in rope)  # broadcast over heads
    x = x_BTHD.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BTHD.dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with grouped KV heads and an optional KV cache.

    The query heads of one group are consecutive (head h reads KV head h // (H // K)), as Hugging
    Face's Llama lays them out, so imported weights need no permutation. `train`: the forward
    pass of a train step, which will be differentiated (the kernels may lay it out for that).
    """

    cfg: ModelConfig
    kernels: Kernels = PORTABLE
    deterministic: bool = True
    train: bool = False

    @nn.compact
    def __call__(
        self, x_BTC: jax.Array, rope: Rope | None, kv: BlockCache | None = None, place: CachePlace | None = None,
        values: ValueEmbeds | None = None, segment_ids: jax.Array | None = None, window: jax.Array | None = None,
        norm: tuple[jax.Array, ...] | None = None, pairing: Pairing | None = None,
    ) -> tuple[jax.Array, BlockCache | None]:
        """Cached decoding passes `place`: the T new keys and values are then returned for the
        caller to write (`write_kv`), so no layer copies the cache. With `kv` too (this layer's
        cache, read only) the queries also read each sequence's cached positions before
        `place.index`; without it (a prefill into an empty cache) they read only the new tokens;
        with every layer's (`CacheStack`) this block writes its new keys and values into its row
        first, reads the row alone and returns the stack. `values`: the
        value embeddings (model.value_embeds), mixed into the values before they are cached;
        `segment_ids` [B, T]: each query reads only its own segment's keys (no cache); `window`
        (model.attention_window, this block's: 0 for the whole context) bounds how far back a
        query reads, cached or not. `norm`: x's LayerNorm statistics, where the projection holds
        the norm folded in (`folded_layer_norms`) and x is the block's raw input. `pairing`
        (model.paired_head_layers): whether this block's heads attend in pairs, and the RoPE
        tables they then read (`jaxgpt.model.paired_heads`)."""
        cfg = self.cfg
        B, T, _ = x_BTC.shape
        H, K, D = cfg.n_heads, cfg.kv_heads, cfg.head_size
        qkv = dense(cfg, self.kernels, (H + 2 * K) * D, "qkv")(x_BTC, norm)
        q_BTHD = qkv[..., : H * D].reshape(B, T, H, D)
        k_BTKD = qkv[..., H * D : (H + K) * D].reshape(B, T, K, D)
        v_BTKD = qkv[..., (H + K) * D :].reshape(B, T, K, D)
        if cfg.value_embeds:
            lookups_NBTX, table, table_on = values
            ve_BTKD = jax.lax.dynamic_index_in_dim(lookups_NBTX, table, keepdims=False).reshape(B, T, K, D)
            if cfg.value_gate:  # one gate in (0, 3) per KV head, read from the block's input
                gate = nn.Dense(K, use_bias=False, dtype=activation_dtype(cfg, self.kernels),
                                kernel_init=dense_init(cfg), name="value_gate")
                gate_BTK1 = (3 * table_on * jax.nn.sigmoid(gate(x_BTC[..., :12]).astype(jnp.float32)))[..., None]
                v_BTKD = (v_BTKD + gate_BTK1 * ve_BTKD).astype(v_BTKD.dtype)
            else:
                mix = self.param("value_mix", nn.initializers.constant(0.5), (2,), jnp.float32)
                v_BTKD = mixed(self.kernels, cfg, v_BTKD, ve_BTKD, mix[0], mix[1] * table_on)
        # QK-norm is not linear: recomputed, its backward keeps the 16-bit q and k, not its
        # float32 copies (GPT-2 124M at batch 32 on h100-1: 16.6 GB of temporaries, else 11.7).
        prepare = recomputed_as_kernels_ask(cfg, self.kernels, functools.partial(prepare_qk, cfg), when=cfg.qk_norm)

        def attend(paired: bool) -> tuple[jax.Array, jax.Array, BlockCache | None]:
            """(the heads' outputs [B, T, H, D], the keys as the cache keeps them [B, T, K, D], the
            cache stack this block wrote or None), the heads in pairs where `paired`."""
            if not paired:
                q, k = prepare(q_BTHD, k_BTKD, rope)
                out, stack = self._attention(q, k, v_BTKD, kv, place, segment_ids, window)
                return out, k, stack
            q, k = prepare(interleaved(q_BTHD), interleaved(k_BTKD), pairing.rope)
            new = (k.reshape(B, T, K, D), v_BTKD)
            if isinstance(kv, CacheStack):  # written in its own layout, then read as the interleaved sequence
                stack = write_layer(kv, new, place, window)
                out = written_attention(q, block_cache_view(stack), doubled_place(place), window)
                return out.reshape(B, T, H, D), new[0], stack
            out, _ = self._attention(q, k, interleaved(v_BTKD), None if kv is None else block_cache_view(kv),
                                     None if place is None else doubled_place(place),
                                     None if segment_ids is None else doubled(segment_ids), window)
            return out.reshape(B, T, H, D), new[0], None

        if pairing is None or isinstance(pairing.on, (bool, np.bool_)):
            out_BTHD, k_BTKD, stack = attend(pairing is not None and bool(pairing.on))
        else:  # a scanned stack's per-layer choice: both ways compiled into the one layer
            out_BTHD, k_BTKD, stack = jax.lax.cond(pairing.on, lambda: attend(True), lambda: attend(False))
        if cfg.exclusive_self_attention:
            strength_H = jnp.tanh(self.param("xsa_alpha", nn.initializers.zeros, (H,), jnp.float32))
            out_BTHD = without_own_value(out_BTHD, v_BTKD, strength_H)
        kv = stack if isinstance(kv, CacheStack) else None if place is None else (k_BTKD, v_BTKD)
        out = dense(cfg, self.kernels, cfg.d_model, "out", output=True)(out_BTHD.reshape(B, T, H * D))
        return nn.Dropout(cfg.dropout)(out, deterministic=self.deterministic), kv

    def _attention(self, q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, kv: BlockCache | None,
                   place: CachePlace | None, segment_ids: jax.Array | None, window: jax.Array | None,
                   ) -> tuple[jax.Array, CacheStack | None]:
        """The heads' outputs, and the cache stack where `kv` is one (`CacheStack`) that this call
        writes first."""
        if kv is None:
            masks = {key: value for key, value in (("segment_ids", segment_ids), ("window", window)) if value is not None}
            return self.kernels.attention(q_BTHD, k_BTKD, v_BTKD, train=self.train, remat=self.cfg.remat != "none",
                                          **masks), None
        if isinstance(kv, LayerCaches):
            return layered_attention(q_BTHD, kv, (k_BTKD, v_BTKD), place, window), None
        if isinstance(kv, CacheStack):
            one_kernel = self.kernels.written_attention
            fused = None if one_kernel is None else one_kernel(q_BTHD, kv, (k_BTKD, v_BTKD), place, window)
            if fused is not None:
                return fused
            kv = write_layer(kv, (k_BTKD, v_BTKD), place, window)
            return written_attention(q_BTHD, kv, place, window), kv
        return cached_attention(q_BTHD, kv, (k_BTKD, v_BTKD), place, window), None


def without_own_value(out_BTHD: jax.Array, v_BTKD: jax.Array, strength_H: jax.Array) -> jax.Array:
    """model.exclusive_self_attention: each head's output less `strength` times its projection on
    the token's own value (its KV head's, normalised as F.normalize does, |v| at least 1e-4)."""
    B, T, H, D = out_BTHD.shape
    K = v_BTKD.shape[2]
    v_BTKD = v_BTKD.astype(jnp.float32)
    unit_BTK1D = (v_BTKD / jnp.maximum(jnp.linalg.norm(v_BTKD, axis=-1, keepdims=True), 1e-4))[:, :, :, None]
    y_BTKGD = out_BTHD.astype(jnp.float32).reshape(B, T, K, H // K, D)  # the query heads of each KV head's group
    along_BTKG1 = jnp.sum(y_BTKGD * unit_BTK1D, axis=-1, keepdims=True)
    y_BTKGD = y_BTKGD - strength_H.reshape(K, H // K, 1) * along_BTKG1 * unit_BTK1D
    return y_BTKGD.reshape(B, T, H, D).astype(out_BTHD.dtype)


def prepare_qk(cfg: ModelConfig, q_BTHD: jax.Array, k_BTKD: jax.Array, rope: Rope | None) -> tuple[jax.Array, jax.Array]:
    """Queries and keys as the attention reads them: QK-norm (model.qk_norm), then RoPE, then the
    queries scaled by model.attention_scale (every kernel divides by sqrt(D): the queries carry
    the rest)."""
    if cfg.qk_norm:
        q_BTHD, k_BTKD = rms_normalize(q_BTHD), rms_normalize(k_BTKD)
    if rope is not None:
        q_BTHD, k_BTKD = apply_rope(q_BTHD, rope), apply_rope(k_BTKD, rope)
    D = q_BTHD.shape[-1]
    # muP: sqrt(D_base) / D where 1 / sqrt(D) was (model.mup_base_head_size; equal at D = D_base).
    mup = (cfg.mup_base_head_size / D) ** 0.5 if cfg.parametrization == "mup" and cfg.mup_base_head_size else 1.0
    if cfg.attention_scale or mup != 1.0:
        q_BTHD = q_BTHD * jnp.asarray((cfg.attention_scale * D**0.5 if cfg.attention_scale else 1.0) * mup, q_BTHD.dtype)
    return q_BTHD, k_BTKD


def mixed(kernels: Kernels, cfg: ModelConfig, x_BTC: jax.Array, y_BTC: jax.Array, a: jax.Array, b: jax.Array
          ) -> jax.Array:
    """a·x + b·y in x's dtype: the learned sums of the x0 mix, a U-net skip and a value embedding. Recomputed, its
    backward keeps x and y as they are, not the float32 copies the scalars' products make."""
    fn = lambda x, y, a, b: (a * x + b * y).astype(x.dtype)
    return recomputed_as_kernels_ask(cfg, kernels, fn)(x_BTC, y_BTC, a, b)


class FeedForward(nn.Module):
    """Widen to hidden_size, GELU (tanh, as GPT-2), SwiGLU or ReLU², project back."""

    cfg: ModelConfig
    kernels: Kernels = PORTABLE
    deterministic: bool = True

    @nn.compact
    def __call__(self, x_BTC: jax.Array, norm: tuple[jax.Array, ...] | None = None) -> jax.Array:
        """`norm`: as `CausalSelfAttention`'s."""
        cfg = self.cfg
        up_BTF = dense(cfg, self.kernels, cfg.hidden_size, "up")(x_BTC, norm)
        if cfg.feed_forward == "swiglu":
            gate_BTF = dense(cfg, self.kernels, cfg.hidden_size, "gate")(x_BTC, norm)
            h_BTF = recomputed_as_kernels_ask(cfg, self.kernels, lambda gate, up: nn.silu(gate) * up)(gate_BTF, up_BTF)
        elif cfg.feed_forward == "relu2":
            h_BTF = recomputed_as_kernels_ask(cfg, self.kernels, lambda up: jnp.square(nn.relu(up)))(up_BTF)
        else:
            h_BTF = recomputed_as_kernels_ask(cfg, self.kernels, self.kernels.gelu)(up_BTF)
        out = dense(cfg, self.kernels, cfg.d_model, "down", output=True)(h_BTF)
        return nn.Dropout(cfg.dropout)(out, deterministic=self.deterministic)


class TransformerBlock(nn.Module):
    """One decoder block, pre- or post-norm exactly as the seed's `TransformerBlock.forward`."""

    cfg: ModelConfig
    kernels: Kernels = PORTABLE
    deterministic: bool = True
    train: bool = False  # a train step's forward pass (`CausalSelfAttention.train`)

    @nn.compact
    def __call__(
        self, x_BTC: jax.Array, rope: Rope | None, kv: BlockCache | None = None, place: CachePlace | None = None,
        x0_BTC: jax.Array | None = None, values: ValueEmbeds | None = None, segment_ids: jax.Array | None = None,
        window: jax.Array | None = None, bigram_BTC: jax.Array | None = None, pairing: Pairing | None = None,
    ) -> tuple[jax.Array, BlockCache | None]:
        """`x0_BTC`: the first block's input, mixed in under model.x0_mix; `values`: the value
        embeddings (model.value_embeds); `segment_ids` and `window`: the attention's masks;
        `bigram_BTC`: the bigram table's lookup, added times this block's lambda
        (model.bigram_hash_rows); `pairing`: whether its heads attend in pairs
        (model.paired_head_layers)."""
        cfg, kernels = self.cfg, self.kernels
        B, T, _ = x_BTC.shape
        chex.assert_shape(x_BTC, (B, T, cfg.d_model))
        if cfg.x0_mix:
            mix = self.param("x0_mix", lambda _, shape, dtype: jnp.array([1.0, 0.0], dtype), (2,), jnp.float32)
            x_BTC = mixed(kernels, cfg, x_BTC, x0_BTC, mix[0], mix[1])
        if cfg.bigram_hash_rows:
            weight = self.param("bigram_lambda", nn.initializers.constant(0.1), (1,), jnp.float32)
            x_BTC = mixed(kernels, cfg, x_BTC, bigram_BTC, jnp.float32(1.0), weight[0])
        attention = CausalSelfAttention(cfg, kernels, self.deterministic, self.train, name="attention")
        feed_forward = FeedForward(cfg, kernels, self.deterministic, name="feed_forward")
        attention_norm = make_norm(cfg, kernels, "attention_norm")
        feed_forward_norm = make_norm(cfg, kernels, "feed_forward_norm")
        if "norm_sum" in self.variables.get("params", {}).get("attention", {}).get("qkv", {}):
            # The sampler's weights with the norms folded into the products (`folded_layer_norms`).
            attended, kv = attention(x_BTC, rope, kv, place, values, segment_ids, window,
                                     layer_norm_statistics(x_BTC, cfg.norm_eps), pairing)
            y_BTC = x_BTC + attended
            y_BTC = y_BTC + feed_forward(y_BTC, layer_norm_statistics(y_BTC, cfg.norm_eps))
        elif cfg.residual == "pre":
            attended, kv = attention(attention_norm(x_BTC), rope, kv, place, values, segment_ids, window,
                                     pairing=pairing)
            y_BTC = x_BTC + attended
            y_BTC = y_BTC + feed_forward(feed_forward_norm(y_BTC))
        else:
            attended, kv = attention(x_BTC, rope, kv, place, values, segment_ids, window, pairing=pairing)
            y_BTC = attention_norm(x_BTC + attended)
            y_BTC = feed_forward_norm(y_BTC + feed_forward(y_BTC))
        y_BTC = y_BTC.astype(x_BTC.dtype)
        chex.assert_equal_shape([x_BTC, y_BTC])
        chex.assert_trees_all_equal_dtypes(x_BTC, y_BTC)
        return y_BTC, kv
