"""The model's dtypes: the compute dtype (matmul operands, the KV cache) and the activations'."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxgpt.config import ModelConfig
from jaxgpt.kernels.base import Kernels


def compute_dtype(cfg: ModelConfig) -> Any:
    """The dtype of matmul operands and of the KV cache."""
    return jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32


def activation_dtype(cfg: ModelConfig, kernels: Kernels) -> Any:
    """The dtype of activations between matmuls: the compute dtype, unless the kernels keep float32."""
    return jnp.float32 if kernels.float32_activations else compute_dtype(cfg)
