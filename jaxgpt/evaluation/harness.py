"""lm-evaluation-harness tasks on a jaxgpt model: the harness's `TemplateLM` backed by parameters.

    lm = HarnessLM(cfg, params, tokenizer, batch_size=16, step=step)
    results = run_tasks(lm, ["hellaswag_local"], include_path="experiments/tasks", limit=100)  # tasks.py
    record = task_record(results, lm.step)                     # the metrics.jsonl record

The harness (PyPI `lm-eval`, imported by this module alone) builds the requests from its task
files and computes the metrics; this module answers the requests as the harness's own Hugging
Face backend (`hf`) does, request for request:
- loglikelihood: the harness encodes context and continuation (an empty context is the
  end-of-text token); the input is the last `context_length` tokens of the two but the last one,
  and the continuation's summed log-probability and whether each of its tokens is the argmax
  are read at its own positions.
- loglikelihood_rolling: a document is cut into the harness's rolling windows (every token
  scored once; every window but the first sees a full context) and the windows' sums are added.
- generate_until: KV-cache decoding (greedy unless the task samples) from the context's last
  `context_length - max_gen_toks` tokens, stopped at the end-of-text token, the text cut at the
  first stop string. Where `max_gen_toks` reaches the context length (the `hf` backend refuses),
  the prompt keeps its last `context_length // 2` tokens and the generator slides.
Logits past the tokenizer's vocabulary (rows of a larger model vocabulary no text maps to) are
left out of the argmax and the softmax; a model exported with `export-hf` has none.

Shapes: the log-likelihoods are computed in batches of at most eight widths, and the choices of
a question share their context's computation (`jaxgpt.evaluation.scoring`); a generation's prompts are
right-padded to one of four widths (`generation_widths`: the context length and its halves down
to an eighth; decoding, not the prefill, takes a generation's time), and a last partial batch is
filled with empty rows. So the compiles of a task do not grow with its number of requests.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from typing import Any

if importlib.util.find_spec("lm_eval") is None:  # an extra: jaxgpt trains, samples and exports without it
    raise ImportError("lm-evaluation-harness tasks need the harness: pip install 'jaxgpt[eval]'")

import jax
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm.auto import tqdm

from jaxgpt.config import ModelConfig
from jaxgpt.data.tokenizer import Tokenizer
from jaxgpt.errors import UserError
from jaxgpt.evaluation.generate import FINISHED, generate_tokens
from jaxgpt.evaluation.scoring import batches_by_width, coarse_widths, score_pairs
from jaxgpt.model.decoder import Params, count_params

DEFAULT_BATCH_SIZE = 16
MAX_GEN_TOKS = 256  # what a generation task gets when it sets no limit (the harness's default)
GEN_CHUNK = 8  # new tokens per compiled decoding call; the stop strings are checked between calls


def check_tokenizer(tokenizer: Tokenizer) -> None:
    if tokenizer.document_token is None:
        raise UserError("the run's tokenizer has neither a begin-of-text nor an end-of-text token, one of which the "
                         "harness puts before an empty context and each document")


def _on_one_device(params: Params) -> Params:
    """`params` on one local device: the scorer then compiles for one device, whatever the training layout."""
    leaves = jax.tree_util.tree_leaves(params)
    if all(isinstance(x, jax.Array) and len(x.sharding.device_set) == 1 for x in leaves):
        return params
    return jax.device_put(jax.device_get(params), jax.local_devices()[0])


class HarnessLM(TemplateLM):
    """The harness's model interface on a jaxgpt decoder (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, params: Params, tokenizer: Tokenizer, *,
                 batch_size: int = DEFAULT_BATCH_SIZE, progress: bool = True, step: int | None = None,
                 documents: bool = False) -> None:
        super().__init__()
        check_tokenizer(tokenizer)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UserError(f"batch size must be an integer >= 1, got {batch_size!r}")
        self.cfg, self.params, self.text_tokenizer = cfg, _on_one_device(params), tokenizer
        self.batch_size, self.progress, self.step = batch_size, progress, step
        # A model trained with data.document_mask reads each document alone, the document token opening it.
        self.document_token = tokenizer.document_token if documents else None
        self.generation_widths = coarse_widths(cfg.context_length)  # decoding, not the prefill, takes the time
        self.vocab_limit = min(tokenizer.vocab_size, cfg.vocab_size)
        self._seed = 0
        self._encoded: dict[str, np.ndarray] = {}  # texts encoded ahead of the harness's calls

    @property
    def eot_token_id(self) -> int:
        """What the harness puts before an empty context: the token that opens a document."""
        return self.text_tokenizer.document_token

    @property
    def max_length(self) -> int:
        return self.cfg.context_length

    @property
    def max_gen_toks(self) -> int:
        return MAX_GEN_TOKS

    @property
    def tokenizer_name(self) -> str:
        return f"jaxgpt-{self.text_tokenizer.fingerprint[:16]}"

    def get_model_info(self) -> dict[str, Any]:
        return {"model_num_parameters": count_params(self.params), "model_dtype": self.cfg.dtype}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        ids = self._encoded.get(string)  # jaxgpt's tokenizers add no special tokens
        return (self.text_tokenizer.encode(string) if ids is None else ids).tolist()

    # ------------------------------------------------------------------ log-likelihoods

    def _score(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool) -> list[tuple[float, bool]]:
        bar = functools.partial(tqdm, desc="scoring", unit="batch", disable=disable_tqdm or not self.progress)
        return score_pairs(self.params, self.cfg, pairs, batch_size=self.batch_size, vocab_limit=self.vocab_limit,
                           progress=bar, document_token=self.document_token)

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """The harness's own (it encodes each pair), with the texts it will encode encoded first in
        one parallel batch; its encoding bar follows `progress`, as the evaluator asks for no quiet."""
        texts = set()
        for context, continuation in (request.args for request in requests):
            texts.update((context.rstrip(), context + continuation) if context else (continuation,))
        self._encoded = dict(zip(texts, self.text_tokenizer.encode_many(list(texts)))) if texts else {}
        try:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)
        finally:
            self._encoded = {}

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        answers = self._score([(context, continuation) for _, context, continuation in requests], disable_tqdm)
        for (key, _, _), answer in zip(requests, answers):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        pairs, owners = [], []
        for i, (text,) in enumerate(request.args for request in requests):
            windows = lm_utils.get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                         max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(lm_utils.make_disjoint_window, windows):
                pairs.append((context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owners, self._score(pairs, disable_tqdm)):
            totals[i] += logp
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        texts: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}  # requests with the same options decode together
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        eos = self.text_tokenizer.decode([self.eot_token_id])
        for members in groups.values():
            options = dict(normalize_gen_kwargs(requests[members[0]].args[1], self.max_gen_toks))
            until = handle_stop_sequences(options.pop("until", None), eos=eos)
            max_new = options.pop("max_gen_toks")
            sampling = _sampling(options)
            S = self.cfg.context_length
            keep = S - max_new if max_new < S else S // 2
            prompts = [self.tok_encode(requests[i].args[0])[-keep:] or [self.eot_token_id] for i in members]
            for i, text in zip(members, self._generate(prompts, max_new, until, sampling, disable_tqdm)):
                texts[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return texts

    def _generate(self, prompts: list[list[int]], max_new: int, until: list[str], sampling: dict[str, Any],
                  disable_tqdm: bool) -> list[str]:
        eot, B = self.eot_token_id, self.batch_size
        new: list[list[int]] = [[] for _ in prompts]
        batches = list(batches_by_width([len(p) for p in prompts], self.generation_widths, B))
        for width, batch in tqdm(batches, desc="generating", unit="batch", disable=disable_tqdm or not self.progress):
            rows = [prompts[i] for i in batch] + [[eot]] * (B - len(batch))  # empty rows keep the shape
            self._seed += 1
            stream = generate_tokens(self.params, self.cfg, rows, max_new, **sampling, seed=self._seed,
                                     stop_token=eot, vocab_limit=self.vocab_limit, chunk=GEN_CHUNK,
                                     prompt_width=width, document_token=self.document_token)
            ended = [False] * len(batch)
            for t, tokens_B in enumerate(stream):
                for r, i in enumerate(batch):
                    token = int(tokens_B[r])
                    ended[r] |= token in (FINISHED, eot)
                    if not ended[r]:
                        new[i].append(token)
                if (t + 1) % GEN_CHUNK == 0:  # a row that holds a stop string is done: the rest is cut off
                    ended = [ended[r] or _stopped(self._text(new[i]), until) for r, i in enumerate(batch)]
                    if all(ended):
                        break
        return [postprocess_generated_text(self._text(tokens), until, None) for tokens in new]

    def _text(self, tokens: list[int]) -> str:
        specials = self.text_tokenizer.special_ids()
        return self.text_tokenizer.decode([t for t in tokens if t not in specials])


def _stopped(text: str, until: list[str]) -> bool:
    return any(stop and stop in text for stop in until)


def _sampling(options: dict[str, Any]) -> dict[str, Any]:
    """generate_tokens' sampling arguments for the harness's normalised generation options."""
    unknown = sorted(set(options) - {"do_sample", "temperature", "top_k", "top_p"})
    if unknown:
        raise UserError(f"generation option {unknown[0]!r} is not supported by jaxgpt's generator (it takes "
                         "do_sample, temperature, top_k, top_p, until and max_gen_toks)")
    if not options.get("do_sample"):
        return {"temperature": 0.0}
    top_k, top_p = options.get("top_k"), options.get("top_p")
    return {"temperature": float(options.get("temperature", 1.0)), "top_k": int(top_k) if top_k else None,
            "top_p": float(top_p) if top_p is not None else None}
