"""How the model's matmuls run: flat 2-D everywhere, and in the layouts XLA CPU runs fast.

`flat_dot_general` is what every `nn.Dense` of the model calls with float32 compute; on
the CPU backend its float32 matmul is `cpu_f32_matmul`, whose kernel gradient takes the faster
of two layouts.
`cpu_bf16_dot_general` replaces it when the compute dtype is bfloat16 on the CPU backend: XLA CPU
has no bfloat16 vector arithmetic (it converts to float32 and back around every elementwise op),
but on CPUs with AVX512-BF16 or AMX its matmul runs bfloat16 operands into a float32
accumulator at about twice the float32 rate. So there the activations stay float32 and only
the matmul operands are bfloat16, as PyTorch's CPU autocast does (docs/performance.md):
`bf16_matmul` for the projections and the head, `bf16_causal_attention`
for the attention.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# Names of what `bf16_matmul` keeps for its backward pass; the CPU remat policy saves them.
BF16_MATMUL_SAVED = ("bf16_matmul_out", "bf16_matmul_input_t")
# ... and of what `bf16_causal_attention` keeps (its bfloat16 q, k and v).
BF16_ATTENTION_SAVED = "bf16_attention_qkv"


def _is_flat_matmul(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any) -> bool:
    """Whether the dot is `[..., C] x [C, F]` with no batch axes (what `nn.Dense` asks for)."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    return (lhs.ndim >= 2 and rhs.ndim == 2 and not lhs_batch and not rhs_batch
            and tuple(lhs_contract) == (lhs.ndim - 1,) and tuple(rhs_contract) == (0,))


def flat_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                     precision: Any = None, preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
    """`lax.dot_general` that runs `[..., C] x [C, F]` as one 2-D matmul `[N, C] x [C, F]`.

    Same values; a different backward graph. Autodiff of the 3-D form contracts the kernel
    gradient over two axes (batch and time), which XLA CPU lowers by transposing the [B, T, F]
    cotangent and fusing that transpose into the elementwise backward (GELU, residual adds): a
    strided loop several times slower than the matmul. With the batch axes flattened first, the
    kernel gradient is a plain [N, C]^T x [N, F] matmul and nothing is transposed. On GPU/TPU the
    reshapes are free (leading axes merge). A float32 matmul on the CPU is `cpu_f32_matmul`.
    """
    if not _is_flat_matmul(lhs, rhs, dimension_numbers):
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **kwargs)
    x_NC = lhs.reshape(-1, lhs.shape[-1])
    plain_f32 = (precision is None and not kwargs and lhs.dtype == rhs.dtype == jnp.float32
                 and preferred_element_type in (None, jnp.float32))
    if plain_f32 and jax.default_backend() == "cpu":
        out = cpu_f32_matmul(x_NC, rhs)
    else:
        out = jax.lax.dot_general(x_NC, rhs, (((1,), (0,)), ((), ())), precision=precision,
                                  preferred_element_type=preferred_element_type, **kwargs)
    return out.reshape(*lhs.shape[:-1], rhs.shape[-1])


@jax.custom_vjp
def cpu_f32_matmul(x_NC: jax.Array, w_CF: jax.Array) -> jax.Array:
    """x @ w in float32, whose kernel gradient x^T g runs in the layout XLA CPU runs fastest.

    Autodiff contracts x [N, C] and g [N, F] over their leading axis, which XLA CPU runs at
    ~100 GFLOP/s when C > F (the [512, 128] gradient of a feed-forward down-projection) and at
    ~165 when C < F. Instead, as `bf16_matmul` does: for C <= F, a row-major transposed copy of
    x times g (~185); for C > F, g^T x with the small [F, C] product transposed (~160)
    (docs/performance.md). The CPU remat policy still sees the forward matmul as a
    dot, and saves its output.
    """
    return jnp.dot(x_NC, w_CF)


def _f32_matmul_fwd(x_NC, w_CF):
    return jnp.dot(x_NC, w_CF), (x_NC, w_CF)


def _f32_matmul_bwd(residuals, g_NF):
    x_NC, w_CF = residuals
    dx_NC = jax.lax.dot_general(g_NF, w_CF, (((1,), (1,)), ((), ())))
    if _transpose_x(w_CF):
        dw_CF = jnp.dot(transposed_copy(x_NC), g_NF)
    else:  # (g^T x)^T; behind the barrier XLA cannot fold the transpose back into the matmul
        g_x_FC = jax.lax.dot_general(g_NF, x_NC, (((0,), (0,)), ((), ())))
        dw_CF = transposed_copy(jax.lax.optimization_barrier(g_x_FC))
    return dx_NC, dw_CF


cpu_f32_matmul.defvjp(_f32_matmul_fwd, _f32_matmul_bwd)


def cpu_bf16_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                         precision: Any = None, preferred_element_type: Any = None, **kwargs: Any) -> jax.Array:
    """`nn.Dense`'s dot for bfloat16 compute on the CPU: `bf16_matmul` on the flattened input.

    Inputs and output are in the activation dtype (float32 on the CPU).
    """
    if not _is_flat_matmul(lhs, rhs, dimension_numbers):
        raise ValueError(f"cpu_bf16_dot_general multiplies [..., C] x [C, F] only; got {lhs.shape} x "
                         f"{rhs.shape} with dimension numbers {dimension_numbers}")
    out = bf16_matmul(lhs.reshape(-1, lhs.shape[-1]), rhs)
    return out.reshape(*lhs.shape[:-1], rhs.shape[-1]).astype(lhs.dtype)


def transposed_copy(a: jax.Array) -> jax.Array:
    """`a` with its last two axes swapped, written out row-major.

    XLA CPU runs a bfloat16 matmul natively only on row-major `[M, K] x [K, N]` operands. A plain
    transpose is a layout change that XLA folds into the matmul, and the matmul then gets its
    operands converted to float32 (half the speed, plus the converts). Behind the barrier XLA
    cannot see that the flattened array is a transpose, so it writes it out.
    """
    swapped = jnp.swapaxes(a, -1, -2)
    return jax.lax.optimization_barrier(swapped.reshape(-1)).reshape(swapped.shape)


def bf16_matmul(x_NC: jax.Array, w_CF: jax.Array) -> jax.Array:
    """x @ w with bfloat16 operands, float32 accumulation and a float32 result.

    Forward and both gradients are row-major bfloat16 matmuls (see `transposed_copy`). The kernel
    gradient x^T g needs one of x [N, C] and g [N, F] transposed; the narrower one is, since a
    transposed copy costs far more per element than a plain one. When that is x, the forward
    pass writes the transposed copy while x is at hand; otherwise it keeps x. What it keeps, and
    the result, carry the `BF16_MATMUL_SAVED` names, which the CPU remat policy saves.
    """
    return checkpoint_name(_bf16_matmul(x_NC.astype(jnp.float32), w_CF.astype(jnp.float32)),
                           BF16_MATMUL_SAVED[0])


def _bf16_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def _keep(a: jax.Array, name: str) -> jax.Array:
    """A bfloat16 residual as raw 16-bit words, named for the CPU remat policy. The scan stacks
    what a layer saves with dynamic-update-slice, which XLA CPU does not do in bfloat16: it would
    convert the whole [L, ...] stack to float32 and back for every layer."""
    return checkpoint_name(jax.lax.bitcast_convert_type(a, jnp.uint16), name)


def _kept(words: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(words, jnp.bfloat16)


def _transpose_x(w_CF: jax.Array) -> bool:
    C, F = w_CF.shape
    return C <= F


@jax.custom_vjp
def _bf16_matmul(x_NC: jax.Array, w_CF: jax.Array) -> jax.Array:
    return _bf16_dot(x_NC, w_CF)


def _bf16_matmul_fwd(x_NC, w_CF):
    x_NC = x_NC.astype(jnp.bfloat16)
    kept = _keep(transposed_copy(x_NC) if _transpose_x(w_CF) else x_NC, BF16_MATMUL_SAVED[1])
    return _bf16_dot(x_NC, w_CF), (kept, w_CF)


def _bf16_matmul_bwd(residuals, g_NF):
    kept, w_CF = residuals
    kept = _kept(kept)
    g_NF = g_NF.astype(jnp.bfloat16)
    dx_NC = _bf16_dot(g_NF, transposed_copy(w_CF.astype(jnp.bfloat16)))
    if _transpose_x(w_CF):
        dw_CF = _bf16_dot(kept, g_NF)
    else:  # (g^T x)^T; behind the barrier XLA cannot fold the transpose back into the matmul
        dw_CF = transposed_copy(jax.lax.optimization_barrier(_bf16_dot(transposed_copy(g_NF), kept)))
    return dx_NC, dw_CF


_bf16_matmul.defvjp(_bf16_matmul_fwd, _bf16_matmul_bwd)


def bf16_causal_attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, blocks: int) -> jax.Array:
    """Causal attention with bfloat16 matmul operands (float32 in and out, softmax in float32).

    The query blocks of `cpu_attention.blocked_causal_attention` (block i of `blocks` reads keys
    [0, (i + 1) T / blocks)), laid out head-major with the G query heads of a KV head stacked
    as rows (`_bf16_attention`).
    """
    B, T, H, D = q_BTHD.shape
    K = k_BTKD.shape[2]
    q_XGTD = (q_BTHD.astype(jnp.float32) * D**-0.5).reshape(B, T, K, H // K, D).transpose(0, 2, 3, 1, 4)
    k_XTD, v_XTD = (t.astype(jnp.float32).transpose(0, 2, 1, 3).reshape(B * K, T, D) for t in (k_BTKD, v_BTKD))
    out_XGTD = _bf16_attention(q_XGTD.reshape(B * K, H // K, T, D), k_XTD, v_XTD, blocks)
    return out_XGTD.reshape(B, K, H // K, T, D).transpose(0, 3, 1, 2, 4).reshape(B, T, H, D)


def _batched(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def _block_mask(rows: int, keys: int, queries: int, offset: int) -> jax.Array:
    """Row r is query r % `queries` of its head, `offset` positions after the first key."""
    return jnp.arange(keys)[None, :] <= offset + (jnp.arange(rows) % queries)[:, None]


def _query_block(t_XGTD: jax.Array, i: int, size: int) -> jax.Array:
    """Queries [i * size, (i + 1) * size) of every head, heads stacked as rows: [X, G * size, D]."""
    X, G, _, D = t_XGTD.shape
    return t_XGTD[:, :, i * size: (i + 1) * size].reshape(X, G * size, D)


def _block_probs(q_XMD: jax.Array, k_XSD: jax.Array, queries: int, offset: int) -> jax.Array:
    scores_XMS = _batched("xmd,xsd->xms", q_XMD, k_XSD)
    mask = _block_mask(q_XMD.shape[1], k_XSD.shape[1], queries, offset)
    return jax.nn.softmax(jnp.where(mask, scores_XMS, -jnp.inf), axis=-1).astype(jnp.bfloat16)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _bf16_attention(q_XGTD, k_XTD, v_XTD, blocks):
    return _bf16_attention_fwd(q_XGTD, k_XTD, v_XTD, blocks)[0]


def _bf16_attention_fwd(q_XGTD, k_XTD, v_XTD, blocks):
    """Keeps only q, k and v, in bfloat16 (`_keep`, as `bf16_matmul` keeps its input): the
    backward pass recomputes each block's probabilities from them, so it neither holds the
    [T, T] squares nor recomputes the head-major layout from the float32 qkv projection."""
    X, G, T, D = q_XGTD.shape
    size = T // blocks
    q_XGTD, k_XTD, v_XTD = (t.astype(jnp.bfloat16) for t in (q_XGTD, k_XTD, v_XTD))
    outs = []
    for i in range(blocks):
        S = (i + 1) * size  # keys this block may read
        probs_XMS = _block_probs(_query_block(q_XGTD, i, size), k_XTD[:, :S], size, i * size)
        outs.append(_batched("xms,xsd->xmd", probs_XMS, v_XTD[:, :S]).reshape(X, G, size, D))
    return jnp.concatenate(outs, axis=2), tuple(_keep(t, BF16_ATTENTION_SAVED) for t in (q_XGTD, k_XTD, v_XTD))


def _bf16_attention_bwd(blocks, kept, g_XGTD):
    """Autodiff would contract the probabilities' (and their gradient's) first axis for dv and
    dk, a form XLA CPU runs only after converting to float32; their transposes, computed from
    transposed copies of the small q and g blocks, take the native forms, and are transposed
    back once, summed over the blocks."""
    q_XGTD, k_XTD, v_XTD = (_kept(t) for t in kept)
    X, G, T, D = q_XGTD.shape
    size = T // blocks
    g_XGTD = g_XGTD.astype(jnp.bfloat16)
    dq, dk_XDT, dv_XDT = [], 0.0, 0.0
    for i in range(blocks):
        S = (i + 1) * size
        q_XMD, g_XMD = _query_block(q_XGTD, i, size), _query_block(g_XGTD, i, size)
        k_XSD, v_XSD = k_XTD[:, :S], v_XTD[:, :S]
        probs_XMS = _block_probs(q_XMD, k_XSD, size, i * size)
        p_XMS = probs_XMS.astype(jnp.float32)
        dp_XMS = _batched("xmd,xsd->xms", g_XMD, v_XSD)
        ds_XMS = (p_XMS * (dp_XMS - jnp.sum(dp_XMS * p_XMS, axis=-1, keepdims=True))).astype(jnp.bfloat16)
        dq.append(_batched("xms,xsd->xmd", ds_XMS, k_XSD).reshape(X, G, size, D))
        pad = ((0, 0), (0, 0), (0, T - S))
        dk_XDT = dk_XDT + jnp.pad(_batched("xdm,xms->xds", transposed_copy(q_XMD), ds_XMS), pad)
        dv_XDT = dv_XDT + jnp.pad(_batched("xdm,xms->xds", transposed_copy(g_XMD), probs_XMS), pad)
    # Behind the barrier XLA cannot fold the transposes back into the matmuls.
    return (jnp.concatenate(dq, axis=2), transposed_copy(jax.lax.optimization_barrier(dk_XDT)),
            transposed_copy(jax.lax.optimization_barrier(dv_XDT)))


_bf16_attention.defvjp(_bf16_attention_fwd, _bf16_attention_bwd)
