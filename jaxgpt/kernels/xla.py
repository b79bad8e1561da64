"""The portable kernels: what JAX and Flax offer, on every backend.

`jax.lax.dot_general` for the dense layers, `jax.nn.dot_product_attention` (XLA's
implementation) for the attention, the embedding read backwards (`nn.Embed.attend`'s product)
for the tied head, `jax.nn.gelu`, and XLA's own choice of what the backward pass keeps. Every
other kernel set is tested equal to this one (tests/test_kernels.py).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxgpt.kernels.base import Kernels, in_window


def attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, *, train: bool = False,
              remat: bool = False, segment_ids: jax.Array | None = None, window: jax.Array | None = None) -> jax.Array:
    """Causal attention, grouped KV heads read in place; with `segment_ids` [B, T] a query reads
    only the keys of its own segment; with `window` (an int32 scalar, traced or not; 0: none) the
    query at t reads only keys t - window + 1 .. t. `train` and `remat` change nothing here."""
    mask = None if segment_ids is None else same_segment(segment_ids)
    if window is not None:
        mask = in_window(q_BTHD.shape[1], window) if mask is None else mask & in_window(q_BTHD.shape[1], window)
    masks = {} if mask is None else {"mask": mask}
    return jax.nn.dot_product_attention(q_BTHD, k_BTKD, v_BTKD, is_causal=True, **masks)


def masks_by_xla(attend: Callable[..., Any], on_mask: Callable[[], None] | None = None) -> Callable[..., Any]:
    """A causal-only kernel `attend` whose masked calls (`segment_ids`, a `window`) run `attention`
    above instead, after `on_mask()` (a warning, say); its unmasked calls are its own."""
    @functools.wraps(attend)
    def masked(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, *, segment_ids: jax.Array | None = None,
               window: jax.Array | None = None, **options: Any) -> jax.Array:
        if segment_ids is None and window is None:
            return attend(q_BTHD, k_BTKD, v_BTKD, **options)
        if on_mask is not None:
            on_mask()
        return attention(q_BTHD, k_BTKD, v_BTKD, segment_ids=segment_ids, window=window)
    return masked


def with_banded(attend: Callable[..., Any], banded: Callable[..., Any], every_block: bool,
                segments: bool = False) -> Callable[..., Any]:
    """`attend` (a set's attention, with `masks_by_xla`'s arguments) whose windowed calls run
    `banded`, a kernel built for the model's window (static, so that it skips what the window
    masks); those with segment ids too where `segments` says it takes them. A block's window
    arrives traced from the per-layer table, the window or 0: where `every_block` has the window,
    every windowed call is banded; else `lax.cond` picks by the value, both kernels compiled into
    the one scanned layer."""
    @functools.wraps(attend)
    def attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, *, segment_ids: jax.Array | None = None,
                  window: jax.Array | None = None, **options: Any) -> jax.Array:
        if window is None or (segment_ids is not None and not segments):
            return attend(q_BTHD, k_BTKD, v_BTKD, segment_ids=segment_ids, window=window, **options)
        if segment_ids is not None:
            options = dict(options, segment_ids=segment_ids)
        if every_block:
            return banded(q_BTHD, k_BTKD, v_BTKD, **options)
        return jax.lax.cond(window == 0, lambda *qkv: attend(*qkv, **options), lambda *qkv: banded(*qkv, **options),
                            q_BTHD, k_BTKD, v_BTKD)
    return attention


def same_segment(segment_ids_BT: jax.Array) -> jax.Array:
    """[B, 1, T, T]: whether query t and key s lie in the same segment (one mask for every head)."""
    return (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])[:, None]


def tied_logits(h_BTC: jax.Array, embedding_VC: jax.Array, dtype: Any) -> jax.Array:
    """h @ embedding^T (what `nn.Embed.attend` computes) in the compute dtype, float32 logits."""
    return jnp.einsum("btc,vc->btv", h_BTC.astype(dtype), embedding_VC.astype(dtype),
                      preferred_element_type=jnp.float32)


def untied_logits(h_BTC: jax.Array, kernel_CV: jax.Array, dtype: Any) -> jax.Array:
    return jnp.einsum("btc,cv->btv", h_BTC.astype(dtype), kernel_CV.astype(dtype),
                      preferred_element_type=jnp.float32)


KERNELS = Kernels(
    name="xla", dot_general=jax.lax.dot_general, attention=attention, tied_logits=tied_logits,
    untied_logits=untied_logits, gelu=functools.partial(jax.nn.gelu, approximate=True),
)
