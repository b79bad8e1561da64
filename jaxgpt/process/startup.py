"""Where a process's start goes: seconds since it began, per stage, and in XLA's compiler.

    clock = Startup()               # at a command's entry: imports are behind us
    ... clock.stage("data") ...     # each stage ends where the next begins
    clock.record()                  # {"imports_s": ..., "data_s": ..., "compile_s": ..., "total_s": ...}

`record()` covers the start up to the last stage. `total_s` counts from the process's start (Linux's /proc, which survives the huge-page re-exec of
`jaxgpt.cli.main`), so `imports_s` is the interpreter's and the imports' share; elsewhere it counts from
the entry. `compile_s` is the time XLA spent compiling, `cache_load_s` the time spent loading
programs from the compilation cache instead (`jaxgpt.process.compile_cache`), both from JAX's own events
(its compile event times a load too: the load is taken out).
`jaxgpt bench startup` reads these from a fresh process's summary.
"""

from __future__ import annotations

import os
import time
from typing import Any

_compile = {"obtain_s": 0.0, "cache_load_s": 0.0}
_listening = False
EVENTS = {"/jax/core/compile/backend_compile_duration": "obtain_s",  # a compile, or a load from the cache
          "/jax/compilation_cache/cache_retrieval_time_sec": "cache_load_s"}


def _on_duration(event: str, duration: float, **_: Any) -> None:
    if event in EVENTS:
        _compile[EVENTS[event]] += duration


def listen() -> None:
    """Count XLA's compile and cache-load seconds in this process from now on (once)."""
    global _listening
    if not _listening:
        import jax

        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _listening = True


def process_age() -> float | None:
    """Seconds since this process started (Linux), else None."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class Startup:
    """Stage times of one start, from the moment it is made (see the module docstring)."""

    def __init__(self) -> None:
        listen()
        self.age = process_age()
        self.stages: dict[str, float] = {}
        self.last = time.perf_counter()
        self.compiled = dict(_compile)
        self.compiled_by_now = dict(_compile)

    def stage(self, name: str) -> None:
        """The stage `name` ends now."""
        now = time.perf_counter()
        self.stages[f"{name}_s"] = round(self.stages.get(f"{name}_s", 0.0) + now - self.last, 3)
        self.last = now
        self.compiled_by_now = dict(_compile)

    def record(self) -> dict[str, Any]:
        spent = sum(self.stages.values())
        record: dict[str, Any] = {"imports_s": None if self.age is None else round(self.age, 3), **self.stages}
        spent_in = {key: self.compiled_by_now[key] - self.compiled[key] for key in _compile}
        record["compile_s"] = round(max(0.0, spent_in["obtain_s"] - spent_in["cache_load_s"]), 3)
        record["cache_load_s"] = round(spent_in["cache_load_s"], 3)
        record["total_s"] = round((self.age or 0.0) + spent, 3)
        return record
