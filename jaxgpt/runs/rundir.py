"""The run directory's layout, named in one place, and the one way files in it are replaced.

    runs/a/
      config.toml      the resolved config, written before the first step
      tokenizer.json   the run's tokenizer (a resumed run keeps it)
      metrics.jsonl    one JSON record per line: train, eval, eval_tasks, core, sample, summary
      checkpoints/     Orbax checkpoints, one folder per saved step
      tensorboard/     TensorBoard event files of the metrics' numbers
      wandb/, wandb.json  with train.trackers = ["wandb"]: W&B's folder, the ids of the run's W&B runs
      loss.png         train and val loss against step, redrawn when a run ends

Every file that a reader may open while it is being rewritten (a notebook refreshing the plot, a
resume reading the config) is written with `atomic_file` / `write_atomic`: a reader sees the old
file or the new one, never half of either, and a failed write leaves the old file as it was.

Beside the runs, one cache folder serves every run of a machine: `$JAXGPT_CACHE`, by default
~/.cache/jaxgpt (token stores, their locks, compiled programs).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

CONFIG = "config.toml"
TOKENIZER = "tokenizer.json"
NANOCHAT_TOKENIZER = "nanochat_tokenizer.pkl"  # nanochat's tokenizer as it stores it: an imported run's, or the one a run trained on
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tensorboard"
LOSS_PLOT = "loss.png"


def default_cache_dir() -> Path:
    """The folder of the token stores, their locks and the compiled programs."""
    return Path(os.environ.get("JAXGPT_CACHE") or Path.home() / ".cache" / "jaxgpt")


class RunDir:
    """The paths of one run directory; creating a RunDir touches nothing on disk."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    def __fspath__(self) -> str:
        return os.fspath(self.root)

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def tokenizer(self) -> Path:
        return self.root / TOKENIZER

    @property
    def nanochat_tokenizer(self) -> Path:
        """The tokenizer.pkl a run imported from nanochat came with, which export-nanochat writes back."""
        return self.root / NANOCHAT_TOKENIZER

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def tensorboard(self) -> Path:
        return self.root / TENSORBOARD

    @property
    def loss_plot(self) -> Path:
        return self.root / LOSS_PLOT

    def has_checkpoints(self) -> bool:
        """True when checkpoints/ holds anything (a run was saved here)."""
        return self.checkpoints.is_dir() and any(self.checkpoints.iterdir())


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "wb", encoding: str | None = None) -> Iterator[IO]:
    """An open temp file beside `path` that replaces `path` when the block ends without error.

    The data is flushed to disk before the rename, so a crash leaves the old file or the new one.
    If the block raises, the temp file is removed and `path` is untouched.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, data: str | bytes | memoryview) -> None:
    """Replace `path` with `data` (str as UTF-8) in one step: readers never see a partial file."""
    if isinstance(data, str):
        with atomic_file(path, "w", encoding="utf-8") as f:
            f.write(data)
    else:
        with atomic_file(path, "wb") as f:
            f.write(data)
