"""SIGINT and SIGTERM as a request to stop at the next safe point.

Python's own SIGINT handler raises KeyboardInterrupt wherever the main thread happens to be. During
a compile that is often inside JAX's garbage-collection callback, where the exception is printed
as "Exception ignored" and lost (the run trains on), or it unwinds while XLA's threads still run
and the process dies with a segmentation fault on exit. The handlers here only record the signal;
the training code calls `check()` between its stages and reads `received` after each step, so a
stop always happens between two complete writes.

    with signals.handled() as stop:
        prepare()
        signals.check()      # raises Stopped if a signal came
        for step in ...:
            ...
            if stop.received: break

A signal can also come before any handler of ours exists: while Python starts and imports JAX, or
while the command re-executes itself (`cli.entry`). A process started in the background by a
non-interactive shell even begins with SIGINT ignored. So the command's first instruction is
`hold()`, which blocks both signals: one that comes then stays pending (across `exec` too) until
`handled()` installs the recording handlers and unblocks it, or `release()` lets it act as it
would have.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """A run stopped by SIGINT or SIGTERM at a safe point; `exit_code` is the shell's 128 + signal."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


class StopRequest:
    """What `handled()` recorded: `received` is the first signal's number, or None."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.active = False


_state = StopRequest()
_CAN_BLOCK = hasattr(signal, "pthread_sigmask")  # POSIX; elsewhere nothing holds a signal: it acts at once


def hold() -> None:
    """Block SIGINT and SIGTERM in this thread, and in the threads and processes it starts from now
    on, until `handled()` or `release()`; one that comes meanwhile waits, it is not lost."""
    if _CAN_BLOCK:
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)


def release() -> None:
    """Unblock what `hold()` blocked: a pending signal acts now, under the handlers in place."""
    if _CAN_BLOCK:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def _handle(signum: int, frame: Any) -> None:
    if _state.received is not None and signum == signal.SIGINT:
        raise Stopped(signum, "interrupted again: stopped at once")  # a second Ctrl-C aborts
    _state.received = signum


@contextmanager
def handled() -> Iterator[StopRequest]:
    """Record SIGINT and SIGTERM instead of acting on them, inside this block, including one held
    back by `hold()` before it. Nested blocks share the outer one's record; off the main thread
    (where Python cannot install handlers) it records nothing and the process keeps its handlers."""
    if _state.active or threading.current_thread() is not threading.main_thread():
        yield _state
        return
    previous = {signum: signal.signal(signum, _handle) for signum in SIGNALS}
    _state.received, _state.active = None, True
    release()  # a signal held since start-up is recorded now
    try:
        yield _state
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _state.received, _state.active = None, False


def received() -> int | None:
    """The signal recorded inside `handled()`, or None."""
    return _state.received


def check(where: str = "before the first step") -> None:
    """Raise Stopped if a signal was recorded: call it where stopping leaves nothing half-done."""
    if _state.received is not None:
        name = signal.Signals(_state.received).name
        raise Stopped(_state.received, f"stopped by {name} {where}")
