"""The lesson-reproduction scripts in experiments/, run with tiny settings."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"experiments_{name}", EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _written(tmp_path: Path, stem: str) -> dict:
    assert (tmp_path / f"{stem}.png").stat().st_size > 0
    return json.loads((tmp_path / f"{stem}.json").read_text())


def test_depth_widget(tmp_path):
    results = _load("depth_widget").main(tmp_path, max_depth=32)
    assert _written(tmp_path, "depth_widget")["max_depth"] == 32
    cases = results["cases"]
    for c in (0.9, 1.1):
        neither, norm = cases[f"c={c}/neither"], cases[f"c={c}/layernorm"]
        residual, both = cases[f"c={c}/residual"], cases[f"c={c}/both"]
        # Neither: the forward pass drifts geometrically (vanishes for c < 1, explodes for c > 1).
        drift = neither["activation_rms"][-1] / results["input_rms"]
        assert (drift < 0.2) if c < 1 else (drift > 10)
        # Residual carries the gradient: at L = 32 the plain stack's is orders of magnitude smaller.
        assert neither["grad_layer0"][-1] < 1e-3 * residual["grad_layer0"][-1]
        # LayerNorm keeps the activation magnitude bounded at every layer.
        assert 0.3 < min(norm["activation_rms"]) and max(norm["activation_rms"]) < 3
        # Both: no explosion, and the gradient at layer 0 stays O(1) or more at every depth.
        assert max(both["activation_rms"]) < 1e3 and min(both["grad_layer0"]) > 0.1
        assert all(np.isfinite(v) for case in (neither, norm, residual, both) for v in case["grad_layer0"])
    # The vanishing side of "neither": the gradient reaching layer 0 collapses towards 0.
    assert cases["c=0.9/neither"]["grad_layer0"][-1] < 0.1 * cases["c=0.9/both"]["grad_layer0"][-1]
    assert cases["c=0.9/neither"]["grad_layer0"][-1] < 0.05
    split = results["params_per_block"]
    assert split["mlp_8d2"] == 2 * split["attention_4d2"] == 8 * split["d_model"] ** 2


def test_depth_widget_is_deterministic(tmp_path):
    module = _load("depth_widget")
    a = module.run_widget(max_depth=8, factors=(0.9,))
    b = module.run_widget(max_depth=8, factors=(0.9,))
    assert a == b


def test_shortcut_gradients(tmp_path):
    results = _load("shortcut_gradients").main(tmp_path, seeds=5)
    saved = _written(tmp_path, "shortcut_gradients")
    assert len(saved["per_seed"]) == 5
    assert results["summary"]["median_ratio"] > 10
    for row in results["per_seed"]:
        assert row["ratio"] == pytest.approx(row["with"] / row["without"])


def test_init_scale(tmp_path):
    results = _load("init_scale").main(tmp_path, steps=2, batch_size=2)
    saved = _written(tmp_path, "init_scale")
    ln_v = saved["ln_V"]
    assert ln_v == pytest.approx(math.log(1024))
    wide, gpt2 = results["runs"]["1.0"], results["runs"]["0.02"]
    assert wide["initial_loss"] > ln_v + 10
    assert abs(gpt2["initial_loss"] - ln_v) < 0.1
    assert len(wide["train_loss"]) == len(gpt2["train_loss"]) == 2


def test_length_sweep(tmp_path):
    module = _load("length_sweep")
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "if", "else", "for", "in", "x", "y", "print", "import"]
    corpus, prose = tmp_path / "code.txt", tmp_path / "prose.txt"
    corpus.write_text(" ".join(rng.choice(words, 6000)) + "\n")
    prose.write_text("print x if y else return self for x in y\n" * 20)  # the char tokenizer knows these
    # A wide init, so that two steps leave the attention position-dependent enough to tell RoPE's scales apart.
    tiny = ("model.vocab_size=64", "model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.init_std=0.3",
            f"data.source={corpus}", "data.tokenizer=char", "train.steps=2", "train.batch_size=2",
            "train.warmup_steps=1", "train.eval_batches=1", "train.log_every=1", "train.parallel=single")
    kwargs = dict(runs=tmp_path / "runs", train_length=16, lengths=(16, 32), eval_tokens=64, overrides=tiny,
                  progress=False)
    results = module.main(tmp_path, **kwargs)
    saved = _written(tmp_path, "length_sweep")
    assert saved["rows"] == results["rows"] and saved["code_tokens"] == 64
    keys = [(r["position"], r["length"], r["rope_scale"]) for r in results["rows"]]
    assert keys == [("sinusoidal", 16, 1.0), ("sinusoidal", 32, 1.0),
                    ("rope", 16, 1.0), ("rope", 32, 1.0), ("rope, interpolated", 32, 2.0)]
    assert all(math.isfinite(r["bits_per_byte"]) and r["corpus"] == "code" for r in results["rows"])
    assert results["rows"][4]["bits_per_byte"] != results["rows"][3]["bits_per_byte"]  # the scale is used
    trained = results["trained"]
    assert trained["sinusoidal"]["parameters"] == trained["rope"]["parameters"]  # neither learns positions
    assert trained["rope"]["config"]["model"]["context_length"] == 16
    assert "| 32 |" in (tmp_path / "length_sweep.md").read_text()
    # A rerun finds both runs finished, trains nothing, and scores the prose file as well.
    metrics = (tmp_path / "runs" / "rope" / "metrics.jsonl").read_text()
    again = module.main(tmp_path, prose=str(prose), **kwargs)
    assert (tmp_path / "runs" / "rope" / "metrics.jsonl").read_text() == metrics
    assert [r["bits_per_byte"] for r in again["rows"] if r["corpus"] == "code"] == \
        [r["bits_per_byte"] for r in results["rows"]]
    assert len([r for r in again["rows"] if r["corpus"] == "prose"]) == 5
    assert "## prose" in (tmp_path / "length_sweep.md").read_text()


def test_code_prose_corpus_holds_out_only_the_code_files_of_its_source(tmp_path):
    from jaxgpt.data import in_val_split, open_source

    module = _load("code_prose_corpus")
    code = [(f"pkg{i % 7}/mod{i}.py", f"def f{i}(x):\n    return x + {i}\n" * 40) for i in range(200)]
    prose = "".join(f"Line {i} of a long tale, told slowly.\n" for i in range(2000))
    summary = module.write_corpus(code, prose, tmp_path / "mix", code_share=0.6, val_fraction=0.1)
    documents = list(open_source(str(tmp_path / "mix"), 0.1).documents())
    val, train = [d.text for d in documents if d.val], [d.text for d in documents if not d.val]
    held_out = [text for name, text in code if in_val_split(name, 0.1)]
    assert held_out and sorted(val) == sorted(held_out)
    assert not any("tale" in text for text in val)
    train_prose = sum(len(t) for t in train if "tale" in t)
    assert train_prose == len(prose) == summary["prose_bytes"]
    train_code = sum(len(t) for t in train if "tale" not in t)
    assert train_code == summary["train_code_bytes"]
    # Code files are added until code reaches its share, so it lands within one file above it.
    assert 0.6 <= train_code / (train_code + train_prose) < 0.6 + len(code[0][1]) / (train_code + train_prose)
    assert all(len(c) < module.CHUNK_BYTES + 100 for c in module.prose_chunks(prose))
    with pytest.raises(FileExistsError, match="not empty"):
        module.write_corpus(code, prose, tmp_path / "mix")
    with pytest.raises(ValueError, match="code-share"):
        module.write_corpus(code, prose, tmp_path / "other", code_share=1.0)


def test_mup_tuned_follows_the_base_best_point_and_sets_each_cause_against_it(tmp_path):
    def record(variant, seed, loss):
        evals = [{"step": 5, "val_loss": loss + 1.0}, {"step": 10, "val_loss": loss}]
        return {"variant": variant, "seed": seed, "val_loss": loss, "evals": evals}

    records = [record("mup_w64_lr0.01_out1", 0, 3.5), record("mup_w64_lr0.01_out4", 0, 3.3),
               record("mup_w64_lr0.02_out4", 0, 3.4), record("mup_w64_lr0.01_out4_in2", 0, float("nan")),
               *(record("mup_w128_lr0.01_out4", s, 3.10 + 0.01 * s) for s in range(3)),
               *(record("mup_w256_lr0.01_out4", s, loss) for s, loss in enumerate([3.00, 3.01, 3.05])),
               record("mup_w256_lr0.01_out4_eps", 1, 2.90), record("mup_w256_lr0.01_out1", 0, 3.2),
               record("sp_w256_lr0.001", 0, 3.1), *(record("sp_w256_lr0.002", s, 3.005) for s in range(3)),
               record("sp_w256_lr0.004", 0, 3.2),
               # A cause both take (a shorter horizon): SP's with it leaves SP's grid, though it is lower.
               record("mup_w256_lr0.01_out4_steps3", 0, 2.5), record("sp_w256_lr0.002_steps3", 0, 2.4)]
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    found = _load("mup_tuned").main(["--results", str(results), "--out", str(tmp_path)])
    assert _written(tmp_path, "mup_tuned") == json.loads(json.dumps(found))
    assert found["base_width"] == 64 and found["widest"] == 256 and found["best_tag"] == "lr0.01_out4"
    assert list(found["base_tags"])[-1] == "lr0.01_out4_in2"  # a diverged point ranks last
    assert {w: v["seeds"] for w, v in found["best_tag_by_width"].items()} == {"64": 1, "128": 3, "256": 3}
    assert found["best_tag_by_width"]["256"]["mean"] == pytest.approx(3.02)
    assert found["falls_at_every_width_step"] is True
    assert found["sp_best"] == "lr0.002" and found["sp_best_bracketed"] is True
    assert list(found["sp"]) == ["lr0.001", "lr0.002", "lr0.004"]
    assert found["causes"] == {"eps": {"val_loss": 2.90, "seeds": 1, "effect_nats": pytest.approx(2.90 - 3.01)},  # seed 1's
                               "steps3": {"val_loss": 2.5, "seeds": 1, "effect_nats": pytest.approx(2.5 - 3.00),
                                          "sp_val_loss": 2.4, "gap_to_sp_nats": pytest.approx(0.1)}}
    assert found["others_at_widest"] == {"lr0.01_out1": pytest.approx(3.2)}
    assert found["gap_nats"] == pytest.approx(0.015) and found["goal_met"] is True
    assert "Goal met." in (tmp_path / "mup_tuned.md").read_text()
