"""What the command line says in one line, and what it shows with its traceback.

    UserError   what was asked cannot be done as asked: a bad value, a refused change, a run that
                is not there. One line, exit code 2.
    Failure     something outside the input and outside jaxgpt's code stopped the work: a worker
                process killed (the kernel's OOM killer sends SIGKILL). One line, exit code 1.

Files that are missing or unreadable (OSError) and extras that are not installed (ImportError)
are the user's to fix too: one line, exit 2. Anything else is a bug, and keeps its traceback, so
that it never reads like the user's fault; `JAXGPT_DEBUG=1` shows the traceback of the others too.
Both classes are ValueErrors (UserError) and RuntimeErrors (Failure), as they were raised before.
"""

from __future__ import annotations


class UserError(ValueError):
    """What was asked cannot be done as asked; the message says what and why."""


class Failure(RuntimeError):
    """The work stopped for a cause outside the input and the code; the message says what to do."""
