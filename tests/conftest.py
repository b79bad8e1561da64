import os

# Tests run on the host CPU with eight fake devices (for the multi-device tests); the flag must be
# set before JAX is imported anywhere.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest


@pytest.fixture(autouse=True)
def _private_token_cache(tmp_path_factory, monkeypatch):
    """Token files and trained tokenizers go to a per-session folder, never the user's cache."""
    monkeypatch.setenv("JAXGPT_CACHE", str(tmp_path_factory.getbasetemp() / "jaxgpt-cache"))
