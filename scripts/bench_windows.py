"""What an attention window saves on this machine: the train step at long contexts, windowed
against full attention (portable and tuned kernels), and decoding a long text on the ring cache
of a windowed model against the whole-context cache of a full one.

    python scripts/bench_windows.py                      # the figures in docs/performance.md
    python scripts/bench_windows.py --contexts 1024 --decode-tokens 2048   # a quicker look

Prints one JSON record per measurement and a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import jaxgpt  # noqa: F401  (before jax: the absent accelerators' plugins stay quiet)
import jax
import numpy as np

from jaxgpt.config import load_config
from jaxgpt.evaluation.generate import generate_tokens, lower_decoding
from jaxgpt.model.decoder import init_params
from jaxgpt.tools.bench import time_train_step

MODEL = ["model.position=rope", "model.norm=rmsnorm"]


def train_steps(contexts: list[int], window: int, repeats: int) -> list[dict]:
    records = []
    for T in contexts:
        for kernels in ("xla", "auto"):
            for W in (0, window):
                cfg = load_config(None, [*MODEL, f"model.context_length={T}", f"model.attention_window={W}",
                                         f"model.kernels={kernels}", "train.batch_size=2"])
                timed = time_train_step(cfg, repeats)
                records.append({"bench": "train_step", "context": T, "window": W,
                                "kernels": "portable" if kernels == "xla" else "cpu",
                                "step_ms": round(timed["seconds"] * 1e3, 1), "temp_bytes": timed["temp_bytes"]})
    return records


def decoding(tokens: int, window: int) -> list[dict]:
    records = []
    for W in (0, window):
        cfg = load_config(None, [*MODEL, f"model.context_length={tokens}", f"model.attention_window={W}",
                                 "model.d_model=256", "model.n_heads=4", "model.n_layers=4"]).model
        params = init_params(cfg, jax.random.key(0))
        state = lower_decoding(params, cfg, max_new_tokens=tokens - 1)["advance"].args_info[0][1]
        cache_bytes = sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
                          for leaf in jax.tree_util.tree_leaves(state["cache"]))
        stats: dict = {}
        for _ in generate_tokens(params, cfg, [[1]], tokens - 1, temperature=0.0, chunk=512, stats=stats):
            pass
        records.append({"bench": "decode", "tokens": tokens, "window": W, "cache_bytes": cache_bytes,
                        "tokens_per_s": stats["tokens_per_s"], "first_token_s": stats["first_token_s"]})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="1024,4096", help="train-step contexts, comma-separated")
    parser.add_argument("--train-window", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=8192)
    parser.add_argument("--decode-window", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    records = train_steps([int(c) for c in args.contexts.split(",")], args.train_window, args.repeats)
    records += decoding(args.decode_tokens, args.decode_window)
    for record in records:
        print(json.dumps(record), flush=True)
    for r in records:
        if r["bench"] == "train_step":
            print(f"train step  T {r['context']:>5}  W {r['window'] or 'full':>5}  {r['kernels']:<8} "
                  f"{r['step_ms']:>9.1f} ms  temporaries {r['temp_bytes'] / 2**20:8.1f} MiB", file=sys.stderr)
        else:
            print(f"decode {r['tokens']} tokens  W {r['window'] or 'full':>5}  cache {r['cache_bytes'] / 2**20:7.1f} MiB  "
                  f"{r['tokens_per_s']} tokens/s", file=sys.stderr)


if __name__ == "__main__":
    main()
