"""The benchmarks behind `jaxgpt bench MODE`: train step, forward latency, compile time, decoding.

Each mode yields JSON-ready records (`mode`, and `tokens_per_s`, `step_ms`, `mfu`,
`compile_s` where they apply). Every time is a median over `repeats` after a warm-up, with the
result blocked on (`jax.block_until_ready`), so figures from one run are comparable as ratios.

    for record in run_mode("train", load_config("experiments/day1.toml"), repeats=5): ...

MFU is model FLOPs (6 N + 12 L C T per trained token, `jaxgpt.model.flops.flops_per_token`; a
third of that for a forward pass; recomputation under remat not counted) over a peak: the
nominal bf16 peak of a known accelerator, else a float32 matmul measured on this machine.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxgpt.config import ModelConfig, RunConfig
from jaxgpt.errors import UserError
from jaxgpt.kernels.choose import PORTABLE, choose_kernels
from jaxgpt.model.decoder import forward, init_params
from jaxgpt.model.flops import flops_per_token, mfu
from jaxgpt.plan.programs import memory_figures
from jaxgpt.process import compile_cache

MODES = ("train", "forward", "compile", "decode", "speculative", "startup")
FORWARD_LENGTHS = (128, 256, 512, 1024, 2048)
COMPILE_DEPTHS = (2, 4, 8, 16, 32, 48)
REMAT_LAYERS, REMAT_CONTEXT, REMAT_BATCH = 12, 1024, 8

# Dense bf16 peak FLOP/s per chip, matched in order against `device_kind` (lower-cased).
NOMINAL_BF16_PEAK = (
    ("v5 lite", 197e12), ("v5e", 197e12), ("v5p", 459e12), ("tpu v5", 459e12),
    ("v6 lite", 918e12), ("v6e", 918e12), ("tpu v4", 275e12),
    ("a100", 312e12), ("h100", 989e12), ("h200", 989e12),
)


# ---------------------------------------------------------------- timing and peak


def median_time(fn: Callable[[], Any], repeats: int = 5, min_repeat_s: float = 0.2) -> float:
    """Median seconds per call of `fn()` after one warm-up call.

    Each repeat runs enough back-to-back calls to last about `min_repeat_s` (at least one) and
    blocks on the last result, so asynchronous dispatch is timed to completion.
    """
    start = time.perf_counter()
    jax.block_until_ready(fn())
    number = max(1, math.ceil(min_repeat_s / max(time.perf_counter() - start, 1e-6)))
    per_call = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        for _ in range(number):
            out = fn()
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / number)
    return statistics.median(per_call)


def compile_timed(jitted: Any, *args: Any) -> tuple[Any, float]:
    """Trace, lower and compile `jitted` for `args`: (the compiled function, seconds taken), a
    compile each time, never a load from the compilation cache."""
    with compile_cache.bypassed():
        start = time.perf_counter()
        compiled = jitted.lower(*args).compile()
        return compiled, time.perf_counter() - start


def measure_matmul_peak(n: int = 2048, repeats: int = 5, dtype: Any = jnp.float32) -> float:
    """FLOP/s of an n x n x n matmul of `dtype` operands, accumulated in float32 (median of `repeats`)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    matmul = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    return 2.0 * n**3 / median_time(lambda: matmul(a, b), repeats, min_repeat_s=0.0)


def nominal_bf16_peak(device_kind: str) -> float | None:
    """The dense bf16 peak FLOP/s of a known accelerator chip; None for any other device."""
    return next((peak for name, peak in NOMINAL_BF16_PEAK if name in device_kind.lower()), None)


def peak_flops(repeats: int = 5, dtype: str = "float32") -> tuple[float, str]:
    """(peak FLOP/s, where it came from): nominal bf16 for a known accelerator, else measured.

    Measured with `dtype` operands: a CPU with bfloat16 matmul instructions runs bfloat16 at about
    twice the float32 rate, so bfloat16 runs are held against the bfloat16 peak.
    """
    kind = jax.devices()[0].device_kind
    peak = nominal_bf16_peak(kind)
    if peak is not None:
        return peak, f"nominal bf16 {kind}"
    short = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    return measure_matmul_peak(repeats=repeats, dtype=jnp.dtype(dtype)), f"measured {short} matmul 2048 ({kind})"


# ---------------------------------------------------------------- modes


def _tokens(model: ModelConfig, shape: tuple[int, ...], seed: int = 1) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 0, model.vocab_size, jnp.int32)


def time_train_step(cfg: RunConfig, repeats: int, with_peak: bool = False) -> dict[str, Any]:
    """Compile seconds, median step seconds and compiled memory of the jitted train step.

    `with_peak`: each repeat is followed by a peak measurement (`peak_flops`), so the step and
    the peak it is divided by see the same machine load; `mfu_per_flop` is then the median of
    the per-repeat (1 / step seconds) / peak (multiply by FLOPs per step for MFU).
    """
    from jaxgpt.data.batches import window_length, with_segments
    from jaxgpt.train.step import compile_steps, init_state

    state = init_state(cfg, jax.random.key(0))
    batch = _tokens(cfg.model, (cfg.train.batch_size, window_length(cfg.model)))
    if cfg.data.document_mask:  # the built-in tokenizers' end-of-text is their last id
        batch = jnp.asarray(with_segments(np.asarray(batch), cfg.model.context_length, cfg.model.vocab_size - 1))
    if cfg.train.prefix_token_weight:  # any ids stand for the prefix targets: the step's work is the same
        batch = jnp.concatenate([batch, _tokens(cfg.model, (cfg.train.batch_size, cfg.model.context_length), 2)], axis=1)
    step, compile_s = compile_timed(compile_steps(cfg)[0], state, batch)
    holder = [state]

    def call():  # the step donates its state: thread it through
        holder[0], metrics = step(holder[0], batch)
        return metrics["loss"]

    result = {"compile_s": compile_s, "temp_bytes": memory_figures(step)["temp_bytes"]}
    if not with_peak:
        return {"seconds": median_time(call, repeats), **result}
    seconds, peaks = [], []
    for _ in range(max(1, repeats)):
        seconds.append(median_time(call, 1))
        peak, result["peak_source"] = peak_flops(repeats=1, dtype=cfg.model.dtype)
        peaks.append(peak)
    return {"seconds": statistics.median(seconds), "peak_flops": statistics.median(peaks),
            "mfu_per_flop": statistics.median(1 / (s * p) for s, p in zip(seconds, peaks)), **result}


def train_record(run: RunConfig, repeats: int) -> dict[str, Any]:
    """One `train` record: the step of `run` timed, its MFU against the peak measured beside it."""
    tokens = run.train.batch_size * run.model.context_length
    t = time_train_step(run, repeats, with_peak=True)
    fpt = flops_per_token(run.model)
    return {
        "mode": "train", "kernels": choose_kernels(run.model).name, "dtype": run.model.dtype,
        "remat": run.model.remat, "layers": run.model.n_layers,
        "d_model": run.model.d_model, "batch": run.train.batch_size,
        "context": run.model.context_length, "step_ms": t["seconds"] * 1e3,
        "tokens_per_s": tokens / t["seconds"], "flops_per_token": fpt,
        "mfu": t["mfu_per_flop"] * tokens * fpt, "compile_s": t["compile_s"],
        "temp_bytes": t["temp_bytes"], "peak_flops": t["peak_flops"], "peak_source": t["peak_source"],
    }


def bench_train(cfg: RunConfig, repeats: int) -> Iterator[dict[str, Any]]:
    """Each remat x dtype with the backend's kernels, then (where they differ) the portable ones."""
    for remat in ("none", "full"):
        for dtype in ("float32", "bfloat16"):
            run = cfg.replace("model", remat=remat, dtype=dtype)
            yield train_record(run, repeats)
            if run.model.kernels != "xla" and choose_kernels(run.model) != PORTABLE:
                yield train_record(run.replace("model", kernels="xla"), repeats)


def bench_forward(cfg: RunConfig, repeats: int, lengths: tuple[int, ...] = FORWARD_LENGTHS) -> Iterator[dict[str, Any]]:
    """Batch-one forward latency per length (learned positions: context widened to the longest)."""
    model = cfg.model
    if model.position == "learned" and model.context_length < max(lengths):
        model = dataclasses.replace(model, context_length=max(lengths))
    params = init_params(model, jax.random.key(0))
    kernels = choose_kernels(model)
    fn = jax.jit(lambda p, x: forward(p, model, x, kernels=kernels))
    for T in lengths:
        x = _tokens(model, (1, T))
        compiled, compile_s = compile_timed(fn, params, x)
        seconds = median_time(lambda: compiled(params, x), repeats)
        peak, source = peak_flops(dtype=model.dtype)
        fpt = flops_per_token(model, seq_len=T) / 3  # forward only
        yield {"mode": "forward", "context": T, "batch": 1, "layers": model.n_layers,
               "step_ms": seconds * 1e3, "tokens_per_s": T / seconds,
               "mfu": mfu(T / seconds, fpt, peak), "compile_s": compile_s,
               "peak_flops": peak, "peak_source": source}


def bench_compile(cfg: RunConfig, repeats: int, depths: tuple[int, ...] = COMPILE_DEPTHS,
                  remat_shape: tuple[int, int, int] = (REMAT_LAYERS, REMAT_CONTEXT, REMAT_BATCH)
                  ) -> Iterator[dict[str, Any]]:
    """Train-step compile time and memory against depth (scanned and unrolled), then remat vs not."""
    from jaxgpt.plan.programs import compile_train
    from jaxgpt.train.sharding import make_mesh

    mesh = make_mesh(cfg.train, jax.devices()[:1])
    total = {}
    for scan in (True, False):
        for depth in depths:
            with compile_cache.bypassed():  # timed: compiled, never loaded
                result = compile_train(cfg.replace("model", n_layers=depth, scan_layers=scan), mesh)
            total[scan, depth] = result["lower_s"] + result["compile_s"]
            yield {"mode": "compile", "layers": depth, "scan_layers": scan,
                   "compile_s": total[scan, depth], "lower_s": result["lower_s"],
                   "xla_compile_s": result["compile_s"], "temp_bytes": result["temp_bytes"],
                   "argument_bytes": result["argument_bytes"]}
        yield {"mode": "compile", "summary": f"compile({depths[-1]})/compile({depths[0]})",
               "scan_layers": scan, "ratio": total[scan, depths[-1]] / total[scan, depths[0]]}
    layers, context, batch = remat_shape
    base = cfg.replace("train", batch_size=batch, grad_accum=1)
    timed = {}
    for remat in ("none", "full"):
        run = base.replace("model", n_layers=layers, context_length=context, remat=remat)
        timed[remat] = t = time_train_step(run, repeats)
        yield {"mode": "compile", "remat": remat, "layers": layers, "context": context,
               "batch": batch, "temp_bytes": t["temp_bytes"], "step_ms": t["seconds"] * 1e3,
               "tokens_per_s": batch * context / t["seconds"], "compile_s": t["compile_s"]}
    yield {"mode": "compile", "summary": "remat/no-remat", "layers": layers, "context": context,
           "temp_ratio": timed["full"]["temp_bytes"] / timed["none"]["temp_bytes"],
           "step_time_ratio": timed["full"]["seconds"] / timed["none"]["seconds"]}


@functools.partial(jax.jit, static_argnames="model")
def _recompute_next(params: Any, tokens_1P: jax.Array, length: jax.Array, model: ModelConfig) -> jax.Array:
    """Greedy next token from a forward pass over the whole (right-padded) prefix."""
    logits_1PV = forward(params, model, tokens_1P, kernels=choose_kernels(model))
    return jnp.argmax(logits_1PV[0, length - 1]).astype(jnp.int32)


def recompute_generate(params: Any, model: ModelConfig, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding without a cache: each token re-runs the prefix, padded to a power of two."""
    from jaxgpt.evaluation.generate import bucket_length

    sequence = list(prompt)
    for _ in range(max_new_tokens):
        window = sequence[-model.context_length:]
        padded = np.zeros((1, bucket_length(len(window), model.context_length)), np.int32)
        padded[0, : len(window)] = window
        sequence.append(int(_recompute_next(params, padded, len(window), model)))
    return sequence[len(prompt):]


def bench_decode(cfg: RunConfig, repeats: int) -> Iterator[dict[str, Any]]:
    """KV-cache generation against recomputing the prefix, and per-token cost against position.

    Lengths scale with the context: at 1,024, 512 new tokens after a 16-token prompt, then 100
    new tokens after a prompt of 100 and of 900.
    """
    from jaxgpt.evaluation.generate import generate

    model = cfg.model
    C = model.context_length
    params = init_params(model, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.vocab_size, 16).tolist()
    new = min(C // 2, C - len(prompt))
    cached = lambda: generate(params, model, [prompt], new, temperature=0.0)
    cached_s = median_time(cached, repeats, min_repeat_s=0.0)
    recompute_s = median_time(lambda: recompute_generate(params, model, prompt, new), repeats, 0.0)
    yield {"mode": "decode", "method": "kv_cache", "new_tokens": new, "prompt": len(prompt),
           "tokens_per_s": new / cached_s, "step_ms": cached_s / new * 1e3}
    yield {"mode": "decode", "method": "recompute_prefix", "new_tokens": new, "prompt": len(prompt),
           "tokens_per_s": new / recompute_s, "step_ms": recompute_s / new * 1e3}
    yield {"mode": "decode", "summary": "kv_cache speed-up", "ratio": recompute_s / cached_s}
    steps = max(1, C * 100 // 1024)
    seconds, position = {}, []
    for length in (steps, C - steps - C * 24 // 1024):  # 100 and 900 at C = 1024
        p = rng.integers(0, model.vocab_size, length).tolist()
        for n in (1, steps):
            seconds[length, n] = median_time(lambda: generate(params, model, [p], n, temperature=0.0),
                                             repeats, min_repeat_s=0.0)
        per_token = (seconds[length, steps] - seconds[length, 1]) / max(1, steps - 1)
        position.append({"mode": "decode", "method": "position", "prompt": length, "new_tokens": steps,
                         "call_ms": seconds[length, steps] * 1e3, "step_ms": per_token * 1e3,
                         "tokens_per_s": steps / seconds[length, steps]})
        yield position[-1]
    short, long = position
    yield {"mode": "decode", "summary": f"prompt {long['prompt']} / prompt {short['prompt']}",
           "ratio": long["call_ms"] / short["call_ms"], "per_token_ratio": long["step_ms"] / short["step_ms"]}


def bench_speculative(run_dir: str, repeats: int, batches: tuple[int, ...] = (1, 8),
                      new_tokens: int = 256) -> Iterator[dict[str, Any]]:
    """MTP self-speculative greedy decoding against plain greedy, on a trained run's val text.

    Prompts are 32-token windows of the run's val split. `within_context` generates up to the
    context's end (no window slides); `new_tokens` runs past it, where rows slide their windows
    at different steps (speculative rows advance unevenly) and each slide re-encodes the batch.
    """
    from jaxgpt.data.from_config import prepare_data
    from jaxgpt.evaluation.generate import generate
    from jaxgpt.train.checkpoint import load_run_config, read_params

    run_cfg = load_run_config(run_dir)
    model, (params, _) = run_cfg.model, read_params(run_dir, run_cfg)
    if model.mtp_depth < 1:
        raise UserError(f"{run_dir} has model.mtp_depth = 0: speculative decoding needs MTP adapters")
    data = prepare_data(run_cfg, Path(run_dir))
    val, rng = data.tokens.val, np.random.default_rng(0)  # read by windows: a split may be large
    P = min(32, model.context_length // 2)
    for B in batches:
        prompts = [val[i: i + P].tolist() for i in rng.integers(0, len(val) - P, B)]
        for label, n in (("within_context", model.context_length - P), (f"{new_tokens}_tokens", new_tokens)):
            runs, outputs = {}, {}
            for speculative in (False, True):
                stats: dict[str, Any] = {}
                call = lambda: generate(params, model, prompts, n, temperature=0.0, speculative=speculative)
                seconds = median_time(call, repeats, min_repeat_s=0.0)
                outputs[speculative] = generate(params, model, prompts, n, temperature=0.0,
                                                speculative=speculative, stats=stats)
                runs[speculative] = {"mode": "speculative", "method": "speculative" if speculative else "greedy",
                                     "batch": B, "prompt": P, "new_tokens": n, "case": label,
                                     "tokens_per_s": B * n / seconds, "step_ms": seconds / stats["forward_passes"] * 1e3,
                                     "forward_passes": stats["forward_passes"],
                                     "acceptance_rate": stats["acceptance_rate"]}
                yield runs[speculative]
            yield {"mode": "speculative", "summary": f"speed-up, batch {B}, {label}",
                   "ratio": runs[True]["tokens_per_s"] / runs[False]["tokens_per_s"],
                   "identical": outputs[True] == outputs[False]}


def run_mode(mode: str, cfg: RunConfig, repeats: int = 5, run: str | None = None) -> Iterator[dict[str, Any]]:
    """The mode's records, each yielded as soon as it is measured."""
    if mode not in MODES:
        raise UserError(f"unknown bench mode {mode!r}: one of {', '.join(MODES)}")
    if mode == "speculative":
        if run is None:
            raise UserError("bench speculative needs --run DIR: a trained run with model.mtp_depth >= 1")
        return bench_speculative(run, repeats)
    if mode == "startup":
        from jaxgpt.tools.bench_startup import bench_startup

        return bench_startup(cfg, repeats)
    return {"train": bench_train, "forward": bench_forward, "compile": bench_compile,
            "decode": bench_decode}[mode](cfg, repeats)


# ---------------------------------------------------------------- output


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def table(records: list[dict[str, Any]]) -> str:
    """A plain text table of the records (peak fields left out; they are the same on every row)."""
    keys = [k for r in records for k in r if k not in ("peak_flops", "peak_source", "flops_per_token")]
    keys = list(dict.fromkeys(keys))
    rows = [keys] + [[_cell(r.get(k, "")) for k in keys] for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(keys))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
