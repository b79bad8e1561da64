"""Forward + backward time of one causal attention layer alone: the attention of jaxgpt's CPU
kernels and of its portable ones (as `jaxgpt.kernels.choose_kernels` hands them to a float32 train
step) against `jax.nn.dot_product_attention` and, when torch is installed, PyTorch's
`scaled_dot_product_attention`.

    .venv/bin/python scripts/bench_attention.py --shape 12,64,4,32     # Shakespeare: B, T, heads, head size
    .venv/bin/python scripts/bench_attention.py --shape 32,128,4,32    # Day 1

Prints one JSON line per implementation with the median milliseconds of `--repeats` timed runs
(`jaxgpt.tools.bench.median_time`). Torch uses as many threads as the machine has cores, as XLA does.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from jaxgpt.config import ModelConfig
from jaxgpt.kernels import PORTABLE, choose_kernels
from jaxgpt.tools.bench import median_time


def jax_timings(B: int, T: int, H: int, D: int, repeats: int) -> dict[str, float]:
    """Median seconds of one forward + backward call per JAX implementation."""
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (jax.random.normal(key, (B, T, H, D), jnp.float32) for key in keys)
    cpu = choose_kernels(ModelConfig(), backend="cpu")
    implementations = {
        "jaxgpt_cpu": lambda q, k, v: cpu.attention(q, k, v, train=True),
        "jaxgpt_portable": lambda q, k, v: PORTABLE.attention(q, k, v, train=True),
        "jax_dot_product_attention": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
    }
    results = {}
    for name, attend in implementations.items():
        fwd_bwd = jax.jit(lambda q, k, v, attend=attend: jax.vjp(attend, q, k, v)[1](g))
        results[name] = median_time(lambda: fwd_bwd(q, k, v), repeats)
    return results


def torch_timing(B: int, T: int, H: int, D: int, repeats: int) -> float:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(os.cpu_count() or 1)
    q, k, v = (torch.randn(B, T, H, D).transpose(1, 2).requires_grad_() for _ in range(3))
    g = torch.randn(B, H, T, D)

    def fwd_bwd():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

    return median_time(fwd_bwd, repeats)  # synchronous: the block on its None result is a no-op


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="12,64,4,32", help="B,T,H,D (default: nanoGPT's Shakespeare run)")
    parser.add_argument("--repeats", type=int, default=9, help="timed repeats of >= 0.2 s each")
    args = parser.parse_args()
    B, T, H, D = (int(x) for x in args.shape.split(","))

    results = jax_timings(B, T, H, D, args.repeats)
    try:
        results["torch_sdpa"] = torch_timing(B, T, H, D, args.repeats)
    except ImportError:
        print("torch is not installed: PyTorch's timing left out")
    for name, seconds in results.items():
        print(json.dumps({"impl": name, "shape_BTHD": [B, T, H, D], "fwd_bwd_ms": round(seconds * 1e3, 3),
                          "backend": jax.default_backend()}))


if __name__ == "__main__":
    main()
