"""Checkpoints over Orbax's CheckpointManager: the train state plus a JSON manifest.

A run directory holds `config.toml` (resolved), `tokenizer.json` and `checkpoints/<step>/`, each
checkpoint with the state (params, optimiser state, step) and a manifest of the fingerprints of the
config, tokenizer and token files it was trained with. Orbax writes each checkpoint to a temporary
folder and renames it when complete, so a half-written one is never listed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxgpt.config import ModelConfig, RunConfig, load_config
from jaxgpt.model import Params
from jaxgpt.step import TrainState, init_state


class Checkpointer:
    def __init__(self, run_dir: Path, keep: int) -> None:
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=True)
        self.directory = Path(run_dir).absolute() / "checkpoints"
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "manifest"))

    def save(self, state: TrainState, manifest: dict[str, Any]) -> None:
        """Start writing a checkpoint of `state`; training goes on while Orbax writes it."""
        step = int(state.step)
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), manifest=ocp.args.JsonSave({**manifest, "step": step})
        ), force=True)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, like: TrainState, step: int | None = None) -> tuple[TrainState, dict[str, Any]]:
        """Restore the state at `step` (default: newest) into the structure and shardings of `like`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), manifest=ocp.args.JsonRestore()
        ))
        return restored["state"], restored["manifest"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def load_run_config(run_dir: str | Path) -> RunConfig:
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.toml)")
    return load_config(path)


def load_run(run_dir: str | Path) -> tuple[ModelConfig, Params]:
    """The model config and params of the newest checkpoint in a run directory."""
    cfg = load_run_config(run_dir)
    like = jax.eval_shape(lambda: init_state(cfg, jax.random.key(0)))
    checkpointer = Checkpointer(Path(run_dir), keep=cfg.train.keep_checkpoints)
    try:
        state, _ = checkpointer.restore(like)
    finally:
        checkpointer.close()
    return cfg.model, state.params
