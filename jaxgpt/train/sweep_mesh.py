"""A sweep group on many devices: its members spread over a ("members", "data") mesh.

A group (members that differ only in seed, optimiser values or muP's numbers, `jaxgpt.tools.sweep`) trains as one
program, `jax.vmap` of the train step over a leading member axis. Here that axis is split over
the mesh's "members" axis, and each member's batch rows over its "data" axis:

    layout = group_layout(n_members=8, n_devices=8, micro_batch=32)   # Layout(members=8, data=1)
    mesh = group_mesh(layout)                                           # jax.devices(), row-major
    programs = GroupPrograms(cfg, mesh, n_members)
    state = programs.init(seeds_M, knobs_M)                             # each member's init, placed
    state, metrics = programs.step(state, programs.batch(rows), hparams, seeds, knobs_M)

`group_layout` spreads the members as far as they divide over the devices and gives each member
the devices left over for its batch (3 seeds on 8 devices: 1 × 8, each member's batch over all 8;
24 members: 8 × 1), so a group trains on every device given to the sweep when the batch divides
(else on as many as it can: the layout says how many). XLA splits the vmapped step along the mesh
as it does a sharded train step: the members never talk, a member's gradient is summed over its
"data" devices. The same program with the mesh of a target's compile-only devices is what
`jaxgpt sweep --dry-run --target` compiles (`jaxgpt.plan.programs.compile_group`).

Many processes: devices are ordered by (process, id), so a process holds whole members or whole
row blocks of them; `batch` asks the caller for the rows of the members a process holds only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxgpt.config import RunConfig
from jaxgpt.errors import UserError
from jaxgpt.kernels.choose import choose_kernels
from jaxgpt.model.knobs import Knobs
from jaxgpt.train.optim import OptHParams
from jaxgpt.train.step import TrainState, batch_width, eval_step, init_state, train_step
from jaxgpt.train.window_warmup import StagedSteps

AXES = ("members", "data")


@dataclass(frozen=True)
class Layout:
    members: int  # the mesh's "members" axis: each device holds n_members / members members
    data: int  # the "data" axis: each member's batch rows split over this many devices

    @property
    def devices(self) -> int:
        return self.members * self.data


def group_layout(n_members: int, n_devices: int, micro_batch: int) -> Layout:
    """The layout using the most devices: `members` divides the member count, `data` the
    micro-batch's rows, their product at most `n_devices`; among equals, the most members apart
    (they never communicate, data-parallel rows do)."""
    best = Layout(1, 1)
    for members in range(1, min(n_members, n_devices) + 1):
        if n_members % members:
            continue
        data = max(d for d in range(1, n_devices // members + 1) if micro_batch % d == 0)
        if (members * data, members) > (best.devices, best.members):
            best = Layout(members, data)
    return best


def ordered_devices(devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    return sorted(jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id))


def group_mesh(layout: Layout, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The first `layout.devices` devices (in process, id order) as a ("members", "data") mesh."""
    chosen = ordered_devices(devices)[: layout.devices]
    return Mesh(np.array(chosen, dtype=object).reshape(layout.members, layout.data), AXES)


def layout_for(cfg: RunConfig, n_members: int, devices: Sequence[jax.Device] | None = None) -> Layout:
    """The layout of a group of `n_members` members of `cfg` on `devices` (default: all of them)."""
    devices = ordered_devices(devices)
    layout = group_layout(n_members, len(devices), cfg.train.batch_size // cfg.train.grad_accum)
    processes = {d.process_index for d in devices}
    if len(processes) > 1 and {d.process_index for d in devices[: layout.devices]} != processes:
        raise UserError(
            f"a group of {n_members} members with micro-batches of {cfg.train.batch_size // cfg.train.grad_accum} "
            f"rows spreads over {layout.devices} of the {len(devices)} devices, leaving out whole processes: "
            "choose a seed count or batch size that divides over the devices")
    return layout


class GroupPrograms:
    """The compiled programs of one group on `mesh`: init, step and eval, each member's state on
    its "members" devices, each batch over ("members", "data"), metrics and losses replicated.

    Each member runs the plain train and eval steps with the kernels chosen for the model, laid
    out for the mesh. Init, step and eval take the members' muP numbers that differ (`knobs`: a
    dict of [M] arrays, by `Knobs` field; empty where none do: those stay the config's
    constants). `on_trace("train" | "eval")`, if given, is called each time a step is traced (the
    sweep's tests count them)."""

    def __init__(self, cfg: RunConfig, mesh: Mesh, n_members: int,
                 on_trace: Callable[[str], None] | None = None, knob_names: Sequence[str] = ()) -> None:
        if n_members % mesh.shape["members"]:
            raise UserError(f"{n_members} members do not split over {mesh.shape['members']} devices")
        self.cfg, self.mesh, self.n_members = cfg, mesh, n_members
        kernels = choose_kernels(cfg.model).on_mesh(mesh, batch_axes=("data",))
        on_trace = on_trace or (lambda kind: None)

        def member_eval(params: Any, batch_BW: jax.Array, knobs: dict[str, jax.Array]) -> jax.Array:
            on_trace("eval")
            return eval_step(cfg, params, batch_BW, kernels, knobs=Knobs.of(cfg.model, knobs))

        spread, self.rows, self.replicated = (NamedSharding(mesh, P("members")), NamedSharding(mesh, P(*AXES)),
                                              NamedSharding(mesh, P()))
        self.knob_shapes = {name: jax.ShapeDtypeStruct((n_members,), jnp.float32) for name in knob_names}
        self.state_shapes = jax.eval_shape(jax.vmap(functools.partial(_init, cfg)),
                                           jax.ShapeDtypeStruct((n_members,), jnp.int32), self.knob_shapes)
        self.state_shardings = jax.tree_util.tree_map(lambda _: spread, self.state_shapes)
        options = kernels.jit_options()
        vmapped = functools.partial(jax.vmap, spmd_axis_name="members")
        self.init = jax.jit(vmapped(functools.partial(_init, cfg)),
                            in_shardings=self.replicated, out_shardings=self.state_shardings)

        def compile_step(staged: RunConfig) -> Callable:
            def member_step(state: TrainState, batch_BW: jax.Array, hparams: OptHParams, seed: jax.Array,
                            knobs: dict[str, jax.Array]) -> Any:
                on_trace("train")
                return train_step(staged, state, batch_BW, hparams=hparams, seed=seed, kernels=kernels,
                                  knobs=Knobs.of(staged.model, knobs))

            return jax.jit(vmapped(member_step), donate_argnums=0, compiler_options=options,
                           in_shardings=(self.state_shardings, self.rows, self.replicated, self.replicated,
                                         self.replicated),
                           out_shardings=(self.state_shardings, self.replicated))

        self.step = compile_step(cfg)
        self.steps = StagedSteps(cfg, self.step, compile_step)  # `steps.at(step)`: a window warm-up's stage
        self.evaluate = jax.jit(vmapped(member_eval), compiler_options=options,
                                in_shardings=(self.state_shardings.params, self.rows, self.replicated),
                                out_shardings=self.replicated)

    def constant(self, value: np.ndarray) -> jax.Array:
        """A small array every process holds whole (seeds, hyperparameters), as a global array."""
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, self.replicated, lambda index: value[index])

    def batch(self, rows_of: Callable[[int], np.ndarray]) -> jax.Array:
        """The global [M, B, W] batch; `rows_of(m)` gives member m's [B, W] rows, asked only for
        the members this process holds (once each)."""
        W = batch_width(self.cfg)
        shape = (self.n_members, self.cfg.train.batch_size, W)
        made: dict[int, np.ndarray] = {}

        def block(index: tuple[slice, ...]) -> np.ndarray:
            members = range(*index[0].indices(self.n_members))
            for m in members:
                if m not in made:
                    made[m] = np.asarray(rows_of(m), np.int32)
            return np.stack([made[m][index[1], index[2]] for m in members])

        return jax.make_array_from_callback(shape, self.rows, block)


def _init(cfg: RunConfig, seed: jax.Array, knobs: dict[str, jax.Array]) -> TrainState:
    """The state `jaxgpt.train.loop.train` starts a run with train.seed = `seed` (and muP's numbers
    `knobs`) from."""
    return init_state(cfg, jax.random.key(seed), knobs)
