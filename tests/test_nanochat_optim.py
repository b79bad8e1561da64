"""nanochat's optimizer as options of jaxgpt's: from the same params and gradients, two steps of
jaxgpt's optimizer (Polar Express, MuonEq, Muon+, NorMuon, cautious weight decay, q, k and v
apart; nanochat's AdamW table, its width scaling) equal two of MuonAdamW's, rebuilt in PyTorch
(tests/nanochat_optim_reference.py), within 1e-5 of the largest update entry; each part matters;
nanochat's schedules."""

import dataclasses

import jax
import numpy as np
import pytest
import torch
from nanochat_optim_reference import groups
from nanochat_optim_reference import step as reference_step
from test_checkpoint import assert_bitwise_equal, config, corpus, full_state, stop_at  # noqa: F401  (corpus: a fixture)
from test_sweep import base_file, single_run, sweep_text, write_sweep  # noqa: F401  (base_file: a fixture)

import jaxgpt.train.loop as train_module
from jaxgpt.config import load_config
from jaxgpt.model.decoder import init_params
from jaxgpt.nanochat import TRAIN_OVERRIDES, model_config, state_from_params
from jaxgpt.nanochat.weights import without_gain_gradients
from jaxgpt.runs.metrics import read_metrics
from jaxgpt.tools.sweep import load_sweep, run_sweep
from jaxgpt.train.optim import lr_schedule, make_optimizer, muon_momentum

GPT = {"sequence_len": 32, "vocab_size": 100, "n_layer": 3, "n_head": 4, "n_kv_head": 2, "n_embd": 64,
       "window_pattern": "SL"}
# nanochat's options (setup_optimizer's peaks, a constant momentum and decay as one step of
# MuonAdamW has them), for a model with an untied head.
NANOCHAT = [*(o for o in TRAIN_OVERRIDES if "schedule" not in o), "train.lr_embed=0.2", "train.lr_head=0.004",
            "train.weight_decay=0.1", "train.schedule=warmdown", "train.warmup_steps=0", "train.steps=100",
            "model.tie_embeddings=false"]


def _random_like(tree, seed, spread=1.0):
    leaves, structure = jax.tree_util.tree_flatten(tree)
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_unflatten(
        structure, [np.asarray(leaf) + spread * rng.standard_normal(leaf.shape).astype(np.float32) for leaf in leaves])


def _both(scan: bool, overrides=()):
    """jaxgpt's params after two steps and the reference's, as nanochat state dicts, and the
    reference's largest update entry."""
    model = model_config(GPT, scan_layers=scan)
    cfg = load_config(None, [*NANOCHAT, *overrides])
    cfg = dataclasses.replace(cfg, model=model)
    params = _random_like(init_params(model, jax.random.key(0)), seed=1, spread=0.1)
    params = jax.tree_util.tree_map_with_path(  # nanochat's norms have no gains: jaxgpt's at 1
        lambda path, leaf: np.ones_like(leaf) if jax.tree_util.keystr(path).endswith("['scale']") else leaf, params)
    # nanochat's GPT has no norm gains: theirs get no gradient (the export folds them in)
    grads = [without_gain_gradients(_random_like(jax.tree_util.tree_map(np.zeros_like, params), seed=s))
             for s in (2, 3)]
    optimizer = make_optimizer(cfg.train, model=model)
    state, ours = optimizer.init(params), params
    for g in grads:
        updates, state = optimizer.update(g, state, ours)
        ours = jax.tree_util.tree_map(lambda p, u: p + u, ours, updates)

    before = state_from_params(params, model)
    theirs = {k: torch.tensor(v) for k, v in before.items()}
    table, slots = groups(list(theirs), GPT["n_embd"], weight_decay=0.1), {}
    for g in grads:
        reference_step(theirs, {k: torch.tensor(v) for k, v in state_from_params(g, model, fold_gains=False).items()},
                       slots, table)
    theirs = {k: v.numpy() for k, v in theirs.items()}
    largest = max(float(np.abs(theirs[k] - before[k]).max()) for k in theirs)
    edges = {k: slot["edge"].numpy() for k, slot in slots.items() if "edge" in slot}
    return state_from_params(ours, model), theirs, largest, edges


@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
def test_two_steps_equal_muon_adamw(scan):
    """Every entry, but those whose cautious mask was decided on a product g p within 1e-4 of its
    matrix's median |g p| of 0 (at most 0.1 % of them): near the mask's edge float rounding may
    put either implementation on either side, and both are right."""
    ours, theirs, largest, edges = _both(scan)
    assert largest > 1e-3
    at_edge = 0
    for key in theirs:
        clear = edges[key] > 1e-4 * np.median(edges[key]) if key in edges else np.ones(theirs[key].shape, bool)
        at_edge += int((~clear).sum())
        np.testing.assert_allclose(ours[key][clear], theirs[key][clear], rtol=0, atol=1e-5 * largest, err_msg=key)
    assert at_edge <= 1e-3 * sum(edge.size for edge in edges.values())


@pytest.mark.parametrize("off", ["train.muon_orthogonalizer=newton_schulz", "train.muon_equilibrate_rows=false",
                                 "train.muon_renormalize=false", "train.muon_beta2=0", "train.muon_cautious_decay=false",
                                 "train.muon_qkv_apart=false", "train.adam_groups=jaxgpt",
                                 "train.adam_reference_width=0"])
def test_each_part_matters_to_the_match(off):
    ours, theirs, largest, _ = _both(False, [off])
    assert max(float(np.abs(ours[k] - theirs[k]).max()) for k in theirs) > 1e-4 * largest  # 10 x the match's tolerance


def test_nanochat_schedules():
    """base_train's get_lr_multiplier and get_muon_momentum, at 2,000 steps: the warm-down is the
    last 1,300 (from step 700)."""
    train = load_config(None, [*NANOCHAT, "train.warmup_steps=10", "train.muon_momentum_schedule=nanochat",
                               "train.steps=2000"]).train
    lr = lr_schedule(train)
    assert [float(lr(n)) / 0.02 for n in (0, 9, 10, 700)] == pytest.approx([0.1, 1.0, 1.0, 1.0])
    assert float(lr(1350)) / 0.02 == pytest.approx(0.5 + 0.5 * 0.05) and float(lr(2000)) / 0.02 == pytest.approx(0.05)
    momentum = muon_momentum(train)
    assert [float(momentum(n)) for n in (0, 200, 400, 699, 1350, 2000)] == pytest.approx(
        [0.85, 0.91, 0.97, 0.97, 0.935, 0.90])
    # Before the warm-up's end, once the run is short enough that the warm-down starts first.
    short = muon_momentum(load_config(None, [*NANOCHAT, "train.muon_momentum_schedule=nanochat", "train.steps=1000"]).train)
    assert float(short(350)) == pytest.approx(0.85 + 0.12 * 350 / 400) and float(short(400)) < 0.97


# nanochat's GPT in config keys (what jaxgpt.nanochat.model_config sets), at the checkpoint tests' size.
NANOCHAT_MODEL = ["model.position=rope", "model.rope_base=100000", "model.norm=rmsnorm", "model.qk_norm=true",
                  "model.embed_norm=true", "model.feed_forward=relu2", "model.logit_softcap=15", "model.x0_mix=true",
                  "model.n_layers=3", "model.kv_heads=2", "model.value_embeds=2", "model.value_embeds_layout=alternating",
                  "model.value_gate=true", "model.smear=true", "model.backout=true", "model.init_scheme=nanochat",
                  "model.attention_window=6", "model.window_pattern=SL"]


def test_a_nanochat_run_stops_and_resumes_bitwise(corpus, tmp_path, monkeypatch):
    """nanochat's model and every part of its optimizer, with its schedules of the rate, Muon's
    momentum and its decay: their state (the lerped momentum, NorMuon's second moments, the
    grouped AdamW's moments, the counts the schedules read) is saved and restored exactly."""
    cfg = config(corpus, *NANOCHAT_MODEL, *TRAIN_OVERRIDES, "model.tie_embeddings=false", "train.steps=8",
                 "train.warmup_steps=2", "train.warmdown_ratio=0.5")
    train_module.train(cfg, tmp_path / "reference", progress=False)
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        stop_at(6, patch)
        assert train_module.train(cfg, run, progress=False)["step"] == 6
    train_module.train(cfg, run, resume=True, progress=False)
    state = full_state(run)
    assert {"smear_gate", "backout_lambda", "value_embeds"} <= set(state.params) and int(state.step) == 8
    assert_bitwise_equal(state, full_state(tmp_path / "reference"))
    losses = [r["loss"] for r in read_metrics(run / "metrics.jsonl") if r["type"] == "train"]
    assert losses[-1] < losses[0]


def test_nanochat_peaks_vmap_in_a_sweep_and_each_member_equals_its_single_run(base_file, tmp_path):
    """Two members with every nanochat option, at other peaks (embeddings, head, scalars, Muon),
    train as one vmapped group; the hotter equals its single run."""
    options = [*NANOCHAT_MODEL, *TRAIN_OVERRIDES, "model.tie_embeddings=false", "train.warmup_steps=2"]
    hot = ["train.lr_embed=0.05", "train.lr_head=0.02", "train.lr_scalar=0.1", "train.muon_lr=0.03"]
    sweep = load_sweep(write_sweep(tmp_path, sweep_text(base_file, 1, ("nanochat", options),
                                                        ("nanochat-hot", [*options, *hot]))))
    records = run_sweep(sweep, tmp_path / "out", progress=False)
    assert [r["group_members"] for r in records] == [2, 2]
    summary, evals, _ = single_run(sweep.variants[1].config, tmp_path / "hot")
    assert records[1]["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
    np.testing.assert_allclose([e["val_loss"] for e in records[1]["evals"]], [e["val_loss"] for e in evals], rtol=1e-5)
    assert abs(records[1]["val_loss"] - records[0]["val_loss"]) > 1e-3  # its own peaks took effect
