"""The accelerator compilers a plan runs, in a process of their own.

libtpu (TPU) and jax's CUDA plugin (GPU) compile for chips this machine need not have; the extra
`pip install 'jaxgpt[targets]'` brings both, and cuDNN for the GPU's attention. Each plan for a
target runs `python -m jaxgpt.plan.worker` with JAX on the CPU and the target's compiler loaded
for compile-only devices, so that:

* the calling process (a training run, a notebook on a TPU runtime) keeps its own devices and
  never loads a compiler for another chip;
* what the compilers print while they load (absl's "cuda drivers" notices, libtpu's start-up
  logs, which go to a temporary folder removed afterwards) stays out of the user's terminal:
  the worker's stderr is passed on without those lines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable

from jaxgpt.config import ConfigError
from jaxgpt.plan.targets import Target
from jaxgpt.process.platforms import installed_plugins

INSTALL = "pip install 'jaxgpt[targets]'"
KEEP_PLUGINS = "JAXGPT_KEEP_PLUGINS"  # read by jaxgpt.process.platforms: the worker needs the CUDA plugin
# Lines the compilers print while they load, which say nothing about the plan.
NOISE = [re.compile(pattern) for pattern in (
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR",
    r"WARNING: Logging before InitGoogle\(\) is written to STDERR",
    r"I\d{4} [\d:. ]+\d+ \S+:\d+\] .*",  # absl INFO lines (the CUDA stub's "could not find cuda drivers")
    # XLA's GPU compiler, failing to shrink a program to 76 % of the card by recomputing: the plan's
    # figures and `fits` say what it needs.
    r"W\d{4} [\d:. ]+\d+ hlo_rematerialization\.cc:\d+\] Can't reduce memory use below .*",
    # XLA's alarm at a compile past a few minutes, which a large model's plan takes on a small CPU.
    r"E\d{4} [\d:. ]+\d+ slow_operation_alarm\.cc:\d+\] *",
    r"\*{20,}",
    r"\[Compiling module \S+ for \w+\] Very slow compile\?.*",
)]


class CompilerMissing(ConfigError):
    """The target's compiler is not installed: one line naming the pip command."""


def check_installed(target: Target) -> None:
    """Raise CompilerMissing unless the compiler for `target` is installed."""
    if target.platform == "tpu" and "tpu" not in installed_plugins():
        raise CompilerMissing(f"planning for {target.name} needs the TPU compiler (libtpu): {INSTALL}")
    if target.platform == "gpu" and "cuda" not in installed_plugins():
        raise CompilerMissing(f"planning for {target.name} needs jax's CUDA compiler plugin: {INSTALL}")


def worker_environment(target: Target, log_dir: str) -> dict[str, str]:
    """The worker's environment: JAX on the CPU, libtpu told it runs on no TPU host (so it does
    not look for one) and logging into `log_dir`, the CUDA plugin kept for a GPU target."""
    env = dict(os.environ)
    # ALLOW_MULTIPLE_LIBTPU_LOAD: libtpu's lock on the host's chips (/tmp/libtpu_lockfile) guards
    # chips a compile-only process never opens; without it a second plan at once fails.
    env.update(JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_SKIP_MDS_QUERY="1",
               TPU_ACCELERATOR_TYPE="v5litepod-1",
               TPU_WORKER_HOSTNAMES="localhost", TPU_WORKER_ID="0", TPU_LOG_DIR=log_dir,
               LIBTPU_INIT_ARGS=f"{env.get('LIBTPU_INIT_ARGS', '')} --log_dir={log_dir}".strip())
    if target.platform == "gpu":
        env[KEEP_PLUGINS] = "1"
    return env


def is_noise(line: str) -> bool:
    return any(pattern.fullmatch(line) for pattern in NOISE)


def run_worker(plans: list[dict[str, Any]], target: Target, echo: Callable[[str], None] | None = None
               ) -> list[dict[str, Any]]:
    """Run `plans` (requests as `jaxgpt.plan.worker` reads them) in one compile process for
    `target`; their records, or {"error": ...} for a plan the user cannot have. The worker's
    stderr, less the compilers' loading noise, goes to `echo` line by line (default: stderr).
    A failure of the worker itself is a RuntimeError."""
    check_installed(target)
    echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory(prefix="jaxgpt-plan-") as log_dir:
        process = subprocess.Popen([sys.executable, "-m", "jaxgpt.plan.worker"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=worker_environment(target, log_dir))
        kept: list[str] = []

        def relay() -> None:  # the compilers' stderr, less their loading noise
            for line in process.stderr:
                line = line.rstrip("\n")
                if line and not is_noise(line):
                    kept.append(line)
                    echo(line)

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        answer = ""
        try:
            process.stdin.write(json.dumps({"target": target.name, "plans": plans}))
            process.stdin.close()
            for line in process.stdout:  # progress lines, then the records
                line = line.rstrip("\n")
                if line.startswith("jaxgpt plan:"):
                    echo(line)
                elif line:
                    answer = line
            process.wait()
        except BaseException:  # Ctrl-C: the compile process goes too
            process.kill()
            process.wait()
            raise
        reader.join()
    try:
        records = json.loads(answer)
    except json.JSONDecodeError:
        records = None
    if not isinstance(records, list) or len(records) != len(plans) or process.returncode != 0:
        code = process.returncode
        how = (f"died of {signal.Signals(-code).name} (a crash in the compiler)" if code and code < 0
               else f"failed (exit {code})")
        said = "its output is above" if kept else "it printed nothing more"
        raise RuntimeError(f"the compile process for {target.name} {how}; {said}")
    return records
