"""The GPU sampler's cached attention in one kernel: a block writes its new keys and values into
its row of the cache and every query reads the row, in one Pallas (Triton) call.

XLA's GPU backend compiles `jaxgpt.model.cache.write_layer` and `written_attention` as six kernels
a block at one decoded token (the new keys and values split off the projection, the scores, the
softmax, the values' sum, two in-place writes). Here one program per (row, KV head) writes its T
new entries, waits for its threads (`debug_barrier`: the block's own writes are then visible to
it), and reads the row in blocks of positions with an online softmax (scores and sums in
float32), its G query heads of the group and T queries together. The cache is the kernel's
output aliased to its input, so XLA passes the loop's buffer and copies nothing.

It takes every layout: a linear cache, a ring (every block windowed), and a long-short model's
two stacks (the block's window picks its kind's stack, read by a loop whose trip count is 0 for
the other). The queries, keys and values reach it in one array, [B, T, H + 2K, D]: where they
are the projection's slices XLA folds their concatenation back into its output, so nothing
splits them first (with RoPE, QK-norm or value embeddings one fusion writes it). A head size or a
group of query heads that is not a power of two (Triton's arrays are powers of two on every
axis) is left to the two XLA ops: `written_attention` then returns None. `interpret=True` runs
it in Pallas' interpret mode, which the CPU runs (tests).

The stack and the place are `jaxgpt.model.cache`'s `CacheStack` and `CachePlace`, read by their
fields (the kernels package imports nothing of the model's).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

try:  # a jax without Pallas' Triton backend keeps the XLA ops
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt
except Exception:  # ImportError, or an AttributeError raised inside an older Pallas
    pl = plt = None

MAX_BLOCK = 64  # positions a step of the read loads: [64, D] keys at D = 64 fill four warps' registers
PRODUCT_ELEMENTS = 4096  # a step's [G, D, positions] float32 products held at once, per query


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _segments(S: int, G: int, D: int) -> tuple[tuple[int, int, int], ...]:
    """How the read steps over S positions: (first position, positions a step, steps) runs, the
    block of the first the largest power of two up to MAX_BLOCK that keeps a query's products in
    registers, the rest of S in one step of each of its power-of-two parts (a speculative
    sampler's ring of 258 slots: 4 steps of 64, then one of 2), so no step reads past the end."""
    block = MAX_BLOCK
    while block > 1 and G * D * block > PRODUCT_ELEMENTS:
        block //= 2
    runs, start = [(0, block, S // block)] if S >= block else [], S // block * block
    for part in (1 << bit for bit in reversed(range(block.bit_length()))):
        if (S - start) & part:
            runs.append((start, part, 1))
            start += part
    return tuple(runs)


def applies(q_BTHD: jax.Array, new: tuple[jax.Array, jax.Array]) -> bool:
    """Whether the kernel takes this pass: a power-of-two head size and query group."""
    H, D, K = q_BTHD.shape[2], q_BTHD.shape[3], new[0].shape[2]
    return pl is not None and _power_of_two(D) and _power_of_two(H // K)


class _Stack(NamedTuple):  # the fields of `jaxgpt.model.cache.CacheStack` the kernel reads
    k: jax.Array
    v: jax.Array
    layer: jax.Array
    ring: tuple[jax.Array, jax.Array] | None = None


class _Place(NamedTuple):  # of `jaxgpt.model.cache.CachePlace`
    index: jax.Array
    floors: jax.Array | None = None
    slot_positions: jax.Array | None = None


def probe(n_heads: int, kv_heads: int, head_size: int, dtype: Any, device: Any = None) -> None:
    """Compile the kernel once for a model's heads (one token against a small linear cache) for
    `device` (default: this backend's); raises what the compiler raises where it cannot."""
    if not _power_of_two(head_size) or not _power_of_two(n_heads // kv_heads):
        return
    placed = {} if device is None else {"sharding": jax.sharding.SingleDeviceSharding(device)}
    shape = lambda *dims, kind=dtype: jax.ShapeDtypeStruct(dims, kind, **placed)  # noqa: E731
    K, D = kv_heads, head_size

    def one_token(q, k, v, new_k, new_v, index):
        stack = _Stack(k, v, jnp.zeros((), jnp.int32))
        return written_attention(q, stack, (new_k, new_v), _Place(index))

    jax.jit(one_token).lower(shape(1, 1, n_heads, D), shape(2, 1, K, 16, D), shape(2, 1, K, D, 16),
                             shape(1, 1, K, D), shape(1, 1, K, D), shape(1, kind=jnp.int32)).compile()


def written_attention(q_BTHD: jax.Array, stack: Any, new: tuple[jax.Array, jax.Array], place: Any,
                      window: jax.Array | None = None, *, interpret: bool = False) -> tuple[jax.Array, Any] | None:
    """`write_layer`, then `written_attention` (`jaxgpt.model.cache`), in one kernel: (the
    queries' outputs [B, T, H, D], the stack); None where it does not apply (`applies`)."""
    if not applies(q_BTHD, new):
        return None
    B, T, H, D = q_BTHD.shape
    K = new[0].shape[2]
    # [B, T, H + 2K, D]: the projection's output itself where q, k and v are its slices.
    qkv_BTND = jnp.concatenate([q_BTHD.reshape(B, T, H * D), new[0].reshape(B, T, K * D),
                                new[1].reshape(B, T, K * D)], axis=-1).reshape(B, T, H + 2 * K, D)
    ring_in_place = place.slot_positions is not None
    linear = None if ring_in_place and stack.ring is None else (stack.k, stack.v)
    ring = stack.ring if stack.ring is not None else ((stack.k, stack.v) if ring_in_place else None)
    scalars = jnp.stack([jnp.asarray(stack.layer, jnp.int32),
                         jnp.asarray(0 if window is None else window, jnp.int32)])
    operands = [scalars, place.index.astype(jnp.int32)]
    if ring is not None:
        operands.append(place.slot_positions.astype(jnp.int32))
    if place.floors is not None:
        operands.append(place.floors.astype(jnp.int32))
    operands.append(qkv_BTND)
    caches = [*(linear or ()), *(ring or ())]
    kernel = functools.partial(
        _kernel, T=T, H=H, K=K, linear=None if linear is None else _segments(linear[0].shape[3], H // K, D),
        ring=None if ring is None else _segments(ring[0].shape[3], H // K, D),
        documents=place.floors is not None, barrier=not interpret)
    first = len(operands)
    out_BTHD, *caches = pl.pallas_call(
        kernel, grid=(B, K), interpret=interpret,
        out_shape=(jax.ShapeDtypeStruct((B, T, H, D), q_BTHD.dtype),
                   *(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches)),
        input_output_aliases={first + i: 1 + i for i in range(len(caches))},
        compiler_params=None if interpret else plt.CompilerParams(num_warps=4, num_stages=1),
        name="jaxgpt_written_attention",
    )(*operands, *caches)
    if linear is None:  # a ring alone
        return out_BTHD, stack._replace(k=caches[0], v=caches[1])
    return out_BTHD, stack._replace(k=caches[0], v=caches[1], ring=None if ring is None else tuple(caches[2:]))


Runs = tuple[tuple[int, int, int], ...]


def _kernel(*refs: Any, T: int, H: int, K: int, linear: Runs | None, ring: Runs | None, documents: bool,
            barrier: bool) -> None:
    """One (row b, KV head h): write the T new keys and values into the block's row of its
    stack, then read the row. `linear`, `ring`: how the read steps over each stack (`_segments`)
    where the model has it; with both, a block whose window is not 0 takes the ring. `barrier`:
    between the writes and the reads (interpret mode runs one thread and has none)."""
    refs = list(refs)
    scalars_ref, index_ref = refs.pop(0), refs.pop(0)
    held_ref = refs.pop(0) if ring else None
    floors_ref = refs.pop(0) if documents else None
    qkv_ref = refs.pop(0)
    n_caches = 2 * ((linear is not None) + (ring is not None))
    out_ref, caches = refs[n_caches], refs[n_caches + 1:]  # the caches read and written as outputs
    linear_k, linear_v = caches[:2] if linear else (None, None)
    ring_k, ring_v = caches[-2:] if ring else (None, None)
    b, h = pl.program_id(0), pl.program_id(1)
    row, window, index = scalars_ref[0], scalars_ref[1], index_ref[b]
    G, D = H // K, qkv_ref.shape[-1]
    both = linear is not None and ring is not None
    in_ring = window != 0  # a long-short model's block reads its ring, else its linear row

    for t in range(T):  # the new entries, in place (a slot past a linear cache's end is dropped)
        at = index + t
        k_D, v_D = qkv_ref[b, t, H + h, :], qkv_ref[b, t, H + K + h, :]
        for k_ref, v_ref in ((linear_k, linear_v), (ring_k, ring_v)):
            if k_ref is None:
                continue
            size = k_ref.shape[3]
            if k_ref is linear_k:
                slot, kept = at, at < size
                kept = kept & ~in_ring if both else kept
            else:  # a ring alone keeps every entry
                slot, kept = at % size, in_ring if both else None
            mask = None if kept is None else jnp.full((D,), kept)
            plt.store(k_ref.at[row, b, h, slot, :], k_D.astype(k_ref.dtype), mask=mask)
            plt.store(v_ref.at[row, b, h, :, slot], v_D.astype(v_ref.dtype), mask=mask)
    if barrier:  # every thread's writes land before any reads the row
        plt.debug_barrier()

    scale = jnp.asarray(D**-0.5, qkv_ref.dtype)
    queries = [(qkv_ref[b, t, pl.ds(h * G, G), :] * scale).astype(jnp.float32) for t in range(T)]
    floors = [floors_ref[b, t] if documents else None for t in range(T)]

    def reader(k_ref, v_ref, first, block, ring_slots):
        def step(i, state):
            start = first + i * block
            slots_S = start + jnp.arange(block, dtype=jnp.int32)
            held_S = held_ref[b, pl.ds(start, block)] if ring_slots else slots_S  # the position each slot holds
            k_SD = k_ref[row, b, h, pl.ds(start, block), :].astype(jnp.float32)
            v_DS = v_ref[row, b, h, :, pl.ds(start, block)].astype(jnp.float32)
            new_state = []
            for t, (q_GD, (peak_G, total_G, acc_GD)) in enumerate(zip(queries, state)):
                scores_GS = jnp.sum(q_GD[:, None, :] * k_SD[None, :, :], axis=-1)
                distance_S = index + t - held_S
                read_S = (held_S >= 0) & (distance_S >= 0) & ((window == 0) | (distance_S < window))
                if documents:
                    read_S = read_S & (held_S >= floors[t])
                scores_GS = jnp.where(read_S[None, :], scores_GS, -1e30)
                new_peak_G = jnp.maximum(peak_G, jnp.max(scores_GS, axis=1))
                rescale_G = jnp.exp(peak_G - new_peak_G)
                p_GS = jnp.where(read_S[None, :], jnp.exp(scores_GS - new_peak_G[:, None]), 0.0)
                p_GS = p_GS.astype(qkv_ref.dtype).astype(jnp.float32)  # the values' sum takes compute-dtype weights
                acc_GD = rescale_G[:, None] * acc_GD + jnp.sum(p_GS[:, None, :] * v_DS[None, :, :], axis=-1)
                new_state.append((new_peak_G, rescale_G * total_G + jnp.sum(p_GS, axis=1), acc_GD))
            return new_state
        return step

    state = [(jnp.full((G,), -1e30, jnp.float32), jnp.zeros((G,), jnp.float32), jnp.zeros((G, D), jnp.float32))
             for _ in range(T)]
    for runs, k_ref, v_ref, taken, ring_slots in ((linear, linear_k, linear_v, ~in_ring, False),
                                                  (ring, ring_k, ring_v, in_ring, True)):
        for first, block, steps in runs or ():  # a long-short model's block reads its own kind's stack alone
            state = jax.lax.fori_loop(0, steps * taken.astype(jnp.int32) if both else steps,
                                      reader(k_ref, v_ref, first, block, ring_slots), state)
    # Every query reads its own key, so each total is positive at the end.
    for t, (_, total_G, acc_GD) in enumerate(state):
        out_ref[b, t, pl.ds(h * G, G), :] = (acc_GD / total_G[:, None]).astype(out_ref.dtype)
