"""The small models the plan tests compile for accelerator targets (tests/test_plan*.py)."""

from conftest import SPEEDRUN

from jaxgpt.config import RunConfig, load_config

TINY = ["model.vocab_size=256", "model.n_layers=1", "train.sample_tokens=4"]
GIB = 2**30


def tiny(*overrides: str) -> RunConfig:
    return load_config(None, [*TINY, *overrides])


def attention(kind: str, T: int, D: int, dtype: str, *more: str) -> RunConfig:
    """A one-layer model with 4 query heads of size D: multi-head, grouped (2 KV heads) or
    multi-query attention ("mha", "gqa", "mqa"), T positions."""
    kv = {"mha": 4, "gqa": 2, "mqa": 1}[kind]
    return tiny("model.n_heads=4", f"model.kv_heads={kv}", f"model.d_model={4 * D}", f"model.context_length={T}",
                f"model.dtype={dtype}", "train.batch_size=2", *more)


# Four layers of short rows, bfloat16: small programs that still hold more activations than the
# rest, so what each remat policy keeps shows (a TPU keeps a small program's temporaries on chip,
# out of its HBM figures: GPUs show the policies at this size), and whose largest batch on a chip
# is found in a few fast compiles.
LAYERS = ["model.d_model=128", "model.n_heads=2", "model.n_layers=4", "model.context_length=128",
          "model.dtype=bfloat16", *TINY[:1], "train.sample_tokens=4"]


# Every switch of the speedrun block and the group learning rates, on AdamW (Muon's Newton-Schulz
# steps are plain XLA matmuls whatever the kernels (on the CPU: test_step, test_parallel), and
# would double the train step's compile for a target), under muP at twice its base width.
SPEEDRUN_BLOCK = attention("gqa", 256, 64, "bfloat16", *SPEEDRUN, "train.optimizer=adamw",
                           "model.parametrization=mup", "model.mup_base_width=128")


# Long-short windows: a windowed block and a whole-context one in the one scanned layer (lax.cond
# picks the kernel), at a length where the window skips blocks.
WINDOWED = ["model.n_layers=2", "model.position=rope", "model.attention_window=128", "model.window_pattern=SL"]
