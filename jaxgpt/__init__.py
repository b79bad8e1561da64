"""jaxgpt: a configurable GPT-style decoder in JAX/Flax, with the tooling to train, checkpoint,
sample, sweep and plan it (README.md; the packages and modules: docs/layout.md)."""

from jaxgpt import platforms

# Before anything imports JAX: compilers installed for chips this machine lacks stay quiet.
platforms.quiet_absent_plugins()
