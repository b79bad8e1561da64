"""A bound on the device programs one loop has dispatched and not yet seen finish.

JAX dispatches asynchronously: a loop that calls a jitted function N times without reading a
result queues N programs. On the CPU backend with several devices (the tests' eight fake ones, a
`--xla_force_host_platform_device_count` run), that queue deadlocks once it passes 32 programs per
device: XLA:CPU runs each device's share of a program as a task on one thread pool of
max(cores, devices) threads, and a launch that finds its device's 32 slots taken waits for one
while holding a pool thread. Enough such launches hold the threads an earlier program needs for
its collective, which then never gathers every device; XLA kills the process 40 s later
("Expected 8 threads to join the rendezvous, but only 5 of them arrived").
`scripts/xla_cpu_burst.py` shows it in plain JAX; docs/many_hosts.md has the whole account.

Every loop in jaxgpt that dispatches multi-device programs back to back (eval batches, harness
batches, a sweep's steps and evals) passes their results through an `InFlight` window: after
`limit` programs, each new one waits for the oldest. Four keep any accelerator's queue full (a
program waits on the one four before it, long finished or about to be), far below the deadlock.
"""

from __future__ import annotations

import collections
from typing import Any, TypeVar

import jax

T = TypeVar("T")

IN_FLIGHT = 4


class InFlight:
    """Results of dispatched programs, at most `limit` of them unfinished: `add` waits for the
    oldest once more are pending."""

    def __init__(self, limit: int = IN_FLIGHT) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._pending: collections.deque[Any] = collections.deque()

    def add(self, result: T) -> T:
        """`result` (a pytree of arrays, as a jitted function returns it), kept in the window."""
        self._pending.append(result)
        if len(self._pending) > self.limit:
            jax.block_until_ready(self._pending.popleft())
        return result
