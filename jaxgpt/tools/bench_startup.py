"""`jaxgpt bench startup`: how long a fresh process takes to its first train step and its first
generated token, with an empty compilation cache (cold) and a filled one (warm).

Each figure is a median over `repeats` fresh processes (`python -m jaxgpt ...`), the token store
prepared beforehand so that neither start reads text:

* train: `jaxgpt train --steps 2` of the config; `cold_s` / `warm_s` from the process's start
  to its first step done (its summary's `startup.total_s`), `*_wall_s` the whole command;
* generate: `jaxgpt generate --run RUN --max-new-tokens 40 --stats` on that run; `cold_s` /
  `warm_s` from the launch to the first token on stdout, `*_wall_s` the whole command.

Each record also names where the warm start still goes (`warm`: imports, data, setup, first step,
XLA's compile and the cache's load for train; before the call and the call to the first token for
generate), so that the next second to win shows. Cold runs each get an empty cache folder of their
own (`JAX_COMPILATION_CACHE_DIR`); warm runs share one, filled by a run not counted.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from jaxgpt.config import RunConfig
from jaxgpt.errors import Failure

NEW_TOKENS = 40


def _run(args: list[str], env: dict[str, str]) -> tuple[float, float | None, str, str]:
    """(wall seconds, seconds to the first byte on stdout, stdout, stderr) of `python -m jaxgpt ARGS`."""
    launched = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "jaxgpt", *args], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    first = os.read(process.stdout.fileno(), 1)  # unbuffered: communicate() reads the descriptor itself
    first_s = time.perf_counter() - launched if first else None
    out, err = process.communicate()
    wall = time.perf_counter() - launched
    if process.returncode != 0:
        raise Failure(f"jaxgpt {args[0]} ended with exit code {process.returncode}: "
                      f"{err.decode(errors='replace').strip().splitlines()[-1:]}")
    return wall, first_s, (first + out).decode(), err.decode()


def _last_json(text: str) -> dict[str, Any]:
    """The last line of `text` that is a JSON object (a command's summary comes after its other output)."""
    for line in reversed(text.split("\n")):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise Failure(f"no JSON summary in the command's output: {text[-300:]!r}")


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def _record(program: str, cold: list[dict], warm: list[dict], stages: list[str]) -> dict[str, Any]:
    record = {"mode": "startup", "program": program, "repeats": len(cold),
              "cold_s": _median([r["first_s"] for r in cold]), "warm_s": _median([r["first_s"] for r in warm])}
    record["ratio"] = round(record["warm_s"] / record["cold_s"], 3)
    record["cold_wall_s"] = _median([r["wall_s"] for r in cold])
    record["warm_wall_s"] = _median([r["wall_s"] for r in warm])
    record["wall_ratio"] = round(record["warm_wall_s"] / record["cold_wall_s"], 3)
    record["warm"] = {stage: _median([r[stage] for r in warm if r.get(stage) is not None] or [0.0])
                      for stage in stages}
    return record


def bench_startup(cfg: RunConfig, repeats: int) -> Iterator[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="jaxgpt-startup-") as tmp:
        folder = Path(tmp)
        config = folder / "config.toml"
        config.write_text(cfg.to_toml())
        env = {key: value for key, value in os.environ.items() if key != "JAXGPT_COMPILE_CACHE"}

        def with_cache(name: str) -> dict[str, str]:
            return {**env, "JAX_COMPILATION_CACHE_DIR": str(folder / name)}

        _run(["prepare", "--config", str(config), "--no-progress"], env)  # the data, outside every figure
        runs = iter(range(10**6))

        def train(cache: str) -> dict[str, Any]:
            out = folder / f"run-{next(runs)}"
            wall, _, stdout, _ = _run(["train", "--config", str(config), "--out", str(out), "--steps", "2",
                                       "--no-progress"], with_cache(cache))
            startup = _last_json(stdout)["startup"]
            return {"wall_s": wall, "first_s": startup["total_s"], "run": out, **startup}

        def generate(cache: str, run: Path) -> dict[str, Any]:
            wall, first_s, _, err = _run(["generate", "--run", str(run), "--max-new-tokens", str(NEW_TOKENS),
                                          "--stats"], with_cache(cache))
            stats = _last_json(err)
            return {"wall_s": wall, "first_s": first_s, "first_token_s": stats["first_token_s"],
                    "before_the_call_s": first_s - stats["first_token_s"],
                    "decode_tokens_per_s": stats["tokens_per_s"]}

        cold = [train(f"cold-train-{i}") for i in range(repeats)]
        train("warm")  # fills the warm cache
        warm = [train("warm") for _ in range(repeats)]
        yield _record("train", cold, warm, ["imports_s", "checks_s", "data_s", "setup_s", "first_step_s",
                                            "compile_s", "cache_load_s"])
        run = cold[0]["run"]
        cold = [generate(f"cold-generate-{i}", run) for i in range(repeats)]
        generate("warm", run)  # its programs (another buffer than the train runs' samples) go in
        warm = [generate("warm", run) for _ in range(repeats)]
        yield _record("generate", cold, warm, ["before_the_call_s", "first_token_s", "decode_tokens_per_s"])
