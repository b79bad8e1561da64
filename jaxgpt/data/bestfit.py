"""nanochat's rows (data.align = "bestfit"): every row opens at a document's start, the documents
placed best-fit, one cropped only where none fits.

The split's documents (each from its opening token, `batches.document_starts`) come in order,
again from the first after the last, and fill a buffer of BUFFER_DOCUMENTS, topped up
REFILL_DOCUMENTS at a time as nanochat tops up from its tokenizer's batches. A row of `window`
tokens takes, while it has room, the longest buffered document that fits whole (the earliest of
equal lengths); where none fits, the shortest (the earliest of equal lengths), cut to the room
left, the rest of it dropped. Every token of a row is a document's, and every row starts with
one's opening token. These are nanochat's rows, read by one process, wherever its top-ups meet
ours: where its Parquet row groups and every file of a split but the last hold multiples of 128
documents (its shards hold 1,024 a group and multiples of 1,024 a file).

A plan is a pure function of the split and the window: row r is the same on every machine and in
every process, so a batch is a function of the step and a resumed run reads the rows it would
have read. Rows are planned as far as they are asked for and kept as three integer arrays.
"""

from __future__ import annotations

import bisect
from array import array

import numpy as np

BUFFER_DOCUMENTS = 1000
REFILL_DOCUMENTS = 128


class RowPlan:
    """The best-fit rows of one split: `rows(first, count)` gives their tokens."""

    def __init__(self, starts: np.ndarray, length: int, window: int) -> None:
        self.window = window
        self.doc_start = np.asarray(starts, np.int64)
        self.doc_length = np.diff(np.append(self.doc_start, length))
        self._buffer: list[tuple[int, int, int]] = []  # (length, arrival, document), sorted
        self._arrivals = 0
        self._next = 0  # the next document to buffer
        self.piece_start, self.piece_length = array("q"), array("q")
        self.row_end = array("q", [0])  # row r is pieces [row_end[r], row_end[r + 1])

    def __len__(self) -> int:
        return len(self.row_end) - 1

    def pieces(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """(offset in the split, length) of each document piece of `row`, in order."""
        self._plan(row + 1)
        a, b = self.row_end[row], self.row_end[row + 1]
        return np.asarray(self.piece_start[a:b], np.int64), np.asarray(self.piece_length[a:b], np.int64)

    def rows(self, tokens, first: int, count: int) -> np.ndarray:
        """int32 [count, window]: rows first .. first + count - 1 read from `tokens` (the split)."""
        self._plan(first + count)
        a, b = self.row_end[first], self.row_end[first + count]
        starts = np.asarray(self.piece_start[a:b], np.int64)
        lengths = np.asarray(self.piece_length[a:b], np.int64)
        shards = getattr(tokens, "shards", None)
        if shards is None or len(shards) == 1:
            flat = shards[0] if shards is not None else np.asarray(tokens)
            within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
            ids = flat[np.repeat(starts, lengths) + within]
        else:
            ids = np.concatenate([tokens.span(int(s), int(n)) for s, n in zip(starts, lengths)])
        return np.asarray(ids, np.int32).reshape(count, self.window)

    def _plan(self, rows: int) -> None:
        while len(self) < rows:
            self._plan_row()

    def _refill(self) -> None:
        """Buffer the next REFILL_DOCUMENTS documents, stopping at the split's end (an epoch's last
        batch may be short, as a file's last row group is)."""
        stop = min(self._next + REFILL_DOCUMENTS, len(self.doc_start))
        for doc in range(self._next, stop):
            bisect.insort(self._buffer, (int(self.doc_length[doc]), self._arrivals, doc))
            self._arrivals += 1
        self._next = stop % len(self.doc_start)

    def _plan_row(self) -> None:
        room = self.window
        while room:
            while len(self._buffer) < BUFFER_DOCUMENTS:
                self._refill()
            fits = bisect.bisect_right(self._buffer, (room, self._arrivals, 0)) - 1
            if fits >= 0:  # the longest that fits, the earliest of its length
                length = self._buffer[fits][0]
                taken = self._buffer.pop(bisect.bisect_left(self._buffer, (length, -1, -1)))
            else:  # none fits: the shortest, cut to the room left
                taken = self._buffer.pop(0)
                length = room
            self.piece_start.append(int(self.doc_start[taken[2]]))
            self.piece_length.append(length)
            room -= length
        self.row_end.append(len(self.piece_start))
