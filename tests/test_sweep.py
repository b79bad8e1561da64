"""Sweeps: vmapped members equal their single runs, one compile per group, the report and its
verdicts, resuming a sweep, and clear errors for bad sweep files."""

import json
import math
import random
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SPEEDRUN

from jaxgpt.cli.main import main
from jaxgpt.config import ConfigError, TrainConfig
from jaxgpt.data import prepare_data
from jaxgpt.errors import UserError
from jaxgpt.runs.metrics import read_jsonl, read_metrics
from jaxgpt.tools import sweep as sweep_module
from jaxgpt.tools.sweep import (group_knobs, group_members, load_sweep, members, run_sweep, shared_config,
                               stack_hparams, train_group)
from jaxgpt.tools.sweep_report import markdown_table, summarise, verdict
from jaxgpt.train.checkpoint import load_run
from jaxgpt.train.loop import train
from jaxgpt.train.optim import OptHParams, lr_schedule

BASE = """
[model]
vocab_size = 64
context_length = 16
d_model = 32
n_layers = 1
n_heads = 4

[data]
source = {corpus}
tokenizer = "char"

[train]
steps = 6
batch_size = 4
lr = 3e-3
min_lr = 3e-4
warmup_steps = 2
eval_every = 3
eval_batches = 2
log_every = 2
sample_tokens = 0
checkpoint_every = 6
parallel = "single"
"""
# Every optimiser value and muP number the sweep traces differs from the base config's.
LR_VARIANT = ["train.lr=1e-2", "train.min_lr=1e-3", "train.warmup_steps=3", "train.weight_decay=0.05",
              "train.beta1=0.8", "train.beta2=0.95", "train.lr_embed=2e-2", "train.lr_scalar=5e-3",
              "model.output_multiplier=2.0", "model.input_multiplier=0.5", "model.hidden_init_scale=0.5"]


@pytest.fixture(scope="module")
def base_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sweep")
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "it", "was", "red"]
    lines = [" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(300)]
    (folder / "corpus.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    base = folder / "base.toml"
    base.write_text(BASE.format(corpus=json.dumps(str(folder / "corpus.txt"))), encoding="utf-8")
    return base


def write_sweep(folder: Path, text: str, name: str = "s.toml") -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def sweep_text(base: Path, seeds: int, *variants: tuple[str, list[str]]) -> str:
    tables = "".join(f'\n[[variant]]\nname = "{name}"\nset = {json.dumps(sets)}\n' for name, sets in variants)
    return f'base = {json.dumps(str(base))}\nseeds = {seeds}\n{tables}'


def single_run(cfg, out: Path) -> tuple[dict, list[dict], dict]:
    summary = train(cfg, out, progress=False)
    evals = [r for r in read_metrics(out / "metrics.jsonl") if r["type"] == "eval"]
    return summary, evals, load_run(out)[1]


class _Prepared(Exception):
    pass


def test_no_progress_reaches_the_token_stores_bar_in_train_and_sweep(base_file, tmp_path, monkeypatch):
    """--no-progress (progress=False) silences the store's preparation bar too: each command hands
    its flag to prepare_data (stopped there, before anything compiles)."""
    import jaxgpt.train.loop as loop

    asked = []

    def prepare(cfg, run_dir=None, **options):
        asked.append(options.get("progress", True))
        raise _Prepared

    monkeypatch.setattr(loop, "prepare_data", prepare)
    monkeypatch.setattr(sweep_module, "prepare_data", prepare)
    sweep = load_sweep(write_sweep(tmp_path, sweep_text(base_file, 1, ("baseline", []))))
    for quiet in (False, True):
        with pytest.raises(_Prepared):
            train(sweep.variants[0].config, tmp_path / f"run-{quiet}", progress=not quiet)
        with pytest.raises(_Prepared):
            run_sweep(sweep, tmp_path / f"sweep-{quiet}", progress=not quiet)
    assert asked == [True, True, False, False]


def test_three_seeds_compile_once_and_equal_their_single_runs(base_file, tmp_path):
    sweep = load_sweep(write_sweep(tmp_path, sweep_text(base_file, 3, ("baseline", []))))
    runs = members(sweep)
    assert [m.seed for m in runs] == [0, 1, 2] and len(group_members(runs)) == 1
    data = prepare_data(runs[0].config, tmp_path)
    traces = Counter()
    result = train_group(runs, data, progress=False, traces=traces)
    assert traces == {"train": 1, "eval": 1}  # one compiled step for all three seeds
    finals = []
    for index, member in enumerate(runs):
        summary, evals, params = single_run(member.config, tmp_path / f"seed{member.seed}")
        mine = jax.tree_util.tree_map(lambda leaf: leaf[index], result.state.params)
        # Batched and unbatched matmuls sum in different orders; Adam's division by sqrt(v) turns those
        # last-bit gradient differences into parameter differences of up to ~1e-4 of lr (3e-3).
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6), mine, params)
        assert [e["step"] for e in result.evals[index]] == [e["step"] for e in evals] == [3, 6]
        np.testing.assert_allclose([e["val_loss"] for e in result.evals[index]], [e["val_loss"] for e in evals],
                                   rtol=1e-5)
        assert result.train_loss[index] == pytest.approx(summary["train_loss"], rel=1e-5)
        finals.append(summary["val_loss"])
    assert len(set(finals)) == 3  # the seeds really differ


def test_a_group_never_has_more_than_a_few_programs_in_flight(base_file, tmp_path, in_flight_windows):
    """Every step and every eval batch of a group passes through one window of
    `dispatch.IN_FLIGHT` (a group's programs span every device of its mesh: a burst deadlocks
    XLA:CPU, tests/test_collective_order.py)."""
    from jaxgpt.process import dispatch

    watch, check = in_flight_windows
    windows = watch(sweep_module)
    runs = members(load_sweep(write_sweep(tmp_path, sweep_text(base_file, 2, ("baseline", [])))))
    cfg = runs[0].config.train
    train_group(runs, prepare_data(runs[0].config, tmp_path), progress=False)
    [window] = windows
    assert window.limit == dispatch.IN_FLIGHT
    evals = cfg.steps // cfg.eval_every
    assert len(window.added) == cfg.steps + evals * cfg.eval_batches > window.limit + 2
    check(window)


def test_optimiser_variant_vmapped_with_baseline_equals_its_single_run(base_file, tmp_path, capsys, monkeypatch):
    path = write_sweep(tmp_path, sweep_text(base_file, 1, ("baseline", []), ("hot", LR_VARIANT),
                                            ("rms", ["model.norm=rmsnorm"])))
    traces, real_run_sweep = Counter(), sweep_module.run_sweep
    monkeypatch.setattr(sweep_module, "run_sweep", lambda *args, **kw: real_run_sweep(*args, **kw, traces=traces))
    out = tmp_path / "out"
    assert main(["sweep", str(path), "--out", str(out), "--no-progress"]) == 0
    assert traces["train"] == 2  # {baseline, hot} together, then rms
    assert "| hot |" in capsys.readouterr().out
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["seed"], r["group_members"]) for r in records] == [
        ("baseline", 0, 2), ("hot", 0, 2), ("rms", 0, 1)]
    hot = records[1]
    summary, evals, _ = single_run(load_sweep(path).variants[1].config, tmp_path / "hot")
    assert hot["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
    assert hot["train_loss"] == pytest.approx(summary["train_loss"], rel=1e-5)
    np.testing.assert_allclose([e["val_bits_per_byte"] for e in hot["evals"]],
                               [e["val_bits_per_byte"] for e in evals], rtol=1e-5)
    assert abs(hot["val_loss"] - records[0]["val_loss"]) > 1e-3  # its own hyperparameters took effect
    table = (out / "results.md").read_text()
    assert "seed spread (max − min)" in table and "| baseline |" in table and "| rms |" in table
    assert (out / "val_loss.png").stat().st_size > 1000


def test_a_group_traces_the_mup_numbers_its_members_differ_in_and_keeps_the_rest_constants(base_file, tmp_path):
    sweep = load_sweep(write_sweep(tmp_path, sweep_text(
        base_file, 1, ("a", ["model.hidden_init_scale=0.5"]),
        ("b", ["model.hidden_init_scale=0.5", "model.output_multiplier=2.0", "train.lr=1e-2"]))))
    [group] = group_members(members(sweep))
    cfg, varying = group_knobs(shared_config(group[0].config), [m.config.model for m in group])
    assert list(varying) == ["output_multiplier"] and varying["output_multiplier"].tolist() == [1.0, 2.0]
    assert cfg.model.hidden_init_scale == 0.5 and cfg.model.output_multiplier == 1.0  # shared: a constant


def test_speedrun_variants_train_apart_from_the_baseline_and_their_group_peaks_vmap(base_file, tmp_path):
    """The speedrun block's switches change the parameter tree (skip weights, value tables, mixes,
    an MTP head, an untied head, three layers): its variants form a group of their own, in which
    the group learning rates and Muon's are vmapped like lr, each member equal to its single run."""
    hot = ["train.lr_embed=1e-2", "train.lr_head=4e-3", "train.lr_scalar=1e-3", "train.muon_lr=0.03"]
    sweep = load_sweep(write_sweep(tmp_path, sweep_text(base_file, 1, ("baseline", []), ("speedrun", SPEEDRUN),
                                                        ("speedrun-hot", [*SPEEDRUN, *hot]))))
    assert [[m.variant for m in group] for group in group_members(members(sweep))] == [
        ["baseline"], ["speedrun", "speedrun-hot"]]
    traces = Counter()
    records = run_sweep(sweep, tmp_path / "out", progress=False, traces=traces)
    assert traces["train"] == 2
    assert [(r["variant"], r["group_members"]) for r in records] == [
        ("baseline", 1), ("speedrun", 2), ("speedrun-hot", 2)]
    assert records[0]["parameters"] < records[1]["parameters"] == records[2]["parameters"]
    summary, evals, _ = single_run(sweep.variants[2].config, tmp_path / "hot")
    assert records[2]["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
    assert records[2]["train_loss"] == pytest.approx(summary["train_loss"], rel=1e-5)
    np.testing.assert_allclose([e["val_loss"] for e in records[2]["evals"]], [e["val_loss"] for e in evals], rtol=1e-5)
    assert abs(records[2]["val_loss"] - records[1]["val_loss"]) > 1e-3  # its own learning rates took effect


def test_mup_members_vmap_their_peaks_and_each_equals_its_single_run(base_file, tmp_path):
    """Two muP peaks at twice the base width train as one vmapped group; the hotter one equals its
    single run (the sweep's step scales AdamW's hidden matrices by 1 / m as training does)."""
    mup = ["model.parametrization=mup", "model.mup_base_width=16"]
    sweep = load_sweep(write_sweep(tmp_path, sweep_text(base_file, 1, ("mup", mup),
                                                        ("mup-hot", [*mup, "train.lr=1e-2", "train.min_lr=1e-3"]))))
    traces = Counter()
    records = run_sweep(sweep, tmp_path / "out", progress=False, traces=traces)
    assert traces["train"] == 1 and [r["group_members"] for r in records] == [2, 2]
    summary, evals, _ = single_run(sweep.variants[1].config, tmp_path / "hot")
    assert records[1]["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
    np.testing.assert_allclose([e["val_loss"] for e in records[1]["evals"]], [e["val_loss"] for e in evals], rtol=1e-5)
    assert abs(records[1]["val_loss"] - records[0]["val_loss"]) > 1e-3


def test_a_rerun_skips_finished_members_and_more_seeds_run_only_the_new_ones(base_file, tmp_path):
    path = write_sweep(tmp_path, sweep_text(base_file, 1, ("baseline", []), ("hot", ["train.lr=1e-2"])))
    out = tmp_path / "out"
    traces = Counter()
    first = run_sweep(load_sweep(path), out, progress=False, traces=traces)
    assert traces["train"] == 1
    again = run_sweep(load_sweep(path), out, progress=False, traces=traces)
    assert again == first and traces["train"] == 1  # nothing retrained
    more = run_sweep(load_sweep(path, seeds=2), out, progress=False, traces=traces)
    assert traces["train"] == 2
    assert [(r["variant"], r["seed"]) for r in more] == [("baseline", 0), ("baseline", 1), ("hot", 0), ("hot", 1)]
    assert more[0] == first[0] and more[1]["group_members"] == 2  # the two new seeds trained together
    # A partial run into the same folder (a new seed of one variant) keeps the records it leaves out.
    partial = run_sweep(load_sweep(path, seeds=3, only=("baseline",)), out, progress=False, traces=traces)
    assert [(r["variant"], r["seed"]) for r in partial] == [("baseline", 0), ("baseline", 1), ("baseline", 2)]
    assert read_jsonl(out / "results.jsonl") == partial + more[2:]


def test_traced_schedule_equals_each_members_schedule():
    configs = [TrainConfig(steps=20, lr=1e-3, min_lr=1e-4, warmup_steps=5),
               TrainConfig(steps=20, lr=3e-3, min_lr=0.0, warmup_steps=0),
               TrainConfig(steps=20, lr=2e-3, min_lr=2e-4, warmup_steps=30)]  # warmup longer than the run
    hparams = stack_hparams(configs)
    counts = jnp.arange(25)
    traced = jax.jit(jax.vmap(lambda hp: jax.vmap(lr_schedule(configs[0], hp))(counts)))(hparams)
    for row, cfg in zip(np.asarray(traced), configs):
        np.testing.assert_allclose(row, [float(lr_schedule(cfg)(n)) for n in range(25)], rtol=1e-5)
    assert OptHParams.from_config(configs[1]).warmup_steps == 0


def test_verdict_needs_a_gap_beyond_the_baseline_seed_spread():
    assert verdict(-0.02, 0.01, 3) == "better"
    assert verdict(0.02, 0.01, 3) == "worse"
    assert verdict(-0.01, 0.01, 3) == "within noise"  # not beyond the spread
    assert verdict(0.004, 0.01, 3) == "within noise"
    assert verdict(0.5, 0.0, 1) == "no noise estimate (1 seed)"
    assert verdict(math.nan, 0.01, 3) == "diverged"


def test_summary_rows_gap_spread_and_baseline(base_file, tmp_path):
    path = write_sweep(tmp_path, sweep_text(base_file, 3, ("first", []), ("baseline", ["train.lr=1e-2"]),
                                            ("worse", ["train.lr=2e-2"])))
    sweep = load_sweep(path)
    assert sweep.baseline == "baseline"  # named baseline wins over the first
    bpb = {"first": [1.50, 1.52, 1.51], "baseline": [1.60, 1.62, 1.61], "worse": [1.70, 1.71, 1.72]}
    records = [{"variant": name, "val_bits_per_byte": v, "parameters": 10} for name, vs in bpb.items() for v in vs]
    rows = {row["variant"]: row for row in summarise(sweep, records)}
    assert rows["baseline"]["verdict"] == "baseline" and rows["baseline"]["spread"] == pytest.approx(0.02)
    assert rows["first"]["gap"] == pytest.approx(-0.10) and rows["first"]["verdict"] == "better"
    assert rows["worse"]["mean"] == pytest.approx(1.71) and rows["worse"]["verdict"] == "worse"


def test_a_reference_grid_stands_beside_ours_with_its_verdicts_by_the_same_rule(tmp_path):
    # The reference's verdicts use its own baseline spread (0.05): "first" is better there too,
    # "worse" is within its noise (0.03 < 0.05) where ours is worse, so the verdicts disagree.
    text = 'seeds = 3\nreference = { name = "octlm", seeds = 3 }\n' + "".join(
        f'[[variant]]\nname = "{name}"\nset = {json.dumps(overrides)}\n' + (
            f"reference = {{ bpb = {bpb}, spread = {spread} }}\n" if bpb else "")
        for name, overrides, bpb, spread in [("baseline", [], 2.90, 0.05), ("first", ["train.lr=1e-2"], 2.80, 0.01),
                                              ("worse", ["train.lr=2e-2"], 2.93, 0.02), ("other", ["train.lr=3e-2"], None, None)])
    sweep = load_sweep(write_sweep(tmp_path, text))
    assert (sweep.reference, sweep.reference_seeds) == ("octlm", 3)
    bpb = {"first": [1.50, 1.52, 1.51], "baseline": [1.60, 1.62, 1.61], "worse": [1.70, 1.71, 1.72], "other": [1.6] * 3}
    records = [{"variant": name, "val_bits_per_byte": v, "parameters": 10} for name, vs in bpb.items() for v in vs]
    rows = {row["variant"]: row for row in summarise(sweep, records)}
    assert (rows["baseline"]["ref_verdict"], rows["baseline"]["agrees"]) == ("baseline", "–")
    assert (rows["first"]["ref_mean"], rows["first"]["ref_verdict"], rows["first"]["agrees"]) == (2.80, "better", "yes")
    assert (rows["worse"]["verdict"], rows["worse"]["ref_verdict"], rows["worse"]["agrees"]) == (
        "worse", "within noise", "no")
    assert "ref_mean" not in rows["other"]
    table = markdown_table(list(rows.values()), sweep.reference).splitlines()
    assert "octlm bits/byte | octlm spread | octlm verdict | verdicts agree |" in table[0]
    assert table[3].endswith("| better | 2.8000 | 0.0100 | better | yes |") and table[5].endswith("| – | – | – | – |")


@pytest.mark.parametrize("text,message", [
    ('seeds = 2\nvariants = []\n', "unknown key 'variants' (did you mean 'variant'?)"),
    ('[[variant]]\nname = "a"\nreference = { bpb = 2.9, spread = 0.1 }\n', "a reference needs the sweep's own reference"),
    ('reference = { name = "x" }\n[[variant]]\nname = "a"\n', "reference needs seeds"),
    ('reference = { name = "x", seeds = 3 }\n[[variant]]\nname = "a"\nreference = { bpb = "2.9", spread = 0.1 }\n',
     "reference bpb must be a finite number >= 0"),
    ('reference = { name = "x", seeds = 3 }\n[[variant]]\nname = "a"\nreference = { bpb = 2.9, spred = 0.1 }\n',
     "unknown key 'spred' (did you mean 'spread'?)"),
    ('[[variant]]\nname = "a"\nsett = []\n', "variant 'a': unknown key 'sett' (did you mean 'set'?)"),
    ('[[variant]]\nname = "a"\n[[variant]]\nname = "a"\n', "variant name 'a' is used twice"),
    ('[[variant]]\nname = "a"\n[[variant]]\nname = "b"\nset = ["model.norm=batchnorm"]\n',
     "variant 'b': model.norm = 'batchnorm' is not one of layernorm, rmsnorm"),
    ('[[variant]]\nname = "a"\nset = ["train.lrr=1"]\n', "variant 'a': unknown config key train.lrr"),
    ('[[variant]]\nname = "a"\nset = "model.norm=rmsnorm"\n', "variant 'a': set must be a list"),
    ('[[variant]]\nset = []\n', "[[variant]] #1: needs a name"),
    ('seeds = 0\n[[variant]]\nname = "a"\n', "seeds must be an integer >= 1"),
    ('base = "missing.toml"\n[[variant]]\nname = "a"\n', "base config not found"),
    ('set = ["nodot=1"]\n[[variant]]\nname = "a"\n', "set: override 'nodot=1' must look like section.key=value"),
    ('seeds = 2\n', "needs at least one [[variant]]"),
])
def test_bad_sweep_files_are_clear_errors(text, message, tmp_path, capsys):
    path = write_sweep(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_sweep(path)
    assert message in str(err.value) and str(path) in str(err.value)
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_command_line_overrides_and_a_subset_of_variants(base_file, tmp_path, capsys, monkeypatch):
    path = write_sweep(tmp_path, sweep_text(base_file, 2, ("baseline", []), ("rms", ["model.norm=rmsnorm"]),
                                            ("wide", ["model.d_model=64"])))
    sweep = load_sweep(path, overrides=("model.d_model=48", "train.steps=4"), only=("rms", "baseline"))
    # The file's order, its variant's own set after the command line's (so "wide" would keep 64).
    assert [v.name for v in sweep.variants] == ["baseline", "rms"]
    assert all(v.config.model.d_model == 48 and v.config.train.steps == 4 for v in sweep.variants)
    assert sweep.variants[1].config.model.norm == "rmsnorm"
    assert load_sweep(path, overrides=("model.d_model=48",)).variants[2].config.model.d_model == 64
    for only, message in ((("rms",), "must include the baseline 'baseline'"),
                          (("baseline", "nope"), "no variant named 'nope'; the variants are baseline, rms, wide")):
        with pytest.raises(ConfigError, match=message):
            load_sweep(path, only=only)
    with pytest.raises(ConfigError, match="train.stepz"):
        load_sweep(path, overrides=("train.stepz=4",))
    # Without --out, a changed or partial grid would rewrite (and drop records of) the file's own folder.
    for flags in (["--set", "train.steps=4"], ["--variants", "baseline,rms"]):
        assert main(["sweep", str(path), *flags]) == 2
        assert "name an --out folder" in capsys.readouterr().err
    # With --out, the command line's flags reach the sweep it runs.
    ran = []

    def capture(sweep, out, **_):
        ran.append((sweep, out))
        raise UserError("stop before training")  # a one-line error: the command ends there

    monkeypatch.setattr(sweep_module, "run_sweep", capture)
    assert main(["sweep", str(path), "--set", "model.d_model=48", "--variants", "baseline, rms",
                 "--out", str(tmp_path / "o")]) == 2
    (sweep, out), = ran
    assert [v.name for v in sweep.variants] == ["baseline", "rms"] and out == tmp_path / "o"
    assert all(v.config.model.d_model == 48 for v in sweep.variants)
