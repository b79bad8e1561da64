"""nanochat's checkpoints in and out: `jaxgpt import-nanochat` makes a run (its step, its
tokenizer's ids) that computes what nanochat's GPT computes and that generate and train --resume
read; `export-nanochat` writes nanochat's base directory back, the gains jaxgpt trained folded in;
bad folders, state dicts, tokenizers and runs are one line each, nothing written."""

import json
import sys

import numpy as np
import pytest
import torch
from nanochat_files import train_encoding, write_checkpoint, write_tokenizer
from speedrun_references import NanochatGPT
from test_speedrun_parity import randomised

from jaxgpt.cli.main import main
from jaxgpt.config import load_config
from jaxgpt.data.tokenizer import Tokenizer, build_tokenizer
from jaxgpt.errors import UserError
from jaxgpt.evaluation.generate import generate
from jaxgpt.model.decoder import forward
from jaxgpt.nanochat.checkpoints import read_checkpoint
from jaxgpt.data.tiktoken_pickle import read_encoding
from jaxgpt.nanochat.weights import layer_letters
from jaxgpt.train.checkpoint import load_newest
from jaxgpt.train.imported import export_nanochat_run, import_nanochat_run

TEXT = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
        "You are all resolved rather to die than to famish? 123 4567 don't we'll\n") * 30
T, LAYERS, HEADS, KV, C = 32, 3, 4, 2, 32


@pytest.fixture(scope="module")
def nanochat_base(tmp_path_factory):
    """BASE/tokenizer/tokenizer.pkl and BASE/base_checkpoints/d3 at steps 100 and 200 (200 the
    random model, 100 another), as nanochat lays them out; and the step-200 model."""
    base = tmp_path_factory.mktemp("nanochat")
    encoding = train_encoding(TEXT, 60)
    write_tokenizer(base / "tokenizer", encoding)
    gpt = {"sequence_len": T, "vocab_size": encoding.n_vocab, "n_layer": LAYERS, "n_head": HEADS, "n_kv_head": KV,
           "n_embd": C, "window_pattern": "SL"}
    folder = base / "base_checkpoints" / "d3"
    for step, seed in ((100, 1), (200, 0)):
        ref = randomised(NanochatGPT(gpt["vocab_size"], T, LAYERS, HEADS, KV, C, "SL"), seed)
        write_checkpoint(folder, step, ref.state_dict(), gpt)
    return base, folder, ref, encoding, gpt


def test_the_tokenizer_gives_nanochats_ids(nanochat_base):
    base, _, _, encoding, _ = nanochat_base
    # data.tokenizer may name it: a run stores it as tokenizer.json (the same ids)
    tokenizer = build_tokenizer(str(base / "tokenizer" / "tokenizer.pkl"), [], encoding.n_vocab)
    assert tokenizer.vocab_size == encoding.n_vocab and tokenizer.bos_id == encoding.encode_single_token("<|bos|>")
    for text in (TEXT[:500], "Hello  world!\n\n  123456 ÿ€ 日本語 I'll\t\tx  ", "<|bos|>Speak<|user_start|>hi", "  "):
        ids = tokenizer.encode(text).tolist()
        assert ids == encoding.encode(text, allowed_special="all") and tokenizer.decode(ids) == text


def test_import_computes_nanochats_logits_keeps_its_step_and_generates(nanochat_base, tmp_path, capsys):
    base, folder, ref, encoding, gpt = nanochat_base
    run = tmp_path / "run"
    assert main(["import-nanochat", str(folder), "--out", str(run)]) == 0
    assert json.loads(capsys.readouterr().out) == {"run": str(run), "from": str(folder), "step": 200}
    model, params, step = load_newest(run)
    assert step == 200 and model.vocab_size == gpt["vocab_size"] and model.smear and model.backout
    tokens = np.array([encoding.encode(TEXT[:200])[:T]])
    with torch.no_grad():
        want = ref(torch.from_numpy(tokens)).numpy()
    np.testing.assert_allclose(np.asarray(forward(params, model, tokens)), want, atol=1e-4, rtol=0)
    assert Tokenizer.load(run / "tokenizer.json").encode(TEXT[:300]).tolist() == encoding.encode(TEXT[:300])
    # generate reads it like any run, from <|bos|> as nanochat generates: the greedy
    # continuation of a prompt is the forward pass's after BOS and the prompt.
    assert main(["generate", "--run", str(run), "--prompt", "First Citizen:", "--temperature", "0",
                 "--max-new-tokens", "5"]) == 0
    prompt = [encoding.encode_single_token("<|bos|>"), *encoding.encode("First Citizen:")]
    new = generate(params, model, [prompt], 5, temperature=0.0)[0]
    assert capsys.readouterr().out == "First Citizen:" + encoding.decode(new) + "\n"
    assert new != generate(params, model, [prompt[1:]], 5, temperature=0.0)[0]  # BOS matters to the text
    # --step picks an older checkpoint; the run keeps its step.
    older = tmp_path / "older"
    assert import_nanochat_run(folder, older, step=100)[1] == 100 and load_newest(older)[2] == 100


def test_an_imported_run_trains_on_then_exports_what_it_computes(nanochat_base, tmp_path, capsys):
    """Two steps more with nanochat's optimizer (the RMSNorm gains jaxgpt keeps train too), then
    export: nanochat's GPT loaded from the exported folder computes the trained params' logits."""
    base, folder, _, encoding, gpt = nanochat_base
    run, out = tmp_path / "run", tmp_path / "exported"
    import_nanochat_run(folder, run)
    corpus = tmp_path / "corpus.jsonl"  # documents of many lengths: nanochat's best-fit rows, each opening with BOS
    corpus.write_text("".join(json.dumps({"text": TEXT[:n]}) + "\n" for n in range(20, 800, 9)), encoding="utf-8")
    assert load_config(run / "config.toml").data.align == "bestfit"
    assert main(["train", "--config", str(run / "config.toml"), "--out", str(run), "--resume", "--force",
                 "--data", str(corpus), "--steps", "202",
                 "--no-progress", "--set", "train.batch_size=8", "--set", "train.eval_every=1000",
                 "--set", "train.sample_tokens=0", "--set", "train.warmup_steps=0"]) == 0
    model, params, step = load_newest(run)
    assert step == 202 and not np.allclose(params["final_norm"]["scale"], 1.0)  # the gains moved
    assert main(["export-nanochat", "--run", str(run), "--out", str(out)]) == 0
    assert (out / "tokenizer" / "tokenizer.pkl").read_bytes() == (base / "tokenizer" / "tokenizer.pkl").read_bytes()
    state, meta, saved = read_checkpoint(out / "base_checkpoints" / "d3")
    exported = meta["model_config"]
    assert saved == 202 and {**exported, "window_pattern": None} == {**gpt, "window_pattern": None}
    assert layer_letters(exported["window_pattern"], LAYERS) == layer_letters(gpt["window_pattern"], LAYERS) == "SLL"
    ref = NanochatGPT(gpt["vocab_size"], T, LAYERS, HEADS, KV, C, "SL")
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    tokens = np.array([encoding.encode(TEXT[:200])[:T]])
    with torch.no_grad():
        want = ref(torch.from_numpy(tokens)).numpy()
    np.testing.assert_allclose(np.asarray(forward(params, model, tokens)), want, atol=1e-4, rtol=0)
    assert main(["export-nanochat", "--run", str(run), "--out", str(out)]) == 2  # the same step again: refused


def _copy(folder, to):
    import shutil
    shutil.copytree(folder, to)
    return to


@pytest.mark.parametrize("harm, message", [
    ("no meta", "holds model_000200.pt but no meta_000200.json"),
    ("no model", "holds no model_NNNNNN.pt: not a nanochat checkpoint folder"),
    ("unknown key", "nanochat's state dict does not hold a GPT of this config: unexpected transformer.h.7"),
    ("another vocabulary", "the tokenizer at"),
    ("not a pickle of an Encoding", "is not a nanochat tokenizer.pkl"),
    ("no torch", "needs PyTorch: pip install 'jaxgpt[nanochat]'"),
])
def test_bad_input_is_one_line_and_writes_nothing(nanochat_base, tmp_path, monkeypatch, harm, message):
    base, folder, _, encoding, gpt = nanochat_base
    base = _copy(base, tmp_path / "base")
    folder = base / "base_checkpoints" / "d3"
    if harm == "no meta":
        (folder / "meta_000200.json").unlink()
    elif harm == "no model":
        for f in folder.glob("model_*.pt"):
            f.unlink()
    elif harm == "unknown key":
        state = torch.load(folder / "model_000200.pt")
        state["transformer.h.7.attn.c_q.weight"] = state["transformer.h.0.attn.c_q.weight"]
        torch.save(state, folder / "model_000200.pt")
    elif harm == "another vocabulary":
        write_tokenizer(base / "tokenizer", train_encoding(TEXT, 50))
    elif harm == "not a pickle of an Encoding":
        import pickle
        (base / "tokenizer" / "tokenizer.pkl").write_bytes(pickle.dumps(print))
    else:
        monkeypatch.setitem(sys.modules, "torch", None)
    run = tmp_path / "run"
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")) as refused:
        import_nanochat_run(folder, run)
    assert "\n" not in str(refused.value) and not run.exists()


def test_a_tokenizer_pickle_runs_no_code(tmp_path):
    """A pickle that would call a function is refused before the call."""
    import pickle

    class Trap:
        def __reduce__(self):
            return (print, ("ran",))

    (tmp_path / "tokenizer.pkl").write_bytes(pickle.dumps(Trap()))
    with pytest.raises(UserError, match="builtins.print"):
        read_encoding(tmp_path / "tokenizer.pkl")


@pytest.mark.parametrize("change, key", [("model.mtp_depth=1", "model.mtp_depth"),
                                         ("model.smear=false", "model.smear"),
                                         ("model.attention_window=9", "model.attention_window")])
def test_export_refuses_what_nanochats_gpt_cannot_hold(nanochat_base, tmp_path, change, key):
    _, folder, _, _, _ = nanochat_base
    run = tmp_path / "run"
    import_nanochat_run(folder, run)
    config = (run / "config.toml").read_text()
    section, setting = change.split(".", 1)
    name, value = setting.split("=")
    lines = [f"{name} = {value}" if line.startswith(f"{name} = ") else line for line in config.splitlines()]
    (run / "config.toml").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=f"cannot export to nanochat: {key}"):
        export_nanochat_run(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_run_without_nanochats_tokenizer_is_refused(nanochat_base, tmp_path):
    _, folder, _, _, _ = nanochat_base
    run = tmp_path / "run"
    import_nanochat_run(folder, run)
    (run / "nanochat_tokenizer.pkl").unlink()
    with pytest.raises(UserError, match="has no nanochat tokenizer"):
        export_nanochat_run(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_run_trained_here_on_nanochats_tokenizer_exports_to_nanochat(nanochat_base, tmp_path):
    """A nanochat model trained from scratch on nanochat's tokenizer.pkl (data.tokenizer) keeps
    the pickle and exports: its vocabulary, padded past the tokenizer's, goes out cut to the
    tokenizer's ids (nanochat refuses a model and tokenizer of two sizes), and nanochat's GPT
    loaded from the export computes the run's logits over those ids."""
    import dataclasses

    from jaxgpt.nanochat import TRAIN_OVERRIDES, model_config
    from jaxgpt.train.loop import train

    base, _, _, encoding, gpt = nanochat_base
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": TEXT[:n]}) + "\n" for n in range(20, 800, 9)), encoding="utf-8")
    padded = -(-encoding.n_vocab // 64) * 64 + 64  # a row past nanochat's own padding too
    cfg = load_config(None, [*TRAIN_OVERRIDES, "model.tie_embeddings=false", f"data.source={corpus}",
                             f"data.tokenizer={base / 'tokenizer' / 'tokenizer.pkl'}", "data.align=bestfit",
                             "train.steps=2", "train.batch_size=8", "train.eval_every=1000", "train.sample_tokens=0",
                             "train.warmup_steps=0"])
    cfg = dataclasses.replace(cfg, model=model_config({**gpt, "vocab_size": padded}))
    run, out = tmp_path / "run", tmp_path / "exported"
    train(cfg, run, progress=False)
    assert (run / "nanochat_tokenizer.pkl").read_bytes() == (base / "tokenizer" / "tokenizer.pkl").read_bytes()
    export_nanochat_run(run, out)
    state, meta, step = read_checkpoint(out / "base_checkpoints" / "d3")
    assert step == 2 and meta["model_config"]["vocab_size"] == encoding.n_vocab
    ref = NanochatGPT(encoding.n_vocab, T, LAYERS, HEADS, KV, C, "SL")
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    model, params, _ = load_newest(run)
    tokens = np.array([encoding.encode(TEXT[:200])[:T]])
    with torch.no_grad():
        want = ref(torch.from_numpy(tokens)).numpy()
    np.testing.assert_allclose(np.asarray(forward(params, model, tokens))[..., :encoding.n_vocab], want, atol=1e-4, rtol=0)
