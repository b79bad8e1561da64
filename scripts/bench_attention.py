"""Forward + backward time of one causal attention layer alone: jaxgpt's CPU path against
`jax.nn.dot_product_attention` and, when torch is installed, PyTorch's `scaled_dot_product_attention`.

    .venv/bin/python scripts/bench_attention.py --shape 12,64,4,32     # Shakespeare: B, T, heads, head size
    .venv/bin/python scripts/bench_attention.py --shape 32,128,4,32    # Day 1

Prints one JSON line per implementation with the best and median milliseconds of `--repeats`
timed runs of `--iters` calls. Torch uses as many threads as the machine has cores, as XLA does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp

from jaxgpt.layers import blocked_causal_attention


def _time(call: Callable[[], object], sync: Callable[[object], object], iters: int, repeats: int) -> tuple[float, float]:
    sync(call())  # compile / warm up
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = call()
        sync(out)
        per_call.append((time.perf_counter() - start) / iters * 1e3)
    return min(per_call), statistics.median(per_call)


def jax_timings(B: int, T: int, H: int, D: int, iters: int, repeats: int) -> dict[str, tuple[float, float]]:
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (jax.random.normal(key, (B, T, H, D), jnp.float32) for key in keys)
    implementations = {
        "jaxgpt_blocked": blocked_causal_attention,
        "jax_dot_product_attention": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
    }
    results = {}
    for name, attend in implementations.items():
        fwd_bwd = jax.jit(lambda q, k, v, attend=attend: jax.vjp(attend, q, k, v)[1](g))
        results[name] = _time(lambda: fwd_bwd(q, k, v), jax.block_until_ready, iters, repeats)
    return results


def torch_timing(B: int, T: int, H: int, D: int, iters: int, repeats: int) -> tuple[float, float]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(os.cpu_count() or 1)
    q, k, v = (torch.randn(B, T, H, D).transpose(1, 2).requires_grad_() for _ in range(3))
    g = torch.randn(B, H, T, D)

    def fwd_bwd():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

    return _time(fwd_bwd, lambda _: None, iters, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="12,64,4,32", help="B,T,H,D (default: nanoGPT's Shakespeare run)")
    parser.add_argument("--iters", type=int, default=50, help="calls per timed repeat")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats")
    args = parser.parse_args()
    B, T, H, D = (int(x) for x in args.shape.split(","))

    results = jax_timings(B, T, H, D, args.iters, args.repeats)
    try:
        results["torch_sdpa"] = torch_timing(B, T, H, D, args.iters, args.repeats)
    except ImportError:
        print("torch is not installed: PyTorch's timing left out")
    for name, (best, median) in results.items():
        print(json.dumps({"impl": name, "shape_BTHD": [B, T, H, D], "fwd_bwd_ms_best": round(best, 3),
                          "fwd_bwd_ms_median": round(median, 3), "backend": jax.default_backend()}))


if __name__ == "__main__":
    main()
