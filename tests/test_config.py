"""Config: defaults, TOML and overrides, validation messages, fingerprints."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from jaxgpt.cli.main import main
from jaxgpt.config import ConfigError, DataConfig, ModelConfig, RunConfig, TrainConfig, build_config, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_the_day1_baseline():
    cfg = ModelConfig()
    assert (cfg.vocab_size, cfg.context_length, cfg.d_model, cfg.n_layers, cfg.n_heads) == (1024, 128, 128, 2, 4)
    assert (cfg.kv_heads, cfg.hidden_size, cfg.norm_eps, cfg.init_std) == (4, 512, 1e-5, 0.02)
    assert (cfg.position, cfg.norm, cfg.residual, cfg.feed_forward) == ("learned", "layernorm", "pre", "gelu")
    assert cfg.tie_embeddings and not cfg.bias and cfg.dropout == 0.0


def test_toml_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\nd_model = 64\nposition = "rope"\n[train]\nlr = 1\n')
    cfg = load_config(path, ["model.n_layers=3", "model.norm=rmsnorm", "train.steps=7", "data.source=hf:x:train"])
    assert (cfg.model.d_model, cfg.model.position, cfg.model.n_layers, cfg.model.norm) == (64, "rope", 3, "rmsnorm")
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float) and cfg.train.steps == 7
    assert cfg.data.source == "hf:x:train"
    assert cfg.model.hidden_size == 256  # derived from the overridden width


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config(None, ["model.position=rope", "model.kv_heads=2"])
    path = tmp_path / "resolved.toml"
    path.write_text(cfg.to_toml())
    again = load_config(path)
    assert again == cfg and again.fingerprint() == cfg.fingerprint()


def test_fingerprint_tracks_every_value():
    a = RunConfig()
    assert a.fingerprint() == RunConfig().fingerprint()
    assert a.fingerprint() != load_config(None, ["model.dropout=0.1"]).fingerprint()
    longer = load_config(None, ["train.steps=99"])
    assert longer.fingerprint() != a.fingerprint()
    assert longer.fingerprint(exclude=("train.steps",)) == a.fingerprint(exclude=("train.steps",))


def test_remat_names_a_policy_and_takes_true_and_false_as_before(tmp_path):
    assert [load_config(None, [f"model.remat={v}"]).model.remat for v in ("false", "true", "dots", "none")] == [
        "none", "full", "dots", "none"]
    assert ModelConfig(remat=True).remat == "full" and ModelConfig(remat=False).remat == "none"
    old = tmp_path / "old.toml"  # a run's config.toml from before the policies
    old.write_text("[model]\nremat = true\n")
    assert load_config(old).model.remat == "full"
    # What is recomputed does not change the numbers: not part of the config's identity.
    assert load_config(None, ["model.remat=dots"]).fingerprint() == RunConfig().fingerprint()


def test_every_key_declares_its_roles_once_and_the_rules_read_them():
    from dataclasses import fields

    from jaxgpt.config import FORCE, IDENTITY, INIT_FROM, RESUME, ROLES, SECTIONS, SWEEP, all_keys, keys_with, roles_of
    from jaxgpt.tools.sweep import VMAPPED_KEYS
    from jaxgpt.model.knobs import Knobs
    from jaxgpt.train.optim import OptHParams

    for section, cls in SECTIONS.items():
        for f in fields(cls):
            assert "roles" in f.metadata, f"{section}.{f.name} declares no roles"
            assert f.metadata["roles"] <= set(ROLES)
    assert len(all_keys()) == sum(len(fields(cls)) for cls in SECTIONS.values())
    # The model is never --force's; the tokenizer and the optimiser neither.
    assert not [k for k in keys_with(FORCE) if k.startswith("model.")]
    assert "data.tokenizer" not in keys_with(FORCE) and "train.optimizer" not in keys_with(FORCE)
    # A sweep group varies the seed and exactly the optimiser values and muP numbers its vmapped step takes.
    assert set(VMAPPED_KEYS) == set(keys_with(SWEEP)) == {"train.seed", *(f"train.{n}" for n in OptHParams._fields),
                                                          *(f"model.{n}" for n in Knobs._fields)}
    assert {"model.kernels", "model.remat"} <= set(keys_with(RESUME)) & set(keys_with(INIT_FROM, None))
    # The fingerprint changes with every IDENTITY key and with no other.
    base = RunConfig()
    for dotted in all_keys():
        section, name = dotted.split(".", 1)
        value = getattr(getattr(base, section), name)
        other = {bool: lambda v: not v, int: lambda v: 2 * v if v else 1, float: lambda v: v / 2 if v else 0.25}.get(
            type(value), lambda v: {"kernels": "xla", "remat": "dots", "parallel": "pmap", "optimizer": "muon",
                                    "position": "rope", "norm": "rmsnorm", "residual": "post",
                                    "feed_forward": "swiglu", "dtype": "bfloat16", "window_pattern": "SL",
                                    "align": "document", "parametrization": "mup", "trackers": ["wandb"],
                                    "value_embeds_layout": "alternating", "init_scheme": "nanochat",
                                    "schedule": "warmdown", "adam_groups": "nanochat",
                                    "muon_orthogonalizer": "polar_express", "muon_momentum_schedule": "nanochat",
                                    "muon_decay_schedule": "cosine", "future_token_weights": [0.5],
                                    "paired_head_layers": [0]}.get(name, "other"))(value)
        if value is None:  # a key that follows another (the group peaks follow train.lr)
            other = 1e-3
        if name == "bigram_hash_rows":  # one row would hold no pair
            other = 2
        if name in ("kv_heads", "hidden_size", "eval_tasks_every", "ffn_match_params", "eval_tasks", "lr_head",
                    "rope_truncated", "window_warmup_steps", "value_gate"):
            continue  # derived or validated against others: covered by their neighbours
        # Muon's parts need train.optimizer = "muon"; a zero readout, an untied head.
        needs = ["train.optimizer=muon"] if name.startswith("muon_") and name != "muon_lr" else \
            ["model.tie_embeddings=false"] if name == "zero_init_readout" else []
        if needs:
            changed = load_config(None, [*needs, f"{dotted}={json.dumps(other)}"])
            assert changed.fingerprint() != load_config(None, needs).fingerprint() and IDENTITY in roles_of(dotted), dotted
            continue
        changed = load_config(None, [f"{dotted}={json.dumps(other)}"])
        assert (changed.fingerprint() != base.fingerprint()) == (IDENTITY in roles_of(dotted)), dotted


def test_a_key_added_at_a_default_that_keeps_the_model_leaves_every_fingerprint(monkeypatch):
    """So sweeps find their records again after the code gains a key: the config as a tree
    without model.smear had it fingerprints as it does with the key off."""
    import jaxgpt.config as config

    cfg = load_config(None, ["model.d_model=64", "model.n_heads=2", "train.lr=1e-3"])
    fingerprints = {cfg.fingerprint()}
    assert cfg.replace("model", smear=True).fingerprint() not in fingerprints
    as_dict = RunConfig.to_dict

    def before_the_key(self):
        data = as_dict(self)
        data["model"].pop("smear")
        return data

    monkeypatch.setattr(RunConfig, "to_dict", before_the_key)
    config._default_values.cache_clear()
    fingerprints.add(cfg.fingerprint())
    config._default_values.cache_clear()
    assert len(fingerprints) == 1


def test_ffn_match_params_gives_swiglu_the_gelu_layers_parameters(tmp_path):
    swiglu = load_config(None, ["model.d_model=256", "model.feed_forward=swiglu", "model.ffn_match_params=true"])
    assert swiglu.model.hidden_size == 680  # 2/3 x 1,024 = 682.7, the nearest multiple of 8
    assert 3 * 256 * 680 <= 2 * 256 * 1024 < 3 * 256 * 688
    assert [ModelConfig(d_model=d, n_heads=1, feed_forward="swiglu", ffn_match_params=True).hidden_size
            for d in (2, 128, 130, 768)] == [8, 344, 344, 2048]
    # GELU is the layer matched against: its width stays 4 x d_model.
    assert ModelConfig(d_model=256, ffn_match_params=True).hidden_size == 1024
    # The resolved config names the width and the rule together; it loads again unchanged.
    path = tmp_path / "resolved.toml"
    path.write_text(swiglu.to_toml())
    assert load_config(path) == swiglu
    assert ModelConfig(d_model=256, feed_forward="swiglu", ffn_match_params=True, hidden_size=680) == swiglu.model
    # The rule only chooses hidden_size: the same width chosen by hand has the same fingerprint.
    by_hand = load_config(None, ["model.d_model=256", "model.feed_forward=swiglu", "model.hidden_size=680"])
    assert by_hand.fingerprint() == swiglu.fingerprint()


def test_ffn_match_params_refuses_another_explicit_hidden_size():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.feed_forward=swiglu", "model.ffn_match_params=true", "model.hidden_size=512"])
    assert str(err.value) == ("model.hidden_size = 512 contradicts model.ffn_match_params = true, which sets "
                              "it to 344 for swiglu at d_model 128; drop one of them")
    with pytest.raises(ConfigError, match="contradicts model.ffn_match_params"):
        ModelConfig(ffn_match_params=True, hidden_size=344)  # GELU's matched width is 512
    with pytest.raises(ConfigError, match="model.ffn_match_params = 1 must be true or false"):
        load_config(None, ["model.ffn_match_params=1"])


@pytest.mark.parametrize("overrides,message", [
    (["model.d_model=130"], "model.d_model = 130 is not divisible by model.n_heads = 4"),
    (["model.kv_heads=3"], "model.n_heads = 4 is not divisible by model.kv_heads = 3"),
    (["model.norm=batchnorm"], "model.norm = 'batchnorm' is not one of layernorm, rmsnorm"),
    (["model.position=alibi"], "model.position = 'alibi' is not one of learned, rope, sinusoidal"),
    (["model.position=sinusoidal", "model.d_model=9", "model.n_heads=1"],
     "model.position = 'sinusoidal' needs an even d_model, got 9"),
    (["model.position=rope", "model.d_model=36", "model.n_heads=4"],
     "model.position = 'rope' needs an even head size, got 9"),
    (["model.dropout=1.0"], "model.dropout = 1.0 must be in [0, 1)"),
    (["model.dropout=-0.1"], "model.dropout = -0.1 must be in [0, 1)"),
    (["model.n_layers=5", "model.value_embeds=2", "model.value_embeds_layout=alternating"],
     "model.value_embeds = 2 with value_embeds_layout = 'alternating' must be (n_layers + 1) // 2 = 3"),
    (["model.value_embeds_layout=every"], "model.value_embeds_layout = 'every' is not one of ends, alternating"),
    (["model.value_gate=true"], "model.value_gate gates the value tables' lookups: it needs model.value_embeds > 0"),
    (["model.smear=true", "model.d_model=16"], "model.smear reads the first 24 channels: it needs d_model >= 24, got 16"),
    (["model.bigram_hash_rows=1"], "model.bigram_hash_rows = 1 leaves no row for the pairs: 0 (off) or at least 2"),
    (["model.bigram_hash_rows=-5"], "model.bigram_hash_rows = -5 must be >= 0"),
    (["model.value_gate=true", "model.value_embeds=1", "model.d_model=8"],
     "model.value_gate reads the first 12 channels: it needs d_model >= 12, got 8"),
    (["model.init_scheme=nanochat", "model.parametrization=mup"], "model.init_scheme = 'nanochat' draws its own"),
    (["model.init_scheme=xavier"], "model.init_scheme = 'xavier' is not one of normal, nanochat"),
    (["train.muon_beta2=0.9"], "train.muon_beta2 is one of Muon's parts: it needs train.optimizer = 'muon'"),
    (["train.optimizer=muon", "train.muon_beta2=1"], "train.muon_beta2 = 1.0 must be in [0, 1)"),
    (["train.optimizer=muon", "train.muon_orthogonalizer=svd"],
     "train.muon_orthogonalizer = 'svd' is not one of newton_schulz, polar_express"),
    (["train.schedule=linear"], "train.schedule = 'linear' is not one of cosine, warmdown"),
    (["train.warmdown_ratio=1.5"], "train.warmdown_ratio = 1.5 must be in [0, 1]"),
    (["train.adam_groups=torch"], "train.adam_groups = 'torch' is not one of jaxgpt, nanochat"),
    (["train.adam_reference_width=-768"], "train.adam_reference_width = -768 must be >= 0"),
    (["train.future_token_weights=[0.5, -0.25]"],
     "train.future_token_weights = [0.5, -0.25] holds -0.25: each weight must be a finite number > 0"),
    (["train.future_token_weights=[0.5, nan]"], "holds nan: each weight must be a finite number > 0"),
    (["train.future_token_weights=[\"a\"]"], "train.future_token_weights = ['a'] must be a list of numbers"),
    (["model.n_head=2"], "unknown config key model.n_head (did you mean 'n_heads'?)"),
    (["modle.n_heads=2"], "unknown config section 'modle' (did you mean 'model'?)"),
    (["model.d_model=big"], "model.d_model = 'big' must be an integer"),
    (["model.bias=1"], "model.bias = 1 must be true or false"),
    (["train.lr=\"fast\""], "train.lr = 'fast' must be a number"),
    (["data.source=3"], "data.source = 3 must be a string"),
    (["train.lr=nan"], "train.lr = nan must be a finite number"),
    (["train.min_lr=-inf"], "train.min_lr = -inf must be a finite number"),
    (["model.rope_base=inf"], "model.rope_base = inf must be a finite number"),
    (["train.clip_norm=+inf"], "train.clip_norm = inf must be a finite number"),
    (["data.val_fraction=nan"], "data.val_fraction = nan must be a finite number"),
    (["train.batch_size=10", "train.grad_accum=3"], "train.batch_size = 10 is not divisible by train.grad_accum = 3"),
    (["model.n_layers"], "must look like section.key=value"),
    (["train.optimizer=sgd"], "train.optimizer = 'sgd' is not one of adamw, muon"),
    (["train.muon_lr=0"], "train.muon_lr"),
    (["train.eval_task=hellaswag"], "unknown config key train.eval_task (did you mean 'eval_tasks'?)"),
    (["train.eval_tasks=hellaswag,,arc_easy"], "train.eval_tasks = 'hellaswag,,arc_easy' has an empty name"),
    (["train.eval_tasks_every=0"], "train.eval_tasks_every = 0 must be > 0"),
    (["train.eval_tasks_limit=-1"], "train.eval_tasks_limit = -1 must be >= 0"),
    (["model.remat=some"], "model.remat = 'some' is not one of none, dots, full"),
    (["model.remat=1"], "model.remat = 1 must be a string"),
])
def test_validation_names_the_key_and_why(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_eval_tasks_default_to_every_eval_and_take_bare_names():
    cfg = load_config(None, ["train.eval_every=40", "train.eval_tasks=hellaswag, lambada_openai"])
    assert cfg.train.eval_tasks_every == 40 and cfg.train.eval_tasks == "hellaswag, lambada_openai"
    assert load_config(None, ["train.eval_tasks_every=7"]).train.eval_tasks_every == 7


@pytest.mark.parametrize("make", [lambda: ModelConfig(norm_eps=float("nan")), lambda: DataConfig(val_fraction=math.inf),
                                  lambda: TrainConfig(weight_decay=float("nan"))])
def test_dataclasses_refuse_nan_and_inf_however_built(make):
    with pytest.raises(ConfigError, match="must be a finite number"):
        make()


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="must be a table"):
        build_config({"model": 3})


def test_dry_run_day1_prints_the_acceptance_line():
    out = subprocess.run([sys.executable, "-m", "jaxgpt", "dry-run", "--config", "experiments/day1.toml"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    record = json.loads(out.stdout)
    assert record["parameters"] == 541952 and record["logits_shape"] == [1, 128, 1024]
    assert record["config_sha256"] == load_config(ROOT / "experiments/day1.toml").fingerprint()


def test_dry_run_bad_input_is_one_line_without_traceback():
    out = subprocess.run([sys.executable, "-m", "jaxgpt", "dry-run", "--set", "model.d_model=130"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0 and "not divisible" in out.stderr


@pytest.mark.parametrize("args,message", [
    (["--set", "model.position=alibi"], "is not one of learned, rope"),
    (["--set", "model.kv_heads=3"], "not divisible by model.kv_heads"),
    (["--seq-len", "129"], "sequence exceeds context_length"),
    (["--config", "missing.toml"], "config file not found"),
    (["--fit", "--headroom", "1.5"], "--headroom 1.5: a share of the chip's memory, in (0, 1]"),
    (["--headroom", "0"], "--headroom 0.0: a share of the chip's memory, in (0, 1]"),
])
def test_dry_run_errors_in_process(args, message, capsys):
    assert main(["dry-run", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_base_config_under_the_file_and_overrides(tmp_path):
    from jaxgpt.config import DataConfig, ModelConfig, RunConfig

    base = RunConfig(model=ModelConfig(d_model=64, n_heads=2), data=DataConfig(tokenizer="char"))
    path = tmp_path / "c.toml"
    path.write_text("[model]\nn_heads = 4\n[train]\nsteps = 7\n", encoding="utf-8")
    cfg = load_config(path, ["model.n_layers=3"], base=base)
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.n_layers) == (64, 4, 3)
    assert cfg.data.tokenizer == "char" and cfg.train.steps == 7
    assert load_config(None, [], base=base) == base


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "experiments").glob("*.toml") if "[model]" in p.read_text()),
                         ids=lambda p: p.name)
def test_committed_run_configs_load(path):
    cfg = load_config(path)
    assert cfg.model.n_layers >= 1 and cfg.train.steps >= 1


def test_hugepage_malloc_applies_to_glibc_linux_only(monkeypatch):
    from jaxgpt.cli import main as cli

    monkeypatch.setattr(cli.sys, "platform", "linux")
    monkeypatch.setattr(cli.platform, "libc_ver", lambda: ("glibc", "2.36"))
    env = cli.hugepage_malloc_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert cli.hugepage_malloc_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) is None  # the user's own
    assert cli.hugepage_malloc_env({"JAXGPT_HUGEPAGE_MALLOC": "0"}) is None  # opted out
    monkeypatch.setattr(cli.platform, "libc_ver", lambda: ("glibc", "2.31"))  # before the tunable existed
    assert cli.hugepage_malloc_env({}) is None
    monkeypatch.setattr(cli.platform, "libc_ver", lambda: ("", ""))  # musl and others
    assert cli.hugepage_malloc_env({}) is None
    monkeypatch.setattr(cli.sys, "platform", "darwin")
    assert cli.hugepage_malloc_env({}) is None


def test_console_entry_reruns_itself_once_with_the_tunable(monkeypatch):
    from jaxgpt.cli import main as cli

    class Exec(Exception):
        pass

    def fake_execve(path, args, env):
        raise Exec(path, args, env)

    monkeypatch.setattr(cli.sys, "platform", "linux")
    monkeypatch.setattr(cli.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(cli.os, "execve", fake_execve)
    monkeypatch.setattr(cli.sys, "argv", ["jaxgpt", "train", "--steps", "3"])
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("JAXGPT_HUGEPAGE_MALLOC", raising=False)
    with pytest.raises(Exec) as called:
        cli.entry()
    path, args, env = called.value.args
    assert path == sys.executable and args == [sys.executable, "-m", "jaxgpt", "train", "--steps", "3"]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    # The re-run process has the variable set, so it goes straight to main().
    monkeypatch.setenv("GLIBC_TUNABLES", env["GLIBC_TUNABLES"])
    monkeypatch.setattr(cli, "main", lambda: 7)
    assert cli.entry() == 7
