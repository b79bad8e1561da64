"""GPT-2 124M on one TPU chip, in one run: the TPU kernels against the portable ones, and decoding.

    python scripts/bench_tpu.py --out bench_tpu             # one chip (Colab's v5e-1 or v6e-1): at most 8 minutes
    python scripts/bench_tpu.py --smoke --out /tmp/smoke     # a tiny model on the CPU, Pallas in interpret mode

Prints the device and the library versions, then one line per measurement as it finishes, then
a table (markdown). Writes every record to OUT/records.jsonl (one JSON object a line).

1. jaxgpt's train step (experiments/gpt2_124m.toml: bfloat16 compute, float32 params and loss),
   one variant at a time: the TPU set (`jaxgpt.kernels.tpu`: splash attention, the head fused
   with its loss) against the portable one at batch 16, 32 and 64, with remat, with the plain
   head (splash attention alone), in float32. Each: step time (median), tokens/s, MFU against
   the chip's nominal bfloat16 peak (v5e 197 TFLOP/s, v6e 918, v4 275, v5p 459), compiled memory
   against the chip's, compile seconds, the loss, and whether the step holds the splash kernel.
   A variant that does not fit records its error; variants past `--budget-s` are skipped.
2. Greedy decoding of `--new-tokens` after a 16-token prompt at batch 1 and 64, while the run
   is within `--total-s`.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_chip import (  # noqa: E402
    CONFIG,
    SMOKE,
    Records,
    Variant,
    decode_records,
    stored_params,
    table,
    time_train_step,
    variant_kernels,
    versions,
)

from jaxgpt.config import load_config  # noqa: E402
from jaxgpt.kernels import choose_kernels  # noqa: E402
from jaxgpt.plan.programs import device_memory_bytes  # noqa: E402

# Splash attention runs from 128 positions on: the smoke model has them, one head of 128 (every jax
# the project allows takes that size), and an eighth of each variant's batch (interpret mode is slow).
TPU_SMOKE = [*SMOKE, "model.context_length=128", "model.d_model=128", "model.n_heads=1"]
SMOKE_BATCH_DIVISOR = 8
PACKAGES = ("libtpu", "orbax-checkpoint")

# In order of what the run must not miss if the budget runs out.
VARIANTS = (
    Variant("tpu, batch 32", ("train.batch_size=32",)),
    Variant("portable, batch 32", ("train.batch_size=32",), portable=True),
    Variant("tpu, batch 16", ("train.batch_size=16",)),
    Variant("portable, batch 16", ("train.batch_size=16",), portable=True),
    Variant("tpu, batch 64", ("train.batch_size=64",)),
    Variant("tpu, plain head, batch 32", ("train.batch_size=32",), plain_head=True),
    Variant("tpu, remat, batch 64", ("train.batch_size=64", "model.remat=true")),
    Variant("portable, batch 64", ("train.batch_size=64",), portable=True),
    Variant("tpu, float32, batch 16", ("train.batch_size=16", "model.dtype=float32")),
)


def chooser(smoke: bool):
    """The kernel choice: the machine's own, or (smoke) the TPU set in interpret mode on the CPU."""
    return functools.partial(choose_kernels, backend="tpu", interpret=True) if smoke else choose_kernels


def smoke_sized(overrides: tuple[str, ...]) -> list[str]:
    key = "train.batch_size="
    return [f"{key}{int(o[len(key):]) // SMOKE_BATCH_DIVISOR}" if o.startswith(key) else o for o in overrides]


def train_variant(base: list[str], variant: Variant, repeats: int, smoke: bool = False) -> list[dict[str, Any]]:
    cfg = load_config(CONFIG, [*base, *(smoke_sized(variant.overrides) if smoke else variant.overrides)])
    kernels = variant_kernels(chooser(smoke)(cfg.model), cfg, variant)
    record, traced, _, _ = time_train_step(cfg, kernels, repeats)
    chip = device_memory_bytes(jax.devices()[0])
    parts = [record.get("temp_bytes"), record.get("argument_bytes")]
    # The TPU set's one Pallas kernel is splash attention.
    return [{**record, "variant": variant.name, "splash": "pallas_call" in str(traced.jaxpr),
             "device_bytes": chip, "share_of_device": sum(parts) / chip if chip and None not in parts else None}]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_tpu")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, Pallas in interpret mode")
    parser.add_argument("--variants", default="all", help="names, separated by ';' (default: all)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=330.0, help="no new train variant after this")
    parser.add_argument("--total-s", type=float, default=440.0, help="no new decoding batch after this")
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    base = TPU_SMOKE if args.smoke else []
    new_tokens = min(args.new_tokens, 16) if args.smoke else args.new_tokens
    records = Records(Path(args.out))
    records.emit({"mode": "versions", **versions(PACKAGES), "interpret": args.smoke})
    for variant in [v for v in VARIANTS if args.variants == "all" or v.name in args.variants.split(";")]:
        records.each("train", variant.name, lambda: train_variant(base, variant, args.repeats, args.smoke), args.budget_s)
    model, params = stored_params(base)
    for batch in (1, 4) if args.smoke else (1, 64):
        records.each("decode", f"greedy, batch {batch}",
                     lambda: decode_records(model, params, (batch,), new_tokens, "greedy"), args.total_s)
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, {records.elapsed():.0f} s\n")
    print(table(records.all, ("of HBM", "share_of_device")))


if __name__ == "__main__":
    main()
