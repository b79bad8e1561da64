"""A run directory started from a Hugging Face folder's weights (`jaxgpt import-hf`): its config,
its tokenizer where the folder has one, and a step-0 checkpoint that generate, eval and a
resumed train read as any other run's.

    import_hf_run("path/to/hf_dir", "runs/imported")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxgpt.config import DataConfig, RunConfig
from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.errors import UserError
from jaxgpt.hf.importer import import_hf, tokenizer_source
from jaxgpt.runs.rundir import RunDir, write_atomic
from jaxgpt.train.checkpoint import Checkpointer
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
    write_atomic(files.config, cfg.to_toml())
    checkpointer = Checkpointer(run_dir, keep=cfg.train.keep_checkpoints)
    try:
        checkpointer.save(state, manifest)
    finally:
        checkpointer.close()
    return run_dir
