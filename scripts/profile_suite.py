"""Where the test suite's CPU goes: a pytest plugin that sums, for each pytest-xdist worker, its own
CPU time, the CPU time of the processes it started and waited for, and JAX's compile events
(tracing, lowering to MLIR, XLA's backend compile: how many, how long), each also by the test
module that spent it, then prints two tables.

    PYTHONPATH=scripts .venv/bin/python -m pytest -n 3 -p profile_suite

The compile durations are wall-clock: with more workers than cores they include time a worker
waited for a core, so compare them with each other, and the CPU columns with the run's `time`."""

import json
import os
import resource
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

FOLDER = "JAXGPT_PROFILE_SUITE_DIR"
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}
COLUMNS = ["compiles", "compile_s", "lowers", "lower_s", "traces", "trace_s"]
MODULES_SHOWN = 20
_module = "(outside a test)"
_by_module: defaultdict[str, Counter] = defaultdict(Counter)


def _listen(event: str, duration: float, **_: object) -> None:
    if event in EVENTS:
        name = EVENTS[event]
        _by_module[_module][f"{name}s"] += 1
        _by_module[_module][f"{name}_s"] += duration


def pytest_configure(config) -> None:
    # Set before pytest-xdist starts its workers, so that they inherit the folder.
    os.environ.setdefault(FOLDER, tempfile.mkdtemp(prefix="profile-suite-"))
    if os.environ.get("PYTEST_XDIST_WORKER") or not config.pluginmanager.hasplugin("dsession"):
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(_listen)


def _cpu() -> tuple[float, float]:
    own, waited = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime, waited.ru_utime + waited.ru_stime


_started = _cpu()


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    global _module, _started
    _module, _started = nodeid.split("::")[0], _cpu()


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    (own, waited), (own_before, waited_before) = _cpu(), _started
    _by_module[_module]["cpu_s"] += own - own_before
    _by_module[_module]["children_cpu_s"] += waited - waited_before


def pytest_sessionfinish(session) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    own, waited = _cpu()
    total = sum(_by_module.values(), Counter())
    record = {"cpu_s": own, "children_cpu_s": waited, **{column: total[column] for column in COLUMNS},
              "modules": _by_module}
    (Path(os.environ[FOLDER]) / f"{worker or 'main'}.json").write_text(json.dumps(record))


def pytest_terminal_summary(terminalreporter) -> None:
    rows = {path.stem: json.loads(path.read_text()) for path in sorted(Path(os.environ[FOLDER]).glob("*.json"))}
    workers = {name: row for name, row in rows.items() if name != "main"} or rows
    write = terminalreporter.write_line
    columns = ["cpu_s", "children_cpu_s", *COLUMNS]
    write("")
    write("where the suite's CPU goes (scripts/profile_suite.py), by worker:")
    write(f"{'worker':<8}" + "".join(f"{c:>15}" for c in columns))
    for name, row in workers.items():
        write(f"{name:<8}" + "".join(f"{row[c]:>15,.0f}" for c in columns))
    write(f"{'total':<8}" + "".join(f"{sum(r[c] for r in workers.values()):>15,.0f}" for c in columns))
    modules: defaultdict[str, Counter] = defaultdict(Counter)
    for row in workers.values():
        for module, figures in row["modules"].items():
            modules[module].update(figures)
    ranked = sorted(modules.items(), key=lambda item: -(item[1]["cpu_s"] + item[1]["children_cpu_s"]))
    write(f"by test module (its fixtures' setup and teardown included), the {MODULES_SHOWN} that took the most CPU:")
    write("".join(f"{c:>15}" for c in columns) + "  module")
    for module, figures in ranked[:MODULES_SHOWN]:
        write("".join(f"{figures[c]:>15,.0f}" for c in columns) + f"  {module}")
