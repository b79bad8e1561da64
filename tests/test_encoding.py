"""Encoding: tiktoken's form of a byte-level BPE gives the tokenizer's own ids, and worker
processes return the same ids, in order, as this process."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxgpt.data.encoding import HF, TIKTOKEN, Encoder, Workers, tiktoken_encoding
from jaxgpt.data.tokenizer import EOT, build_tokenizer

CORPUS = [
    "def main():\n    print('hello, world')\n\n\nif __name__ == '__main__':\n    main()\n",
    "The quick brown fox jumps over the lazy dog. It's 1984; we'll see, they've said, I'm sure.\n" * 3,
    "naïve café — 日本語のテキスト 🙂 emoji\ttabs  and   spaces\n   \n\n",
    "a:\n\nb\n\n\tZ's 1\n\n  \n" * 20,
] * 2


@pytest.fixture(scope="module")
def bpe():
    return build_tokenizer("bpe", CORPUS, 400)


@settings(max_examples=300, deadline=None)
@given(text=st.one_of(st.text(), st.text(alphabet=list("ab Z\n\t'sdl1é🙂.<|>endoftx"), max_size=300)))
def test_tiktoken_gives_the_tokenizers_ids(bpe, text) -> None:
    fast, own = Encoder(bpe.to_json(), TIKTOKEN, None, None), Encoder(bpe.to_json(), HF, None, None)
    text = text + EOT + text  # the end-of-text token's text is the token, as in Hugging Face's
    assert fast.ids([text]) == own.ids([text]) == [bpe.encode(text).tolist()]


def test_only_byte_level_bpe_has_a_tiktoken_form(bpe) -> None:
    assert tiktoken_encoding(bpe.to_json()) is not None
    assert tiktoken_encoding(build_tokenizer("char", CORPUS, 400).to_json()) is None
    with pytest.raises(ValueError, match="no tiktoken form"):
        Encoder(build_tokenizer("char", CORPUS, 400).to_json(), TIKTOKEN, None, None)


@pytest.mark.parametrize("opens", [False, True])
def test_encode_frames_the_documents_that_start_and_end(bpe, opens) -> None:
    """End-of-text after each document that ends, or (a tokenizer with `<|bos|>`, as nanochat's)
    begin-of-text before each that starts: a long text's pieces get one of either, in its place."""
    token = bpe.eot_id
    encoder = Encoder(bpe.to_json(), TIKTOKEN, token if opens else None, None if opens else token)
    texts = ["one piece ", "and its end.", "another"]
    ids, lengths = encoder.encode(texts, [True, False, True], [False, True, True], np.dtype(np.uint16))
    one, two, three = (bpe.encode(text).tolist() for text in texts)
    expected = [token, *one, *two, token, *three] if opens else [*one, *two, token, *three, token]
    assert ids.dtype == np.uint16 and ids.tolist() == expected and int(lengths.sum()) == len(expected)
    assert lengths.tolist() == ([len(one) + 1, len(two), len(three) + 1] if opens
                                else [len(one), len(two) + 1, len(three) + 1])


@pytest.mark.parametrize("kind", [TIKTOKEN, HF])
def test_workers_return_this_process_ids_in_order(bpe, kind) -> None:
    tasks = [([f"task {t}, document {d}: " + CORPUS[(t + d) % len(CORPUS)] for d in range(t % 5 + 1)],
              [d % 3 == 0 for d in range(t % 5 + 1)], [d % 2 == 0 for d in range(t % 5 + 1)]) for t in range(40)]
    local = Encoder(bpe.to_json(), kind, 1, bpe.eot_id)
    workers = Workers(2, bpe.to_json(), kind, 1, bpe.eot_id, np.dtype(np.uint16), depth=2)
    try:
        results = list(workers.map(iter(tasks)))
    finally:
        workers.close()
    assert len(results) == len(tasks)
    for task, (ids, lengths) in zip(tasks, results):
        want_ids, want_lengths = local.encode(*task, np.dtype(np.uint16))
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(lengths, want_lengths)


def test_a_worker_error_is_raised_here(bpe) -> None:
    char = build_tokenizer("char", ["ab"], 10)
    workers = Workers(1, char.to_json(), HF, None, None, np.dtype(np.uint16))
    try:
        with pytest.raises(ValueError):
            list(workers.map(iter([(["abc"], [True], [True])])))  # "c" is not in the vocabulary
    finally:
        workers.close()


def test_a_worker_killed_while_it_sends_a_result_is_a_worker_death(bpe) -> None:
    """A SIGKILL mid-message leaves a short body on the pipe: the worker's death, with its exit
    status, not pickle's "data was truncated"."""
    import subprocess
    import sys

    from jaxgpt.errors import Failure

    workers = Workers(1, bpe.to_json(), HF, None, bpe.eot_id, np.dtype(np.uint16))
    # In the worker's place, a process that announces 1,000 bytes, writes 10 and is killed.
    dies_mid_message = ("import os, signal, struct, sys; out = sys.stdout.buffer; "
                        "out.write(struct.pack('<I', 1000) + b'x' * 10); out.flush(); "
                        "os.kill(os.getpid(), signal.SIGKILL)")
    workers.procs[0].kill()
    workers.procs[0].wait()
    workers.procs[0] = subprocess.Popen([sys.executable, "-c", dies_mid_message], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE)
    try:
        with pytest.raises(Failure, match=r"^encoding worker 0 was killed by SIGKILL; what was prepared is kept"):
            workers._result(0)
    finally:
        workers.close()
