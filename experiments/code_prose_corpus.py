"""A code + prose corpus folder like octlm's: the default corpus's code beside a prose file.

octlm trained its Day 2 grid on 60 % Python stdlib code and 40 % prose and scored the held-out
code. This writes such a corpus for `data.source`, so that the grid can run on it:

    .venv/bin/python experiments/code_prose_corpus.py --prose FILE [--out DIR] [--code-share 0.6]
    jaxgpt sweep experiments/octlm_day2.toml --set data.source=DIR --variants baseline,swiglu,post-norm \\
        --out runs/sweep-octlm_day2-prose

The folder holds every held-out code file of the default corpus under its own path (so
`data.source=DIR` holds out exactly the files `data.source=stdlib` does, and its val bits per byte
are on the same code, none of it prose), training code files (in an order fixed by their paths'
hashes, spread over the whole library) until code is `--code-share` of the training bytes, and
the prose cut at line ends into files of about 16 KB under DIR/prose/, each named so that none is
held out. A window of a training batch is then prose about as often as prose's share of the
training tokens. The BPE is trained on the folder's training files, prose included, as octlm's was.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from jaxgpt.data import in_val_split, open_source, stdlib_paths, stdlib_root

CHUNK_BYTES = 16_000


def stdlib_files() -> list[tuple[str, str]]:
    """The default corpus's files as (path relative to the stdlib, text), sorted; those that are not
    UTF-8 are left out, as the default corpus leaves them out."""
    root, files = stdlib_root(), []
    for path in stdlib_paths():
        try:
            files.append((path.relative_to(root).as_posix(), path.read_bytes().decode("utf-8")))
        except UnicodeDecodeError:
            continue
    return sorted(files)


def held_out_texts(source: str, val_fraction: float) -> list[str]:
    return [doc.text for doc in open_source(source, val_fraction).documents() if doc.val]


def prose_chunks(text: str, size: int = CHUNK_BYTES) -> list[str]:
    """The text cut at line ends into pieces of about `size` bytes (a longer line is one piece)."""
    chunks, current, length = [], [], 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        length += len(line.encode("utf-8"))
        if length >= size:
            chunks.append("".join(current))
            current, length = [], 0
    if current:
        chunks.append("".join(current))
    return chunks


def _spread(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8")).hexdigest()


def write_corpus(code: list[tuple[str, str]], prose: str, out: str | Path, *, code_share: float = 0.6,
                 val_fraction: float = 0.1) -> dict[str, float | int]:
    """Write the folder (which must not exist yet or be empty); return what went into it."""
    if not 0.0 < code_share < 1.0:
        raise ValueError(f"--code-share {code_share!r} must be in (0, 1)")
    if not prose.strip():
        raise ValueError("the prose text is empty")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty: choose a new folder (its files would join the corpus)")
    if any(name.split("/")[0] == "prose" for name, _ in code):
        raise ValueError("a code file's path starts with prose/, where the prose goes")
    held_out, trainable = [], []
    for name, text in code:
        if text:
            (held_out if in_val_split(name, val_fraction) else trainable).append((name, text))
    if not held_out:
        raise ValueError(f"none of the {len(code)} code files is held out at val_fraction {val_fraction}")
    prose_bytes = len(prose.encode("utf-8"))
    wanted = prose_bytes * code_share / (1.0 - code_share)
    train_code, code_bytes = [], 0
    for name, text in sorted(trainable, key=lambda c: _spread(c[0])):
        if code_bytes >= wanted:
            break
        train_code.append((name, text))
        code_bytes += len(text.encode("utf-8"))
    files = held_out + train_code
    number = 0
    for chunk in prose_chunks(prose):
        while in_val_split(f"prose/{number:05d}.txt", val_fraction):
            number += 1
        files.append((f"prose/{number:05d}.txt", chunk))
        number += 1
    for name, text in files:
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return {"held_out_code_files": len(held_out),
            "held_out_code_bytes": sum(len(t.encode("utf-8")) for _, t in held_out),
            "train_code_files": len(train_code), "train_code_bytes": code_bytes,
            "prose_files": len(files) - len(held_out) - len(train_code), "prose_bytes": prose_bytes,
            "code_share": round(code_bytes / (code_bytes + prose_bytes), 4)}


def main(argv: list[str] | None = None) -> dict[str, float | int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prose", required=True, help="a UTF-8 text file")
    parser.add_argument("--out", default="runs/code_prose_corpus", help="a new folder (default: %(default)s)")
    parser.add_argument("--code-share", type=float, default=0.6, help="code's share of the training bytes")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="as data.val_fraction (default 0.1)")
    args = parser.parse_args(argv)
    code = stdlib_files()
    summary = write_corpus(code, Path(args.prose).read_text(encoding="utf-8"), args.out,
                           code_share=args.code_share, val_fraction=args.val_fraction)
    held_out = held_out_texts(args.out, args.val_fraction)
    stdlib_val = held_out_texts("stdlib", args.val_fraction)
    if sorted(held_out) != sorted(stdlib_val):
        raise AssertionError(f"{args.out}'s held-out files are not the default corpus's")
    print(json.dumps(summary))
    print(f"data.source={args.out}: training {summary['code_share']:.0%} code by bytes; held out: the default "
          f"corpus's {summary['held_out_code_files']} code files, no prose")
    return summary


if __name__ == "__main__":
    main()
