"""A stand-in for what nanochat downloads, laid out where nanochat puts it, for machines that
cannot reach its servers (this project's CI and sandboxes): BASE/base_data/shard_0000N.parquet
(the documents of a text file split at blank lines, the last shard held out as val), a
BASE/tokenizer/tokenizer.pkl trained on them by the tests' byte-pair trainer (nanochat's split
pattern and special tokens), and a BASE/eval_bundle of the tests' synthetic CORE tasks in
nanochat's bundle format. It stands in for `python -m nanochat.dataset -n 2`, `scripts.tok_train`
and the eval_bundle.zip download; the CPU run of docs/nanochat.md then runs on it unchanged:

    python scripts/nanochat_stand_in.py ~/.cache/nanochat --text ../shared/data/tinyshakespeare.txt
    jaxgpt prepare --config experiments/nanochat_cpu.toml     # ... as docs/nanochat.md goes on

Its CORE numbers mean nothing beyond the pipeline running: the tasks are random words.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="the base directory to write (nanochat's: ~/.cache/nanochat)")
    parser.add_argument("--text", type=Path, required=True, help="a text file; its blank lines part the documents")
    parser.add_argument("--merges", type=int, default=400, help="byte-pair merges of the tokenizer")
    args = parser.parse_args()
    import pyarrow as pa
    import pyarrow.parquet as pq

    sys.path.insert(0, str(ROOT / "tests"))
    from core_reference import make_examples, write_bundle
    from nanochat_files import train_encoding

    base = args.base.expanduser()
    for part in ("base_data", "tokenizer", "eval_bundle"):
        if (base / part).exists():
            raise SystemExit(f"{base / part} exists: this script writes a fresh stand-in only")
    documents = [d.strip() for d in args.text.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    held_out = max(1, len(documents) // 10)
    (base / "base_data").mkdir(parents=True)
    for n, part in enumerate((documents[:-held_out], documents[-held_out:])):
        pq.write_table(pa.table({"text": part}), base / "base_data" / f"shard_{n:05d}.parquet", row_group_size=1024)
    (base / "tokenizer").mkdir()
    encoding = train_encoding("\n\n".join(documents[: len(documents) // 4]), args.merges)
    (base / "tokenizer" / "tokenizer.pkl").write_bytes(pickle.dumps(encoding))
    kinds = (("multiple_choice", 0, 25.0), ("multiple_choice", 2, 25.0), ("schema", 1, 50.0),
             ("language_modeling", 0, 0.0))
    write_bundle(base / "eval_bundle", [
        {"label": f"{kind}_{shots}shot", "type": kind, "shots": shots, "baseline": baseline,
         "examples": make_examples(kind, 40, seed)} for seed, (kind, shots, baseline) in enumerate(kinds)])
    print(f"{base}: {len(documents) - held_out} train and {held_out} val documents, a tokenizer of "
          f"{encoding.n_vocab} ids, {len(kinds)} CORE tasks")


if __name__ == "__main__":
    main()
