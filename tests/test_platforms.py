"""Compilers installed for chips this machine lacks (the `targets` extra: libtpu, jax's CUDA
plugin) change nothing for a jaxgpt process: JAX starts on the CPU without a word."""

import os
import subprocess
import sys
import types

import pytest

from jaxgpt.process import platforms

PROBE = ("import os, sys, jaxgpt, jax, jax.numpy as jnp; "
         "print(os.environ.get('JAX_PLATFORMS'), jax.default_backend(), float(jnp.ones(3).sum()), "
         "'jax_cuda12_plugin' in sys.modules)")


def _run(code: str, **env_changes: str | None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_the_test_environment_has_both_compilers():
    assert platforms.installed_plugins() == ["tpu", "cuda"]


def test_with_the_compilers_installed_a_jaxgpt_process_starts_on_the_cpu_in_silence():
    out = _run(PROBE)
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.split() == ["cpu", "cpu", "3.0", "False"]  # the CUDA plugin never loaded


def test_platforms_a_user_set_are_kept():
    out = _run("import os, jaxgpt; print(repr(os.environ['JAX_PLATFORMS']))", JAX_PLATFORMS="")
    assert out.stdout.strip() == "''"


def test_the_compile_process_keeps_every_plugin():
    out = _run("import os, sys, jaxgpt, importlib.util; print(os.environ.get('JAX_PLATFORMS'), "
               "importlib.util.find_spec('jax_cuda12_plugin') is not None)", JAXGPT_KEEP_PLUGINS="1")
    assert out.stdout.split() == ["None", "True"]


@pytest.mark.parametrize("chips, nvidia, amd, visible", [
    (0, False, 0, []), (4, False, 0, ["tpu"]), (0, True, 0, ["cuda"]), (0, False, 2, ["rocm"]),
    (1, True, 1, ["tpu", "cuda", "rocm"])])
def test_the_chips_present_are_read_by_jax_s_own_tests(chips, nvidia, amd, visible, monkeypatch):
    fake = types.SimpleNamespace(num_available_tpu_chips_and_device_id=lambda: (chips, None),
                                 has_visible_nvidia_gpu=lambda: nvidia, num_available_amd_gpus=lambda stop_at: amd)
    monkeypatch.setattr(platforms, "_jax_hardware_utils", lambda: fake)
    assert platforms.visible_accelerators() == visible


def test_where_jax_s_tests_cannot_be_read_every_chip_counts_as_present(monkeypatch):
    monkeypatch.setattr(platforms, "_jax_hardware_utils", lambda: None)
    assert platforms.visible_accelerators() == ["tpu", "cuda", "rocm"]
    monkeypatch.undo()
    hardware = platforms._jax_hardware_utils()
    assert hardware is not None and hardware.num_available_tpu_chips_and_device_id()[0] == 0
