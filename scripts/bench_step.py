"""Median wall time of the jitted train step (and of forward / grad alone) for one config.

    .venv/bin/python scripts/bench_step.py --config experiments/shakespeare_char.toml
    .venv/bin/python scripts/bench_step.py --config experiments/day1.toml --set train.batch_size=32

Prints one JSON line per measurement: mode, median/min step_ms, tokens_per_s, compile_s.
Mode `step-no-attention` times the same step with the kernels' attention replaced by a same-shape
stand-in (q + k + v): its difference from `step` is what the attention costs inside the step.
Each repeat times `--iters` consecutive calls and the median over `--repeats` is reported, so a
neighbour's burst of CPU use shifts the minimum and median less than a single long run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp

from jaxgpt.config import load_config
from jaxgpt.kernels import choose_kernels
from jaxgpt.model.decoder import forward
from jaxgpt.train.step import compile_steps, init_state, window_length


def _time(fn, args, iters: int, repeats: int) -> tuple[float, float]:
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / iters * 1e3)
    return statistics.median(per_call), min(per_call)


def _without_attention(kernels):
    """The kernels with the attention swapped for q + k + v (same shapes, no scores)."""
    def stand_in(q_BTHD, k_BTKD, v_BTKD, *, train=False, remat=False):
        return q_BTHD + jnp.repeat(k_BTKD + v_BTKD, q_BTHD.shape[2] // k_BTKD.shape[2], axis=2)

    return dataclasses.replace(kernels, name=f"{kernels.name} without attention", attention=stand_in)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="TOML config file (default: the built-in Day 1 baseline)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--iters", type=int, default=10, help="calls per timed repeat")
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats; the median is reported")
    parser.add_argument("--modes", default="step,forward,grad",
                        help="comma-separated: step, step-no-attention, forward, grad")
    args = parser.parse_args()

    cfg = load_config(args.config, args.overrides)
    model = cfg.model
    B, W = cfg.train.batch_size, window_length(model)
    batch = jax.random.randint(jax.random.key(1), (B, W), 0, model.vocab_size, jnp.int32)
    tokens = B * model.context_length

    for mode in args.modes.split(","):
        _measure(mode, cfg, batch, tokens, args)


def _measure(mode: str, cfg, batch: jax.Array, tokens: int, args: argparse.Namespace) -> None:
    """Compile and time one mode; prints its JSON line."""
    model = cfg.model
    kernels = choose_kernels(model)
    state = init_state(cfg, jax.random.key(0))
    if mode in ("step", "step-no-attention"):
        train_step, _ = compile_steps(cfg, _without_attention(kernels) if mode == "step-no-attention" else kernels)

        def fn(state_and_batch=None):  # the step donates its state: thread it through
            nonlocal state
            state, metrics = train_step(state, batch)
            return metrics["loss"]

        call_args: tuple = ()
    elif mode == "forward":
        fn = jax.jit(lambda p, x: forward(p, model, x[:, :model.context_length], kernels=kernels))
        call_args = (state.params, batch)
    elif mode == "grad":
        from jaxgpt.train.step import depth_losses
        fn = jax.jit(jax.grad(lambda p, x: depth_losses(p, model, x)[0]))
        call_args = (state.params, batch)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    start = time.perf_counter()
    jax.block_until_ready(fn(*call_args))
    compile_s = time.perf_counter() - start
    _time(fn, call_args, 3, 1)  # warm-up
    median, best = _time(fn, call_args, args.iters, args.repeats)
    print(json.dumps({"mode": mode, "step_ms": round(median, 2), "min_ms": round(best, 2),
                      "tokens_per_s": round(tokens / median * 1e3),
                      "compile_s": round(compile_s, 2), "batch": batch.shape[0], "context": model.context_length,
                      "layers": model.n_layers}), flush=True)


if __name__ == "__main__":
    main()
