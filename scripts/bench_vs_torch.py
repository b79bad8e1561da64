"""Train-step speed of jaxgpt against PyTorch (Hugging Face GPT2LMHeadModel) on the same model.

    .venv/bin/python scripts/bench_vs_torch.py                 # both configs, a few minutes on 2 cores
    .venv/bin/python scripts/bench_vs_torch.py --configs day1 --steps 10 --rounds 3
    .venv/bin/python scripts/bench_vs_torch.py --dtype bfloat16     # jaxgpt bf16 vs torch.autocast bf16

Same model (GPT-2 layout: learned positions, pre-LayerNorm, GELU-tanh, tied head, biases), same
initial weights (jaxgpt's, exported with `jaxgpt.hf.exporter.export_hf`), same batches, same AdamW (lr,
betas, eps, weight decay on the kernels only, global-norm clipping; constant lr on both sides).
PyTorch runs eagerly on the CPU with as many threads as XLA uses (all cores). The two alternate
in rounds of `--steps` steps each, so both see the same machine load; every step is timed to its
loss on the host, and the median step time gives tokens/s. Prints one JSON line per config, then
a table on stderr. With `--dtype bfloat16` jaxgpt computes in bfloat16 (`model.dtype`) and PyTorch
runs its forward pass under `torch.autocast("cpu", torch.bfloat16)`; MFU is then taken against
the measured bfloat16 matmul peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

from jaxgpt.cli.main import hugepage_malloc_env
from jaxgpt.config import load_config
from jaxgpt.hf.exporter import export_hf
from jaxgpt.model.flops import flops_per_token, mfu
from jaxgpt.tools.bench import peak_flops
from jaxgpt.train.step import compile_steps, init_state

CONFIGS = {
    "day1": ["train.batch_size=32"],
    "6x384": ["model.n_layers=6", "model.d_model=384", "model.n_heads=6", "model.context_length=256",
              "train.batch_size=16"],
}
COMMON = ["model.bias=true", "model.dropout=0.0", "train.warmup_steps=0",
          "train.min_lr=3e-3", "train.lr=3e-3", "train.grad_accum=1"]


def jax_trainer(cfg, batches):
    state = init_state(cfg, jax.random.key(0))
    step, _ = compile_steps(cfg)
    params = jax.tree_util.tree_map(np.asarray, state.params)
    holder = {"state": state, "i": 0}

    def run() -> float:
        holder["state"], metrics = step(holder["state"], batches[holder["i"] % len(batches)])
        holder["i"] += 1
        return float(metrics["loss"])

    return run, params


def torch_trainer(cfg, params, batches):
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    with tempfile.TemporaryDirectory() as hf_dir:
        export_hf(cfg.model, params, hf_dir)
        model = GPT2LMHeadModel.from_pretrained(hf_dir)
    model.train()
    train = cfg.train
    kernels = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    named = list(model.named_parameters())  # the tied head appears once, as wte
    groups = [{"params": [p for n, p in named if n.endswith(kernels)], "weight_decay": train.weight_decay},
              {"params": [p for n, p in named if not n.endswith(kernels)], "weight_decay": 0.0}]
    try:
        optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2),
                                      eps=train.adam_eps, fused=True)
    except (RuntimeError, TypeError):
        optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.adam_eps)
    windows = [torch.from_numpy(b.astype(np.int64)) for b in batches]
    T, V = cfg.model.context_length, cfg.model.vocab_size
    state = {"i": 0}
    bf16 = cfg.model.dtype == "bfloat16"

    def run() -> float:
        window = windows[state["i"] % len(windows)]
        state["i"] += 1
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(window[:, :T]).logits
            loss = F.cross_entropy(logits.float().reshape(-1, V), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if train.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.clip_norm)
        optimizer.step()
        return float(loss.detach())

    return run


def timed_steps(run, n: int, times: list[float], losses: list[float]) -> None:
    for _ in range(n):
        start = time.perf_counter()
        losses.append(run())
        times.append(time.perf_counter() - start)


def compare(name: str, steps: int, rounds: int, warmup: int, dtype: str = "float32") -> dict:
    import torch

    cfg = load_config("experiments/day1.toml", COMMON + CONFIGS[name] + [f"model.dtype={dtype}"])
    B, T = cfg.train.batch_size, cfg.model.context_length
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, cfg.model.vocab_size, (B, T + 1), dtype=np.int32) for _ in range(4)]
    run_jax, params = jax_trainer(cfg, batches)
    run_torch = torch_trainer(cfg, params, batches)
    times = {"jax": [], "torch": []}
    losses = {"jax": [], "torch": []}
    for label, run in (("jax", run_jax), ("torch", run_torch)):  # compile, first-touch, allocator
        timed_steps(run, warmup, [], losses[label])
    peaks = []
    for _ in range(rounds):  # the peak is measured in every round too, under the same load
        for label, run in (("jax", run_jax), ("torch", run_torch)):
            timed_steps(run, steps, times[label], losses[label])
        peak, source = peak_flops(dtype=dtype)
        peaks.append(peak)
    peak = statistics.median(peaks)
    fpt = flops_per_token(cfg.model)
    record = {"config": name, "dtype": dtype, "layers": cfg.model.n_layers, "d_model": cfg.model.d_model,
              "heads": cfg.model.n_heads, "context": T, "batch": B, "vocab": cfg.model.vocab_size,
              "timed_steps": steps * rounds, "threads": torch.get_num_threads()}
    for label in ("jax", "torch"):
        step_s = statistics.median(times[label])
        record[f"{label}_step_ms"] = step_s * 1e3
        record[f"{label}_tokens_per_s"] = B * T / step_s
        record[f"{label}_mfu"] = mfu(B * T / step_s, fpt, peak)
        record[f"{label}_loss_first"] = losses[label][0]
        record[f"{label}_loss_last"] = losses[label][-1]
    record["speedup"] = record["jax_tokens_per_s"] / record["torch_tokens_per_s"]
    record.update(peak_flops=peak, peak_source=source)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="day1,6x384", help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round and framework")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (jax, torch, jax, ...)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, per framework")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="compute dtype of both (bfloat16: jaxgpt model.dtype, torch.autocast)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(os.cpu_count() or 1)  # XLA CPU's pool uses every core too
    rows = []
    for name in args.configs.split(","):
        record = compare(name, args.steps, args.rounds, args.warmup, args.dtype)
        print(json.dumps(record), flush=True)
        rows.append(record)
    print(f"{'config':8} {'jax tok/s':>10} {'torch tok/s':>12} {'speed-up':>9} {'jax MFU':>8} {'torch MFU':>10}",
          file=sys.stderr)
    for r in rows:
        print(f"{r['config']:8} {r['jax_tokens_per_s']:10.0f} {r['torch_tokens_per_s']:12.0f} "
              f"{r['speedup']:8.2f}x {r['jax_mfu']:8.1%} {r['torch_mfu']:10.1%}", file=sys.stderr)


if __name__ == "__main__":
    env = hugepage_malloc_env(os.environ)
    if env is not None:  # both frameworks get the malloc the `jaxgpt` command runs with
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    main()
