"""What the command line says in one line, and what it shows with its traceback.

    UserError   what was asked cannot be done as asked: a bad value, a refused change, a run that
                is not there. One line, exit code 2.
    Failure     something outside the input and outside jaxgpt's code stopped the work: a worker
                process killed (the kernel's OOM killer sends SIGKILL). One line, exit code 1.

Files that are missing or unreadable (OSError) and extras that are not installed (ImportError)
are the user's to fix too: one line, exit 2. Anything else is a bug, and keeps its traceback, so
that it never reads like the user's fault; `JAXGPT_DEBUG=1` shows the traceback of the others too.
UserError is a ValueError and Failure a RuntimeError, so callers catching those catch them.

A misspelt name is answered with the nearest known ones (`nearest`, `did_you_mean`).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(ValueError):
    """What was asked cannot be done as asked; the message says what and why."""


class Failure(RuntimeError):
    """The work stopped for a cause outside the input and the code; the message says what to do."""


def nearest(name: str, known: Iterable[str], n: int = 1, cutoff: float = 0.5) -> list[str]:
    """The `n` known names closest to a misspelt `name` (difflib's ratio at least `cutoff`)."""
    return difflib.get_close_matches(name, list(known), n=n, cutoff=cutoff)


def did_you_mean(name: str, known: Iterable[str], cutoff: float = 0.5) -> str:
    """" (did you mean 'x'?)" for the nearest known name, or "" where none is near."""
    match = nearest(name, known, cutoff=cutoff)
    return f" (did you mean {match[0]!r}?)" if match else ""
