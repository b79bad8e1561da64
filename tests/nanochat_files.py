"""nanochat's files, made here for the tests (no hub): a tokenizer.pkl trained as nanochat trains
one (byte-pair merges over its split pattern, its special tokens after them, a pickled tiktoken
Encoding), and a checkpoint folder laid out as its checkpoint_manager saves one."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path

import regex
import tiktoken

SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
SPECIAL_TOKENS = ["<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
                  "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]


def train_encoding(text: str, merges: int) -> tiktoken.Encoding:
    """Byte-level BPE: the most frequent adjacent pair within the split's pieces merged, `merges`
    times (ties to the pair first met), then the special tokens."""
    pieces = Counter(tuple(bytes([b]) for b in piece.encode()) for piece in regex.findall(SPLIT_PATTERN, text))
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(merges):
        pairs = Counter()
        for piece, count in pieces.items():
            for pair in zip(piece, piece[1:]):
                pairs[pair] += count
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        ranks[a + b] = len(ranks)
        joined = Counter()
        for piece, count in pieces.items():
            out, i = [], 0
            while i < len(piece):
                if i + 1 < len(piece) and (piece[i], piece[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(piece[i])
                    i += 1
            joined[tuple(out)] += count
        pieces = joined
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    return tiktoken.Encoding(name="rustbpe", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def write_tokenizer(folder: Path, encoding: tiktoken.Encoding) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.pkl").write_bytes(pickle.dumps(encoding))
    return folder / "tokenizer.pkl"


def write_checkpoint(folder: Path, step: int, state: dict, gpt_config: dict) -> Path:
    """model_NNNNNN.pt (the state dict, torch tensors) and meta_NNNNNN.json (model_config and
    the step), as nanochat's save_checkpoint writes them."""
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    torch.save({k: torch.as_tensor(v) for k, v in state.items()}, folder / f"model_{step:06d}.pt")
    meta = {"step": step, "model_config": gpt_config, "val_bpb": 1.5}
    (folder / f"meta_{step:06d}.json").write_text(json.dumps(meta, indent=2))
    return folder
