"""What the one-chip benchmarks (bench_gpu.py, bench_tpu.py) share: GPT-2 124M's train step timed
per variant, greedy decoding timed, the records written as they come, and a markdown table.

A variant is a config (experiments/gpt2_124m.toml and overrides) and a kernel set: the chosen
one, or the portable one, with the fused head-loss off, the layer loop unrolled or kept, or XLA options
added. Each record is one JSON object; `Records` writes it to OUT/records.jsonl and stdout.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.metadata
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxgpt.config import RunConfig, load_config  # noqa: E402
from jaxgpt.data import window_length  # noqa: E402
from jaxgpt.evaluation.generate import generate  # noqa: E402
from jaxgpt.kernels import PORTABLE, Kernels  # noqa: E402
from jaxgpt.model.decoder import init_params  # noqa: E402
from jaxgpt.model.flops import flops_per_token  # noqa: E402
from jaxgpt.plan.programs import memory_figures  # noqa: E402
from jaxgpt.tools.bench import median_time, nominal_bf16_peak  # noqa: E402
from jaxgpt.train.step import init_state, train_step  # noqa: E402

CONFIG = ROOT / "experiments/gpt2_124m.toml"
SMOKE = ["model.vocab_size=256", "model.context_length=64", "model.d_model=64", "model.n_layers=2",
         "model.n_heads=4", "train.batch_size=4"]


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...] = ()
    plain_head: bool = False  # the head's logits, then the cross-entropy (the fused head-loss off)
    portable: bool = False  # the portable kernels: XLA's attention, the plain head
    scan_unroll: int | None = None  # layers per iteration of the scanned stack's loop (`Kernels.scan_unroll`); None: the set's
    recompute: bool | None = None  # `Kernels.recompute_elementwise`; None: the set's
    options: tuple[tuple[str, Any], ...] = ()  # XLA options added to the kernels' own


def versions(packages: tuple[str, ...]) -> dict[str, Any]:
    out = {"python": platform.python_version(), "devices": [str(d) for d in jax.devices()],
           "device_kind": jax.devices()[0].device_kind, "backend": jax.default_backend()}
    for package in ("jax", "jaxlib", "flax", "optax", *packages):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def variant_kernels(chosen: Kernels, cfg: RunConfig, variant: Variant) -> Kernels:
    """The variant's kernels, from `chosen` (the set picked for the model on this machine)."""
    kernels = PORTABLE if variant.portable else chosen
    if variant.plain_head:
        kernels = dataclasses.replace(kernels, head_loss=None)
    if variant.scan_unroll is not None:
        kernels = dataclasses.replace(kernels, scan_unroll=variant.scan_unroll)
    if variant.recompute is not None:
        kernels = dataclasses.replace(kernels, recompute_elementwise=variant.recompute)
    return dataclasses.replace(kernels, compiler_options=kernels.compiler_options + variant.options)


def time_train_step(cfg: RunConfig, kernels: Kernels, repeats: int
                    ) -> tuple[dict[str, Any], Any, Any, Callable[[], Any]]:
    """(record, the traced step, the lowered step, a call of the compiled step) for one config and
    kernel set: step time (median), tokens/s, MFU against the chip's nominal bf16 peak, compiled memory, the first
    step's loss and the last one's."""
    state = init_state(cfg, jax.random.key(0))
    B, T = cfg.train.batch_size, cfg.model.context_length
    batch = jax.random.randint(jax.random.key(1), (B, window_length(cfg.model)), 0, cfg.model.vocab_size)
    step = jax.jit(lambda s, b: train_step(cfg, s, b, kernels=kernels), donate_argnums=0,
                   compiler_options=kernels.jit_options())
    started = time.perf_counter()
    traced = step.trace(state, batch)  # its jaxpr names the kernels the step runs
    lowered = traced.lower()
    compiled = lowered.compile()
    compile_s = time.perf_counter() - started
    holder = [state]

    def call():  # the step donates its state: thread it through
        holder[0], metrics = compiled(holder[0], batch)
        return metrics["loss"]

    # The first step's loss is a function of the init and the batch alone, so kernel sets that
    # agree give the same one; the loss after the timed steps depends on how many ran.
    first_loss = float(call())
    seconds = median_time(call, repeats, min_repeat_s=0.5)
    loss = float(call())
    memory = memory_figures(compiled)
    peak = nominal_bf16_peak(jax.devices()[0].device_kind)
    tokens_per_s = B * T / seconds
    record = {
        "mode": "train", "framework": "jaxgpt", "kernels": kernels.name,
        "head_loss": "fused" if kernels.head_loss else "plain", "options": dict(kernels.compiler_options),
        "dtype": cfg.model.dtype, "remat": cfg.model.remat, "batch": B, "context": T,
        "step_ms": seconds * 1e3, "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token(cfg.model) / peak if peak else None,
        "compile_s": compile_s, "first_loss": first_loss, "loss": loss,
        "temp_bytes": memory["temp_bytes"], "argument_bytes": memory["argument_bytes"],
    }
    return record, traced, lowered, call


def decode_records(model: Any, params: Any, batches: tuple[int, ...], new_tokens: int, label: str
                   ) -> list[dict[str, Any]]:
    """Greedy decoding's tokens/s at each batch size, after a 16-token prompt per row."""
    rng = np.random.default_rng(0)
    records = []
    for B in batches:
        prompts = rng.integers(0, model.vocab_size, (B, 16)).tolist()
        run = lambda: generate(params, model, prompts, new_tokens, temperature=0.0)
        start = time.perf_counter()
        first = run()
        first_s = time.perf_counter() - start
        seconds = median_time(run, 3, min_repeat_s=0.0)
        records.append({"mode": "decode", "variant": label, "batch": B, "new_tokens": new_tokens,
                        "tokens_per_s": B * new_tokens / seconds, "ms_per_token": seconds / new_tokens * 1e3,
                        "first_call_s": first_s, "first_row": first[0][:8]})
    return records


def stored_params(base: list[str]) -> tuple[Any, Any]:
    """(model config, fresh params) of the benchmark's model with `base` overrides."""
    model = load_config(CONFIG, base).model
    return model, init_params(model, jax.random.key(0))


class Records:
    """Every record, stamped with the seconds since the start, to OUT/records.jsonl and stdout."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.started = time.perf_counter()
        self.all: list[dict[str, Any]] = []
        self.sink = (out / "records.jsonl").open("w", encoding="utf-8")

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def emit(self, record: dict[str, Any]) -> None:
        record = {**record, "elapsed_s": round(self.elapsed(), 1)}
        self.all.append(record)
        self.sink.write(json.dumps(record) + "\n")
        self.sink.flush()
        print(json.dumps(record), flush=True)

    def each(self, mode: str, name: str, records: Callable[[], list[dict[str, Any]]], budget_s: float) -> None:
        """Emit what `records()` returns; past `budget_s`, or if it fails (out of memory, say), one
        error record instead, and the run goes on."""
        if self.elapsed() > budget_s:
            self.emit({"mode": mode, "variant": name, "error": f"skipped: past the budget of {budget_s:.0f} s"})
            return
        try:
            for record in records():
                self.emit(record)
        except Exception as error:  # one failing variant must not end the run
            self.emit({"mode": mode, "variant": name, "error": f"{type(error).__name__}: {str(error)[:300]}"})
        gc.collect()  # the variant's state and program go before the next one's


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def table(records: list[dict[str, Any]], extra: tuple[str, str] | None = None) -> str:
    """Train and decode records as markdown; `extra`: (heading, record key) of one more train column."""
    head, key = extra or ("", "")
    lines = [f"| what | batch | step ms | tokens/s | MFU |{f' {head} |' if extra else ''} temp GB | compile s |",
             f"| --- | ---: | ---: | ---: | ---: |{' ---: |' if extra else ''} ---: | ---: |"]
    for r in records:
        if r.get("mode") == "train":
            name = r["variant"] if r.get("framework") in (None, "jaxgpt") else f"{r['variant']} ({r['framework']})"
            temp = r.get("temp_bytes") or r.get("peak_bytes")
            more = f" {_fmt(r.get(key), 3)} |" if extra else ""
            lines.append(f"| {name} | {_fmt(r.get('batch'))} | {_fmt(r.get('step_ms'))} | "
                         f"{_fmt(r.get('tokens_per_s'), 0)} | "
                         f"{_fmt(r['mfu'] * 100 if r.get('mfu') else None)}{'%' if r.get('mfu') else ''} |{more} "
                         f"{_fmt(temp / 1e9 if temp else None, 2)} | "
                         f"{_fmt(r.get('compile_s'))} |" if "error" not in r else f"| {name} | error: {r['error']} |")
    lines += ["", "| decoding | batch | tokens/s | ms a token |", "| --- | ---: | ---: | ---: |"]
    for r in records:
        if r.get("mode") == "decode":
            lines.append(f"| {r['variant']} | {_fmt(r.get('batch'))} | {_fmt(r.get('tokens_per_s'), 0)} | "
                         f"{_fmt(r.get('ms_per_token'), 3)} |" if "error" not in r else f"| {r['variant']} | error: {r['error']} |")
    return "\n".join(lines)
