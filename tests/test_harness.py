"""lm-evaluation-harness tasks: jaxgpt's backend answers as the harness's own Hugging Face backend
(transformers, CPU, float32) does on the exported copy of a run trained here, request for request
and metric for metric; train.eval_tasks logs at the steps asked across a crash and a resume;
`jaxgpt eval --tasks` and its one-line errors. All offline: the tasks read the repository's files."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from conftest import xla_flags
from core_reference import make_examples, write_bundle
from test_metrics import read_scalars
from test_train import write_corpus

import jaxgpt.evaluation.harness as harness
import jaxgpt.evaluation.scoring as scoring
import jaxgpt.evaluation.tasks as tasks_module
import jaxgpt.train.loop as train_module
from jaxgpt.cli.main import main
from jaxgpt.config import load_config
from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.runs.metrics import read_metrics
from jaxgpt.train.checkpoint import load_newest

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "experiments" / "tasks"
CHOICE, ROLLING, UNTIL = "jaxgpt_tiny_choice", "jaxgpt_tiny_rolling", "jaxgpt_tiny_until"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
SETS = ["model.context_length=32", "model.d_model=32", "model.n_heads=4", "model.n_layers=1", "model.vocab_size=288",
        "train.batch_size=8", "train.warmup_steps=2", "train.lr=1e-2", "train.steps=12", "train.checkpoint_every=4",
        "train.eval_every=12", "train.eval_batches=1", "train.sample_tokens=0", "train.keep_checkpoints=5",
        f"train.eval_tasks={CHOICE}", "train.eval_tasks_every=4", f"train.eval_tasks_path={json.dumps(str(TASKS))}"]
# Each program this process obtains: JAX times a load from the suite's compilation cache as a compile.
COMPILES: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _seconds, **_: COMPILES.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)


class Killed(Exception):
    """A kill of the trainer while it runs the tasks (before that step's checkpoint)."""


@pytest.fixture(scope="module")
def offline():
    with pytest.MonkeyPatch.context() as patch:
        for name, value in OFFLINE.items():
            patch.setenv(name, value)
        yield


@pytest.fixture(scope="module")
def trained(offline, tmp_path_factory):
    """A tiny run with train.eval_tasks every 4 of 12 steps and CORE every 6, killed during the
    tasks at step 8 and resumed; then exported, and loaded by both backends."""
    from lm_eval.models.huggingface import HFLM

    folder = tmp_path_factory.mktemp("harness")
    corpus, run, hf_dir = write_corpus(folder / "corpus.txt"), folder / "run", folder / "hf"
    bundle = write_bundle(folder / "bundle", [
        {"label": "mc", "type": "multiple_choice", "shots": 1, "examples": make_examples("multiple_choice", 6, 0),
         "baseline": 25.0},
        {"label": "lm", "type": "language_modeling", "shots": 0, "examples": make_examples("language_modeling", 4, 1),
         "baseline": 0.0}])
    cfg = load_config(None, [*SETS, f"data.source={json.dumps(str(corpus))}", "train.core_every=6",
                             f"train.core_bundle={json.dumps(str(bundle))}"])
    real_run, ran = tasks_module.TrainingTasks.run, []

    def killed_at_8(self, params, model, step):
        ran.append(step)
        if step == 8 and ran.count(8) == 1:
            raise Killed
        return real_run(self, params, model, step)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tasks_module.TrainingTasks, "run", killed_at_8)
        with pytest.raises(Killed):
            train_module.train(cfg, run, progress=False)
        train_module.train(cfg, run, resume=True, progress=False)
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["export-hf", "--run", str(run), "--out", str(hf_dir)]) == 0
    records = read_metrics(run / "metrics.jsonl")
    cfg, params, step = load_newest(run)
    # The batch size training used: its compiled shapes.
    ours = harness.HarnessLM(cfg, params, Tokenizer.load(run / "tokenizer.json"), progress=False, step=step)
    theirs = HFLM(pretrained=str(hf_dir), device="cpu", dtype="float32", batch_size=harness.DEFAULT_BATCH_SIZE)
    assert ours.text_tokenizer.vocab_size == ours.cfg.vocab_size  # one softmax over the same ids in both
    return run, records, ours, theirs, ran, bundle


def requests(kind, arguments):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(arguments)]


WORDS = "the dog ran to the cat and it was red and the cat sat on a mat and the dog was red too".split()


def test_loglikelihoods_and_greedy_flags_equal_the_hf_backends(trained, monkeypatch):
    _, _, ours, theirs, _, _ = trained
    one_token = next(w for w in (" a", " the", " cat") if len(ours.tok_encode(w)) == 1)
    pairs = [(" ".join((WORDS * 2)[:k]), c) for k in range(1, 2 * len(WORDS) + 1)
             for c in (one_token, " sat on the mat")]
    pairs += [("", " the cat"), ("", "the"), ("the cat", " " + " ".join(WORDS))]  # empty context; a long continuation
    # The oracle's own greedy continuations, of one token and of several: is_greedy must hold for them.
    prompts = [(c, {"until": ["\n"], "max_gen_toks": n, "do_sample": False}) for c in ("the cat sat on", "it was")
               for n in (1, 3)]
    pairs += [(c, x) for (c, _), x in zip(prompts, theirs.generate_until(requests("generate_until", prompts))) if x]
    encoded = [ours._encode_pair(c, x) if c else ([ours.eot_token_id], ours.tok_encode(x)) for c, x in pairs]
    inputs = [len(c) + len(x) - 1 for c, x in encoded]
    assert {15, 16, 17, 24, 25} <= set(inputs) and max(inputs) > 32  # both sides of widths, and cut to the context
    assert 1 in {len(x) for _, x in encoded}
    real_shared, shared = scoring._score_shared, []  # the batches whose pairs share their context's computation
    monkeypatch.setattr(scoring, "_score_shared", lambda *a, **k: shared.append(1) or real_shared(*a, **k))
    COMPILES.clear()
    got = ours.loglikelihood(requests("loglikelihood", pairs))
    assert shared
    # A scorer per width and one per width of shared contexts, whatever the number of requests.
    assert len(COMPILES) <= len(scoring.score_widths(32)) + len(scoring.coarse_widths(32)) == 5
    want = theirs.loglikelihood(requests("loglikelihood", pairs))
    for pair, (logp, greedy), (hf_logp, hf_greedy) in zip(pairs, got, want):
        assert abs(logp - hf_logp) <= 1e-4 and greedy == hf_greedy, pair
    assert any(greedy for _, greedy in got) and not all(greedy for _, greedy in got)
    COMPILES.clear()
    assert ours.loglikelihood(requests("loglikelihood", pairs[::-1])) == got[::-1] and COMPILES == []


def test_rolling_loglikelihoods_equal_the_hf_backends(trained):
    _, _, ours, theirs, _, _ = trained
    texts = ["", "the", " ".join(WORDS), " ".join(WORDS * 4) + "."]
    assert len(ours.tok_encode(texts[-1])) > 2 * ours.max_length  # several windows
    got = ours.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in texts]))
    want = theirs.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in texts]))
    assert got[0] == want[0] == 0.0
    assert all(abs(a - b) <= 1e-4 for a, b in zip(got, want)), (got, want)


def test_generations_equal_the_hf_backends(trained):
    _, _, ours, theirs, _, _ = trained
    greedy = {"until": ["."], "max_gen_toks": 8, "do_sample": False}
    other = {"until": [" mat", "\n"], "max_gen_toks": 12}
    contexts = ["the cat sat on the", "it was", "a", " ".join(WORDS * 2)]  # the last is cut to 32 - 8 tokens
    assert len(ours.tok_encode(contexts[-1])) > 32
    arguments = [(c, options) for options in (greedy, other) for c in contexts]
    COMPILES.clear()
    got = ours.generate_until(requests("generate_until", arguments))
    assert len(COMPILES) <= 2 * 2 * 2  # per option group (2) and width (2): the prefill and the decoding loop
    assert got == theirs.generate_until(requests("generate_until", arguments))
    assert any(got) and all(" mat" not in text for text in got[4:])
    # An empty context starts at the end-of-text token, as the hf backend's does when given it.
    empty = ours.generate_until(requests("generate_until", [("", greedy)]))
    assert empty == theirs.generate_until(requests("generate_until", [("<|endoftext|>", greedy)]))


def test_task_metrics_equal_the_hf_backends(trained):
    """Multiple choice (acc, acc_norm), rolling (word and byte perplexity, bits per byte) and
    generation (exact match), through the harness's own evaluator on both backends."""
    _, _, ours, theirs, _, _ = trained
    names = [CHOICE, ROLLING, UNTIL]
    manager = tasks_module.task_manager(names, TASKS)
    got, want = (tasks_module.run_tasks(lm, names, manager=manager, bootstrap_iters=0)["results"] for lm in (ours, theirs))
    for task, metrics in ((CHOICE, ("acc", "acc_norm")), (UNTIL, ("exact_match",)),
                          (ROLLING, ("word_perplexity", "byte_perplexity", "bits_per_byte"))):
        for metric in metrics:
            exact = metric in ("acc", "acc_norm", "exact_match")
            assert got[task][f"{metric},none"] == pytest.approx(want[task][f"{metric},none"], rel=0 if exact else 1e-4)
    assert 1 < got[ROLLING]["word_perplexity,none"] < 288 ** 4


def test_train_eval_tasks_log_at_the_steps_asked_across_a_kill_and_a_resume(trained):
    run, all_records, ours, _, ran, bundle = trained
    assert ran == [4, 8, 8, 12]  # the kill at 8 came before step 8's checkpoint: the resume redid the step
    records = [r for r in all_records if r["type"] == "eval_tasks"]
    assert [r["step"] for r in records] == [4, 8, 12]
    assert all(0 <= r[f"{CHOICE}/acc"] <= 1 and r["samples"] == {CHOICE: 5} for r in records)
    scalars = read_scalars(run / "tensorboard")
    assert all((f"eval_tasks/{CHOICE}/acc_norm", step) in scalars for step in (4, 8, 12))
    # CORE, every 6 steps: once each step across the kill, the last what `eval --core` gives the run.
    from jaxgpt.evaluation.core import evaluate_core, load_bundle

    cores = [r for r in all_records if r["type"] == "core"]
    assert [r["step"] for r in cores] == [6, 12] and ("core/core", 12) in scalars
    want = evaluate_core(ours.params, ours.cfg, ours.text_tokenizer, load_bundle(bundle), progress=False)
    assert cores[-1]["core"] == want["core"] and cores[-1]["mc/accuracy"] == want["tasks"]["mc"]["accuracy"]


def test_a_task_whose_file_is_missing_stops_training_before_its_first_step(offline, tmp_path, capsys):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "local_data.py").write_text((TASKS / "local_data.py").read_text())
    (tasks / "absent.yaml").write_text((TASKS / "tiny_choice.yaml").read_text()
                                       .replace(CHOICE, "absent").replace("tiny_choice.jsonl", "absent.jsonl"))
    corpus, run = write_corpus(tmp_path / "corpus.txt"), tmp_path / "run"
    sets = [*SETS, "train.eval_tasks=absent", f"train.eval_tasks_path={json.dumps(str(tasks))}",
            f"data.source={json.dumps(str(corpus))}"]
    assert main(["train", "--out", str(run), "--no-progress", *(a for kv in sets for a in ("--set", kv))]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("jaxgpt train: error: ") and "absent.jsonl not found" in err[-1]
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()


def test_a_process_other_than_the_writer_waits_and_runs_nothing(trained, monkeypatch):
    _, _, ours, _, _, _ = trained
    tasks = tasks_module.TrainingTasks(load_config(None, SETS).train, ours.text_tokenizer)
    waited = []
    monkeypatch.setattr(tasks_module.distributed, "is_writer", lambda: False)
    monkeypatch.setattr(tasks_module.distributed, "wait_for_writer", waited.append)
    monkeypatch.setattr(tasks_module, "run_tasks", lambda *args, **kwargs: pytest.fail("only the writer runs tasks"))
    assert tasks.run(ours.params, ours.cfg, 4) == {"type": "eval_tasks", "step": 4}
    assert waited == ["jaxgpt-eval-tasks-4"]


def test_cli_writes_the_table_the_json_and_the_record_at_the_checkpoints_step(trained, tmp_path, capsys):
    run, records, _, _, _, _ = trained
    out = tmp_path / "results.json"
    assert main(["eval", "--run", str(run), "--tasks", CHOICE, "--include-path", str(TASKS), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert CHOICE in table and "acc_norm" in table and table.lstrip().startswith("|")
    results = json.loads(out.read_text())
    during_training = [r for r in records if r["type"] == "eval_tasks"][-1]
    from_cli = read_metrics(run / "metrics.jsonl")[-1]
    assert from_cli["step"] == 12 and from_cli[f"{CHOICE}/acc"] == results["results"][CHOICE]["acc,none"]
    assert from_cli[f"{CHOICE}/acc"] == during_training[f"{CHOICE}/acc"]  # the same params, the same score
    assert f"{CHOICE}/acc_stderr" in from_cli  # the CLI bootstraps standard errors, training does not


@pytest.mark.parametrize("args, message", [
    (["--tasks", "jaxgpt_tiny_choise", "--include-path", "TASKS"], "unknown task 'jaxgpt_tiny_choise' (did you mean "
                                                                    "'jaxgpt_tiny_choice'?)"),
    (["--tasks", CHOICE, "--include-path", "BROKEN"], "broken.yaml does not parse"),
    (["--tasks", CHOICE, "--include-path", "TASKS", "--run", "EMPTY"], "is not a run directory"),
    (["--tasks", CHOICE, "--include-path", "TASKS", "--data", "x"], "use one or the other"),
    (["--tasks", f"{CHOICE},,x"], "has an empty name"),
    (["--limit", "3"], "--limit applies to harness tasks: name them with --tasks"),
])
def test_bad_input_is_one_line(trained, args, message, tmp_path, capsys):
    run, _, _, _, _, _ = trained
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "broken.yaml").write_text("task: [unclosed\n")
    (tmp_path / "empty").mkdir()
    names = {"TASKS": str(TASKS), "BROKEN": str(tmp_path / "broken"), "EMPTY": str(tmp_path / "empty")}
    argv = ["eval", "--run", str(run), *(names.get(a, a) for a in args)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("jaxgpt eval: error: "), err


def test_a_run_without_a_checkpoint_is_one_line(offline, tmp_path, capsys):
    (tmp_path / "config.toml").write_text(load_config(None, SETS).to_toml())
    assert main(["eval", "--run", str(tmp_path), "--tasks", CHOICE, "--include-path", str(TASKS)]) == 2
    err = capsys.readouterr().err
    assert "no good checkpoint" in err and err.count("\n") == 1


def test_without_the_harness_eval_names_the_extra(trained, monkeypatch, capsys):
    run, _, _, _, _, _ = trained
    monkeypatch.delitem(sys.modules, "jaxgpt.evaluation.harness")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "lm_eval" else object())
    assert main(["eval", "--run", str(run), "--tasks", CHOICE]) == 2
    err = capsys.readouterr().err
    assert err == "jaxgpt eval: error: lm-evaluation-harness tasks need the harness: pip install 'jaxgpt[eval]'\n"


# `jaxgpt ARGS` where the packages finder finds neither torch nor transformers (as if not installed).
WITHOUT_TORCH = """
import importlib.machinery, sys
class Without(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.partition(".")[0] in ("torch", "transformers") else super().find_spec(name, path, target)
sys.meta_path[sys.meta_path.index(importlib.machinery.PathFinder)] = Without
from jaxgpt.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_command_runs_without_torch_or_transformers(trained):
    """`jaxgpt eval --tasks` in a fresh process where PyTorch and transformers cannot be imported,
    as with `pip install 'jaxgpt[eval]'`: the harness's table."""
    run, _, _, _, _, _ = trained
    env = {**os.environ, **OFFLINE, "XLA_FLAGS": xla_flags(1)}
    result = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, "eval", "--run", str(run), "--tasks", UNTIL,
                             "--include-path", str(TASKS), "--limit", "2"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert UNTIL in result.stdout and "exact_match" in result.stdout
