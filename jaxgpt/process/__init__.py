"""A jaxgpt process around JAX: what it sets up before and while it compiles and trains.

    platforms.py      which installed accelerator plugins JAX may start (none whose chip is absent)
    signals.py        SIGINT / SIGTERM turned into a stop at a safe point
    distributed.py    many processes: jax.distributed, which one writes
    compile_cache.py  compiled programs kept on disk ($JAXGPT_CACHE/xla), reused by the next process
    startup.py        where a start's seconds go (stages, XLA compiles and cache loads)

Imports only the foundation and `jaxgpt.runs`; imports no JAX at package level, so that
`jaxgpt/__init__.py` can run `platforms` before anything imports JAX.
"""
