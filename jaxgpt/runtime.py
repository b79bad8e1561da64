"""How the steps run on the devices at hand: one device, a sharded mesh, or pmap.

The training loop talks to a `Runtime` and never to devices: it gets a fresh or restored state
laid out for the mode, feeds host batches (this process's rows of the global batch), and gets
back host metrics and params it can sample from. Checkpoints always hold the plain (unreplicated)
state, so a run saved in one mode or device count resumes in another.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jaxgpt import parallel
from jaxgpt.checkpoint import on_one_device
from jaxgpt.config import RunConfig
from jaxgpt.model import Params
from jaxgpt.step import TrainState, compile_steps, eval_step, init_state, state_from_params


@dataclass
class Runtime:
    cfg: RunConfig
    mode: str  # "single" | "sharded" | "pmap"
    mesh: Mesh | None
    shardings: Any  # of the train state, in sharded mode
    _train: Callable
    _eval: Callable

    def init_state(self) -> TrainState:
        rng = jax.random.key(self.cfg.train.seed)
        if self.mode == "sharded":
            return parallel.init_sharded_state(self.cfg, rng, self.mesh)
        state = init_state(self.cfg, rng)
        return parallel.replicate(state) if self.mode == "pmap" else state

    def state_from_params(self, params: Params) -> TrainState:
        """A step-0 state holding `params` (host or device arrays), laid out for the mode."""
        state = state_from_params(self.cfg, params)
        if self.mode == "sharded":
            return jax.device_put(state, self.shardings)
        state = jax.device_put(state, jax.devices()[0])
        return parallel.replicate(state) if self.mode == "pmap" else state

    def to_saved(self, state: TrainState) -> TrainState:
        """The state as checkpoints hold it (one copy, whatever the mode)."""
        return parallel.unreplicate(state) if self.mode == "pmap" else state

    def from_saved(self, state: TrainState) -> TrainState:
        return parallel.replicate(state) if self.mode == "pmap" else state

    def restore_target(self) -> Any:
        """Abstract state with the shardings a restored checkpoint should land in."""
        shapes = parallel.state_shapes(self.cfg)
        if self.mode != "sharded":
            return on_one_device(shapes)
        return jax.tree_util.tree_map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            shapes, self.shardings)

    def train_step(self, state: TrainState, batch_bW: np.ndarray) -> tuple[TrainState, dict[str, jax.Array]]:
        if self.mode == "sharded":
            return self._train(state, parallel.shard_batch(batch_bW, self.mesh))
        if self.mode == "pmap":
            state, metrics = self._train(state, parallel.shard_for_pmap(batch_bW))
            return state, {key: value[0] for key, value in metrics.items()}
        return self._train(state, batch_bW)

    def eval_loss(self, state: TrainState, batch_bW: np.ndarray) -> jax.Array:
        if self.mode == "sharded":
            return self._eval(state.params, parallel.shard_batch(batch_bW, self.mesh))
        return self._eval(self.params(state), batch_bW)

    def params(self, state: TrainState) -> Params:
        return self.to_saved(state).params

    def describe(self, state: TrainState) -> dict[str, Any]:
        if self.mode == "sharded":
            return {"mode": self.mode, **parallel.describe(self.mesh, state)}
        return {"mode": self.mode, "devices": jax.local_device_count() if self.mode == "pmap" else 1}


@functools.lru_cache(maxsize=8)
def make_runtime(cfg: RunConfig) -> Runtime:
    """The runtime for `cfg` on this machine's devices, compiled once per process and config."""
    mode = parallel.resolve_mode(cfg.train, jax.device_count())
    if mode == "single":
        train_fn, eval_fn = compile_steps(cfg)
        return Runtime(cfg, mode, None, None, train_fn, eval_fn)
    if mode == "pmap":
        _, eval_fn = compile_steps(cfg)
        return Runtime(cfg, mode, None, None, parallel.pmap_train_step(cfg), eval_fn)
    mesh = parallel.make_mesh(cfg.train)
    shardings = parallel.state_shardings(mesh, parallel.state_shapes(cfg), cfg.train.fsdp)
    train_fn = parallel.sharded_train_step(cfg, mesh, shardings)
    params_shardings = shardings.params
    eval_fn = jax.jit(functools.partial(eval_step, cfg),
                      in_shardings=(params_shardings, parallel.batch_sharding(mesh)),
                      out_shardings=parallel.replicated(mesh))
    return Runtime(cfg, mode, mesh, shardings, train_fn, eval_fn)
