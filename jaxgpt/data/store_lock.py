"""One preparer per token store: processes that find the same store unfinished take turns.

Two runs that start together on one corpus (a sweep's, two users of one cache) would otherwise
write the same shard files at once, and one would find its `.partial` shard renamed away by the
other. So a store is prepared under a lock: `locks/<key>.lock` in the cache root, held with
`fcntl.lockf` (POSIX record locks, which the kernel drops when the holder dies, and which NFS
carries between hosts). It holds the holder's pid and host, for the one line a waiting process
prints; the file stays after use (removing it would let a waiter hold a lock on a file no one
else sees).

    tokens = prepared_once(cache, key, folder, build)   # build() runs in at most one process at a time

A process that waits rechecks the store once it gets the lock: the one before it has usually
finished it, and it opens the store instead of building it; a holder that died leaves its ledger,
and the next one continues from there (`jaxgpt.data.store_builder`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

from jaxgpt.process import signals

T = TypeVar("T")
POLL_S = 0.5


def _holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return json.loads(os.read(fd, 4096) or b"{}")
    except (OSError, ValueError):
        return {}


def _try_lock(fd: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno in (errno.EACCES, errno.EAGAIN):
            return False
        raise


def prepared_once(cache: Path, key: str, folder: Path, ready: Callable[[], T | None], build: Callable[[], T]) -> T:
    """`ready()` if the store is there, else `build()` under the store's lock: a process that finds
    the lock held waits (one line saying for whom), then takes `ready()` if the holder finished."""
    found = ready()
    if found is not None:
        return found
    locks = cache / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    fd = os.open(locks / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        said = False
        while not _try_lock(fd):
            if not said:
                holder = _holder(fd)
                who = f"process {holder.get('pid', '?')} on {holder.get('host', '?')}"
                print(f"note: waiting for {who}, which is preparing the token store {folder}", file=sys.stderr,
                      flush=True)
                said = True
            signals.check("while waiting for another process to prepare the token store")
            time.sleep(POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        found = ready()  # the process before this one may have finished it
        return found if found is not None else build()
    finally:
        os.close(fd)  # closing the file releases the lock
