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

    from jaxgpt.model.decoder import forward
    from jaxgpt.nanochat import model_config, params_from_state

    gpt = dict(sequence_len=32, vocab_size=100, n_layer=5, n_head=4, n_kv_head=2, n_embd=64, window_pattern="SSL")
    model = random_gpt(gpt, 0)
    T = gpt["sequence_len"]
    model.window_sizes = [w if w[0] == T else (args.short, 0) for w in model.window_sizes]  # its S below T
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
    print(json.dumps({"check": "two optimizer steps", **optimizer_steps(model, gpt, args.short)}))
    print(json.dumps({"check": "checkpoints through nanochat's own checkpoint_manager", **checkpoints()}))
    print(json.dumps({"check": "best-fit rows against nanochat's dataloader", **rows()}))
    print(json.dumps({"check": "CORE against nanochat's core_eval and base_eval", **core_score(args.nanochat)}))


def random_gpt(gpt: dict, seed: int):
    """nanochat's own GPT at its init, every weight then moved off it (so that the smear, the
    backout and the gates all count)."""
    import torch
    from nanochat.gpt import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(**gpt))
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "lambda" in name else 0.15))
    return model


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


def optimizer_steps(model, gpt: dict, short: int) -> dict:
    """Two steps of nanochat's MuonAdamW (`setup_optimizer`, weight decay 0.1 on the matrices)
    against two of jaxgpt's with every nanochat option (docs/nanochat.md), from the same params
    and random gradients: the largest difference over the largest update entry, and how many
    entries differ by more than 1e-5 of it (where the cautious mask meets g p = 0 within float
    rounding, either side is right). The vocabulary's padding rows, never read, are left out."""

    import jax
    import torch

    from jaxgpt.config import load_config
    from jaxgpt.nanochat import TRAIN_OVERRIDES, model_config, params_from_state, state_from_params
    from jaxgpt.nanochat.weights import without_gain_gradients
    from jaxgpt.train.optim import make_optimizer

    torch.manual_seed(1)
    before = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    grads = [{k: torch.randn_like(v) for k, v in before.items()} for _ in range(2)]
    optimizer = model.setup_optimizer(weight_decay=0.1)
    for g in grads:
        for name, p in model.named_parameters():
            p.grad = g[name].clone()
        optimizer.step()
    theirs = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    cfg = model_config(gpt, short=short)
    # setup_optimizer's peaks, a constant momentum (0.95) and decay (0.1), as the two steps have them
    train = load_config(None, ["model.tie_embeddings=false", *TRAIN_OVERRIDES, "train.lr_embed=0.2", "train.lr_head=0.004",
                               "train.weight_decay=0.1", "train.muon_momentum_schedule=constant",
                               "train.muon_decay_schedule=constant", "train.warmup_steps=0"]).train
    ours_opt = make_optimizer(train, model=cfg)
    params = params_from_state({k: v.numpy() for k, v in before.items()}, cfg)
    state = ours_opt.init(params)
    for g in grads:
        g_params = without_gain_gradients(params_from_state({k: v.numpy() for k, v in g.items()}, cfg))
        updates, state = ours_opt.update(g_params, state, params)
        params = jax.tree_util.tree_map(lambda p, u: p + u, params, updates)
    ours = state_from_params(params, cfg)
    start = {k: v.numpy() for k, v in before.items()}
    largest = max(float(np.abs(theirs[k] - start[k]).max()) for k in theirs)
    V = gpt["vocab_size"]
    crop = lambda key, x: x[:V] if "wte" in key or "lm_head" in key or "value_embeds" in key else x  # noqa: E731
    differences = {k: np.abs(crop(k, ours[k]) - crop(k, theirs[k])) for k in theirs}
    worst = {k: float(d.max()) / largest for k, d in differences.items()}
    name = max(worst, key=worst.get)
    entries = sum(int(np.sum(d > 1e-5 * largest)) for d in differences.values())
    return {"largest_update": largest, "max_diff_over_largest": worst[name], "where": name,
            "entries_past_1e-5": entries, "entries": int(sum(d.size for d in differences.values()))}


def checkpoints() -> dict:
    """nanochat's own save_checkpoint writes a GPT (its window rule: 2,048 positions would be too
    slow here, so 256, whose S window is 128 of them) and a tokenizer trained on a little text by
    a byte-pair trainer written here; `jaxgpt import-nanochat` reads them, `export-nanochat`
    writes them back, and nanochat's own load_model("base") reads the export: logits of all three
    against nanochat's, and the tokenizer's ids."""
    import pickle
    import tempfile
    import types
    from pathlib import Path

    import torch
    sys.modules.setdefault("rustbpe", types.ModuleType("rustbpe"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from nanochat.checkpoint_manager import load_model, save_checkpoint
    from nanochat_files import train_encoding

    from jaxgpt.cli.main import main as jaxgpt_main
    from jaxgpt.data.tokenizer import Tokenizer
    from jaxgpt.model.decoder import forward
    from jaxgpt.train.checkpoint import load_newest

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    encoding = train_encoding(text, 200)
    gpt = dict(sequence_len=256, vocab_size=encoding.n_vocab, n_layer=4, n_head=4, n_kv_head=2, n_embd=64,
               window_pattern="SSSL")
    model = random_gpt(gpt, 2)
    tokens = torch.tensor([encoding.encode(text[:4000])[:256]])
    with torch.no_grad():
        want = model(tokens).float().numpy()
    with tempfile.TemporaryDirectory() as tmp:
        base, again = Path(tmp) / "base", Path(tmp) / "again"
        (base / "tokenizer").mkdir(parents=True)
        (base / "tokenizer" / "tokenizer.pkl").write_bytes(pickle.dumps(encoding))
        save_checkpoint(str(base / "base_checkpoints" / "d4"), 700, model.state_dict(), None,
                        {"step": 700, "model_config": gpt})
        run = Path(tmp) / "run"
        assert jaxgpt_main(["import-nanochat", str(base / "base_checkpoints" / "d4"), "--out", str(run)]) == 0
        cfg, params, step = load_newest(run)
        ours = np.asarray(forward(params, cfg, tokens.numpy()))
        same_ids = Tokenizer.load(run / "tokenizer.json").encode(text).tolist() == encoding.encode(text)
        assert jaxgpt_main(["export-nanochat", "--run", str(run), "--out", str(again)]) == 0
        os.environ["NANOCHAT_BASE_DIR"] = str(again)
        back, tokenizer, meta = load_model("base", torch.device("cpu"), phase="eval")
        with torch.no_grad():
            round_trip = back(tokens).float().numpy()
    return {"step": step, "windows": list(cfg.block_windows()), "same_tokenizer_ids": same_ids,
            "import_max_abs_diff": float(np.abs(ours - want).max()),
            "export_max_abs_diff": float(np.abs(round_trip - want).max()), "max_abs_logit": float(np.abs(want).max()),
            "nanochat_reads_the_tokenizer": tokenizer.get_vocab_size() == encoding.n_vocab}


def rows(B: int = 8, T: int = 64, batches: int = 400) -> dict:
    """Three Parquet shards laid out as nanochat's (row groups of 256 documents; the train files
    hold multiples of 128, the val file does not) and a tokenizer.pkl: nanochat's own BOS best-fit dataloader against jaxgpt's
    data.align = "bestfit" over the same folder, row for row, train (past the end of an epoch) and
    val."""
    import random
    import tempfile
    import types
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq
    sys.modules.setdefault("rustbpe", types.ModuleType("rustbpe"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import nanochat.dataset
    from nanochat.dataloader import tokenizing_distributed_data_loader_bos_bestfit
    from nanochat_files import train_encoding

    from jaxgpt.config import load_config
    from jaxgpt.data.batches import train_batch, val_batch
    from jaxgpt.data.from_config import prepare_data

    rng = random.Random(3)
    words = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8").split()
    docs = [" ".join(rng.choice(words) for _ in range(1 + int(rng.paretovariate(1.2) * 3))) for _ in range(2600)]
    encoding = train_encoding(" ".join(docs[:300]), 100)
    bos = encoding.encode_single_token("<|bos|>")

    class Encoder:  # nanochat's tokenizer interface, as its loader calls it
        def get_bos_token_id(self):
            return bos

        def encode(self, texts, prepend, num_threads):
            return [[prepend] + ids for ids in encoding.encode_ordinary_batch(texts)]

    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / "base_data"
        shards.mkdir()
        for i, part in enumerate((docs[:1024], docs[1024:1920], docs[1920:])):
            pq.write_table(pa.table({"text": part}), shards / f"shard_{i:05d}.parquet", row_group_size=256)
        (Path(tmp) / "tokenizer.pkl").write_bytes(__import__("pickle").dumps(encoding))
        nanochat.dataset.DATA_DIR = str(shards)
        cfg = load_config(None, [f"data.source={shards}", f"data.tokenizer={Path(tmp) / 'tokenizer.pkl'}",
                                 "data.align=bestfit", f"model.vocab_size={encoding.n_vocab}",
                                 f"model.context_length={T}", f"train.batch_size={B}"])
        data = prepare_data(cfg, cache_dir=Path(tmp) / "cache", progress=False)
        result = {}
        for split, ours in (("train", train_batch), ("val", val_batch)):
            loader = tokenizing_distributed_data_loader_bos_bestfit(Encoder(), B, T, split, device="cpu")
            same = 0
            for index in range(batches):
                inputs, targets = next(loader)
                want = np.concatenate([inputs.numpy(), targets.numpy()[:, -1:]], axis=1)
                if not np.array_equal(ours(cfg, data, index, 0, whole=True), want):
                    break
                same += 1
            result[f"{split}_batches_equal"] = f"{same} of {batches}"
        result["train_tokens_read"] = batches * B * (T + 1)
        result["train_split_tokens"] = len(data.tokens.train)
    return result


def core_score(source: str, T: int = 32) -> dict:
    """A bundle written in nanochat's layout (the tests' five tasks: the three types, 0 to 2
    shots, prompts past the context) scored by nanochat's own evaluate_example and its base_eval
    evaluate_core on a random GPT saved by its save_checkpoint and read by its load_model (given
    max_seq_len = T, so that it crops as jaxgpt does), against `jaxgpt eval --core` on the
    import: each example's decision, each task's accuracy and CORE."""
    import contextlib
    import importlib.util
    import io
    import pickle
    import random
    import tempfile
    import types
    from pathlib import Path

    import torch
    sys.modules.setdefault("rustbpe", types.ModuleType("rustbpe"))
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests"))
    from core_reference import WORDS, make_examples, write_bundle
    from nanochat.checkpoint_manager import load_model, save_checkpoint
    from nanochat.core_eval import evaluate_example
    from nanochat_files import train_encoding

    from jaxgpt.cli.main import main as jaxgpt_main
    from jaxgpt.data.tokenizer import Tokenizer
    from jaxgpt.evaluation import core
    from jaxgpt.evaluation.scoring import score_pairs
    from jaxgpt.train.checkpoint import load_newest

    encoding = train_encoding(" ".join(WORDS * 20) + "\nAnswer: 0123456789.,;", 100)
    gpt = dict(sequence_len=T, vocab_size=encoding.n_vocab, n_layer=4, n_head=4, n_kv_head=2, n_embd=64,
               window_pattern="SSSL")
    model = random_gpt(gpt, 5)
    tasks = [{"label": "mc_zeroshot", "type": "multiple_choice", "shots": 0, "baseline": 25.0,
              "examples": make_examples("multiple_choice", 40, 1)},
             {"label": "mc_2shot", "type": "multiple_choice", "shots": 2, "delimiter": "\nAnswer: ", "baseline": 30.0,
              "examples": make_examples("multiple_choice", 30, 2)},
             {"label": "schema_1shot", "type": "schema", "shots": 1, "baseline": 50.0,
              "examples": make_examples("schema", 40, 4)},
             {"label": "lm_zeroshot", "type": "language_modeling", "shots": 0, "baseline": 0.0,
              "examples": make_examples("language_modeling", 30, 3)},
             {"label": "lm_2shot", "type": "language_modeling", "shots": 2, "baseline": 0.0,
              "examples": make_examples("language_modeling", 30, 5)}]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        (base / "tokenizer").mkdir(parents=True)
        (base / "tokenizer" / "tokenizer.pkl").write_bytes(pickle.dumps(encoding))
        save_checkpoint(str(base / "base_checkpoints" / "d4"), 900, model.state_dict(), None,
                        {"step": 900, "model_config": gpt})
        bundle = write_bundle(base / "eval_bundle", tasks)
        os.environ["NANOCHAT_BASE_DIR"] = str(base)
        theirs, tokenizer, _ = load_model("base", torch.device("cpu"), phase="eval")
        theirs.max_seq_len = T  # core_eval crops a model that has one
        # Each example, as nanochat's scorer decides it and as jaxgpt's does.
        run = Path(tmp) / "run"
        assert jaxgpt_main(["import-nanochat", str(base / "base_checkpoints" / "d4"), "--out", str(run)]) == 0
        cfg, params, _ = load_newest(run)
        ours_tokenizer = Tokenizer.load(run / "tokenizer.json")
        differing, examples_seen, cropped = {}, 0, 0
        for task in core.load_bundle(bundle):
            data = list(task.data)
            random.Random(1337).shuffle(data)
            meta = {"task_type": task.kind, "num_fewshot": task.num_fewshot, "continuation_delimiter": task.delimiter}
            want = [evaluate_example(i, theirs, tokenizer, data, "cpu", meta) for i in range(len(data))]
            rows = core.task_examples(task, ours_tokenizer.encode_many, ours_tokenizer.bos_id, T)
            cropped += sum(len(r) == T for e in rows for r in e.rows)
            pairs = [(r[:s], r[s:]) for e in rows for r, s in zip(e.rows, e.starts)]
            answers = iter(score_pairs(params, cfg, pairs, batch_size=16, vocab_limit=ours_tokenizer.vocab_size))
            got = [core.is_correct(e, [next(answers) for _ in e.rows]) for e in rows]
            differing[task.label] = sum(a != b for a, b in zip(got, want))
            examples_seen += len(data)
        # The whole score: nanochat's base_eval against the command.
        spec = importlib.util.spec_from_file_location("nanochat_base_eval", Path(source) / "scripts" / "base_eval.py")
        with contextlib.redirect_stdout(io.StringIO()):
            base_eval = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(base_eval)
            reference = base_eval.evaluate_core(theirs, tokenizer, "cpu")
            assert jaxgpt_main(["eval", "--run", str(run), "--core", str(bundle)]) == 0
        ours = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    return {"examples": examples_seen, "rows_cut_to_the_context": cropped, "examples_decided_apart": differing,
            "nanochat_core": reference["core_metric"], "jaxgpt_core": ours["core"],
            "accuracies": {label: [reference["results"][label], ours[f"{label}/accuracy"]]
                           for label in reference["results"]}}


if __name__ == "__main__":
    main()
