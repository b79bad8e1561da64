"""`jaxgpt launch`: one jaxgpt command as N processes of one JAX job on this machine.

    jaxgpt launch -n 2 --devices-per-process 4 -- train --out runs/two

Each process gets the variables `distributed.distributed_env` reads (JAX_COORDINATOR_ADDRESS on a
free local port, JAX_NUM_PROCESSES, JAX_PROCESS_ID) and runs `python -m jaxgpt COMMAND...`.
Process 0's output is shown as it comes; the others' is kept (their last lines are shown, prefixed,
when they fail) or, with `all_output`, shown prefixed with the process index. Ctrl-C and SIGTERM
go to every process. When one process dies abnormally the others cannot go on (every step needs
all of them), so they are stopped at once and the launcher names the lost process. The exit code
is the worst of the processes' (128 + N for a process ended by signal N).
"""

from __future__ import annotations

import collections
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from jaxgpt.errors import UserError
from jaxgpt.process import signals

MULTI_PROCESS_COMMANDS = ("train", "sweep")
KEPT_LINES = 20  # of a process other than 0, shown when it fails
EXIT_GRACE_S = 30.0  # how long the others may take to end by themselves after one exits with an error
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def process_env(environ: Mapping[str, str], index: int, count: int, port: int,
                devices_per_process: int | None) -> dict[str, str]:
    """The environment of process `index`: the coordinator, the count, the index and, with
    `devices_per_process`, that many CPU devices."""
    env = {**environ, "JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": str(count),
           "JAX_PROCESS_ID": str(index)}
    if devices_per_process is not None:
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices_per_process}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def exit_code(returncode: int) -> int:
    """A Popen return code as a shell reports it: 128 + N for a process ended by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_end(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def _own_group_dying_with_parent() -> None:
    """In the child: a process group of its own, so a terminal's Ctrl-C reaches the launcher alone
    (which forwards it once), and, on Linux, SIGKILL when the launcher dies."""
    os.setpgrp()
    if sys.platform == "linux":
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass


def _pump(stream: IO[str], prefix: str, kept: collections.deque, echo: bool) -> None:
    for line in stream:
        if line.startswith("[Gloo] "):  # the collectives' connection notices, one per device
            continue
        kept.append(line)
        if echo:
            sys.stderr.write(prefix + line)
            sys.stderr.flush()


def launch(command: Sequence[str], n: int, devices_per_process: int | None = None, *,
           all_output: bool = False, environ: Mapping[str, str] | None = None) -> int:
    """Run `python -m jaxgpt COMMAND` as `n` processes of one job; the worst exit code."""
    if n < 1:
        raise UserError(f"-n {n}: the number of processes must be at least 1")
    if not command or command[0] not in MULTI_PROCESS_COMMANDS:
        raise UserError(f"jaxgpt launch runs {', '.join(MULTI_PROCESS_COMMANDS)} (e.g. jaxgpt launch -n 2 -- "
                         "train --out runs/a); eval and generate run in one process")
    port = free_port()
    environ = os.environ if environ is None else environ
    procs: list[subprocess.Popen] = []
    kept: list[collections.deque] = []
    pumps: list[threading.Thread] = []
    for index in range(n):
        env = process_env(environ, index, n, port, devices_per_process)
        quiet = index > 0
        proc = subprocess.Popen([sys.executable, "-m", "jaxgpt", *command], env=env,
                                stdout=subprocess.PIPE if quiet else None,
                                stderr=subprocess.STDOUT if quiet else None,
                                text=True, errors="replace", preexec_fn=_own_group_dying_with_parent)
        procs.append(proc)
        lines: collections.deque = collections.deque(maxlen=KEPT_LINES)
        kept.append(lines)
        if quiet:
            pump = threading.Thread(target=_pump, args=(proc.stdout, f"[{index}] ", lines, all_output),
                                    daemon=True)
            pump.start()
            pumps.append(pump)
    print(f"jaxgpt launch: {n} processes (pids {', '.join(str(p.pid) for p in procs)}), "
          f"coordinator localhost:{port}", file=sys.stderr, flush=True)

    forwarded: set[int] = set()

    def forward(signum: int, frame: object) -> None:
        forwarded.add(signum)
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    signals.release()  # one held since start-up (`jaxgpt launch` holds them) is forwarded now
    try:
        _watch(procs, forwarded)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for pump in pumps:
        pump.join(timeout=5)
    for index, proc in enumerate(procs):
        if index > 0 and proc.returncode != 0 and not all_output and kept[index]:
            sys.stderr.write("".join(f"[{index}] {line}" for line in kept[index]))
    return max(exit_code(proc.returncode) for proc in procs)


def _watch(procs: list[subprocess.Popen], forwarded: set[int]) -> None:
    """Wait for every process. One killed by a signal is lost: the others, waiting on it in a
    collective, are stopped at once. One that exits with an error while the others run gives them
    EXIT_GRACE_S to end by themselves (they may be failing alike). Ending by a signal the launcher
    forwarded, or with its exit code (128 + N), is stopping as asked. A loss is named even when the
    others died of it before the launcher looked (a collective's peer gone aborts a process)."""
    first_seen: dict[int, float] = {}
    while True:
        codes = [proc.poll() for proc in procs]  # poll every one: any() would stop at the first
        running = codes.count(None)
        lost = []
        for index, code in enumerate(codes):
            if code is None or code == 0 or exit_code(code) - 128 in forwarded:  # stopping as asked
                continue
            seen = first_seen.setdefault(index, time.monotonic())
            if code < 0 or (running and time.monotonic() - seen > EXIT_GRACE_S):
                lost.append(index)
        for index in lost:
            print(f"jaxgpt launch: process {index} was lost ({describe_end(codes[index])})"
                  + ("; stopping the others" if running else ""), file=sys.stderr, flush=True)
        if lost or not running:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            for proc in procs:
                proc.wait()
            return
        time.sleep(0.2)
