"""The TPU kernels: Pallas splash attention for the training pass, the head fused with its loss.

XLA's attention writes the [B, H, T, T] scores and probabilities to HBM, forward and backward.
Splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`, the kernel MaxText trains
with) computes them block by block on chip, skips the blocks above the causal diagonal, and keeps
only q, k, v, the output and a log-sum-exp per row for the backward pass. Here:

* It runs every uncached causal pass (training, evaluation, a prompt's prefill) from
  `SPLASH_MIN_CONTEXT` positions on (MaxText's threshold: below it one block is mostly padding).
  XLA's attention there would hold the [B, H, T, T] float32 scores: 7.6 GB a chip for an eval
  batch of 114 rows of 2,048 positions with 4 heads, where libtpu 0.0.42's compiler crashes.
  Cached decoding, one or a few queries against the cache, takes the portable attention, which
  is what MaxText decodes with too.
* Grouped KV heads go through the kernel's own forms: its MHA form with K KV heads (the query
  heads of a group consecutive, as `jaxgpt.model.layers` lays them out), its MQA form for one.
* Blocks: T is padded up to a multiple of 128 (the TPU's lanes); the block is the largest
  multiple of 128 up to `MAX_BLOCK` (MaxText's 512, clipped to the sequence) that divides it.
  Padded keys come after every real query, so the causal mask hides them; padded queries' rows
  are dropped. The queries are scaled by D^-1/2 first: the kernel does not scale.
* Packed rows (`forward(segment_ids=...)`) hand their ids to the kernel's own segment mask;
  padded positions form a segment of their own.
* A windowed model's set (`kernels(window=W)`) builds its windowed blocks' kernel on the
  kernel's local mask (keys t - W + 1 .. t), whose block tables skip every block wholly before
  the window, with segment ids too. Its block is at most W rounded up to the lanes, so a row of
  query blocks meets at most two key blocks at a time in the band: at 8,192 positions and W 512,
  2 of 16.
* Under a device mesh (`Kernels.on_mesh`) the kernel runs per device inside `shard_map` over the
  batch axes: XLA's partitioner cannot split a Pallas kernel.

`kernels(interpret=True)` runs the Pallas kernels in interpret mode, which the CPU can run: the
tests prove the set equal to the portable one there (tests/test_kernels_tpu.py). A TPU that
cannot take the kernel (an older generation, a head size it refuses) or a jax without it makes
`jaxgpt.kernels.usable` fall back to the portable set with one warning line.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxgpt.kernels import xla
from jaxgpt.kernels.base import Kernels, per_device
from jaxgpt.kernels.head_loss import mean_head_loss, weighted_head_loss

try:  # the kernel's home in jax; a jax without it leaves the set unusable, not unimportable
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

    SPLASH_MISSING: str | None = None
except Exception as error:  # ImportError, or an AttributeError raised inside an older Pallas
    pltpu = splash_kernel = splash_mask = None
    SPLASH_MISSING = f"splash attention does not import ({type(error).__name__}: {error})"

SPLASH_MIN_CONTEXT = 128
LANES = 128
MAX_BLOCK = 512
# What the probe (`jaxgpt.kernels.usable`) takes as "this kernel cannot run here", beside the
# errors every backend raises: Pallas' lowering refusals of a shape or a TPU generation.
LOWERING_ERRORS: tuple[type[BaseException], ...] = tuple(
    error for error in [getattr(pltpu, "LoweringException", None)] if isinstance(error, type))


def splash_layout(T: int, max_block: int = MAX_BLOCK) -> tuple[int, int]:
    """(padded length, block) for a sequence of T positions."""
    padded = -(-T // LANES) * LANES
    block = next(b for b in range(min(max_block, padded) // LANES * LANES, 0, -LANES) if padded % b == 0)
    return padded, block


def _splash(padded: int, block: int, heads: int, mqa: bool, interpret: bool, window: int = 0) -> Callable[..., Any]:
    """The causal kernel for one sequence: (q [H, T, D], k and v [K, T, D], or [T, D] for MQA);
    with a `window`, the local one (the query at t reads keys t - window + 1 .. t).

    Built anew by every trace that asks, as MaxText builds it: the kernel holds its block tables
    as arrays of the trace that makes it, so one kept across traces leaks the values of a
    gradient's partial evaluation into the next program (the sampler's, at lengths the probe does
    not compile). jax keeps the costly part, the masks' block tables, in its own cache."""
    one = (splash_mask.LocalMask((padded, padded), (window - 1, 0), offset=0) if window
           else splash_mask.CausalMask((padded, padded)))
    mask = splash_mask.MultiHeadMask([one for _ in range(heads)])
    sizes = splash_kernel.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                     block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                                     block_kv_dq=block)
    make = splash_kernel.make_splash_mqa if mqa else splash_kernel.make_splash_mha
    # `interpret` only when asked for: a jax whose kernel lacks the flag still runs on a TPU.
    flags = {"interpret": True} if interpret else {}
    return make(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, **flags)


def splash_attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, segment_ids_BT: jax.Array | None = None,
                     *, interpret: bool = False, max_block: int = MAX_BLOCK, window: int = 0) -> jax.Array:
    """Causal attention through the splash kernel: `xla.attention`'s result, [B, T, H, D]; with
    `segment_ids_BT`, the kernel's own segment mask (its blocks wholly across segments still run);
    with a static `window`, its local mask, in blocks of at most the window (see above)."""
    if SPLASH_MISSING:
        raise NotImplementedError(SPLASH_MISSING)
    B, T, H, D = q_BTHD.shape
    K = k_BTKD.shape[2]
    padded, block = splash_layout(T, min(max_block, -(-window // LANES) * LANES) if window else max_block)
    kernel = _splash(padded, block, H, K == 1, interpret, window)

    def heads_major(x_BTND: jax.Array) -> jax.Array:  # [B, T, N, D] -> [B, N, padded, D]
        return jnp.pad(x_BTND, ((0, 0), (0, padded - T), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    q_BHTD = heads_major(q_BTHD * jnp.asarray(D**-0.5, q_BTHD.dtype))
    k_BKTD, v_BKTD = heads_major(k_BTKD), heads_major(v_BTKD)
    if K == 1:
        k_BKTD, v_BKTD = k_BKTD[:, 0], v_BKTD[:, 0]
    if segment_ids_BT is None:
        out_BHTD = jax.vmap(kernel)(q_BHTD, k_BKTD, v_BKTD)
    else:  # padded positions are a segment of their own, which no real query reads
        padded_BT = jnp.pad(segment_ids_BT.astype(jnp.int32), ((0, 0), (0, padded - T)), constant_values=-1)
        one = lambda q, k, v, ids: kernel(q, k, v, segment_ids=splash_kernel.SegmentIds(q=ids, kv=ids))
        out_BHTD = jax.vmap(one)(q_BHTD, k_BKTD, v_BKTD, padded_BT)
    return out_BHTD.transpose(0, 2, 1, 3)[:, :T]


def attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, *, train: bool = False,
              remat: bool = False, segment_ids: jax.Array | None = None, window: jax.Array | None = None,
              interpret: bool = False, max_block: int = MAX_BLOCK, mesh: Any = None,
              axes: tuple[str, ...] | None = None, band: int = 0) -> jax.Array:
    """Splash attention from `SPLASH_MIN_CONTEXT` positions on, else XLA's, each with
    `segment_ids` where given and the static window `band` (a windowed set's kernel for its
    windowed blocks); XLA's with a traced `window` (`kernels(window=...)` builds the kernel for
    one); with `mesh`, each device runs the kernel on its share of the batch. `train` and `remat`
    change nothing here."""
    if q_BTHD.shape[1] < SPLASH_MIN_CONTEXT or window is not None:
        window = band or window
        return xla.attention(q_BTHD, k_BTKD, v_BTKD, segment_ids=segment_ids, window=window)
    attend = functools.partial(splash_attention, interpret=interpret, max_block=max_block, window=band)
    arrays = (q_BTHD, k_BTKD, v_BTKD) + (() if segment_ids is None else (segment_ids,))
    return (attend if mesh is None else per_device(attend, mesh, axes, inputs=len(arrays)))(*arrays)


@functools.lru_cache(maxsize=None)
def kernels(interpret: bool = False, max_block: int = MAX_BLOCK, window: int = 0, every_block: bool = True) -> Kernels:
    """The TPU set; `interpret`: the Pallas kernels in interpret mode (the CPU runs them);
    `window`: a windowed model's, whose windowed blocks run the local mask (`every_block`: no
    block reads the whole context, see `xla.with_banded`)."""
    attend = functools.partial(attention, interpret=interpret, max_block=max_block)
    if window:
        attend = xla.with_banded(attend, functools.partial(attend, band=window), every_block, segments=True)
    return dataclasses.replace(
        xla.KERNELS, name="tpu-interpret" if interpret else "tpu", attention=attend, head_loss=mean_head_loss,
        weighted_head_loss=weighted_head_loss,
        mesh_attention=lambda mesh, axes: functools.partial(attend, mesh=mesh, axes=axes))


KERNELS = kernels()
