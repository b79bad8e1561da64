"""Compiled programs kept on disk: a program compiled once is loaded, not compiled, by the next
process that needs it (JAX's persistent compilation cache, switched on for jaxgpt).

    enable()   # every command that compiles calls it first; train() too

The folder is `$JAXGPT_CACHE/xla` (default `~/.cache/jaxgpt/xla`), beside the token stores, so one
variable moves both (a Colab runtime pointing it at Drive keeps its compiles across runtimes); a
`JAX_COMPILATION_CACHE_DIR` the user set wins, and `JAXGPT_COMPILE_CACHE=0` turns the cache off.
Every program is kept, however fast it compiled (JAX's default keeps only those over 1 s, most of
a CPU run's), and the folder is bounded to `MAX_BYTES`, least recently used first
(`JAX_COMPILATION_CACHE_MAX_SIZE` in bytes overrides it). JAX's cache key covers the program, the
compile options, the jax, jaxlib and backend (libtpu, CUDA plugin) versions and the devices, so a
changed config, kernel set, version or chip compiles afresh.

The cache never fails a run: a folder that cannot be written (read-only, full, /proc) is one note
and the cache off; a read or write that fails later is one note for the process, and the compile
goes on. With a size bound JAX takes a file lock around each read and write, so processes that
start together on a cold cache do not read each other's half-written entries. On many hosts JAX
writes from process 0 alone; the others read: point the folder at storage every host sees.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

from jaxgpt.runs.rundir import default_cache_dir

MAX_BYTES = 4 << 30
OFF = "JAXGPT_COMPILE_CACHE"
# The warnings JAX gives for a cache read or write that failed, which say nothing the note does not.
_JAX_CACHE_WARNINGS = ("Error reading persistent compilation cache", "Error writing persistent compilation cache",
                       "Cache value for key")
_state: dict[str, object] = {}


def folder() -> Path:
    """Where compiled programs are kept (whether or not the cache is on)."""
    chosen = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if chosen:
        return Path(chosen).expanduser()
    return default_cache_dir() / "xla"


def _note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


def _writable(path: Path) -> str | None:
    """None if a file can be made and written in `path` (made if missing); else why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-") as probe:
            probe.write(b"x" * 4096)
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as err:
        return err.strerror or type(err).__name__
    return None


def _one_note_for_cache_warnings() -> None:
    """JAX's cache warnings (one per failed read or write) become one note for the process."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if text.startswith(_JAX_CACHE_WARNINGS):
            if not _state.get("warned"):
                _state["warned"] = True
                _note(f"compiled programs could not be kept in {folder()} ({text.split(': ', 1)[-1][:160]}); "
                      "compiling as usual")
            return
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    for prefix in _JAX_CACHE_WARNINGS:
        warnings.filterwarnings("always", message=prefix)  # each one reaches `show`, which keeps one


def enable() -> Path | None:
    """Switch the cache on for this process (once); the folder, or None where it is off."""
    if "folder" in _state:
        return _state["folder"]  # type: ignore[return-value]
    import jax

    path: Path | None = folder()
    if os.environ.get(OFF) == "0":
        path = None
    else:
        why = _writable(path)
        if why is not None:
            _note(f"compiled programs are not kept: {path} cannot be written ({why}); {OFF}=0 silences this")
            path = None
    _state["folder"] = path
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    _one_note_for_cache_warnings()
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()  # a process that compiled before this call takes the cache from now on
    return path


def disable() -> None:
    """No cache in this process, whatever the environment says: for compile-only processes (a plan
    for a chip that is absent), whose programs JAX could keep but never load."""
    import jax

    _state["folder"] = None
    jax.config.update("jax_enable_compilation_cache", False)


@contextlib.contextmanager
def bypassed() -> Iterator[None]:
    """Programs compiled inside are compiled, neither loaded from the cache nor kept in it: for the
    benchmarks that time compiling."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once whether the cache is used: ask it again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()
