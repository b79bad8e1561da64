"""How the steps run on the devices at hand: one device, a sharded mesh, or pmap.

The training loop talks to a `Runtime` and never to devices: it gets a fresh or restored state
laid out for the mode, feeds host batches (this process's rows of the global batch), and gets
back host metrics and params it can sample from. Checkpoints always hold the plain (unreplicated)
state, so a run saved in one mode or device count resumes in another.

The mode is chosen once, in `make_runtime`: each mode is one `Placement` class (`PLACEMENTS`)
saying where states and batches live and which compiled steps run them; `Runtime` holds one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jaxgpt.config import RunConfig
from jaxgpt.model.decoder import Params
from jaxgpt.train import sharding
from jaxgpt.train.checkpoint import on_one_device
from jaxgpt.train.step import TrainState, compile_steps, init_state, state_from_params
from jaxgpt.train.window_warmup import StagedSteps


class SingleDevice:
    """The state and every batch on the first device. The other placements override what differs."""

    mode = "single"

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def compile(self) -> tuple[Callable, Callable]:
        return compile_steps(self.cfg)

    def compile_train(self, cfg: RunConfig) -> Callable:
        """The train step of `cfg`, a config of the same state (a window warm-up's stage)."""
        return compile_steps(cfg)[0]

    def init_state(self, rng: jax.Array) -> TrainState:
        return init_state(self.cfg, rng)

    def place(self, state: TrainState) -> TrainState:
        """A plain state (host or device arrays) laid out for the mode."""
        return jax.device_put(state, jax.devices()[0])

    def from_saved(self, state: TrainState) -> TrainState:
        return state  # restored onto the first device already (`restore_target`)

    def to_saved(self, state: TrainState) -> TrainState:
        return state

    def params(self, state: TrainState) -> Params:
        """The params as checkpoints hold them (`to_saved(state).params`, without the rest)."""
        return state.params

    def restore_target(self) -> Any:
        return on_one_device(sharding.state_shapes(self.cfg))

    def train_batch(self, batch_bW: np.ndarray) -> Any:
        return batch_bW

    def eval_batch(self, batch_bW: np.ndarray) -> Any:
        return batch_bW

    def host_metrics(self, metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return metrics

    def describe(self, state: TrainState) -> dict[str, Any]:
        return {"mode": self.mode, "devices": 1}


class Replicated(SingleDevice):
    """pmap: a copy of the state on every local device, each device a share of the batch; eval
    runs on one device from the first copy."""

    mode = "pmap"

    def compile(self) -> tuple[Callable, Callable]:
        return self.compile_train(self.cfg), compile_steps(self.cfg)[1]

    def compile_train(self, cfg: RunConfig) -> Callable:
        return sharding.pmap_train_step(cfg)

    def init_state(self, rng: jax.Array) -> TrainState:
        return sharding.replicate(init_state(self.cfg, rng))

    def place(self, state: TrainState) -> TrainState:
        return sharding.replicate(super().place(state))

    def from_saved(self, state: TrainState) -> TrainState:
        return sharding.replicate(state)

    def to_saved(self, state: TrainState) -> TrainState:
        return sharding.unreplicate(state)

    def train_batch(self, batch_bW: np.ndarray) -> Any:
        return sharding.shard_for_pmap(batch_bW)

    def host_metrics(self, metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return sharding.unreplicate(metrics)  # equal on every device

    def params(self, state: TrainState) -> Params:
        return sharding.unreplicate(state.params)

    def describe(self, state: TrainState) -> dict[str, Any]:
        return {"mode": self.mode, "devices": jax.local_device_count()}


class Sharded(SingleDevice):
    """One global state split over a device mesh (data parallel, optionally FSDP), batches split
    over its data axis."""

    mode = "sharded"

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.mesh = sharding.make_mesh(cfg.train)
        self.shardings = sharding.state_shardings(self.mesh, sharding.state_shapes(cfg), cfg.train.fsdp)

    def compile(self) -> tuple[Callable, Callable]:
        return self.compile_train(self.cfg), sharding.sharded_eval_step(self.cfg, self.mesh, self.shardings.params)

    def compile_train(self, cfg: RunConfig) -> Callable:
        return sharding.sharded_train_step(cfg, self.mesh, self.shardings)

    def init_state(self, rng: jax.Array) -> TrainState:
        return sharding.init_sharded_state(self.cfg, rng, self.mesh)

    def place(self, state: TrainState) -> TrainState:
        return jax.device_put(state, self.shardings)

    def restore_target(self) -> Any:
        """Abstract state with the shardings a restored checkpoint should land in."""
        return sharding.placed(sharding.state_shapes(self.cfg), self.shardings)

    def train_batch(self, batch_bW: np.ndarray) -> Any:
        return sharding.shard_batch(batch_bW, self.mesh)

    def eval_batch(self, batch_bW: np.ndarray) -> Any:
        return sharding.shard_batch(batch_bW, self.mesh)

    def describe(self, state: TrainState) -> dict[str, Any]:
        return {"mode": self.mode, **sharding.describe(self.mesh, state)}


PLACEMENTS: dict[str, type[SingleDevice]] = {cls.mode: cls for cls in (SingleDevice, Replicated, Sharded)}


@dataclass
class Runtime:
    cfg: RunConfig
    placement: SingleDevice  # or a subclass: the mode's placement
    _train: Callable
    _eval: Callable

    def __post_init__(self) -> None:
        self._steps = StagedSteps(self.cfg, self._train, self.placement.compile_train)

    @property
    def mode(self) -> str:
        return self.placement.mode

    @property
    def mesh(self) -> Mesh | None:
        """The device mesh of a sharded runtime; None for one device or pmap."""
        return getattr(self.placement, "mesh", None)

    def init_state(self) -> TrainState:
        return self.placement.init_state(jax.random.key(self.cfg.train.seed))

    def state_from_params(self, params: Params) -> TrainState:
        """A step-0 state holding `params` (host or device arrays), laid out for the mode."""
        return self.placement.place(state_from_params(self.cfg, params))

    def to_saved(self, state: TrainState) -> TrainState:
        """The state as checkpoints hold it (one copy, whatever the mode)."""
        return self.placement.to_saved(state)

    def from_saved(self, state: TrainState) -> TrainState:
        return self.placement.from_saved(state)

    def restore_target(self) -> Any:
        """Abstract state with the placement a restored checkpoint should land in."""
        return self.placement.restore_target()

    def train_step(self, state: TrainState, batch_bW: np.ndarray, step: int | None = None,
                   ) -> tuple[TrainState, dict[str, jax.Array]]:
        """One update from this process's rows; `step` (the state's) picks a window warm-up's
        program (`jaxgpt.train.window_warmup`), None the full window's."""
        train = self._train if step is None else self._steps.at(step)
        state, metrics = train(state, self.placement.train_batch(batch_bW))
        return state, self.placement.host_metrics(metrics)

    def eval_loss(self, state: TrainState, batch_bW: np.ndarray) -> jax.Array:
        return self._eval(self.params(state), self.placement.eval_batch(batch_bW))

    def params(self, state: TrainState) -> Params:
        return self.placement.params(state)

    def describe(self, state: TrainState) -> dict[str, Any]:
        return self.placement.describe(state)


# Cached per process and config: compiling the steps costs seconds, and one process often trains
# one config more than once (a notebook re-running `train`, the tests). The key is the frozen
# config; the devices a process sees do not change once JAX has started.
@functools.lru_cache(maxsize=8)
def make_runtime(cfg: RunConfig) -> Runtime:
    """The runtime for `cfg` on this machine's devices, compiled once per process and config."""
    placement = PLACEMENTS[sharding.resolve_mode(cfg.train, jax.device_count())](cfg)
    return Runtime(cfg, placement, *placement.compile())
