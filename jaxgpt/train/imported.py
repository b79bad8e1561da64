"""A run directory started from a Hugging Face folder's weights (`jaxgpt import-hf`) or from a
nanochat checkpoint (`jaxgpt import-nanochat`): its config, its tokenizer, and a checkpoint that
generate, eval and a resumed train read as any other run's; and a run written back as nanochat's
base directory (`jaxgpt export-nanochat`).

    import_hf_run("path/to/hf_dir", "runs/imported")
    import_nanochat_run("BASE/base_checkpoints/d20", "runs/d20")
    export_nanochat_run("runs/d20", "BASE2")
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jaxgpt.config import DataConfig, RunConfig, load_config
from jaxgpt.data.tiktoken_pickle import read_encoding
from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.errors import UserError
from jaxgpt.hf.importer import import_hf, tokenizer_source
from jaxgpt.nanochat import TRAIN_OVERRIDES, model_config, params_from_state, state_from_params as nanochat_state
from jaxgpt.nanochat.checkpoints import read_checkpoint, write_checkpoint
from jaxgpt.nanochat.weights import gpt_config, refusal
from jaxgpt.runs.rundir import RunDir, write_atomic
from jaxgpt.train.checkpoint import Checkpointer, load_step
from jaxgpt.train.step import state_from_params


def import_hf_run(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """A run directory (config.toml, tokenizer.json if the HF dir has one, a step-0 checkpoint)."""
    hf_dir, run_dir, files = Path(hf_dir), Path(out_dir), RunDir(out_dir)
    if files.checkpoints.exists() or files.config.exists():
        raise UserError(f"{run_dir} already holds a run; choose another --out")
    model, params = import_hf(hf_dir)
    source = tokenizer_source(hf_dir)
    tokenizer = Tokenizer.load(source) if source is not None else None
    data = DataConfig(tokenizer=str(files.tokenizer.absolute())) if tokenizer else DataConfig()
    cfg = RunConfig(model=model, data=data)
    state = state_from_params(cfg, params)
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"config": cfg.to_dict(), "imported_from": str(hf_dir.absolute())}
    if tokenizer is not None:
        tokenizer.save(files.tokenizer)
        manifest["tokenizer_sha256"] = tokenizer.fingerprint
    _write_run(run_dir, cfg, state, manifest)
    return run_dir


def _write_run(run_dir: Path, cfg: RunConfig, state: Any, manifest: dict[str, Any]) -> None:
    """The run's config.toml, then its checkpoint of `state` (whose step it keeps)."""
    write_atomic(RunDir(run_dir).config, cfg.to_toml())
    checkpointer = Checkpointer(run_dir, keep=cfg.train.keep_checkpoints)
    try:
        checkpointer.save(state, manifest)
    finally:
        checkpointer.close()


def import_nanochat_run(checkpoint_dir: str | Path, out_dir: str | Path, step: int | None = None,
                        tokenizer_dir: str | Path | None = None) -> tuple[Path, int]:
    """A run directory from nanochat's checkpoint folder (its newest step, or `step`) and its
    tokenizer (`tokenizer_dir`/tokenizer.pkl; by default nanochat's base directory's, two levels
    above the folder): the run is at nanochat's step, trains on with nanochat's optimizer
    (`jaxgpt.nanochat.TRAIN_OVERRIDES`) and rows (data.align = "bestfit"), and holds the tokenizer both as jaxgpt's and as
    nanochat's pickle. Everything is checked before anything is written. (run, step)."""
    checkpoint_dir, run_dir, files = Path(checkpoint_dir), Path(out_dir), RunDir(out_dir)
    if files.checkpoints.exists() or files.config.exists():
        raise UserError(f"{run_dir} already holds a run; choose another --out")
    state_dict, meta, step = read_checkpoint(checkpoint_dir, step)
    model = model_config({"window_pattern": "L", **meta["model_config"]})  # nanochat's default for old metas
    params = params_from_state(state_dict, model)
    pickle_path = (Path(tokenizer_dir) if tokenizer_dir is not None
                   else checkpoint_dir.resolve().parents[1] / "tokenizer") / "tokenizer.pkl"
    tokenizer = Tokenizer.load(pickle_path)
    if tokenizer.vocab_size != model.vocab_size:
        raise UserError(f"the tokenizer at {pickle_path} holds {tokenizer.vocab_size} tokens, the model "
                        f"{model.vocab_size}: they are not one model's")
    train = load_config(None, ["model.tie_embeddings=false", *TRAIN_OVERRIDES]).train
    train = dataclasses.replace(train, steps=max(train.steps, step))
    data = DataConfig(tokenizer=str(files.tokenizer.absolute()), align="bestfit")  # nanochat's rows
    cfg = RunConfig(model=model, data=data, train=train)
    state = state_from_params(cfg, params)
    state = state.replace(step=jnp.asarray(step, jnp.int32))
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(files.tokenizer)
    shutil.copyfile(pickle_path, files.nanochat_tokenizer)
    _write_run(run_dir, cfg, state, {"config": cfg.to_dict(), "imported_from": str(checkpoint_dir.absolute()),
                                     "tokenizer_sha256": tokenizer.fingerprint, "nanochat_meta": meta})
    return run_dir, step


def _tokenizer_vocabulary(model: Any, params: Any, vocab_size: int) -> tuple[Any, Any]:
    """The model and params cut to the tokenizer's `vocab_size` ids (embedding, head and value
    tables); a vocabulary smaller than the tokenizer's is refused."""
    if vocab_size > model.vocab_size:
        raise UserError(f"the run's nanochat tokenizer holds {vocab_size} tokens, more than model.vocab_size = "
                        f"{model.vocab_size}: not one model's")
    if vocab_size == model.vocab_size:
        return model, params
    cut = dict(params, token_embedding={"embedding": params["token_embedding"]["embedding"][:vocab_size]},
               lm_head={"kernel": params["lm_head"]["kernel"][:, :vocab_size]})
    if "value_embeds" in params:
        cut["value_embeds"] = params["value_embeds"][:, :vocab_size]
    return dataclasses.replace(model, vocab_size=vocab_size), cut


def export_nanochat_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> Path:
    """nanochat's base-directory layout of a run's newest checkpoint (or `step`'s):
    out/base_checkpoints/d{L}/model_NNNNNN.pt and meta_NNNNNN.json, out/tokenizer/tokenizer.pkl.
    A run nanochat's GPT cannot hold is refused in one line naming the key, before anything is
    written. A model vocabulary larger than the tokenizer's goes out as the tokenizer's (nanochat
    checks that they are equal): the rows past its ids, which no text reads, are left out."""
    files = RunDir(run_dir)
    if not files.config.is_file():
        raise UserError(f"{run_dir} is not a run directory (no {files.config.name})")
    reason = refusal(load_config(files.config).model)
    if reason:
        raise UserError(f"cannot export to nanochat: {reason}")
    if not files.nanochat_tokenizer.is_file():
        raise UserError(f"{run_dir} has no nanochat tokenizer ({files.nanochat_tokenizer.name}): only a run "
                        "imported from nanochat (jaxgpt import-nanochat) or trained on its tokenizer.pkl carries "
                        "one nanochat can read")
    model, params, at = load_step(run_dir, step)
    model, params = _tokenizer_vocabulary(model, params, read_encoding(files.nanochat_tokenizer).n_vocab)
    folder = Path(out_dir) / "base_checkpoints" / f"d{model.n_layers}"
    if (folder / f"model_{at:06d}.pt").exists():
        raise UserError(f"{folder} already holds step {at}; choose another --out")
    write_checkpoint(folder, at, nanochat_state(params, model), {"step": at, "model_config": gpt_config(model),
                                                                    "exported_from": str(Path(run_dir).absolute())})
    (Path(out_dir) / "tokenizer").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(files.nanochat_tokenizer, Path(out_dir) / "tokenizer" / "tokenizer.pkl")
    return folder
