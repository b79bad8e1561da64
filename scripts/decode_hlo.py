"""What one decoded token runs on a chip: the sampler's token loop compiled for a target, counted.

    python scripts/decode_hlo.py                              # GPT-2 124M on h100-1: whole, ring, long-short
    python scripts/decode_hlo.py --target v5e-1 --hlo out/    # another chip; keep each decode.hlo.txt

For each variant of the config, `jaxgpt dry-run --target T --hlo DIR`'s sampler programs are
compiled (nothing runs: the compile proves the program, not its speed) and one iteration of the
token loop in `decode.hlo.txt` is read (`jaxgpt.plan.loop_ops`): the kernel-launching ops, and
each op that writes 2**20 elements or more other than in place. One JSON line per variant.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from jaxgpt.config import load_config
from jaxgpt.plan.api import plans
from jaxgpt.plan.loop_ops import loop_ops

VARIANTS = {
    "whole": [],
    "ring": ["model.position=rope", "model.attention_window=256"],
    "long-short": ["model.attention_window=256", "model.window_pattern=SSSL"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="experiments/gpt2_124m.toml")
    parser.add_argument("--target", default="h100-1")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="overrides for every variant")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--hlo", default=None, metavar="DIR", help="keep each variant's HLO in DIR/VARIANT")
    args = parser.parse_args()
    names = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r} (known: {', '.join(VARIANTS)})")
    root = Path(args.hlo) if args.hlo else Path(tempfile.mkdtemp(prefix="decode-hlo-"))
    cfgs = [load_config(args.config, [*args.set, *VARIANTS[name]]) for name in names]
    records = plans(cfgs, args.target, programs=("decode",), hlo_dirs=[root / name for name in names])
    for name, record in zip(names, records):
        if "error" in record or "failure" in record:
            print(json.dumps({"variant": name, **record}))
            continue
        found = loop_ops((root / name / "decode.hlo.txt").read_text())
        print(json.dumps({"variant": name, "target": args.target, "launches_per_token": found["launches"],
                          "conditionals": found["conditionals"],
                          "large_writes": [{k: w[k] for k in ("root", "shape", "elements", "times")}
                                           for w in found["large_writes"]]}))


if __name__ == "__main__":
    main()
