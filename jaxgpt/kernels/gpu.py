"""The GPU kernels: cuDNN's fused attention in bfloat16 and float16, the head fused with its loss
(`head_loss`), the portable ones elsewhere.

`jax.nn.dot_product_attention` runs XLA's implementation unless told otherwise, which writes
the [B, H, T, T] scores and probabilities to memory, forward and backward; cuDNN's flash
attention keeps them on chip. It refuses with an error where it does not apply (no cuDNN or
too old a one, a ROCm GPU, a head size or layout it does not take): `jaxgpt.kernels` compiles
it once for the model's shapes when it chooses, and takes the portable kernels instead, with one
warning line saying why, where it refuses.

The sampler (`Kernels.decoding`) holds the blocks' matrices transposed, writes each block's keys
into the cache before reading it, in one Pallas kernel (`jaxgpt.kernels.gpu_decode`), takes
LayerNorm's statistics in one pass, and folds a block's norms into the products that read them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp

from jaxgpt.kernels import gpu_decode, xla
from jaxgpt.kernels.base import Kernels, per_device
from jaxgpt.kernels.head_loss import mean_head_loss, weighted_head_loss


def causal_attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, *, train: bool = False,
                     remat: bool = False, mesh: Any = None, axes: tuple[str, ...] | None = None,
                     window: int = 0, implementation: str = "cudnn") -> jax.Array:
    """cuDNN's attention in 16-bit dtypes (with `mesh`, run per device on its rows: cuDNN's own
    partitioner fails under FSDP), XLA's in float32; with a static `window`, cuDNN's sliding
    window (the query at t reads keys t - window + 1 .. t), which skips the blocks before it.
    `implementation="xla"`: the same call, masks included, through jax's reference
    implementation of cuDNN's (what a machine without a GPU can run)."""
    if q_BTHD.dtype not in (jnp.bfloat16, jnp.float16):  # cuDNN's flash kernel has no float32
        return xla.attention(q_BTHD, k_BTKD, v_BTKD, window=window or None)
    local = {"local_window_size": (window - 1, 0)} if window else {}
    attend = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=implementation, **local)
    return (attend if mesh is None else per_device(attend, mesh, axes))(q_BTHD, k_BTKD, v_BTKD)


@functools.lru_cache(maxsize=None)
def _portable_for_masks() -> None:
    """One warning line a process: jaxgpt hands cuDNN's kernel no segment mask (its packed layout
    wants each row's segment offsets, at most a static count of them)."""
    logging.getLogger("jaxgpt.kernels").warning(
        "jaxgpt: packed rows (segment_ids) run XLA's attention on the GPU, not cuDNN's")


# `causal_attention`, with packed rows (and windows outside `windowed`) on XLA's masked attention.
attention = xla.masks_by_xla(causal_attention, _portable_for_masks)


# A train step runs the block stack unrolled (no loop; the params keep their stacked layout): a
# loop's iterations copy their slices of the stacked params and saved activations (memcpy, 9 % of
# GPT-2 124M's step on an H200), whose step takes 66 ms unrolled against 77 ms looped
# (docs/performance.md).
KERNELS = dataclasses.replace(xla.KERNELS, name="gpu", attention=attention, head_loss=mean_head_loss,
                              weighted_head_loss=weighted_head_loss, scan_unroll=1 << 30,
                              recompute_elementwise=False, transposed_decoding=True,
                              decoding=(("cache_written_first", True), ("one_pass_layer_norm", True),
                                        ("folded_layer_norm", True),
                                        ("written_attention", gpu_decode.written_attention)),
                              mesh_attention=lambda mesh, axes: functools.partial(attention, mesh=mesh, axes=axes))


@functools.lru_cache(maxsize=None)
def windowed(size: int, every_block: bool) -> Kernels:
    """The set for a model whose windowed blocks read their last `size` keys: those blocks run
    cuDNN's sliding window (see `xla.with_banded` for `every_block`)."""
    windowed_attention = xla.with_banded(attention, functools.partial(causal_attention, window=size), every_block)
    return dataclasses.replace(
        KERNELS, attention=windowed_attention,
        mesh_attention=lambda mesh, axes: functools.partial(windowed_attention, mesh=mesh, axes=axes))
