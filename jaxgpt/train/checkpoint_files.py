"""A checkpoint's record of its own files: each file's size and SHA-256, checked before Orbax
reads anything.

The record (`files.json` in the checkpoint's folder) is the save's last act: Orbax calls
`write_record` once every item is written and finalised, before it renames the temporary folder
to its step (or, on storage without an atomic rename, before it writes its commit file). So a
checkpoint listed under its step always has its record, and a crash before it leaves a folder
Orbax never lists. A restore calls `verify` first: tensorstore decodes a damaged B-tree node or
chunk with an error that names no damage (or, in an unlucky byte, without any), and it reads the
tree's metadata before any of jaxgpt's own checks could run.

Two files Orbax writes at the rename itself stay out of the record: the step's
`_CHECKPOINT_METADATA` (its commit time is added then), which must still parse, and the commit
file, which a restore does not read.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

RECORD = "files.json"
# The manifest's key saying the checkpoint was written with a record: one without it is older.
MANIFEST_KEY = "files_record"
# The manifest item's JSON, as Orbax's JsonCheckpointHandler names it in the step's folder.
MANIFEST_FILE = Path("manifest") / "metadata"
STEP_METADATA = "_CHECKPOINT_METADATA"
WRITTEN_AT_COMMIT = {STEP_METADATA, "commit_success.txt", RECORD}


class Damaged(ValueError):
    """A checkpoint whose bytes are damaged: a file missing, truncated or corrupt, a manifest that
    does not parse, a checksum that does not match. A trainer moves it aside; a reader skips it."""


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _recorded_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and str(p.relative_to(folder)) not in WRITTEN_AT_COMMIT)


def write_record(folder: Path) -> None:
    """Record the size and SHA-256 of every file in `folder` (a checkpoint Orbax has finalised
    but not yet committed). Written to a temporary name and renamed: a crash mid-write leaves no
    record, and the checkpoint, never committed, is not listed."""
    files = {str(path.relative_to(folder)): {"bytes": path.stat().st_size, "sha256": _sha256(path)}
             for path in _recorded_files(folder)}
    partial = folder / f"{RECORD}.partial"
    partial.write_text(json.dumps({"format": 1, "files": files}, indent=1, sort_keys=True))
    partial.rename(folder / RECORD)


def _read_record(folder: Path) -> dict[str, Any] | None:
    path = folder / RECORD
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_bytes())
        files = record["files"]
        if not isinstance(files, dict) or not all(
                isinstance(f.get("bytes"), int) and isinstance(f.get("sha256"), str) for f in files.values()):
            raise ValueError("entries not of the record's form")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        raise Damaged(f"its {RECORD} does not parse") from None
    return files


def _written_with_record(folder: Path) -> bool:
    """Whether the checkpoint's manifest says it was saved with a record. A manifest that cannot
    be read says nothing here: the older check finds that damage itself."""
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and bool(manifest.get(MANIFEST_KEY))


def verify(folder: Path) -> bool:
    """Check every file of the checkpoint in `folder` against its record, reading nothing through
    Orbax: True where all match, False for a checkpoint written before records (the caller's
    older checks apply). Raises Damaged naming the first file that is missing, of another size or
    of other bytes."""
    files = _read_record(folder)
    if files is None:
        if _written_with_record(folder):
            raise Damaged(f"its {RECORD} is missing")
        return False
    for name, want in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            raise Damaged(f"{name} is missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise Damaged(f"{name} holds {size} bytes, {want['bytes']} were written")
        if _sha256(path) != want["sha256"]:
            raise Damaged(f"{name} does not match the checksum written with it")
    try:
        step_metadata = json.loads((folder / STEP_METADATA).read_bytes())
    except FileNotFoundError:
        raise Damaged(f"{STEP_METADATA} is missing") from None
    except ValueError:
        raise Damaged(f"{STEP_METADATA} does not parse") from None
    if not isinstance(step_metadata, dict):
        raise Damaged(f"{STEP_METADATA} does not parse")
    return True
