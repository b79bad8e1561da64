"""How jaxgpt drives Orbax (`jaxgpt.train.checkpoint` says what a checkpoint is): the handlers a
checkpoint's items are written with, event loops that let a failed restore's other reads end
quietly, the Orbax log lines a trainer or a reader has no use for, and which storage errors mean
a checkpoint's bytes are damaged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

# tensorstore's and Orbax's words for bytes that are not there or not what was written, and the
# storage layer's own names in its decoding errors (which carry no status word).
DAMAGE_CODES = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "INVALID_ARGUMENT", "FAILED_PRECONDITION")
STORAGE_WORDS = re.compile(r"(?i)tensorstore|OCDBT|zarr|ZSTD|decod|corrupt")
# Neither memory nor a permission is damage, whatever layer reports it.
NOT_DAMAGE = re.compile(r"PERMISSION_DENIED|[Pp]ermission denied|RESOURCE_EXHAUSTED|[Oo]ut of memory")


def storage_error(err: Exception) -> bool:
    if isinstance(err, (FileNotFoundError, EOFError, json.JSONDecodeError, UnicodeDecodeError)):
        return True
    text = str(err)
    if NOT_DAMAGE.search(text) or isinstance(err, (MemoryError, OSError)):
        return False
    # Orbax re-raises a failed array read as a bare Exception naming TensorStore, so the words decide.
    return (isinstance(err, ValueError) and any(code in text for code in DAMAGE_CODES)) or bool(STORAGE_WORDS.search(text))


def first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0].split(" [tensorstore_spec=")[0][:300] if text else ""



def handlers() -> dict[str, Any]:
    """The state as a pytree of arrays, and the JSON manifest.

    Orbax's default for a replicated array (every leaf under data parallelism) is to slice it into
    one part per replica first, so that many processes share the writing; in one process that
    is a few hundred eager slices per checkpoint for nothing, and they took most of a small
    run's checkpoint time. One process writes each array from one device's copy.
    """
    scalar = ocp.type_handlers.ScalarHandler()
    arrays = ocp.type_handlers.ArrayHandler(use_replica_parallel=jax.process_count() > 1)
    registry = ocp.type_handlers.create_type_handler_registry(
        (int, scalar), (float, scalar), (np.number, scalar), (np.ndarray, ocp.type_handlers.NumpyHandler()),
        (jax.Array, arrays))
    return {"state": ocp.PyTreeCheckpointHandler(type_handler_registry=registry),
            "manifest": ocp.JsonCheckpointHandler()}


class ClosingLoop(asyncio.SelectorEventLoop):
    """An event loop that, when closed, first runs the tasks still pending on it to their end.

    Orbax runs a restore's reads as tasks on a fresh loop and closes the loop as soon as one read
    fails; the others are still in flight in tensorstore, and each one's completion then reaches
    the closed loop and prints a traceback ("Event loop is closed"). Cancelling them does not stop
    tensorstore's reads; letting them end (their results dropped) does, while the loop still runs.
    The reads that failed beside the first one are the same damage: their errors are marked seen,
    or each would print "Task exception was never retrieved" when it is collected."""

    def __init__(self) -> None:
        super().__init__()
        self._tasks: list[asyncio.Task] = []
        self.set_task_factory(self._recorded_task)

    def _recorded_task(self, loop: asyncio.AbstractEventLoop, coro, **kwargs) -> asyncio.Task:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        self._tasks.append(task)
        return task

    def close(self) -> None:
        while not self.is_closed() and not self.is_running():
            pending = [task for task in asyncio.all_tasks(self) if not task.done()]
            if not pending:
                break
            self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        for task in self._tasks:
            if task.done() and not task.cancelled():
                task.exception()  # marks it retrieved: the restore has raised the first one
        self._tasks.clear()
        super().close()

    def call_soon_threadsafe(self, callback, *args, context=None):  # type: ignore[override]
        """A result for a closed loop is dropped, as asyncio drops those of its own futures."""
        if self.is_closed():
            return None
        return super().call_soon_threadsafe(callback, *args, context=context)


class ClosingLoopPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return ClosingLoop()


@contextmanager
def loops_that_finish_their_tasks() -> Iterator[None]:
    """Inside: the event loops Orbax makes for a restore are `ClosingLoop`s."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the policy API, from Python 3.14
        previous = asyncio.get_event_loop_policy()
        asyncio.set_event_loop_policy(ClosingLoopPolicy())
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            asyncio.set_event_loop_policy(previous)


class ReaderNotices(logging.Filter):
    """What Orbax warns a reader of that a reader here expects: that it opened read-only (every
    reader does, on purpose), and that a checkpoint's files vanished while it listed them or read
    their description (the trainer dropped an old one: the reader lists again, and says in its
    own words where the files of a checkpoint it keeps are missing). No line tells a user anything."""

    EXPECTED = ("Given directory is read only", "Metadata file does not exist")
    VANISHED_ITEM = "was found in the checkpoint, but could not be restored"

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith(self.EXPECTED) or self.VANISHED_ITEM in message)


class TrainerNotices(logging.Filter):
    """Orbax's warning that a save waited for the previous one, in absl's format: the trainer says
    it once in its own words instead (`Checkpointer.save`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Waiting for previous save to complete")
