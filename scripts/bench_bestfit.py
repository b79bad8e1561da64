"""Planning nanochat's best-fit rows (data.align = "bestfit"): how long a run's plan takes, which
a resumed run pays again at its start, and how much of the text the rows drop.

    .venv/bin/python scripts/bench_bestfit.py [--documents 1000000] [--window 2049] [--rows 200000]

Document lengths are drawn from a Pareto tail (shape 1.2, at least 300 tokens, at most 20,000),
about web text's; the plan places them into `--rows` rows of `--window` tokens. One JSON line:
seconds, documents and pieces placed, rows per second, and the fraction of the placed documents'
tokens that crops dropped.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from jaxgpt.data.bestfit import RowPlan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--window", type=int, default=2049)
    parser.add_argument("--rows", type=int, default=200_000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    lengths = np.minimum((rng.pareto(1.2, args.documents) + 1) * 300, 20_000).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    plan = RowPlan(starts, int(lengths.sum()), args.window)
    started = time.perf_counter()
    plan.pieces(args.rows - 1)
    seconds = time.perf_counter() - started
    placed = np.frombuffer(plan.piece_start, np.int64)
    used = np.isin(starts, placed)  # documents that went into a row, whole or cropped
    print(json.dumps({"rows": args.rows, "window": args.window, "seconds": round(seconds, 2),
                      "rows_per_second": round(args.rows / seconds), "documents_placed": int(used.sum()),
                      "pieces": len(placed), "dropped_fraction": round(1 - args.rows * args.window
                                                                       / float(lengths[used].sum()), 3)}))


if __name__ == "__main__":
    main()
