"""The GPU kernels: cuDNN's fused attention in bfloat16 and float16, the head fused with its loss
(`head_loss`), the portable ones elsewhere.

`jax.nn.dot_product_attention` runs XLA's implementation unless told otherwise, which writes
the [B, H, T, T] scores and probabilities to memory, forward and backward; cuDNN's flash
attention keeps them on chip. It refuses with an error where it does not apply (no cuDNN or
too old a one, a ROCm GPU, a head size or layout it does not take): `jaxgpt.kernels` compiles
it once for the model's shapes when it chooses, and takes the portable kernels instead, with one
warning line saying why, where it refuses.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxgpt.kernels import xla
from jaxgpt.kernels.head_loss import mean_head_loss


def attention(q_BTHD: jax.Array, k_BTKD: jax.Array, v_BTKD: jax.Array, *, train: bool = False,
              remat: bool = False) -> jax.Array:
    if q_BTHD.dtype not in (jnp.bfloat16, jnp.float16):  # cuDNN's flash kernel has no float32
        return xla.attention(q_BTHD, k_BTKD, v_BTKD)
    return jax.nn.dot_product_attention(q_BTHD, k_BTKD, v_BTKD, is_causal=True, implementation="cudnn")


KERNELS = dataclasses.replace(xla.KERNELS, name="gpu", attention=attention, head_loss=mean_head_loss)
