"""Documents to token ids, as fast as the tokenizer allows, in this process or in worker processes.

nanoGPT and llm.c encode with tiktoken, several times faster than Hugging Face tokenizers' batch
encoder on the same byte-level BPE. `tiktoken_encoding` builds a tiktoken `Encoding` from a
byte-level BPE tokenizer.json (GPT-2's pre-tokenizer pattern, ranks from the vocabulary ids, the
added tokens as special tokens); the token store uses it only once it has given the same ids as the
tokenizer on a sample of the corpus (`encoder_for`), and the tokenizer's own batch encoder otherwise.

Workers are plain `python -m jaxgpt.data.encoding` processes fed over pipes (not multiprocessing, which
would run a user's script again in each worker): tasks go out in order, results come back in the
same order, so one worker and many write the same bytes.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, BinaryIO

import numpy as np

from jaxgpt.data.tokenizer import BYTE_DECODER
from jaxgpt.errors import Failure, UserError

# GPT-2's pre-tokenizer, as Hugging Face's ByteLevel(use_regex=True) and tiktoken's "gpt2" apply it
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
TIKTOKEN, HF = "tiktoken", "hf"


def tiktoken_encoding(tokenizer_json: str) -> Any | None:
    """A tiktoken Encoding for a byte-level BPE tokenizer.json, or None where the tokenizer is of
    another kind (or tiktoken is not installed): the caller then keeps the tokenizer's encoder."""
    try:
        import tiktoken
    except ImportError:
        return None
    config = json.loads(tokenizer_json)
    model, pre = config.get("model") or {}, config.get("pre_tokenizer") or {}
    if (model.get("type") != "BPE" or model.get("dropout") or model.get("continuing_subword_prefix")
            or model.get("end_of_word_suffix") or model.get("byte_fallback") or config.get("normalizer")
            or pre.get("type") != "ByteLevel" or pre.get("add_prefix_space") or not pre.get("use_regex", True)):
        return None
    added = config.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return None
    decoder = BYTE_DECODER
    special = {t["content"]: t["id"] for t in added}
    try:
        ranks = {bytes(decoder[c] for c in token): rank for token, rank in model["vocab"].items()
                 if token not in special}
    except KeyError:
        return None  # a token outside the byte-level alphabet
    if len(set(ranks.values())) != len(ranks) or any(bytes([b]) not in ranks for b in range(256)):
        return None
    return tiktoken.Encoding("jaxgpt", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=special)


class Encoder:
    """Encodes batches of documents to one id array with their lengths, putting `bos` before
    each document that starts and `eot` after each that ends (a long text cut into pieces starts
    only at its first piece and ends only at its last); `Tokenizer.separators` gives the pair."""

    def __init__(self, tokenizer_json: str, kind: str, bos: int | None, eot: int | None) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self.kind, self.bos, self.eot = kind, bos, eot
        self._tiktoken = tiktoken_encoding(tokenizer_json) if kind == TIKTOKEN else None
        if kind == TIKTOKEN and self._tiktoken is None:
            raise ValueError("this tokenizer has no tiktoken form")
        self._hf = HFTokenizer.from_str(tokenizer_json)

    def ids(self, texts: Sequence[str]) -> list[list[int]]:
        if self._tiktoken is not None:
            return [self._tiktoken.encode(text, allowed_special="all") for text in texts]
        return [encoding.ids for encoding in self._hf.encode_batch_fast(list(texts), add_special_tokens=False)]

    def encode(self, texts: Sequence[str], starts: Sequence[bool], ends: Sequence[bool],
               dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """(ids of every text, each after `bos` where it starts and before `eot` where it ends, as
        one array; tokens per text)."""
        parts, lengths = [], np.empty(len(texts), np.int64)
        head = [] if self.bos is None else [self.bos]
        tail = [] if self.eot is None else [self.eot]
        for i, (ids, start, end) in enumerate(zip(self.ids(texts), starts, ends)):
            if start and head:
                ids = head + ids
            if end:
                ids = ids + tail
            parts.append(ids)
            lengths[i] = len(ids)
        flat = np.fromiter((t for ids in parts for t in ids), dtype, count=int(lengths.sum()))
        return flat, lengths


# Workers: messages are a 4-byte little-endian length and a pickle.

def _send(stream: BinaryIO, message: Any) -> None:
    blob = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<I", len(blob)))
    stream.write(blob)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    """The next message; EOFError where the stream ends before it does. A short body is the
    sender's death mid-message (a SIGKILL while it writes), never a message to unpickle."""
    head = stream.read(4)
    if len(head) < 4:
        raise EOFError
    size = struct.unpack("<I", head)[0]
    body = stream.read(size)
    if len(body) < size:
        raise EOFError
    return pickle.loads(body)


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """A worker: the first message is (tokenizer_json, kind, bos, eot, dtype), each next one a
    task (texts, starts, ends); every task's answer is ("ok", *encode()'s pair), or ("error",
    type, message)."""
    tokenizer_json, kind, bos, eot, dtype = _receive(inp)
    encoder = Encoder(tokenizer_json, kind, bos, eot)
    while True:
        try:
            texts, starts, ends = _receive(inp)
        except EOFError:
            return
        try:
            _send(out, ("ok", *encoder.encode(texts, starts, ends, np.dtype(dtype))))
        except Exception as err:  # reported to the parent, which raises it there
            _send(out, ("error", type(err).__name__, str(err)))


class Workers:
    """N encoding processes; `map` encodes tasks in order, at most `depth` waiting per worker."""

    def __init__(self, n: int, tokenizer_json: str, kind: str, bos: int | None, eot: int | None,
                 dtype: np.dtype, depth: int = 2) -> None:
        # One thread each: N processes already use the cores (HF's encoder would start a pool per process).
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
        self.procs = [subprocess.Popen([sys.executable, "-m", "jaxgpt.data.encoding"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=env) for _ in range(n)]
        self.depth = depth
        self.queues: list[queue.Queue] = [queue.Queue(maxsize=depth) for _ in range(n)]
        self.feeders = [threading.Thread(target=self._feed, args=(proc, q), daemon=True)
                        for proc, q in zip(self.procs, self.queues)]
        for proc in self.procs:
            _send(proc.stdin, (tokenizer_json, kind, bos, eot, dtype.str))
        for feeder in self.feeders:
            feeder.start()

    @staticmethod
    def _feed(proc: subprocess.Popen, tasks: queue.Queue) -> None:
        try:
            while (task := tasks.get()) is not None:
                _send(proc.stdin, task)
        except (BrokenPipeError, OSError):
            pass  # the worker died: the reader below notices and says so
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass

    def map(self, tasks: Iterable[Any]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Each task's result, in the order of the tasks. Tasks go round the workers, and the
        oldest result is read before a worker would hold more than `depth`: a worker blocked on
        writing a result never holds up the tasks of the others."""
        n = len(self.procs)
        pending: collections.deque[int] = collections.deque()
        for sent, task in enumerate(tasks):
            while len(pending) >= n * self.depth:
                yield self._result(pending.popleft())
            self.queues[sent % n].put(task)
            pending.append(sent % n)
        while pending:
            yield self._result(pending.popleft())

    def _result(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The oldest pending result of worker `index`. A document it could not encode is bad input
        (UserError); a worker that died (killed by the OOM killer, say) or ran out of memory is a
        Failure, which leaves what was prepared in place."""
        try:
            result = _receive(self.procs[index].stdout)
        except EOFError:
            code = self.procs[index].wait()
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"ended with exit code {code}"
            raise Failure(f"encoding worker {index} {how}; what was prepared is kept: run the command again "
                          "to continue") from None
        if result[0] == "error":
            _, kind, message = result
            if kind == "MemoryError":
                raise Failure(f"encoding worker {index} ran out of memory; what was prepared is kept: run the "
                              "command again with fewer --workers to continue")
            raise UserError(f"{kind}: {message}")
        return result[1], result[2]

    def close(self) -> None:
        for q in self.queues:
            try:
                q.put_nowait(None)
            except queue.Full:
                pass
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's to handle
    serve(sys.stdin.buffer, sys.stdout.buffer)
