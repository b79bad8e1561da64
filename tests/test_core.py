"""CORE (`jaxgpt eval --core`): on an imported nanochat model and a bundle written here in
nanochat's layout, each task type's accuracy equals a PyTorch rebuild of nanochat's scorer, example
by example; the rows split over eight devices score as on one; a bad bundle is one line."""

import json
import random

import jax
import numpy as np
import pytest
import torch
import yaml
from core_reference import make_examples, reference_core, render, write_bundle
from nanochat_files import train_encoding, write_checkpoint, write_tokenizer
from speedrun_references import NanochatGPT
from test_speedrun_parity import randomised

from jaxgpt.cli.main import main
from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.errors import UserError
from jaxgpt.evaluation import core
from jaxgpt.evaluation.scoring import score_pairs
from jaxgpt.runs.metrics import read_metrics
from jaxgpt.train.checkpoint import load_newest
from jaxgpt.train.imported import import_nanochat_run

T, LAYERS, HEADS, KV, C = 32, 3, 4, 2, 32


def _greedy_continuation(model, encoding, bos, item):
    """The text of the token greedy decoding gives after the example's trimmed context."""
    ids = torch.tensor([[bos, *encoding.encode_ordinary(item["context"].strip())]])
    with torch.no_grad():
        return encoding.decode([int(model(ids)[0, -1].argmax())])


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A random nanochat GPT imported as a run, and a bundle of five tasks covering the three types
    (0 to 2 shots, two delimiters, prompts past the context); the 0-shot language_modeling task's
    every other continuation is the token the model decodes greedily, so its accuracy is neither 0 nor 1."""
    from core_reference import WORDS

    base = tmp_path_factory.mktemp("core")
    encoding = train_encoding(" ".join(WORDS * 20) + " First Citizen: speak, speak.\n", 120)
    write_tokenizer(base / "tokenizer", encoding)
    gpt = {"sequence_len": T, "vocab_size": encoding.n_vocab, "n_layer": LAYERS, "n_head": HEADS, "n_kv_head": KV,
           "n_embd": C, "window_pattern": "SL"}
    model = randomised(NanochatGPT(gpt["vocab_size"], T, LAYERS, HEADS, KV, C, "SL"), 0).eval()
    write_checkpoint(base / "base_checkpoints" / "d3", 300, model.state_dict(), gpt)
    run = base / "run"
    import_nanochat_run(base / "base_checkpoints" / "d3", run)
    bos = encoding.encode_single_token("<|bos|>")
    lm0 = make_examples("language_modeling", 12, 3)
    for item in lm0[::2]:
        item["continuation"] = _greedy_continuation(model, encoding, bos, item)
    tasks = [
        {"label": "mc_zeroshot", "type": "multiple_choice", "shots": 0, "examples": make_examples("multiple_choice", 14, 1),
         "baseline": 25.0},
        {"label": "mc_2shot", "type": "multiple_choice", "shots": 2, "delimiter": "\nAnswer: ",
         "examples": make_examples("multiple_choice", 10, 2), "baseline": 30.0},
        {"label": "schema_1shot", "type": "schema", "shots": 1, "examples": make_examples("schema", 12, 4),
         "baseline": 50.0},
        {"label": "lm_zeroshot", "type": "language_modeling", "shots": 0, "delimiter": "", "examples": lm0,
         "baseline": 0.0},
        {"label": "lm_2shot", "type": "language_modeling", "shots": 2, "examples": make_examples("language_modeling", 8, 5),
         "baseline": 0.0},
    ]
    bundle = write_bundle(base / "eval_bundle", tasks)
    return run, bundle, model, encoding


def _cli_core(run, bundle, capsys, *extra):
    assert main(["eval", "--run", str(run), "--core", str(bundle), *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _outcomes(run, bundle, max_per_task=0):
    """Per task, each example's (correct, mean continuation loss of each row) as jaxgpt scores it,
    and how many of its rows were cut to the context."""
    cfg, params, _ = load_newest(run)
    tokenizer = Tokenizer.load(run / "tokenizer.json")
    outcomes, cut = {}, 0
    for task in core.load_bundle(bundle):
        examples = core.task_examples(task, tokenizer.encode_many, tokenizer.bos_id, T, max_per_task)
        whole = core.task_examples(task, tokenizer.encode_many, tokenizer.bos_id, 10 * T, max_per_task)
        cut += sum(len(a.rows[0]) < len(b.rows[0]) for a, b in zip(examples, whole))
        pairs = [(row[:start], row[start:]) for e in examples for row, start in zip(e.rows, e.starts)]
        answers = iter(score_pairs(params, cfg, pairs, batch_size=8, vocab_limit=tokenizer.vocab_size))
        outcomes[task.label] = []
        for e in examples:
            scored = [next(answers) for _ in e.rows]
            means = [] if e.gold is None else [-logp / (len(r) - s) for (logp, _), r, s in zip(scored, e.rows, e.starts)]
            outcomes[task.label].append((core.is_correct(e, scored), means))
    return outcomes, cut


def test_each_task_type_scores_as_nanochats_scorer_rebuilt(imported, capsys):
    run, bundle, model, encoding = imported
    got = _cli_core(run, bundle, capsys)
    want = reference_core(model, encoding, bundle, T)
    outcomes, cut = _outcomes(run, bundle)
    assert cut >= 5  # rows past the context, kept to their last tokens
    for label, examples in want["outcomes"].items():  # example by example: the decision and each row's mean loss
        assert [c for c, _ in outcomes[label]] == [c for c, _ in examples], label
        for (_, means), (_, want_means) in zip(outcomes[label], examples):
            np.testing.assert_allclose(means, want_means, rtol=0, atol=1e-4)
    assert set(got) == {"core", "tasks"} and list(got["tasks"]) == list(want["tasks"])
    for label, values in want["tasks"].items():
        assert got["tasks"][label] == pytest.approx(values, abs=1e-12), label
    assert got["core"] == pytest.approx(want["core"], abs=1e-12)
    # The rebuild's decisions are clear of float rounding, and the tasks are not decided by chance alone.
    for outcomes in want["outcomes"].values():
        assert all(not means or sorted(means)[1] - min(means) > 1e-3 for _, means in outcomes)
    accuracies = [v["accuracy"] for v in want["tasks"].values()]
    assert want["tasks"]["lm_zeroshot"]["accuracy"] >= 0.25 and 0 < np.mean(accuracies) < 1
    # The record goes to the run's metrics at the checkpoint's step.
    [record] = [r for r in read_metrics(run / "metrics.jsonl") if r["type"] == "core"]
    assert record["step"] == 300 and record["core"] == got["core"]
    assert record["mc_2shot/accuracy"] == got["tasks"]["mc_2shot"]["accuracy"]


def test_max_per_task_keeps_the_first_examples_after_nanochats_shuffle(imported, capsys):
    run, bundle, model, encoding = imported
    got = _cli_core(run, bundle, capsys, "--max-per-task", "5")
    want = reference_core(model, encoding, bundle, T, max_per_task=5)
    for label, values in want["tasks"].items():
        assert got["tasks"][label] == pytest.approx(values, abs=1e-12), label
    full = reference_core(model, encoding, bundle, T)
    assert want["outcomes"]["mc_2shot"] != full["outcomes"]["mc_2shot"][:5]  # the few-shot draws see 5


def test_prompts_render_as_nanochats_templates(imported):
    _, bundle, _, _ = imported
    for task in core.load_bundle(bundle):
        data = list(task.data)
        for index, item in enumerate(data):
            shots = random.Random(index).sample(data[:index] + data[index + 1:], min(2, len(data) - 1))
            for delimiter in (" ", "\nAnswer: ", ""):
                assert core.render(task.kind, item, delimiter, shots) == render(task.kind, item, delimiter, shots)


def test_rows_split_over_eight_devices_score_as_on_one(imported):
    run, bundle, _, _ = imported
    cfg, params, _ = load_newest(run)
    tokenizer = Tokenizer.load(run / "tokenizer.json")
    pairs = []
    for task in core.load_bundle(bundle):
        for e in core.task_examples(task, tokenizer.encode_many, tokenizer.bos_id, cfg.context_length):
            pairs += [(row[:start], row[start:]) for row, start in zip(e.rows, e.starts)]
    mesh = jax.sharding.Mesh(jax.devices()[:8], ("rows",))
    one = score_pairs(params, cfg, pairs, batch_size=6, vocab_limit=tokenizer.vocab_size)
    split = score_pairs(params, cfg, pairs, batch_size=6, vocab_limit=tokenizer.vocab_size, mesh=mesh)
    np.testing.assert_allclose([s for s, _ in split], [s for s, _ in one], rtol=1e-5, atol=1e-5)
    assert [g for _, g in split] == [g for _, g in one]


@pytest.mark.parametrize("harm, message", [
    ("no csv", "no eval_meta_data.csv"),
    ("no baseline", "task schema_1shot has no Random baseline in eval_meta_data.csv"),
    ("unknown type", "task mc_2shot has icl_task_type 'generation'; CORE scores multiple_choice, schema, "
                     "language_modeling"),
    ("dataset missing", "task lm_2shot: its dataset eval_data/lm_2shot.jsonl is missing"),
    ("no yaml", "no core.yaml"),
])
def test_a_bad_bundle_is_one_line(imported, tmp_path, capsys, harm, message):
    import shutil

    run, bundle, _, _ = imported
    bad = shutil.copytree(bundle, tmp_path / "bundle")
    if harm == "no csv":
        (bad / "eval_meta_data.csv").unlink()
    elif harm == "no baseline":
        lines = (bad / "eval_meta_data.csv").read_text().splitlines()
        (bad / "eval_meta_data.csv").write_text("\n".join(x for x in lines if "schema_1shot" not in x) + "\n")
    elif harm == "unknown type":
        config = yaml.safe_load((bad / "core.yaml").read_text())
        next(t for t in config["icl_tasks"] if t["label"] == "mc_2shot")["icl_task_type"] = "generation"
        (bad / "core.yaml").write_text(yaml.safe_dump(config))
    elif harm == "dataset missing":
        (bad / "eval_data" / "lm_2shot.jsonl").unlink()
    else:
        (bad / "core.yaml").unlink()
    before = (run / "metrics.jsonl").read_bytes() if (run / "metrics.jsonl").exists() else b""
    assert main(["eval", "--run", str(run), "--core", str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    [line] = captured.err.strip().splitlines()
    assert line.startswith(f"jaxgpt eval: error: CORE bundle {bad}: {message}")
    assert ((run / "metrics.jsonl").read_bytes() if (run / "metrics.jsonl").exists() else b"") == before


def test_the_rows_keep_the_context_s_last_tokens():
    """A row past the context keeps its last tokens, its continuation's start moved with the cut;
    a continuation that leaves no context is refused, as are rows that do not differ."""
    example = core.example_rows("multiple_choice", [[9, 1, 2, 3, 4, 5], [9, 1, 2, 3, 7]], 0, 4)
    assert example.rows == ((2, 3, 4, 5), (1, 2, 3, 7)) and example.starts == (2, 3)
    schema = core.example_rows("schema", [[9, 1, 5, 6], [9, 2, 2, 5, 6]], 1, 8)
    assert schema.starts == (2, 3)
    with pytest.raises(UserError, match="leaves no context"):
        core.example_rows("language_modeling", [[9, 1], [9, 1, 2, 3, 4]], None, 3)
    with pytest.raises(UserError, match="encode alike"):
        core.example_rows("multiple_choice", [[9, 1, 2], [9, 1, 2]], 0, 8)


def test_the_d24_config_is_nanochats_speedrun_model_and_schedule():
    """experiments/nanochat_d24.toml: nanochat's d24 (its GPTConfig through the import's own
    mapping), its optimizer preset, 2^19 tokens a step for 8 tokens per scaling parameter (the
    blocks' matrices and the head, counted on the rebuild) and base_train.py's decay for them;
    experiments/nanochat_cpu.toml: its depth-4 model and the same preset."""
    from pathlib import Path

    from jaxgpt.config import load_config
    from jaxgpt.nanochat import TRAIN_OVERRIDES, model_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "experiments" / "nanochat_d24.toml")
    gpt = {"sequence_len": 2048, "vocab_size": 32768, "n_layer": 24, "n_head": 12, "n_kv_head": 12, "n_embd": 1536,
           "window_pattern": "SSSL"}
    assert cfg.model == model_config(gpt, dtype="bfloat16", remat="full")
    cpu = load_config(Path(__file__).resolve().parents[1] / "experiments" / "nanochat_cpu.toml")  # runcpu.sh's kind
    assert cpu.model == model_config({**gpt, "sequence_len": 256, "n_layer": 4, "n_head": 4, "n_kv_head": 4, "n_embd": 256,
                                      "window_pattern": "L"})
    preset = load_config(None, [*TRAIN_OVERRIDES, "model.tie_embeddings=false"]).train
    for run in (cfg, cpu):
        assert all(getattr(run.train, key.split("=")[0][6:]) == getattr(preset, key.split("=")[0][6:])
                   for key in TRAIN_OVERRIDES if "weight_decay" not in key)
    with torch.device("meta"):
        d24, d12 = (NanochatGPT(32768, 2048, n, c // 128, c // 128, c) for n, c in ((24, 1536), (12, 768)))
    scaling = [sum(p.numel() for p in m.transformer.h.parameters()) + m.lm_head.weight.numel() for m in (d24, d12)]
    assert cfg.train.batch_size * cfg.model.context_length == 2**19
    assert cfg.train.steps == 8 * scaling[0] // 2**19
    assert cfg.train.weight_decay == pytest.approx(0.28 * scaling[1] / scaling[0], rel=1e-12)
