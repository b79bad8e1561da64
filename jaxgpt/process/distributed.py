"""Many processes of one JAX job (hosts of a pod or cluster, or `jaxgpt launch` on one machine).

Call `maybe_initialize_distributed()` before anything else touches JAX. Process 0 alone writes
what is not a sharded array (`is_writer`), builds caches before the others read them
(`writer_first`), and a stop is agreed by all (`StopVote`), since a process that stopped alone
would leave the others waiting in a collective.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

HEARTBEAT_TIMEOUT_S = 30  # a lost process is noticed within this (JAXGPT_HEARTBEAT_TIMEOUT_S)


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return int(value)
    return None


def distributed_env() -> dict[str, Any] | None:
    """The `jax.distributed.initialize` arguments the environment asks for, or None.

    * JAX_COORDINATOR_ADDRESS / COORDINATOR_ADDRESS with JAX_NUM_PROCESSES (or NUM_PROCESSES)
      and JAX_PROCESS_ID (or PROCESS_ID); a missing count or id is left to JAX to detect, and a
      count of 1 means a single process (nothing to initialize).
    * A Cloud TPU pod: TPU_WORKER_HOSTNAMES naming more than one host, or, when that is unset,
      CLOUD_TPU_TASK_ID; JAX then reads everything from the TPU environment ({}).
    * JAXGPT_DISTRIBUTED=auto: JAX detects the cluster itself (a TPU pod, SLURM, Open MPI, ...).
    """
    coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("COORDINATOR_ADDRESS")
    if coordinator:
        count = _env_int("JAX_NUM_PROCESSES", "JAX_PROCESS_COUNT", "NUM_PROCESSES", "PROCESS_COUNT")
        index = _env_int("JAX_PROCESS_ID", "JAX_PROCESS_INDEX", "PROCESS_ID", "PROCESS_INDEX")
        if count == 1:
            return None
        return {"coordinator_address": coordinator, "num_processes": count, "process_id": index}
    hostnames = os.environ.get("TPU_WORKER_HOSTNAMES")
    if hostnames is not None:
        return {} if len([h for h in hostnames.split(",") if h.strip()]) > 1 else None
    if os.environ.get("CLOUD_TPU_TASK_ID", "").strip():
        return {}
    if os.environ.get("JAXGPT_DISTRIBUTED", "").strip() == "auto":
        return {}
    return None


def maybe_initialize_distributed() -> bool:
    """Start multi-process JAX when the environment says so; True when running multi-process.

    Idempotent (JAX itself records whether it is initialized). Call it first thing, before any
    other JAX call touches a device: on the CPU it switches on the gloo collectives, which JAX
    reads when the backend starts.
    """
    if jax.distributed.is_initialized():
        return True
    kwargs = distributed_env()
    if kwargs is None:
        return False
    platforms = (os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "cpu").split(",")
    if "cpu" in platforms:  # without gloo, the CPU backend's collectives stay inside one process
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    heartbeat = _env_int("JAXGPT_HEARTBEAT_TIMEOUT_S") or HEARTBEAT_TIMEOUT_S
    jax.distributed.initialize(**kwargs, heartbeat_timeout_seconds=heartbeat)
    return True


def process_index() -> int:
    return jax.process_index()


def process_count() -> int:
    return jax.process_count()


def is_writer() -> bool:
    """Whether this process writes the files that are not sharded arrays (process 0 does)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (nothing on one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# How long the other processes wait while the writer works alone (harness tasks take minutes).
WRITER_WORK_S = 6 * 3600


def whole_on_each_process(params: Any) -> Any:
    """`params` whole on every process: a collective where they are spread over the processes'
    devices (every process calls it); a process's own copy (pmap's, unreplicated) is whole already."""
    if jax.process_count() == 1:
        return params
    from jax.experimental import multihost_utils

    return jax.tree.map(lambda x: multihost_utils.process_allgather(x, tiled=True)
                        if isinstance(x, jax.Array) and not x.is_fully_addressable else x, params)


def wait_for_writer(name: str) -> None:
    """Wait until every process, the writer among them, reaches `name` (a name used once), for up
    to WRITER_WORK_S: the coordination service's barrier, which Orbax's checkpoints use too, not a
    device collective, whose transport (gloo on the CPU) may give up sooner."""
    if jax.process_count() > 1:
        from jax._src import distributed as jax_distributed

        jax_distributed.global_state.client.wait_at_barrier(name, WRITER_WORK_S * 1000)


def writer_first(build: Callable[[], Any], name: str) -> Any:
    """`build()` run by the writer first, then by the others: what the writer caches on disk
    (a trained tokenizer, token files) the others then read instead of building it again."""
    if jax.process_count() == 1:
        return build()
    if is_writer():
        result = build()
        barrier(name)
        return result
    barrier(name)
    return build()


class StopVote:
    """Agrees on when to stop: every process stops after the same step, whichever got the signal.

    `vote(signum)` is called once per step with this process's received signal (0 for none) and
    returns the signal every process stops for, or 0. On many processes the vote of step s is a
    collective (the largest signal number) read at step s + 1, so it never waits on the devices.
    """

    def __init__(self, mesh: Mesh | None) -> None:
        self.multi = jax.process_count() > 1
        self.pending: jax.Array | None = None
        if self.multi:
            devices = mesh.devices.flat if mesh is not None else jax.devices()
            self.mesh = Mesh(np.array(sorted(devices, key=lambda d: (d.process_index, d.id)),
                                      dtype=object), ("all",))
            self._max = jax.jit(jnp.max, out_shardings=NamedSharding(self.mesh, P()))

    def vote(self, signum: int) -> int:
        if not self.multi:
            return signum
        local = np.full((len(self.mesh.local_devices),), signum, np.int32)
        votes = jax.make_array_from_process_local_data(NamedSharding(self.mesh, P("all")), local,
                                                       (self.mesh.size,))
        previous, self.pending = self.pending, self._max(votes)
        return 0 if previous is None else int(np.asarray(previous.addressable_data(0)))
