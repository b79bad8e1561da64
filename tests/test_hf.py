"""Hugging Face import/export: logits and greedy generation match transformers on tiny random models."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxgpt.config import ModelConfig
from jaxgpt.evaluation.generate import generate
from jaxgpt.hf.exporter import export_hf
from jaxgpt.hf.importer import import_hf
from jaxgpt.model.decoder import forward, init_params
from jaxgpt.train.imported import import_hf_run

VOCAB = 100
TOL = 1e-4


def _save(model, path):
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def _gpt2(path, vocab=VOCAB):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # GPT-2 inits biases and norms to constants; make every weight matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return _save(model, path)


def _llama(path, **options):
    torch.manual_seed(1)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, **options)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return _save(model, path)


def _hf_logits(path, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def _tokens(seed, batch=2, length=24):
    return np.random.default_rng(seed).integers(0, VOCAB, (batch, length), dtype=np.int32)


MODELS = {
    "gpt2": lambda p: _gpt2(p),
    "llama_gqa_tied": lambda p: _llama(p, tie_word_embeddings=True),
    "llama_linear_untied": lambda p: _llama(p, tie_word_embeddings=False, rope_theta=500.0,
                                            rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


@pytest.fixture(scope="module", params=list(MODELS))
def hf_model(request, tmp_path_factory):
    path = MODELS[request.param](tmp_path_factory.mktemp(request.param))
    cfg, params = import_hf(path)
    return request.param, path, cfg, params


def test_imported_config(hf_model):
    name, _, cfg, params = hf_model
    assert cfg.n_layers == 2 and cfg.d_model == 32 and cfg.vocab_size == VOCAB
    shapes = jax.tree_util.tree_map(lambda a: a.shape, params)
    expected = jax.tree_util.tree_map(lambda a: a.shape, init_params(cfg, jax.random.key(0)))
    assert shapes == expected
    if name == "gpt2":
        assert (cfg.position, cfg.norm, cfg.feed_forward, cfg.bias, cfg.tie_embeddings) == \
            ("learned", "layernorm", "gelu", True, True)
    else:
        assert (cfg.position, cfg.norm, cfg.feed_forward, cfg.kv_heads) == ("rope", "rmsnorm", "swiglu", 2)
    if name == "llama_linear_untied":
        assert (cfg.rope_scale, cfg.rope_base, cfg.tie_embeddings) == (2.0, 500.0, False)


def test_logits_match_transformers(hf_model):
    _, path, cfg, params = hf_model
    tokens = _tokens(0)
    ours = np.asarray(forward(params, cfg, tokens))
    theirs = _hf_logits(path, tokens)
    diff = float(np.abs(ours - theirs).max())
    print(f"max abs logit diff {path.name}: {diff:.2e}")
    assert diff <= TOL
    assert float(np.abs(theirs).max()) > 0.05  # the comparison is not between near-zero logits


def test_greedy_generation_matches_transformers(hf_model):
    _, path, cfg, params = hf_model
    prompt = _tokens(1, batch=1, length=8)
    ours = generate(params, cfg, [prompt[0].tolist()], 32, temperature=0.0)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor(prompt, dtype=torch.long), do_sample=False, max_new_tokens=32,
                             min_new_tokens=32, pad_token_id=0, eos_token_id=None)
    assert ours == out[0, 8:].tolist()


def test_export_round_trip(hf_model, tmp_path):
    _, path, cfg, params = hf_model
    export_hf(cfg, params, tmp_path / "out")
    tokens = _tokens(2)
    np.testing.assert_allclose(_hf_logits(tmp_path / "out", tokens), _hf_logits(path, tokens), atol=1e-5, rtol=0)
    cfg2, params2 = import_hf(tmp_path / "out")
    assert cfg2 == cfg
    jax.tree_util.tree_map(np.testing.assert_array_equal, params2, params)


def _perturbed(params, seed, std=0.05):
    """Params whose biases and norm weights are not their constant initial values, so each one counts."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda leaf: np.asarray(leaf) + rng.normal(0, std, leaf.shape).astype(np.float32),
                                  params)


def test_native_model_exports(tmp_path):
    """A model trained here (not imported) with Llama's options, biases included, exports to the same logits."""
    cfg = ModelConfig(vocab_size=VOCAB, context_length=32, d_model=32, n_heads=4, kv_heads=1, position="rope",
                      norm="rmsnorm", feed_forward="swiglu", tie_embeddings=False, rope_scale=4.0, bias=True)
    params = _perturbed(init_params(cfg, jax.random.key(3)), 3)
    export_hf(cfg, params, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["attention_bias"] is True
    tokens = _tokens(3)
    diff = np.abs(_hf_logits(tmp_path, tokens) - np.asarray(forward(params, cfg, tokens))).max()
    assert diff <= TOL
    cfg2, params2 = import_hf(tmp_path)
    assert cfg2 == cfg
    jax.tree_util.tree_map(np.testing.assert_array_equal, params2, params)


def _edit_config(path, **changes):
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))


@pytest.mark.parametrize("family, change, option", [
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ("gpt2", {"activation_function": "relu"}, "activation_function"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "rope_parameters": None}, "rope_scaling"),
    ("llama", {"attention_bias": True, "mlp_bias": False}, "attention_bias"),
    ("llama", {"head_dim": 16}, "head_dim"),
    ("llama", {"model_type": "mistral"}, "model_type"),
])
def test_unsupported_options_are_named(tmp_path, family, change, option):
    path = (_gpt2 if family == "gpt2" else _llama)(tmp_path)
    _edit_config(path, **change)
    with pytest.raises(ValueError, match=option):
        import_hf(path)


@pytest.mark.parametrize("options, option", [
    ({"residual": "post"}, "residual"),
    ({"norm": "rmsnorm", "bias": True}, "norm"),
    ({"feed_forward": "swiglu"}, "feed_forward"),
    ({"position": "rope", "norm": "layernorm"}, "norm"),
    ({"position": "sinusoidal", "norm": "rmsnorm", "feed_forward": "swiglu"}, "position = 'sinusoidal'"),
    ({"smear": True}, "smear = True"),
    ({"backout": True}, "backout = True"),
    ({"bigram_hash_rows": 64}, "bigram_hash_rows = 64"),
    ({"exclusive_self_attention": True}, "exclusive_self_attention = True"),
])
def test_unexportable_configs(tmp_path, options, option):
    """What neither GPT-2 nor Llama holds is refused, in one line, before the params are looked at."""
    cfg = ModelConfig(**{"vocab_size": VOCAB, "context_length": 16, "d_model": 16, "n_layers": 1, "n_heads": 2,
                         **({"d_model": 24} if options.get("smear") else {}), **options})
    with pytest.raises(ValueError, match=option) as refused:
        export_hf(cfg, {}, tmp_path / "out")
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_import_run_loads(tmp_path):
    from jaxgpt.train.checkpoint import load_run

    path = _llama(tmp_path / "hf", tie_word_embeddings=False)
    cfg, params = import_hf(path)
    import_hf_run(path, tmp_path / "run")
    run_cfg, run_params = load_run(tmp_path / "run")
    assert run_cfg == cfg
    jax.tree_util.tree_map(np.testing.assert_array_equal, run_params, params)
    with pytest.raises(ValueError, match="already holds a run"):
        import_hf_run(path, tmp_path / "run")


def test_cli_import_generate_export(tmp_path, capsys):
    from jaxgpt.cli.main import main
    from jaxgpt.data.tokenizer import Tokenizer, build_char

    hf_dir = _gpt2(tmp_path / "hf")
    build_char(["abcdefghijklmnopqrstuvwxyz \n"], VOCAB).save(hf_dir / "tokenizer.json")
    run = tmp_path / "run"
    assert main(["import-hf", str(hf_dir), "--out", str(run)]) == 0
    assert (run / "tokenizer.json").is_file() and (run / "config.toml").is_file()

    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompt", "abc", "--temperature", "0",
                 "--max-new-tokens", "6"]) == 0
    text = capsys.readouterr().out
    tokenizer = Tokenizer.load(run / "tokenizer.json")
    cfg, params = import_hf(hf_dir)
    new = generate(params, cfg, [tokenizer.encode("abc").tolist()], 6, temperature=0.0,
                   vocab_limit=tokenizer.vocab_size)[0]
    assert text == "abc" + tokenizer.decode(new) + "\n"

    out = tmp_path / "exported"
    assert main(["export-hf", "--run", str(run), "--out", str(out)]) == 0
    tokens = _tokens(4)
    np.testing.assert_allclose(_hf_logits(out, tokens), _hf_logits(hf_dir, tokens), atol=1e-5, rtol=0)
    assert (out / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    assert main(["import-hf", str(hf_dir), "--out", str(run)]) == 2  # refuses to overwrite a run


def test_train_init_from_fine_tunes_and_resumes(tmp_path, capsys):
    from jaxgpt.cli.main import main
    from jaxgpt.data.tokenizer import build_char
    from jaxgpt.train.checkpoint import load_run

    hf_dir = _gpt2(tmp_path / "hf")
    build_char(["abcdefghijklmnopqrstuvwxyz \n"], VOCAB).save(hf_dir / "tokenizer.json")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat and the dog ran to it\n" * 60, encoding="utf-8")
    run = tmp_path / "run"
    # A crop to 16 learned positions and a fresh MTP adapter; lr so small the weights stay put.
    common = ["--init-from", str(hf_dir), "--data", str(corpus), "--out", str(run), "--no-progress",
              "--set", "model.context_length=16", "--set", "model.mtp_depth=1", "--set", "train.batch_size=8",
              "--set", "train.lr=1e-12", "--set", "train.min_lr=1e-12", "--set", "train.warmup_steps=0",
              "--set", "train.eval_every=2", "--set", "train.eval_batches=1", "--set", "train.sample_tokens=4"]
    assert main(["train", "--steps", "2", *common]) == 0
    cfg, params = load_run(run)
    hf_cfg, hf_params = import_hf(hf_dir)
    assert (cfg.d_model, cfg.n_layers, cfg.context_length, cfg.mtp_depth) == (hf_cfg.d_model, 2, 16, 1)
    np.testing.assert_allclose(params["blocks"]["attention"]["qkv"]["kernel"],
                               hf_params["blocks"]["attention"]["qkv"]["kernel"], atol=1e-8)
    np.testing.assert_allclose(params["position_embedding"]["embedding"],
                               hf_params["position_embedding"]["embedding"][:16], atol=1e-8)
    assert "mtp_0" in params
    # The fine-tuned run records its data like any run: resuming needs no --force.
    assert main(["train", "--steps", "4", "--resume", *common]) == 0
    assert "resuming" in capsys.readouterr().err

    # A config that contradicts the checkpoint is refused before anything is written.
    other = tmp_path / "other"
    args = ["train", "--init-from", str(hf_dir), "--data", str(corpus), "--out", str(other), "--set", "model.d_model=64"]
    assert main(args) == 2
    assert "model.d_model = 64 here, 32 in the checkpoint" in capsys.readouterr().err
    assert not other.exists()


def test_init_from_takes_the_keys_that_leave_the_weights_function_alone(tmp_path):
    """The INIT_FROM keys (jaxgpt.config) may differ from the checkpoint's; the others are refused by name."""
    import dataclasses

    from jaxgpt.hf.importer import load_into

    hf_dir = _gpt2(tmp_path / "hf")
    imported_cfg, imported = import_hf(hf_dir)
    for change in ({"kernels": "xla"}, {"remat": "dots"}, {"dtype": "bfloat16"}, {"dropout": 0.1}):
        model = dataclasses.replace(imported_cfg, **change)
        params = load_into(model, hf_dir, init_params(model, jax.random.key(0)))
        np.testing.assert_array_equal(params["blocks"]["attention"]["qkv"]["kernel"],
                                      imported["blocks"]["attention"]["qkv"]["kernel"])
    with pytest.raises(ValueError, match="model.norm_eps = 0.001 here"):
        model = dataclasses.replace(imported_cfg, norm_eps=1e-3)
        load_into(model, hf_dir, init_params(model, jax.random.key(0)))


def test_init_from_a_name_that_is_no_directory_explains_the_download(tmp_path, monkeypatch):
    from jaxgpt.hf.importer import resolve_source

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no hub here: the download fails at once
    with pytest.raises(FileNotFoundError, match="could not be downloaded from the Hugging Face hub"):
        resolve_source("someone/no-such-model")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        resolve_source(tmp_path / "file")


# ------------------------------------------------------------ export-hf of a run trained here

CHAR_CORPUS = "The cat sat on the mat.\n\tTabs,  two spaces,\n\n\nthree newlines; digits 0123!\n"
EXPORTED = {  # learned positions: exported as GPT-2, with zero biases, repeated K/V heads, no MTP
    "default": {},
    "untied_gqa_mtp": {"tie_embeddings": False, "kv_heads": 2, "mtp_depth": 1},
}


def _export_run(run, out, *extra):
    """`jaxgpt export-hf` on `run`: (exit status, stdout, stderr)."""
    from jaxgpt.cli.main import main

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = main(["export-hf", "--run", str(run), "--out", str(out), *extra])
    return status, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module", params=list(EXPORTED))
def exported_run(request, tmp_path_factory):
    """A run's model (the defaults but for size) with a char tokenizer, exported by the CLI once.

    The run's checkpoint is stood in for by patching `load_run`: what is tested is the export.
    """
    from jaxgpt.data.tokenizer import build_char

    cfg = ModelConfig(vocab_size=VOCAB, context_length=32, d_model=32, n_heads=4, **EXPORTED[request.param])
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))  # traced, not compiled
    params = _perturbed(jax.tree_util.tree_map(lambda s: np.zeros(s.shape, np.float32), shapes), 5, std=0.3)
    folder = tmp_path_factory.mktemp(request.param)
    run, out = folder / "run", folder / "hf"
    tokenizer = build_char([CHAR_CORPUS], VOCAB)
    tokenizer.save(run / "tokenizer.json")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("jaxgpt.train.checkpoint.load_run", lambda path: (cfg, params))
        status, stdout, stderr = _export_run(run, out)
        refused = _export_run(run, out)  # the same --out again, now not empty
    assert status == 0, stderr
    return cfg, params, tokenizer, run, out, stdout, stderr, refused


def test_default_config_exports_as_gpt2(exported_run):
    cfg, params, _, _, out, stdout, stderr, _ = exported_run
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"
    tokens = _tokens(6, length=32)
    ours = np.asarray(forward(params, cfg, tokens))
    diff = float(np.abs(_hf_logits(out, tokens) - ours).max())
    assert diff <= TOL
    assert float(np.abs(ours).max()) > 0.05
    if cfg.mtp_depth:  # what is left out is said, on stderr and in the JSON line
        assert "mtp_0" in stderr and "not exported" in stderr
        assert json.loads(stdout)["dropped"] == ["mtp_0"]
    else:
        assert stderr == "" and json.loads(stdout)["dropped"] == []


TOKENIZER_TEXTS = ["The cat sat on the mat.", "  leading and trailing  ", "\n", "\n\n\n\t\ts", "",
                   "digits 0123 thhhe  ,,;;!\n\n", CHAR_CORPUS * 3]


def test_exported_char_tokenizer_gives_the_runs_ids(exported_run):
    _, _, tokenizer, _, out, _, _, _ = exported_run
    auto = transformers.AutoTokenizer.from_pretrained(out)
    # The end-of-text token is named where transformers and the harness's hf backend look for it.
    assert auto.eos_token == "<|endoftext|>" and auto.eos_token_id == tokenizer.eot_id
    assert json.loads((out / "special_tokens_map.json").read_text())["eos_token"] == "<|endoftext|>"
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == tokenizer.eot_id
    for text in TOKENIZER_TEXTS:
        ids = auto(text)["input_ids"]
        assert ids == tokenizer.encode(text).tolist(), repr(text)
        assert auto.decode(ids) == tokenizer.decode(ids) == text
    for unseen in ("café", "The fox", "\r\n"):  # characters outside the corpus: neither gives ids
        with pytest.raises(ValueError, match="not in the char tokenizer's vocabulary"):
            tokenizer.encode(unseen)
        with pytest.raises(Exception, match="UNK|unknown|Missing"):
            auto(unseen)


def test_export_into_a_non_empty_folder_needs_force(exported_run, tmp_path, monkeypatch):
    cfg, params, _, run, out, _, _, (status, _, stderr) = exported_run
    assert status == 2
    assert stderr.count("\n") == 1 and "--force" in stderr and "not empty" in stderr
    target = tmp_path / "hf"
    shutil.copytree(out, target)
    (target / "tokenizer.json").unlink()
    (target / "notes.txt").write_text("the user's")
    weights = (target / "model.safetensors").read_bytes()
    monkeypatch.setattr("jaxgpt.train.checkpoint.load_run", lambda path: (cfg, params))
    assert _export_run(run, target)[0] == 2
    assert (target / "model.safetensors").read_bytes() == weights and not (target / "tokenizer.json").exists()
    assert _export_run(run, target, "--force")[0] == 0
    assert (target / "tokenizer.json").is_file() and (target / "notes.txt").read_text() == "the user's"
    (tmp_path / "file").write_text("x")
    status, _, stderr = _export_run(run, tmp_path / "file")
    assert status == 2 and "is a file" in stderr


# ------------------------------------------------------------ train --init-from: the folder's tokenizer

def test_init_from_without_a_tokenizer_stops_before_writing(tmp_path, capsys):
    from jaxgpt.cli.main import main

    hf_dir = _gpt2(tmp_path / "hf")  # config.json and weights, no tokenizer files
    capsys.readouterr()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\n" * 50, encoding="utf-8")
    run = tmp_path / "run"
    args = ["train", "--init-from", str(hf_dir), "--data", str(corpus), "--out", str(run), "--steps", "1",
            "--no-progress", "--set", "train.batch_size=2", "--set", "train.eval_every=1",
            "--set", "train.eval_batches=1", "--set", "train.sample_tokens=0"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no tokenizer.json" in err and "data.tokenizer" in err
    assert not run.exists()


def _gpt2_vocab_and_merges(folder, corpus):
    """GPT-2's tokenizer files (vocab.json with <|endoftext|> last, merges.txt) for a BPE learned on `corpus`."""
    from jaxgpt.data.tokenizer import train_bpe

    model = json.loads(train_bpe([corpus], 300).save(folder / "bpe.json").read_text())["model"]
    (folder / "bpe.json").unlink()
    vocab = {**model["vocab"], "<|endoftext|>": len(model["vocab"])}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(m + "\n" for m in merges), encoding="utf-8")
    return len(vocab)


def test_init_from_uses_gpt2_vocab_and_merges(tmp_path, monkeypatch):
    from jaxgpt.cli.main import main
    from jaxgpt.data.tokenizer import build_tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat, and the dog ran to it!\n\n" * 30, encoding="utf-8")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    vocab = _gpt2_vocab_and_merges(hf_dir, corpus.read_text())
    _gpt2(hf_dir, vocab=vocab)
    seen = {}

    class Stop(Exception):
        pass

    def train(cfg, **kwargs):  # the run itself is another test's matter: stop once the config is known
        seen["cfg"] = cfg
        raise Stop

    monkeypatch.setattr("jaxgpt.train.loop.train", train)
    with pytest.raises(Stop):
        main(["train", "--init-from", str(hf_dir), "--data", str(corpus), "--out", str(tmp_path / "run")])
    ours = build_tokenizer(seen["cfg"].data.tokenizer, [], vocab)
    theirs = transformers.GPT2Tokenizer(str(hf_dir / "vocab.json"), str(hf_dir / "merges.txt"))
    for text in ["the cat sat", " the dog  ran\n\nto it!<|endoftext|>Then", "naïve café 🙂\t\r\n", "QQQ zz"]:
        assert ours.encode(text).tolist() == theirs(text)["input_ids"], repr(text)
