"""jaxgpt against the real nanochat code (not a rebuild): its GPT's logits and, where it decodes
with its KV cache, its greedy tokens, from the same random weights, on this CPU in float32.

    git clone https://github.com/karpathy/nanochat /tmp/nanochat   # any copy of its source
    TORCHDYNAMO_DISABLE=1 NANOCHAT_DTYPE=float32 python scripts/check_nanochat.py /tmp/nanochat

Prints one JSON line per check: the largest logit difference (and the largest logit, so the
difference has a scale), and whether greedy decoding gave the same tokens. Needs torch (the test
extra) and nanochat's own imports (filelock).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

os.environ.setdefault("NANOCHAT_DTYPE", "float32")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("nanochat", help="a folder holding nanochat's source (its nanochat/ package)")
    parser.add_argument("--short", type=int, default=7, help="the S layers' window (FA3's left size), shorter than the input")
    args = parser.parse_args()
    sys.path.insert(0, args.nanochat)
    import torch
    from nanochat.gpt import GPT, GPTConfig

    from jaxgpt.model.decoder import forward
    from jaxgpt.nanochat import model_config, params_from_state

    gpt = dict(sequence_len=32, vocab_size=100, n_layer=5, n_head=4, n_kv_head=2, n_embd=64, window_pattern="SSL")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**gpt))
    model.init_weights()
    T = gpt["sequence_len"]
    model.window_sizes = [w if w[0] == T else (args.short, 0) for w in model.window_sizes]  # its S below T
    with torch.no_grad():  # every weight off its init, so that the smear, backout and gates all count
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "lambda" in name else 0.15))
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tokens = np.random.default_rng(1).integers(0, gpt["vocab_size"], (3, T))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).float().numpy()
    for scan in (False, True):
        cfg = model_config(gpt, short=args.short, scan_layers=scan)
        got = np.asarray(forward(params_from_state(state, cfg), cfg, tokens))
        print(json.dumps({"check": "logits", "scan_layers": scan, "windows": [w[0] for w in model.window_sizes],
                          "max_abs_diff": float(np.abs(got - want).max()), "max_abs_logit": float(np.abs(want).max())}))

    print(json.dumps({"check": "greedy decoding", **greedy(model, gpt, state, args.short)}))


def greedy(model, gpt: dict, state: dict, short: int) -> dict:
    """Greedy tokens from a 5-token prompt to the end of the context: nanochat's forward pass over
    its own KV cache (a prefill, then one token at a time; its smear reads the cache's previous
    embedding) against jaxgpt's `generate(temperature=0)`. nanochat's engine module imports its
    tokenizer's `rustbpe`, which only trains a tokenizer: an empty stand-in lets it import."""
    import types

    import torch
    sys.modules.setdefault("rustbpe", types.ModuleType("rustbpe"))
    from nanochat.engine import KVCache

    from jaxgpt.evaluation.generate import generate
    from jaxgpt.nanochat import model_config, params_from_state

    T, prompt = gpt["sequence_len"], [3, 14, 15, 92, 65]
    cache = KVCache(1, gpt["n_kv_head"], T, gpt["n_embd"] // gpt["n_head"], gpt["n_layer"], "cpu", torch.float32)
    theirs, ids = [], torch.tensor([prompt])
    with torch.no_grad():
        while len(prompt) + len(theirs) < T:
            logits = model(ids, kv_cache=cache)[:, -1]
            ids = logits.argmax(-1, keepdim=True)
            theirs.append(int(ids[0, 0]))
    cfg = model_config(gpt, short=short)
    ours = generate(params_from_state(state, cfg), cfg, [prompt], len(theirs), temperature=0.0)[0]
    return {"tokens": len(theirs), "same": ours == theirs, "first_difference": next(
        (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)}


if __name__ == "__main__":
    main()
