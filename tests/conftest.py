import os

# Tests run on the host CPU with eight fake devices (for the multi-device tests); the flag must be
# set before JAX is imported anywhere.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import pytest


@pytest.fixture(autouse=True)
def _private_token_cache(tmp_path_factory, monkeypatch):
    """Token files and trained tokenizers go to a per-session folder, never the user's cache."""
    monkeypatch.setenv("JAXGPT_CACHE", str(tmp_path_factory.getbasetemp() / "jaxgpt-cache"))


@pytest.fixture
def random_qkv():
    """A maker of normal q [B, T, H, D], k and v [B, T, K, D], all from one fixed key."""
    def make(B, T, H, K, D, dtype=jnp.float32):
        kq, kk, kv = jax.random.split(jax.random.key(2), 3)
        return (jax.random.normal(kq, (B, T, H, D), dtype), jax.random.normal(kk, (B, T, K, D), dtype),
                jax.random.normal(kv, (B, T, K, D), dtype))
    return make
