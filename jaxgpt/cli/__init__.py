"""The `jaxgpt` command: parsing and one-line errors (`main.py`), each command's body
(`commands.py`). The top floor: imports any package, and no package imports it.

`entry` is the console script's target (`jaxgpt.cli:entry`); `jaxgpt.cli.main.main(argv)` runs a
command in this process."""

from jaxgpt.cli.main import entry, hugepage_malloc_env

__all__ = ["entry", "hugepage_malloc_env"]
