"""Running the train step on many devices: a ("data", "fsdp") mesh, shardings, pmap.

Two ways to spread one global batch over devices, both giving the update a single device would:

* sharded (the default for more than one device): `jax.jit` of the unchanged `train_step` with
  the batch split over every device of the mesh and the train state either replicated
  (fsdp = 1, plain data parallelism) or split over the "fsdp" axis (fsdp > 1, ZeRO-3 style: each
  device holds 1/fsdp of every large parameter and of its Adam moments). XLA inserts the
  all-gathers and reduce-scatters; the model code knows nothing of devices.

      mesh = make_mesh(cfg.train)
      state = init_sharded_state(cfg, jax.random.key(cfg.train.seed), mesh)
      step = sharded_train_step(cfg, mesh, state_shardings(mesh, state, cfg.train.fsdp))
      state, metrics = step(state, shard_batch(batch_BW, mesh))

* pmap: the classic replicated data parallelism, `jax.pmap` over the local devices with the
  gradients averaged by `lax.pmean` before the optimiser update.

      step = pmap_train_step(cfg)
      state = replicate(init_state(cfg, rng))
      state, metrics = step(state, shard_for_pmap(batch_BW))      # metrics: [n_devices] each

Many processes (`jaxgpt.process.distributed`): each feeds its own rows of the global batch
(`data.get_batch(..., process_index=...)`) to `shard_batch`, which assembles the global array.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxgpt.config import PARALLEL_MODES, RunConfig, TrainConfig
from jaxgpt.errors import UserError
from jaxgpt.kernels.base import Kernels
from jaxgpt.kernels.choose import choose_kernels
from jaxgpt.train.step import TrainState, batch_width, eval_step, init_state, train_step

MESH_AXES = ("data", "fsdp")
PMAP_AXIS = "batch"
MODES = tuple(mode for mode in PARALLEL_MODES if mode != "auto")


# ---------------------------------------------------------------------------------------------
# Mesh and mode


def check_batch(train: TrainConfig, data: int, fsdp: int) -> None:
    """Each micro-batch (batch_size // grad_accum rows) must split evenly over all devices."""
    micro = train.batch_size // train.grad_accum
    if micro % (data * fsdp):
        raise UserError(
            f"train.batch_size = {train.batch_size} with train.grad_accum = {train.grad_accum} gives "
            f"micro-batches of {micro} rows, which do not divide over data {data} x fsdp {fsdp} = "
            f"{data * fsdp} devices"
        )


def make_mesh(train: TrainConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "fsdp") mesh: fsdp = train.fsdp, data = n_devices // fsdp.

    Devices are laid out row-major in (process index, id) order, so the batch rows of one process
    are contiguous (what `shard_batch` and `data.get_batch` assume on many hosts).
    """
    if devices is None:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    devices = list(devices)
    n, fsdp = len(devices), train.fsdp
    if fsdp > n:
        raise UserError(f"train.fsdp = {fsdp} exceeds the {n} available devices")
    if n % fsdp:
        raise UserError(f"train.fsdp = {fsdp} does not divide the {n} available devices")
    data = n // fsdp
    check_batch(train, data, fsdp)
    return Mesh(np.array(devices, dtype=object).reshape(data, fsdp), MESH_AXES)


def resolve_mode(train: TrainConfig, n_devices: int) -> str:
    """train.parallel resolved to "single" | "sharded" | "pmap" ("auto": sharded on > 1 device)."""
    mode = train.parallel
    if mode == "auto":
        mode = "sharded" if n_devices > 1 else "single"
    if mode not in MODES:
        raise UserError(f"train.parallel = {train.parallel!r} is not one of auto, {', '.join(MODES)}")
    if train.fsdp > 1 and mode != "sharded":
        raise UserError(
            f"train.fsdp = {train.fsdp} needs train.parallel = 'sharded' (or 'auto' on more than "
            f"one device); it resolved to {mode!r} on {n_devices} device(s)"
        )
    return mode


# ---------------------------------------------------------------------------------------------
# Shardings


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch rows split over every device of the mesh (data and fsdp alike)."""
    return NamedSharding(mesh, P(MESH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def leaf_spec(shape: Sequence[int], fsdp: int) -> P:
    """The partition spec of one state leaf: its largest axis divisible by `fsdp` over "fsdp".

    Ties go to the later axis (feature axes come last; the scanned layer axis comes first).
    Scalars, fsdp = 1 and leaves with no divisible axis are replicated. A function of the shape
    alone, so Adam's mu and nu are sharded exactly like the parameter they belong to.
    """
    if fsdp == 1 or not shape:
        return P()
    candidates = [(size, axis) for axis, size in enumerate(shape) if size % fsdp == 0]
    if not candidates:
        return P()
    _, axis = max(candidates)
    return P(*(["fsdp" if a == axis else None for a in range(len(shape))]))


def state_shardings(mesh: Mesh, abstract_state: Any, fsdp: int) -> Any:
    """NamedShardings for every leaf of a (possibly abstract) train state, same tree structure."""
    if mesh.shape["fsdp"] != fsdp:
        raise UserError(f"fsdp = {fsdp} but the mesh has an fsdp axis of {mesh.shape['fsdp']}")
    return jax.tree_util.tree_map(
        lambda leaf: NamedSharding(mesh, leaf_spec(np.shape(leaf), fsdp)), abstract_state
    )


def placed(shapes: Any, shardings: Any) -> Any:
    """`ShapeDtypeStruct`s of `shapes` placed in `shardings` (one tree each): what a restore lands
    in and what an ahead-of-time compile takes."""
    return jax.tree_util.tree_map(lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where),
                                  shapes, shardings)


def bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a tree of arrays or placed `ShapeDtypeStruct`s (a shard each;
    a leaf without a sharding whole)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) else np.shape(leaf)
        total += int(np.prod(shape)) * np.dtype(leaf.dtype).itemsize
    return total


def state_shapes(cfg: RunConfig) -> TrainState:
    """The train state's shapes and dtypes, computing nothing."""
    return jax.eval_shape(partial(init_state, cfg), jax.random.key(0))


def init_sharded_state(cfg: RunConfig, rng: jax.Array, mesh: Mesh) -> TrainState:
    """`init_state(cfg, rng)` created directly in its shardings (never whole on one device).

    The values equal `init_state`'s: JAX's partitionable threefry makes random numbers
    independent of how the array is split.
    """
    shardings = state_shardings(mesh, state_shapes(cfg), mesh.shape["fsdp"])
    return jax.jit(partial(init_state, cfg), out_shardings=shardings)(rng)


def mesh_kernels(cfg: RunConfig, mesh: Mesh, kernels: Kernels | None = None) -> Kernels:
    """`kernels` (default: those chosen for the model) for programs whose batch is split over `mesh`."""
    return (kernels or choose_kernels(cfg.model)).on_mesh(mesh)


def sharded_train_step(cfg: RunConfig, mesh: Mesh, shardings: Any, kernels: Kernels | None = None) -> Callable:
    """jit(train_step) with the state in `shardings` (donated) and the batch over all devices.

    Called as `step(state, batch_BW) -> (state, metrics)`; metrics come back replicated.
    `kernels`: by default the ones chosen for the model, laid out for the mesh.
    """
    kernels = mesh_kernels(cfg, mesh, kernels)
    return jax.jit(
        partial(train_step, cfg, kernels=kernels),
        in_shardings=(shardings, batch_sharding(mesh)),
        out_shardings=(shardings, replicated(mesh)),
        donate_argnums=0,
        compiler_options=kernels.jit_options(),
    )


def sharded_eval_step(cfg: RunConfig, mesh: Mesh, param_shardings: Any, kernels: Kernels | None = None) -> Callable:
    """jit(eval_step) with the params in `param_shardings` and the batch over all devices:
    `evaluate(params, batch_BW) -> loss`, replicated."""
    kernels = mesh_kernels(cfg, mesh, kernels)
    return jax.jit(partial(eval_step, cfg, kernels=kernels), in_shardings=(param_shardings, batch_sharding(mesh)),
                   out_shardings=replicated(mesh), compiler_options=kernels.jit_options())


def shard_batch(batch_bW: np.ndarray, mesh: Mesh) -> jax.Array:
    """This process's rows of the global batch -> one global array split over the mesh.

    On one host `batch_bW` is the whole batch; on many, each process passes its contiguous
    slice (rows process_index * b ... (process_index + 1) * b), as `data.get_batch` returns.
    """
    batch_bW = np.asarray(batch_bW)
    global_shape = (batch_bW.shape[0] * jax.process_count(), *batch_bW.shape[1:])
    return jax.make_array_from_process_local_data(batch_sharding(mesh), batch_bW, global_shape)


# ---------------------------------------------------------------------------------------------
# pmap


def pmap_train_step(cfg: RunConfig, axis_name: str = PMAP_AXIS) -> Callable:
    """`train_step` under `jax.pmap`: per-device gradients averaged with `lax.pmean`.

    Called as `step(replicated_state, batch_NbW) -> (replicated_state, metrics)` (or lowered
    ahead of time with `step.lower(...)`) with the batch
    from `shard_for_pmap` (N local devices, b rows each) and every metric of shape [N] (equal
    values; `unreplicate` takes one). Mirrors `train_step`: `grad_accum` micro-batches per device,
    the micro gradients and losses averaged, then averaged over devices, so with equal shares the
    update is the one-device update on the whole batch (`train_step` with `axis_name`; dropout
    masks differ per device, so only with dropout 0 do the numbers match one device's).
    `jax.pmap` takes no compiler options: the kernels' `compiler_options` do not reach this step.
    """
    train = cfg.train
    pmapped = jax.pmap(partial(train_step, cfg, axis_name=axis_name), axis_name=axis_name,
                       donate_argnums=0)
    W = batch_width(cfg)

    def step(state: TrainState, batch_NbW: Any):
        shape = tuple(np.shape(batch_NbW))
        n = jax.local_device_count()
        if len(shape) != 3 or shape[0] != n or shape[2] != W:
            raise UserError(f"pmap batch must be [{n} devices, rows, {W}] (see shard_for_pmap), got {shape}")
        if shape[1] % train.grad_accum:
            raise UserError(
                f"each device's {shape[1]} rows do not divide into train.grad_accum = "
                f"{train.grad_accum} micro-batches"
            )
        return pmapped(state, batch_NbW)

    step.lower = pmapped.lower  # ahead-of-time lowering, as for the jitted steps
    return step


def shard_for_pmap(batch_BW: Any, n_devices: int | None = None) -> Any:
    """[B, W] -> [n_devices, B / n_devices, W]: device d gets rows d * B/n ... (d + 1) * B/n."""
    n = jax.local_device_count() if n_devices is None else n_devices
    B = np.shape(batch_BW)[0]
    if B % n:
        raise UserError(f"batch of {B} rows does not divide over {n} devices")
    return batch_BW.reshape(n, B // n, *np.shape(batch_BW)[1:])


def replicate(tree: Any, devices: Sequence[jax.Device] | None = None) -> Any:
    """One copy of every leaf per local device (leading axis [n_devices]), as pmap expects.

    Each device receives its copy directly; the stacked array never exists on one device.
    """
    devices = list(jax.local_devices() if devices is None else devices)
    sharding = NamedSharding(Mesh(np.array(devices, dtype=object), (PMAP_AXIS,)), P(PMAP_AXIS))

    def one(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        copies = [jax.device_put(x[None], d) for d in devices]
        return jax.make_array_from_single_device_arrays((len(devices), *x.shape), sharding, copies)

    return jax.tree_util.tree_map(one, tree)


def unreplicate(tree: Any) -> Any:
    """The first device's copy of every leaf of a replicated tree, on that device alone.

    Read from each leaf's first shard, a program on one device: `x[0]` on the [devices, ...]
    array is a program over every device (a slice and an all-reduce) whose result lies on every
    device, so what then reads it (eval, the sampler, the checksum) runs on every device too, and
    a state's dozens of leaves make a burst of such programs (`jaxgpt.process.dispatch`)."""
    def first(x):
        if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
            shard = min(x.addressable_shards, key=lambda s: (s.index[0].start or 0) if s.index else 0)
            return shard.data[0]
        return x[0]

    return jax.tree_util.tree_map(first, tree)


# ---------------------------------------------------------------------------------------------
# Reporting (compiling ahead of time for memory: jaxgpt.plan)


def _bytes_on(tree: Any, device: jax.Device) -> int:
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
        else:
            total += np.asarray(leaf).nbytes
    return total


def _bytes(tree: Any) -> int:
    return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def describe(mesh: Mesh, state: TrainState) -> dict[str, Any]:
    """Mesh shape and the bytes of params and optimiser state: in all, and on one device
    (the mesh's first device of this process)."""
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    return {
        "mesh": {axis: int(size) for axis, size in mesh.shape.items()},
        "devices": int(mesh.devices.size),
        "process_count": jax.process_count(),
        "params_bytes": _bytes(state.params),
        "opt_state_bytes": _bytes(state.opt_state),
        "params_bytes_per_device": _bytes_on(state.params, device),
        "opt_state_bytes_per_device": _bytes_on(state.opt_state, device),
    }
