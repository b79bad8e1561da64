"""jaxgpt: a configurable GPT-style decoder in JAX/Flax, with the tooling to train, checkpoint,
sample, sweep and plan it (README.md; the packages and modules: docs/layout.md)."""

# The packages, lowest first: a module imports its own package and those before it, never one
# after it. "" is the foundation (config.py, errors.py); "public" the top-level faces
# (__init__.py, __main__.py, and checkpoint.py and generate.py, which hand public names on).
PACKAGES = ("", "runs", "process", "kernels", "model", "data", "evaluation", "hf", "nanochat", "train", "plan", "tools",
            "cli", "public")

from jaxgpt.process import platforms  # noqa: E402

# Before anything imports JAX: compilers installed for chips this machine lacks stay quiet.
platforms.quiet_absent_plugins()
