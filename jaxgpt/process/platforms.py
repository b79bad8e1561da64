"""Which of the installed accelerator plugins a process lets JAX start, decided before JAX loads.

The compilers that plan runs for chips this machine lacks (`pip install 'jaxgpt[targets]'`:
libtpu and jax's CUDA plugin) are JAX platform plugins. Installed where their chip is not, JAX
still tries them: `import jax` prints the CUDA plugin's "Could not find cuda drivers" lines,
and the first computation libtpu's failed start-up and the CUDA plugin's traceback, before
falling back to the CPU. `quiet_absent_plugins()` (run when `jaxgpt` is imported, which does not
import JAX) keeps both away where their chip is absent, by the tests JAX itself uses to warn
that a present chip went unused (`jax/_src/hardware_utils.py`, loaded alone, without JAX):

* `JAX_PLATFORMS`, unless the user set it, names only the accelerators present, then the CPU;
  on a machine with none that is "cpu", what JAX would have ended with after its failed tries.
* Without an NVIDIA device the CUDA plugin's modules are hidden from imports (plugin discovery
  finds a stand-in that registers nothing), unless `JAX_PLATFORMS` asks for CUDA.
* With an NVIDIA device, JAX's share of its memory (`XLA_PYTHON_CLIENT_MEM_FRACTION`, 75 % by
  default) is raised to the 90 % a plan counts as fitting (`jaxgpt.plan`), unless set.

A process that has imported JAX before jaxgpt keeps what JAX chose. The plan's compile process
(`jaxgpt.plan.worker`) sets its own `JAX_PLATFORMS`, and `JAXGPT_KEEP_PLUGINS=1` where it
compiles for a GPU: there the plugins are the point.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path

CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")
CUDA_PJRT_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
PLAN_MEMORY_FRACTION = "0.9"  # jaxgpt.plan.HEADROOM


def _jax_hardware_utils() -> types.ModuleType | None:
    """The installed jax's `_src/hardware_utils.py`, loaded on its own (it imports only the
    standard library), so that importing jax, and its plugins, waits; None if it is not there."""
    spec = importlib.util.find_spec("jax")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "_src" / "hardware_utils.py"
    file_spec = importlib.util.spec_from_file_location("jaxgpt._jax_hardware_utils", path)
    if file_spec is None or not path.is_file():
        return None
    module = importlib.util.module_from_spec(file_spec)
    try:
        file_spec.loader.exec_module(module)
    except Exception:  # another jax's layout: treat every accelerator as present
        return None
    return module


def visible_accelerators() -> list[str]:
    """The JAX platforms whose chips this machine shows ("tpu", "cuda", "rocm"), by jax's own
    tests; all three where those cannot be read."""
    hardware = _jax_hardware_utils()
    if hardware is None:
        return ["tpu", "cuda", "rocm"]
    try:
        found = [name for name, present in (
            ("tpu", lambda: hardware.num_available_tpu_chips_and_device_id()[0] > 0),
            ("cuda", hardware.has_visible_nvidia_gpu),
            ("rocm", lambda: hardware.num_available_amd_gpus(stop_at=1) > 0)) if present()]
    except (AttributeError, OSError):
        return ["tpu", "cuda", "rocm"]
    return found


def installed(module: str) -> bool:
    """Whether a top-level module is installed, looked up on sys.path itself (past the hiding below)."""
    return importlib.machinery.PathFinder.find_spec(module) is not None


def installed_plugins() -> list[str]:
    """The accelerator plugins installed here that `quiet_absent_plugins` can keep away."""
    plugins = []
    if installed("libtpu"):
        plugins.append("tpu")
    if any(installed(name) for name in CUDA_PLUGINS):
        plugins.append("cuda")
    return plugins


class _HiddenCudaPlugin(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of the CUDA plugin fail as if it were not installed; its PJRT entry point (which
    JAX's plugin discovery imports by listing `jax_plugins`) is a module that registers nothing."""

    def find_spec(self, name, path=None, target=None):  # noqa: D401 (importlib's signature)
        if name.split(".")[0] in CUDA_PLUGINS:
            raise ModuleNotFoundError(f"{name} is hidden: no NVIDIA device here", name=name)
        if name in CUDA_PJRT_PLUGINS:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.initialize = lambda: None


def quiet_absent_plugins() -> None:
    """Keep installed accelerator plugins whose chip is absent from starting (module docstring)."""
    if "jax" in sys.modules or os.environ.get("JAXGPT_KEEP_PLUGINS"):
        return
    plugins = installed_plugins()
    if not plugins:
        return
    visible = visible_accelerators()
    if "JAX_PLATFORMS" not in os.environ and any(p not in visible for p in plugins):
        os.environ["JAX_PLATFORMS"] = ",".join([*visible, "cpu"])
    wanted = os.environ.get("JAX_PLATFORMS", "")
    if "cuda" in plugins and "cuda" not in visible and "cuda" not in wanted.split(","):
        if not any(isinstance(finder, _HiddenCudaPlugin) for finder in sys.meta_path):
            sys.meta_path.insert(0, _HiddenCudaPlugin())
    if "cuda" in visible:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", PLAN_MEMORY_FRACTION)
