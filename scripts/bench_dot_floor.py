"""How long a config's train step would take if it did nothing but its matmuls: XLA against PyTorch.

    .venv/bin/python scripts/bench_dot_floor.py --config experiments/shakespeare_char.toml
    .venv/bin/python scripts/bench_dot_floor.py --config experiments/day1.toml --set train.batch_size=32

Every `dot_general` of the traced train step (forward, recomputation and backward; those inside the
layer scan counted once per layer) is timed alone at its own shape and layout: in XLA (one compiled
loop of `--reps` dots, so no dispatch cost) and, where torch is installed, with `torch.matmul` on
the same operands rearranged as [batch, M, K] x [batch, K, N] (the rearrangement is not timed).
The table (stderr) lists each shape's count, GFLOP/s on both sides and XLA's milliseconds a
step; the JSON line (stdout) holds the sums, the floor no fusion or layout change can go below
while XLA runs these dots at these rates, beside the whole step timed in the same process.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp

from jaxgpt.config import load_config
from jaxgpt.data import window_length
from jaxgpt.tools.bench import median_time
from jaxgpt.train.step import compile_steps, init_state

DotKey = tuple[tuple[int, ...], tuple[int, ...], Any, str]


def collect_dots(jaxpr, times: int = 1, counts: collections.Counter | None = None) -> collections.Counter:
    """Counter of DotKey -> how many times the step runs that dot (scan bodies times their length)."""
    counts = collections.Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (v.aval for v in eqn.invars)
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            dims = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
            counts[(lhs.shape, rhs.shape, dims, str(lhs.dtype))] += times
        inner = times * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else times
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            collect_dots(sub, inner, counts)
    return counts


def dot_flops(key: DotKey) -> int:
    """2 x (every lhs element) x (the rhs's free size): batch x M x K x N multiply-adds."""
    _, _, (_, _, _, n) = as_batched_matmul(key)
    return 2 * math.prod(key[0]) * n


def time_xla(key: DotKey, reps: int, repeats: int) -> float:
    """Median ms of one dot, from a compiled loop of `reps` dependent dots."""
    lhs_shape, rhs_shape, dims, dtype = key
    lhs = jax.random.normal(jax.random.key(0), lhs_shape, dtype)
    rhs = jax.random.normal(jax.random.key(1), rhs_shape, dtype)

    @jax.jit
    def loop(lhs, rhs):
        def body(_, lhs):  # each dot reads one element the previous one wrote, so none is hoisted
            out = jax.lax.dot_general(lhs, rhs, dims, preferred_element_type=jnp.float32)
            return lhs.at[(0,) * lhs.ndim].add(out.reshape(-1)[0].astype(lhs.dtype) * 1e-30)
        return jax.lax.fori_loop(0, reps, body, lhs)

    return median_time(lambda: loop(lhs, rhs), repeats, min_repeat_s=0.0) / reps * 1e3


def as_batched_matmul(key: DotKey) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, int, int, int]]:
    """Permutations putting lhs as [batch, free, contract] and rhs as [batch, contract, free]."""
    lhs, rhs, ((lc, rc), (lb, rb)), _ = key
    lf = [i for i in range(len(lhs)) if i not in lc and i not in lb]
    rf = [i for i in range(len(rhs)) if i not in rc and i not in rb]
    sizes = (math.prod(lhs[i] for i in lb), math.prod(lhs[i] for i in lf),
             math.prod(lhs[i] for i in lc), math.prod(rhs[i] for i in rf))
    return tuple(lb) + tuple(lf) + tuple(lc), tuple(rb) + tuple(rc) + tuple(rf), sizes


def time_torch(key: DotKey, reps: int, repeats: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    lhs_perm, rhs_perm, (b, m, k, n) = as_batched_matmul(key)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[key[3]]
    lhs = torch.randn(key[0]).permute(lhs_perm).reshape(b, m, k).contiguous().to(dtype)
    rhs = torch.randn(key[1]).permute(rhs_perm).reshape(b, k, n).contiguous().to(dtype)
    out = torch.empty(b, m, n, dtype=dtype)

    def loop():
        for _ in range(reps):
            torch.matmul(lhs, rhs, out=out)

    return median_time(loop, repeats, min_repeat_s=0.0) / reps * 1e3


def step_ms(cfg, repeats: int) -> tuple[float, Any]:
    state = init_state(cfg, jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), (cfg.train.batch_size, window_length(cfg.model)), 0,
                               cfg.model.vocab_size, jnp.int32)
    step = compile_steps(cfg)[0]
    jaxpr = jax.make_jaxpr(step)(state, batch)

    def one_step():
        nonlocal state
        state, metrics = step(state, batch)
        return metrics

    return median_time(one_step, repeats) * 1e3, jaxpr


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="TOML config file (default: the built-in Day 1 baseline)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--reps", type=int, default=50, help="dots per timed loop")
    parser.add_argument("--repeats", type=int, default=7, help="timed loops per shape; the median is kept")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    measured_step, jaxpr = step_ms(cfg, args.repeats)
    rows = []
    for key, count in sorted(collect_dots(jaxpr.jaxpr).items(), key=lambda kv: -dot_flops(kv[0]) * kv[1]):
        xla, torch_ms = time_xla(key, args.reps, args.repeats), time_torch(key, args.reps, args.repeats)
        rows.append({"lhs": key[0], "rhs": key[1], "dims": key[2], "dtype": key[3], "count": count,
                     "gflop": dot_flops(key) / 1e9, "xla_ms": xla, "torch_ms": torch_ms})
    xla_total = sum(r["count"] * r["xla_ms"] for r in rows)
    torch_total = sum(r["count"] * r["torch_ms"] for r in rows) if rows and rows[0]["torch_ms"] else None
    print(f"{'lhs x rhs (contracting; batch)':56s} {'count':>5s} {'XLA GFLOP/s':>11s} {'torch GFLOP/s':>13s} {'XLA ms':>7s}",
          file=sys.stderr)
    for r in rows:
        t = f"{r['gflop'] / r['torch_ms'] * 1e3:13.0f}" if r["torch_ms"] else f"{'-':>13s}"
        (lc, rc), (lb, rb) = r["dims"]
        shapes = f"{r['lhs']} x {r['rhs']} ({lc}{rc}; {lb}{rb})".replace(",)", ")")
        print(f"{shapes:56s} {r['count']:5d} "
              f"{r['gflop'] / r['xla_ms'] * 1e3:11.0f} {t} {r['count'] * r['xla_ms']:7.2f}", file=sys.stderr)
    print(json.dumps({"mode": "bench_dot_floor", "step_ms": round(measured_step, 2), "xla_dots_ms": round(xla_total, 2),
                      "torch_dots_ms": torch_total and round(torch_total, 2),
                      "dot_gflop": round(sum(r["count"] * r["gflop"] for r in rows), 3),
                      "batch": cfg.train.batch_size, "context": cfg.model.context_length,
                      "layers": cfg.model.n_layers}))


if __name__ == "__main__":
    main()
