"""XLA:CPU deadlocks a collective when too many multi-device programs are queued: plain JAX, no jaxgpt.

    .venv/bin/python scripts/xla_cpu_burst.py                          # bursts of 8, 30, 40, 100 programs
    .venv/bin/python scripts/xla_cpu_burst.py --programs 100 --window 4  # the same burst, 4 in flight

Each burst runs in a process of its own with 8 fake CPU devices: a jitted `x[0]` of an array split
over the 8 devices, its result replicated (a slice and an all-reduce, what indexing a pmap'd
array compiles to), dispatched `--programs` times without waiting, then waited for. XLA's
collective timeout is cut to `--timeout` seconds (40 by default in XLA), after which XLA kills the
process ("Expected 8 threads to join the rendezvous, but only 5 of them arrived"). With
`--window W` the burst waits for the program W before each new one, as jaxgpt's loops do
(`jaxgpt.process.dispatch.InFlight`).

The mechanism: XLA:CPU runs an N-device program as N tasks on its client's thread pool of
max(cores, N) threads, and a launch whose device already has 32 programs in flight waits for a
slot while holding a pool thread. Past 32 queued programs, such launches hold the threads that
an earlier program's collective needs, and it never gathers every device. On a machine with more
cores than devices the pool has spare threads and a burst may pass. One line per burst:
"100 programs, window none: aborted (exit 134, rendezvous timeout) in 12.3 s".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

CHILD = """
import sys, collections
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
n, size, window = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
mesh = Mesh(np.array(jax.devices()), ("i",))
x = jax.device_put(np.ones((len(jax.devices()), size, size), np.float32), NamedSharding(mesh, P("i")))
first = jax.jit(lambda x: x[0], out_shardings=NamedSharding(mesh, P()))
first(x).block_until_ready()
pending = collections.deque()
for _ in range(n):
    pending.append(first(x))
    if window and len(pending) > window:
        pending.popleft().block_until_ready()
jax.block_until_ready(list(pending))
"""


def burst(programs: int, size: int, window: int, timeout: int) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 "
                        f"--xla_cpu_collective_call_terminate_timeout_seconds={timeout}"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, str(programs), str(size), str(window)], env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    code = done.returncode if done.returncode >= 0 else 128 - done.returncode
    how = "finished" if code == 0 else \
        f"aborted (exit {code}{', rendezvous timeout' if 'rendezvous' in done.stderr else ''})"
    return f"{programs} programs, window {window or 'none'}: {how} in {seconds:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", default="8,30,40,100", help="burst sizes, comma-separated")
    parser.add_argument("--size", type=int, default=512, help="each device's block is size x size float32")
    parser.add_argument("--window", type=int, default=0, help="programs in flight before waiting (0: all)")
    parser.add_argument("--timeout", type=int, default=10, help="XLA's collective timeout, seconds")
    args = parser.parse_args()
    for programs in (int(p) for p in args.programs.split(",")):
        print(burst(programs, args.size, args.window, args.timeout), flush=True)


if __name__ == "__main__":
    main()
