import os

# Tests run on the host CPU with eight fake devices (for the multi-device tests); the flags must be
# set before JAX is imported anywhere. The tests' models are tiny, so compiling dominates their
# time. LLVM's optimisation level 0 and XLA's classic CPU fusion emitter in place of the MLIR one
# make a small train step compile faster (figures: docs/performance.md, "The test suite's compiles");
# the HLO passes, and so the programs' structure, are unchanged. Processes a test starts take the
# same flags (`xla_flags`), so their numbers match this process's bit for bit.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int) -> str:
    return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"


# The speedrun block's switches all on at once, and the optimiser settings that go with them: the
# tests of each mode (sharded, pmap, many hosts, resume, dry-run targets, sweeps, generation) add
# them to their own tiny config as one more case. Three layers: the middle one takes no skip and no
# value table; the first pairs its heads, the others do not (one scanned layer, both attentions).
# Model sizes are each test's own (a head size divisible by 4, an even n_heads).
SPEEDRUN = ["model.position=rope", "model.norm=rmsnorm", "model.qk_norm=true", "model.embed_norm=true",
            "model.feed_forward=relu2", "model.logit_softcap=15.0", "model.zero_init=true", "model.x0_mix=true",
            "model.unet_skips=true", "model.value_embeds=1", "model.tie_embeddings=false", "model.kv_heads=2",
            "model.rope_truncated=true", "model.attention_scale=0.12", "model.n_layers=3", "model.mtp_depth=1",
            "model.bigram_hash_rows=509", "model.exclusive_self_attention=true", "model.paired_head_layers=[0]",
            "train.optimizer=muon", "train.lr_embed=6e-3", "train.lr_head=2e-3", "train.lr_scalar=4e-3",
            "train.future_token_weights=[0.5, 0.25]", "train.prefix_token_weight=0.25"]


def with_stand_in_prefixes(rows, context_length: int, prefix_token_weight: float):
    """Token rows [B, W] as a train step takes them: where train.prefix_token_weight asks for prefix
    targets (jaxgpt.data.batches.batch_width), a stand-in for them after: half of each next token's
    id, none (-1) for an odd id. Tests that draw their own rows and no tokenizer use it."""
    if not prefix_token_weight:
        return rows
    import numpy as np

    following = np.asarray(rows)[:, 1:1 + context_length]
    return np.concatenate([np.asarray(rows), np.where(following % 2, -1, following // 2).astype(np.int32)], axis=1)

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", xla_flags(8))

import jaxgpt  # noqa: F401,E402  (before jax: keeps the absent GPU's plugin from loading and talking)
import jax
import jax.numpy as jnp
import pytest

from jaxgpt.process import compile_cache


@pytest.fixture(autouse=True)
def _private_token_cache(tmp_path_factory, monkeypatch):
    """Token files and trained tokenizers go to a per-session folder, never the user's cache."""
    monkeypatch.setenv("JAXGPT_CACHE", str(tmp_path_factory.getbasetemp() / "jaxgpt-cache"))


@pytest.fixture(scope="session", autouse=True)
def _shared_compile_cache(tmp_path_factory):
    """One compiled-program cache (jaxgpt.process.compile_cache) for the processes the tests start, across
    pytest-xdist's workers: they load the programs another compiled instead of compiling them
    again. It lives in the run's temporary root, never the user's cache. The workers themselves
    keep nothing on disk: JAX's in-memory caches serve their own repeats, and writing every program
    cost them more than the few loads it gave (docs/performance.md). Tests that check compiling or
    caching give their processes folders of their own."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above the workers' own
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(root / "xla-cache")
    compile_cache.disable()
    yield


@pytest.fixture
def random_qkv():
    """A maker of normal q [B, T, H, D], k and v [B, T, K, D], all from one fixed key."""
    def make(B, T, H, K, D, dtype=jnp.float32):
        kq, kk, kv = jax.random.split(jax.random.key(2), 3)
        return (jax.random.normal(kq, (B, T, H, D), dtype), jax.random.normal(kk, (B, T, K, D), dtype),
                jax.random.normal(kv, (B, T, K, D), dtype))
    return make


@pytest.fixture
def waits(monkeypatch):
    """The ids of the results anything waited for with `jax.block_until_ready`, in order."""
    seen: list[int] = []
    real = jax.block_until_ready

    def recording(tree):
        seen.append(id(tree))
        return real(tree)

    monkeypatch.setattr(jax, "block_until_ready", recording)
    return seen


@pytest.fixture
def in_flight_windows(monkeypatch, waits):
    """`watch(module)` makes the `InFlight` windows that `module` opens record what passes through
    them (kept alive, so their ids stay theirs); `check(window)` asserts that the window held at
    most its limit: each result beyond it was waited for, oldest first, before the next was sent."""
    from jaxgpt.process import dispatch

    windows: list = []

    class Recording(dispatch.InFlight):
        def __init__(self, limit: int = dispatch.IN_FLIGHT) -> None:
            super().__init__(limit)
            self.added: list = []
            self.waits_before: list[int] = []  # how many waits had happened as each result came
            windows.append(self)

        def add(self, result):
            self.waits_before.append(len(waits))
            self.added.append(result)
            return super().add(result)

    def watch(module) -> list:
        monkeypatch.setattr(module, "InFlight", Recording)
        return windows

    def check(window) -> None:
        ids = [id(result) for result in window.added]
        waited = list(dict.fromkeys(w for w in waits if w in set(ids)))  # first waits, in order
        assert waited[:len(ids) - window.limit] == ids[:len(ids) - window.limit]
        for i in range(window.limit + 1, len(ids)):  # result i - limit - 1 was waited for before result i came
            assert ids[i - window.limit - 1] in waits[:window.waits_before[i]], i
    return watch, check
