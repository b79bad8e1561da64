"""The seam's interface: what the model asks of a backend's kernels.

The model (`jaxgpt.model.decoder`, `jaxgpt.model.layers`) is written once, in plain Flax; each heavy
operation it runs is a field of the `Kernels` it is handed. The arithmetic the model and every
kernel set must agree on (the window rule, the head's cap) is defined here once. Shapes follow the legend in
`jaxgpt.model.decoder`; `dtype` arguments are the compute dtype (`model.dtype`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp


def in_window(T: int, window: jax.Array, offset: jax.Array | int = 0, keys: int | None = None) -> jax.Array:
    """[1, 1, T, S] (S = `keys`, default T): whether key s is within `window` of query t, the
    queries at positions offset + t (0 for every t of a window of 0: the whole context). Causality
    is the caller's."""
    distance = (offset + jnp.arange(T))[:, None] - jnp.arange(T if keys is None else keys)[None, :]
    return ((window == 0) | (distance < window))[None, None]


def softcap(logits: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(logits / cap): every logit inside (-cap, cap), near-identity well below it. 0: off.
    The model's head and the fused head loss both apply it."""
    return cap * jnp.tanh(logits / cap) if cap else logits


@dataclass(frozen=True)
class Kernels:
    name: str
    # `nn.Dense`'s dot_general: [..., C] x [C, F] with its dimension numbers, as `lax.dot_general`
    # (and [..., C] x [F, C] contracting C in a set with `transposed_decoding`).
    dot_general: Callable[..., Any]
    # Causal self-attention without a cache: (q_BTHD, k_BTKD, v_BTKD, *, train, remat, segment_ids,
    # window) -> out_BTHD. `train`: the pass will be differentiated; `remat`: its backward recomputes
    # it (model.remat); `segment_ids` [B, T] (None: one segment): a query reads only its own
    # segment's keys; `window` (an int32 scalar, 0: the whole context; None: no window asked for):
    # the query at t reads keys t - window + 1 .. t only.
    attention: Callable[..., Any]
    # The head's logits, float32: (h_BTC, embedding_VC, dtype) tied, (h_BTC, kernel_CV, dtype) untied.
    tied_logits: Callable[..., Any]
    untied_logits: Callable[..., Any]
    # GPT-2's tanh GELU, equal in value and gradient to `jax.nn.gelu(x, approximate=True)`.
    gelu: Callable[[Any], Any]
    # What a scanned block stack under model.remat = "none" saves for its backward pass (a
    # `jax.checkpoint_policies` policy); None: everything autodiff keeps.
    scan_remat_policy: Callable[..., Any] | None = None
    # Whether the norms and the activation recompute their float32 intermediates in the backward
    # pass instead of keeping them (`jaxgpt.model.layers.recomputed`): several times their input's size
    # and cheap to compute again. Off for sets whose scan remat policy already decides what a
    # block keeps (the CPU's).
    recompute_elementwise: bool = True
    # What a block under model.remat = "dots" saves: the outputs of its matmuls (those without
    # batch axes: the projections, not the attention's scores). Kernels whose matmuls are not
    # plain dots name their outputs here too.
    dots_remat_policy: Callable[..., Any] = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    # Activations between matmuls stay float32 whatever the compute dtype (only matmul operands
    # take it): for backends with low-precision matmuls but no low-precision arithmetic.
    float32_activations: bool = False
    # The head and the mean cross-entropy in one: (h_BTC, weight, targets_BT, *, tied, dtype, softcap) ->
    # float32 scalar, `weight` the embedding [V, C] when tied, the head's kernel [C, V] otherwise.
    # None: the logits above, then the cross-entropy (all [B, T, V] logits in memory).
    head_loss: Callable[..., Any] | None = None
    # The same against several targets at once (`jaxgpt.kernels.head_loss.weighted_head_loss`):
    # (h_BTC, weight, targets_KBT, weights_K, *, tied, dtype, softcap) -> (Σ_k weights[k] * mean
    # loss of targets[k], the next-token loss of targets[0] without a gradient). Set with `head_loss`.
    weighted_head_loss: Callable[..., Any] | None = None
    # Layers per iteration of the scanned block stack's loop in a train step's passes
    # (`lax.scan(unroll=...)`); the params keep their stacked layout whatever it is. The number of
    # layers or more: no loop at all. Evaluation and decoding keep one layer an iteration, which
    # decodes faster (docs/performance.md, GPT-2 124M on an accelerator).
    scan_unroll: int = 1
    # Whether the sampler holds the blocks' matrices transposed ([features, in],
    # `jaxgpt.model.layers.transposed_matrices`, converted with its dtype cast before any decode
    # loop): for backends whose compiler computes a one-token product with a [in, features] matrix
    # as a product tensor written out, then summed (XLA's GPU backend, for the attention's output
    # and the feed-forward's down projection), where it reads a transposed one's contiguous rows in
    # one kernel. An f32 model's sampler then holds a copy of its matrices beside the params. Its
    # `dot_general` takes the transposed matrix too (`lax.dot_general` does; the CPU sets' do not).
    transposed_decoding: bool = False
    # Whether a cached pass has each block write its new keys and values into the cache before it
    # reads it (`jaxgpt.model.cache.writes_first`: the cache carried through the block stack,
    # written in place, read by one softmax), not read the cache and its new keys apart and write
    # every layer's after the stack: for backends that launch a kernel an op, where the two-part
    # read and the stacked new keys cost a token's decoding several launches a layer. The cache
    # must hold every position a pass brings (a key written past its end is dropped): the
    # sampler's does, so a set asks for it in its `decoding` options, not for every cached pass
    # (the harness's scoring brings more tokens than its cache holds past a prefix).
    cache_written_first: bool = False
    # Whether LayerNorm takes its mean and variance from one pass over the features
    # (`jaxgpt.model.layers.one_pass_layer_norm`): one reduction where XLA's GPU backend launches
    # one for the mean and one for the variance after it. Its values are within float32's
    # rounding of the two passes', not equal to them, so a set asks for it in its `decoding`
    # options alone: trained and evaluated models keep the norm they were trained with, and a
    # decoded token runs two kernels fewer a block.
    one_pass_layer_norm: bool = False
    # Whether the sampler's weights fold each pre-norm LayerNorm's gain and shift into the dense
    # layers that read it (`jaxgpt.model.layers.folded_layer_norms`): a block then takes the
    # norm's statistics alone, and each product reads the raw residual and applies them in the
    # elementwise epilogue its bias add already is, where XLA's GPU backend launches the
    # normalisation as one more kernel a norm. Its `dot_general` takes `preferred_element_type`
    # (the product's float32 output, from which the mean is subtracted; `lax.dot_general` does).
    folded_layer_norm: bool = False
    # A block's write of its new keys and values and its read of its row in one, for the passes
    # that write the cache first: (q_BTHD, stack, (k_BTKD, v_BTKD), place, window) -> (out_BTHD,
    # stack), as `jaxgpt.model.cache.write_layer` then `written_attention` compute them, or None
    # where it does not take the pass (the GPU sampler's one kernel, `jaxgpt.kernels.gpu_decode`).
    # None, or a pass it returns None for: those two.
    written_attention: Callable[..., Any] | None = None
    # What the sampler's programs (prefill, decoding, the slide) change of this set (`for_decoding`),
    # as (field, value) pairs.
    decoding: tuple[tuple[str, Any], ...] = ()
    # XLA options for the programs that run these kernels (`jax.jit(compiler_options=...)`): the
    # backend's measured defaults, as (name, value) pairs.
    compiler_options: tuple[tuple[str, Any], ...] = ()
    # The attention for a program whose batch is split over a device mesh: (mesh, the mesh axes the
    # batch rows are split over) -> attention.
    # For kernels XLA cannot partition (Pallas), which must run per device inside `shard_map`.
    # None: `attention` as it is, partitioned by XLA.
    mesh_attention: Callable[[Any, tuple[str, ...]], Callable[..., Any]] | None = None

    def for_decoding(self) -> Kernels:
        """The set the sampler runs: this one with its `decoding` options."""
        return dataclasses.replace(self, **dict(self.decoding))

    def jit_options(self) -> dict[str, Any] | None:
        """`compiler_options` as `jax.jit` takes them."""
        return dict(self.compiler_options) or None

    def on_mesh(self, mesh: Any, batch_axes: tuple[str, ...] | None = None) -> Kernels:
        """These kernels for a program whose batch rows are split over `batch_axes` of `mesh`
        (default: every axis; a sweep's members, vmapped over another axis, take the rest; `()`:
        every device runs the kernel on all rows, as the sampler's few rows need). A sampler's
        one-kernel cache write and read (`written_attention`, Pallas, which XLA's partitioner
        cannot split) gives way to the XLA ops there."""
        kernels = self if self.written_attention is None else dataclasses.replace(self, written_attention=None)
        if kernels.mesh_attention is None:
            return kernels
        axes = tuple(mesh.axis_names) if batch_axes is None else batch_axes
        return dataclasses.replace(kernels, attention=kernels.mesh_attention(mesh, axes))


def per_device(attend: Callable[..., Any], mesh: Any, axes: tuple[str, ...] | None = None,
               inputs: int = 3) -> Callable[..., Any]:
    """`attend(q, k, v)` (and `inputs` - 3 more arrays, each batch first: the segment ids) run by
    each device on its rows of the batch, split over `axes` of `mesh`
    (default: all; under `vmap(..., spmd_axis_name=A)` the vmapped axis goes over A): for a kernel XLA's partitioner cannot split (Pallas), or splits wrongly (cuDNN's
    attention under FSDP: its partitioner asks an internal [1, 1, 4, 1, 2] array to divide by 8)."""
    import jax
    from jax.sharding import PartitionSpec

    spec = PartitionSpec(tuple(mesh.axis_names if axes is None else axes))
    if hasattr(jax, "shard_map"):  # jax 0.6.1 on; before, only the experimental one
        return jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * inputs, out_specs=spec, check_vma=False)
    from jax.experimental.shard_map import shard_map

    return shard_map(attend, mesh=mesh, in_specs=(spec,) * inputs, out_specs=spec, check_rep=False)
