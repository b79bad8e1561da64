"""The CPU kernels: the matmul layouts and attention XLA CPU runs fastest, assembled as two sets.

`F32` for float32 compute; `BF16` for bfloat16 compute, where XLA CPU has bfloat16 matmuls but
no bfloat16 arithmetic, so activations stay float32 and only matmul operands are bfloat16
(`cpu_matmul`). Both equal the portable kernels (`xla`) up to float rounding
(tests/test_kernels.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxgpt.kernels import xla
from jaxgpt.kernels.base import Kernels
from jaxgpt.kernels.cpu_attention import REMAT_TILE, TILED_TRAIN_CONTEXT, blocked_causal_attention, causal_query_blocks
from jaxgpt.kernels.cpu_matmul import (
    BF16_ATTENTION_SAVED,
    BF16_MATMUL_SAVED,
    bf16_causal_attention,
    bf16_matmul,
    cpu_bf16_dot_general,
    flat_dot_general,
    transposed_copy,
)


def _flat(matmul: Any, h_BTC: jax.Array, w: jax.Array) -> jax.Array:
    """`matmul` ([N, C] and a weight -> [N, F]) applied to [B * T, C]: see
    `cpu_matmul.flat_dot_general` for why the heads multiply 2-D."""
    B, T, C = h_BTC.shape
    return matmul(h_BTC.reshape(B * T, C), w).reshape(B, T, -1)


def _einsum_f32(spec: str) -> Any:
    return lambda h, w: jnp.einsum(spec, h, w, preferred_element_type=jnp.float32)


# ---------------------------------------------------------------- attention


def f32_attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, *, train: bool = False,
                  remat: bool = False, window: int = 0) -> jax.Array:
    """Query blocks (`causal_query_blocks`), or flash-style tiles under remat and for a train
    step's long contexts, where they bound what the backward pass holds; with a static `window`,
    each skipping the keys wholly before it."""
    B, T, H, _ = q_BTHD.shape
    tiled = remat or (train and T >= TILED_TRAIN_CONTEXT)
    return blocked_causal_attention(q_BTHD, k_BTKD, v_BTKD, tile=REMAT_TILE if tiled else None,
                                    blocks=causal_query_blocks(T, None if train else B * H), window=window)


def bf16_attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, *, train: bool = False,
                   remat: bool = False) -> jax.Array:
    """`bf16_causal_attention`, whose backward holds only q, k and v and one block's scores at a
    time; under remat from `TILED_TRAIN_CONTEXT` positions on, the float32 tiles."""
    T = q_BTHD.shape[1]
    if remat and T >= TILED_TRAIN_CONTEXT:
        return f32_attention(q_BTHD, k_BTKD, v_BTKD, train=train, remat=remat)
    return bf16_causal_attention(q_BTHD, k_BTKD, v_BTKD, causal_query_blocks(T))


# ---------------------------------------------------------------- head


def f32_tied_logits(h_BTC: jax.Array, embedding_VC: jax.Array, dtype: Any) -> jax.Array:
    return _flat(tied_logits_2d, h_BTC.astype(dtype), embedding_VC.astype(dtype))


def bf16_tied_logits(h_BTC: jax.Array, embedding_VC: jax.Array, dtype: Any) -> jax.Array:
    return _flat(bf16_matmul, h_BTC, transposed_copy(embedding_VC))


def f32_untied_logits(h_BTC: jax.Array, kernel_CV: jax.Array, dtype: Any) -> jax.Array:
    return _flat(_einsum_f32("nc,cv->nv"), h_BTC.astype(dtype), kernel_CV.astype(dtype))


def bf16_untied_logits(h_BTC: jax.Array, kernel_CV: jax.Array, dtype: Any) -> jax.Array:
    return _flat(bf16_matmul, h_BTC, kernel_CV)


@jax.custom_vjp
def tied_logits_2d(h_NC: jax.Array, embedding_VC: jax.Array) -> jax.Array:
    """h @ embedding^T (float32 out), whose embedding gradient reads a transposed copy of dlogits.

    Autodiff's embedding gradient contracts dlogits [N, V] and h [N, C] over their leading axis,
    a form XLA CPU's matmul runs at ~90 GFLOP/s for V >> C; after one explicit [V, N] copy of
    dlogits the same product runs at ~130: the Day 1 step is 3 % faster, 6 x 384 4 %. Same values.
    """
    return jnp.dot(h_NC, embedding_VC.T, preferred_element_type=jnp.float32)


def _tied_logits_fwd(h_NC, embedding_VC):
    return tied_logits_2d(h_NC, embedding_VC), (h_NC, embedding_VC)


def _tied_logits_bwd(residuals, g_NV):
    h_NC, embedding_VC = residuals
    g_NV = g_NV.astype(h_NC.dtype)
    dh_NC = jnp.dot(g_NV, embedding_VC, preferred_element_type=jnp.float32).astype(h_NC.dtype)
    g_VN = jax.lax.optimization_barrier(g_NV.T)  # keeps XLA from folding the transpose into the dot
    d_embedding_VC = jnp.dot(g_VN, h_NC, preferred_element_type=jnp.float32).astype(embedding_VC.dtype)
    return dh_NC, d_embedding_VC


tied_logits_2d.defvjp(_tied_logits_fwd, _tied_logits_bwd)


# ---------------------------------------------------------------- GELU

_SQRT_2_OVER_PI = 0.7978845608028654


@jax.custom_vjp
def gelu_tanh(x: jax.Array) -> jax.Array:
    """GPT-2's tanh GELU, equal to `jax.nn.gelu(x, approximate=True)` in value and gradient.

    Its backward pass keeps only the input and recomputes the tanh: autodiff of the formula
    keeps four [B, T, F] intermediates per layer, and XLA CPU fuses all of them (dynamic-sliced
    from the scanned layer stack) into one slow, transposing loop.
    """
    return jax.nn.gelu(x, approximate=True)


def _gelu_tanh_fwd(x):
    return gelu_tanh(x), x


def _gelu_tanh_bwd(x, g):
    x = x.astype(jnp.float32)  # the derivative in float32, whatever the compute dtype
    x2 = x * x
    t = jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * (x2 * x)))
    dy_dx = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x2)
    return ((g.astype(jnp.float32) * dy_dx).astype(g.dtype),)


gelu_tanh.defvjp(_gelu_tanh_fwd, _gelu_tanh_bwd)


# ---------------------------------------------------------------- the sets

# A scanned stack saves only the matmul outputs (with bfloat16 compute, what `bf16_matmul` and
# `bf16_causal_attention` name) and recomputes the cheap elementwise work (norms, GELU, softmax)
# in the backward pass: the same matmuls, but about half the per-layer residuals, which the scan
# stacks into buffers that XLA CPU zero-fills, copies and page-faults afresh every step (about a
# fifth of the step time).
_policies = jax.checkpoint_policies
SCAN_REMAT_POLICY = _policies.save_from_both_policies(
    _policies.dots_with_no_batch_dims_saveable,
    _policies.save_only_these_names(*BF16_MATMUL_SAVED, BF16_ATTENTION_SAVED))

DOTS_REMAT_POLICY = _policies.save_from_both_policies(
    _policies.dots_with_no_batch_dims_saveable, _policies.save_only_these_names(*BF16_MATMUL_SAVED))

# The blocked kernels know only the causal mask and a static window (`windowed`): packed rows, and
# windows of a set not built for one, take XLA's masked attention.
F32 = Kernels(
    name="cpu", dot_general=flat_dot_general, attention=xla.masks_by_xla(f32_attention), tied_logits=f32_tied_logits,
    untied_logits=f32_untied_logits, gelu=gelu_tanh, scan_remat_policy=SCAN_REMAT_POLICY,
    dots_remat_policy=DOTS_REMAT_POLICY, recompute_elementwise=False,
    float32_activations=True,
)
BF16 = dataclasses.replace(
    F32, name="cpu-bf16", dot_general=cpu_bf16_dot_general, attention=xla.masks_by_xla(bf16_attention),
    tied_logits=bf16_tied_logits, untied_logits=bf16_untied_logits,
)


@functools.lru_cache(maxsize=None)
def windowed(kernels: Kernels, size: int, every_block: bool) -> Kernels:
    """`kernels` (`F32` or `BF16`) for a model whose windowed blocks read their last `size` keys:
    those blocks run the blocked and tiled kernels built for that window, which skip the keys
    wholly before it (float32 scores, whatever the operands); packed rows stay on XLA's masked
    attention. `every_block`: no block reads the whole context (see `xla.with_banded`)."""
    banded = functools.partial(f32_attention, window=size)
    return dataclasses.replace(kernels, attention=xla.with_banded(kernels.attention, banded, every_block))
