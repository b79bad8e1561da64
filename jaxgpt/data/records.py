"""Files of records, one document per row: JSON Lines (`.jsonl`, `.jsonl.gz`) and Parquet.

A row's document is its `text_field` (`data.text_field`, "text" by default). Rows are read as a
stream: a JSONL file line by line, a Parquet file a batch of rows at a time. A row without the
field, a field that is not a string, a line that is not JSON, a Parquet file without the column:
each is a ValueError naming the file (and line).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

from jaxgpt.errors import UserError

RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
PARQUET_BATCH_ROWS = 1024


def record_suffix(name: str) -> str | None:
    """The record format a file name says, or None for a text file."""
    return next((suffix for suffix in RECORD_SUFFIXES if name.endswith(suffix)), None)


def record_rows(path: Path, text_field: str) -> Iterator[str]:
    """The documents of a record file, in order."""
    if path.name.endswith(".parquet"):
        yield from _parquet_rows(path, text_field)
    else:
        yield from _jsonl_rows(path, text_field)


def _jsonl_rows(path: Path, text_field: str) -> Iterator[str]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as err:
                    raise UserError(f"{path}:{number} is not a JSON line: {err}") from None
                if not isinstance(record, dict) or text_field not in record:
                    keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                    raise UserError(f"{path}:{number} has no {text_field!r} field (it has: {keys}); "
                                     "name the field with --set data.text_field=NAME")
                text = record[text_field]
                if not isinstance(text, str):
                    raise UserError(f"{path}:{number}: {text_field!r} is a {type(text).__name__}, not a string")
                yield text
    except (gzip.BadGzipFile, EOFError) as err:
        raise UserError(f"{path} is not a complete gzip file: {err}") from None


def _parquet_rows(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"{path}: reading Parquet needs pyarrow: pip install 'jaxgpt[hf]'") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow's ArrowInvalid and friends
        raise UserError(f"{path} is not a Parquet file: {err}") from None
    columns = parquet.schema_arrow.names
    if text_field not in columns:
        raise UserError(f"{path} has no {text_field!r} column (columns: {', '.join(columns)}); "
                         "name the column with --set data.text_field=NAME")
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field]):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise UserError(f"{path}: column {text_field!r} holds {type(text).__name__} values, not strings")
            yield text or ""
