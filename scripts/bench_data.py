"""Data preparation at scale: `jaxgpt prepare` on a synthetic web-dump-like corpus, beside its floors.

    .venv/bin/python scripts/bench_data.py --size-mb 512 [--workers 1,2] [--out runs/bench_data]

Writes a corpus of `--size-mb` of JSONL files (16 MB each, documents of 5 to 80 lines drawn from
the running Python's standard library, so that the text is as varied as real code), trains a
byte-level BPE tokenizer.json of GPT-2's size on a sample of it, then measures, each in a process
of its own:

- `jaxgpt prepare` with each worker count: MB/s and tokens/s of text, and the peak RSS of the whole
  process tree (the workers included), polled every 20 ms;
- a restart: a new process that finds the complete store and reads its first batch (seconds from
  its start, imports included; JAX is not among them), and the time to read one batch of 32 x 1,024
  (its median over 200);
- the floors, on the same files: the tokenizer's own batch encoder (Hugging Face tokenizers, every
  core) writing uint16 ids straight to one file document by document, and tiktoken on the same
  vocabulary (every core) doing the same;
- with `--hf`, the path where HF tokenizers must encode (the same tokenizer with an NFC
  normalizer, which tiktoken has no form of) beside that tokenizer's own HF floor; "x HF floor"
  compares each row with the floor of its tokenizer.

One JSON record per measurement on stdout, a table on stderr. torch-free.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILE_BYTES = 16 << 20
VOCAB = 50257  # GPT-2's
SAMPLE_BYTES = 32_000_000


def write_corpus(folder: Path, size: int, seed: int = 0) -> int:
    """JSONL files of documents made of random runs of standard-library lines; the text bytes."""
    from jaxgpt.data.sources import stdlib_paths

    lines = []
    for path in stdlib_paths():
        try:
            lines.extend(path.read_text(encoding="utf-8").splitlines(keepends=True))
        except UnicodeDecodeError:
            continue
    rng, written, number = random.Random(seed), 0, 0
    folder.mkdir(parents=True, exist_ok=True)
    while written < size:
        rows, file_bytes = [], 0
        while file_bytes < FILE_BYTES and written < size:
            start = rng.randrange(len(lines))
            text = "".join(lines[start:start + rng.randint(5, 80)])
            row = json.dumps({"text": text, "id": f"doc-{number}-{len(rows)}"}) + "\n"
            rows.append(row)
            file_bytes += len(row)
            written += len(text.encode("utf-8"))
        (folder / f"shard_{number:05d}.jsonl").write_text("".join(rows), encoding="utf-8")
        number += 1
    return written


def train_tokenizer(corpus: Path, out: Path) -> Path:
    from jaxgpt.data.sources import open_source
    from jaxgpt.data.tokenizer import train_bpe
    from jaxgpt.data.tokenizer_cache import sample_texts

    tokenizer = train_bpe(sample_texts(open_source(str(corpus), 0.1), SAMPLE_BYTES), VOCAB)
    return tokenizer.save(out)


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every process below it."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            total += next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
            for task in Path(f"/proc/{current}/task").iterdir():
                stack.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, StopIteration):
            continue
    return total


def timed(command: list[str], env: dict) -> tuple[float, int, str]:
    """(seconds, peak RSS of the process tree, stdout) of a command run to its end."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while process.poll() is None:
        peak = max(peak, tree_rss(process.pid))
        time.sleep(0.02)
    seconds = time.perf_counter() - started
    out, err = process.communicate()
    if process.returncode:
        raise RuntimeError(f"{' '.join(command[:4])}... failed ({process.returncode}): {err[-2000:]}")
    return seconds, peak, out


FLOOR = r"""
import json, sys, os
from pathlib import Path
import numpy as np
kind, corpus, tokenizer_path, out = sys.argv[1:5]
config = Path(tokenizer_path).read_text()
if kind == "hf":
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_str(config)
    encode = lambda texts: [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    eot = tokenizer.token_to_id("<|endoftext|>")
else:
    from jaxgpt.data.encoding import tiktoken_encoding
    encoding = tiktoken_encoding(config)
    threads = os.cpu_count()
    encode = lambda texts: encoding.encode_batch(texts, num_threads=threads, allowed_special="all")
    eot = encoding.eot_token if encoding.eot_token is not None else encoding.encode("<|endoftext|>", allowed_special="all")[0]
tokens = 0
with open(out, "wb") as sink:
    for path in sorted(Path(corpus).glob("*.jsonl")):
        with open(path, "rb") as f:
            batch, size = [], 0
            for line in f:
                text = json.loads(line)["text"]
                batch.append(text)
                size += len(text)
                if size >= 1 << 20:
                    for ids in encode(batch):
                        sink.write(np.asarray(ids + [eot], np.uint16).tobytes())
                        tokens += len(ids) + 1
                    batch, size = [], 0
            for ids in encode(batch):
                sink.write(np.asarray(ids + [eot], np.uint16).tobytes())
                tokens += len(ids) + 1
print(json.dumps({"tokens": tokens}))
"""

RESTART = r"""
import json, sys, time
started = float(sys.argv[1])
from jaxgpt.config import load_config
from jaxgpt.data import get_batch, prepare_data, window_length
cfg = load_config(None, sys.argv[2:])
found = time.time()
data = prepare_data(cfg, progress=False)
find_s = time.time() - found
read = lambda step: get_batch(data.tokens.train, seed=0, step=step, batch_size=cfg.train.batch_size,
                              window=window_length(cfg.model))
batch = read(0)
first_batch_s = time.time() - started
times = []
for step in range(1, 201):
    t = time.perf_counter()
    read(step)
    times.append(time.perf_counter() - t)
times.sort()
print(json.dumps({"restart_s": round(first_batch_s, 3), "find_store_s": round(find_s, 4),
                  "batch_ms": round(times[len(times) // 2] * 1e3, 3), "batch_shape": list(batch.shape)}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, required=True, help="text to write, in MB (1e6 bytes)")
    parser.add_argument("--workers", default="1,2", help="worker counts to time (default: 1,2)")
    parser.add_argument("--out", default="runs/bench_data", help="scratch folder (default: %(default)s)")
    parser.add_argument("--keep", action="store_true", help="keep the corpus and stores afterwards")
    parser.add_argument("--hf", action="store_true",
                        help="also time the path where HF tokenizers must encode: the same tokenizer with an NFC "
                             "normalizer (which tiktoken has no form of), beside its own HF floor")
    args = parser.parse_args()
    out = Path(args.out)
    corpus, tokenizer = out / f"corpus-{args.size_mb:g}MB", out / "tokenizer.json"
    written = corpus.with_name(corpus.name + ".bytes")  # beside the corpus: inside, it would be a document
    if not written.is_file():
        shutil.rmtree(corpus, ignore_errors=True)
        written.write_text(str(write_corpus(corpus, int(args.size_mb * 1e6))))
    text_bytes = int(written.read_text())
    if not tokenizer.is_file():
        train_tokenizer(corpus, tokenizer)
    python, env = sys.executable, {**os.environ, "PYTHONPATH": str(ROOT)}
    sets = [f"data.source={json.dumps(str(corpus.absolute()))}", "model.vocab_size=50304",
            "model.context_length=1024", "train.batch_size=32"]
    records = []

    def emit(record: dict) -> None:
        record = {"size_mb": args.size_mb, "text_mb": round(text_bytes / 1e6, 1), **record}
        print(json.dumps(record), flush=True)
        records.append(record)

    def prepare(workers: int, tokenizer_path: Path, label: str, restart: bool) -> None:
        cache = out / f"cache-{args.size_mb:g}MB-{workers}"
        shutil.rmtree(cache, ignore_errors=True)
        own = [*sets, f"data.tokenizer={json.dumps(str(tokenizer_path.absolute()))}"]
        command = [python, "-m", "jaxgpt", "prepare", "--no-progress", "--workers", str(workers),
                   *[a for s in own for a in ("--set", s)]]
        seconds, peak, stdout = timed(command, {**env, "JAXGPT_CACHE": str(cache)})
        summary = json.loads(stdout)
        tokens = summary["train_tokens"] + summary["val_tokens"]
        emit({"what": f"jaxgpt prepare, {workers} worker(s){label}", "seconds": round(seconds, 1),
              "mb_per_s": round(text_bytes / 1e6 / seconds, 2), "tokens_per_s": round(tokens / seconds),
              "peak_rss_mb": round(peak / 1e6), "tokens": tokens, "shards": summary["shards"]})
        if restart:
            found = subprocess.run([python, "-c", RESTART, str(time.time()), *own], cwd=ROOT, capture_output=True,
                                   text=True, env={**env, "JAXGPT_CACHE": str(cache)})
            if found.returncode:
                raise RuntimeError(found.stderr[-2000:])
            emit({"what": f"restart with the store present ({workers} worker(s) wrote it)", **json.loads(found.stdout)})
        if not args.keep:
            shutil.rmtree(cache, ignore_errors=True)

    def floor(kind: str, tokenizer_path: Path, label: str) -> None:
        sink = out / f"floor-{kind}.bin"
        seconds, peak, stdout = timed([python, "-c", FLOOR, kind, str(corpus), str(tokenizer_path), str(sink)], env)
        tokens = json.loads(stdout)["tokens"]
        emit({"what": label, "seconds": round(seconds, 1), "mb_per_s": round(text_bytes / 1e6 / seconds, 2),
              "tokens_per_s": round(tokens / seconds), "peak_rss_mb": round(peak / 1e6), "tokens": tokens})
        sink.unlink()

    worker_counts = [int(w) for w in args.workers.split(",")]
    for workers in worker_counts:
        prepare(workers, tokenizer, "", restart=True)
    floor("hf", tokenizer, "floor: HF tokenizers' batch encoder to one file")
    floor("tiktoken", tokenizer, "floor: tiktoken, same vocabulary, to one file")
    if args.hf:
        normalized = out / "tokenizer-nfc.json"
        config = json.loads(tokenizer.read_text())
        config["normalizer"] = {"type": "NFC"}
        normalized.write_text(json.dumps(config))
        for workers in worker_counts:
            prepare(workers, normalized, ", HF tokenizers (NFC tokenizer)", restart=False)
        floor("hf", normalized, "floor: HF tokenizers' batch encoder, NFC tokenizer")
    if not args.keep:
        shutil.rmtree(corpus, ignore_errors=True)
        written.unlink()
    floors = {nfc: next(r["mb_per_s"] for r in records if r["what"].startswith("floor: HF") and
                        ("NFC" in r["what"]) == nfc) for nfc in ({False, True} if args.hf else {False})}
    for r in records:
        if "mb_per_s" in r:
            r["vs_hf_floor"] = round(r["mb_per_s"] / floors["NFC" in r["what"]], 2)
    keys = ["what", "seconds", "mb_per_s", "vs_hf_floor", "tokens_per_s", "peak_rss_mb", "restart_s",
            "find_store_s", "batch_ms"]
    print(" | ".join(keys), file=sys.stderr)
    for r in records:
        print(" | ".join(str(r.get(k, "")) for k in keys), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
