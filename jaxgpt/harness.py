"""lm-evaluation-harness tasks on a jaxgpt model: the harness's `TemplateLM` backed by a run.

    lm = HarnessLM.from_run("runs/a", batch_size=16)          # or HarnessLM(cfg, params, tokenizer)
    results = run_tasks(lm, ["hellaswag_local"], include_path="experiments/tasks", limit=100)
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
a question share their context's computation (`jaxgpt.scoring`); a generation's prompts are
right-padded to one of four widths (`generation_widths`: the context length and its halves down
to an eighth; decoding, not the prefill, takes a generation's time), and a last partial batch is
filled with empty rows. So the compiles of a task do not grow with its number of requests.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

if importlib.util.find_spec("lm_eval") is None:  # an extra: jaxgpt trains, samples and exports without it
    raise ImportError("lm-evaluation-harness tasks need the harness: pip install 'jaxgpt[eval]'")

import jax
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm.auto import tqdm

from jaxgpt import distributed
from jaxgpt.checkpoint import load_newest
from jaxgpt.config import ModelConfig, TrainConfig, names_list
from jaxgpt.errors import UserError
from jaxgpt.generate import FINISHED, generate_tokens
from jaxgpt.model import Params, count_params
from jaxgpt.rundir import RunDir
from jaxgpt.scoring import batches_by_width, coarse_widths, score_pairs
from jaxgpt.tokenizer import Tokenizer

DEFAULT_BATCH_SIZE = 16
MAX_GEN_TOKS = 256  # what a generation task gets when it sets no limit (the harness's default)
GEN_CHUNK = 8  # new tokens per compiled decoding call; the stop strings are checked between calls
# The harness bootstraps the standard error of metrics such as perplexity; 1,000 draws in this
# process (see `_harness_settings`) instead of its default 100,000 in a pool of processes.
BOOTSTRAP_ITERS = 1000


def _check_tokenizer(tokenizer: Tokenizer) -> None:
    if tokenizer.eot_id is None:
        raise UserError("the run's tokenizer has no end-of-text token, which the harness puts before an empty "
                         "context and each document")


def _on_one_device(params: Params) -> Params:
    """`params` on one local device: the scorer then compiles for one device, whatever the training layout."""
    leaves = jax.tree_util.tree_leaves(params)
    if all(isinstance(x, jax.Array) and len(x.sharding.device_set) == 1 for x in leaves):
        return params
    return jax.device_put(jax.device_get(params), jax.local_devices()[0])


class HarnessLM(TemplateLM):
    """The harness's model interface on a jaxgpt decoder (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, params: Params, tokenizer: Tokenizer, *,
                 batch_size: int = DEFAULT_BATCH_SIZE, progress: bool = True, step: int | None = None) -> None:
        super().__init__()
        _check_tokenizer(tokenizer)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UserError(f"batch size must be an integer >= 1, got {batch_size!r}")
        self.cfg, self.params, self.text_tokenizer = cfg, _on_one_device(params), tokenizer
        self.batch_size, self.progress, self.step = batch_size, progress, step
        self.generation_widths = coarse_widths(cfg.context_length)  # decoding, not the prefill, takes the time
        self.vocab_limit = min(tokenizer.vocab_size, cfg.vocab_size)
        self._seed = 0
        self._encoded: dict[str, np.ndarray] = {}  # texts encoded ahead of the harness's calls

    @classmethod
    def from_run(cls, run_dir: str | Path, **options: Any) -> HarnessLM:
        """The newest good checkpoint of a run, with the run's tokenizer; `step` is the checkpoint's."""
        cfg, params, step = load_newest(run_dir)
        return cls(cfg, params, Tokenizer.load(RunDir(run_dir).tokenizer), step=step, **options)

    @property
    def eot_token_id(self) -> int:
        return self.text_tokenizer.eot_id

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
                           progress=bar)

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
                                     prompt_width=width)
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


# ---------------------------------------------------------------------- tasks and their results

def _check_task_files(folder: Path) -> None:
    """A YAML file in the folder that does not parse is named: the harness itself would skip it unsaid."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    for path in sorted(folder.rglob("*.yaml")):
        try:
            parsed = yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)  # noqa: S506 (a safe loader)
        except yaml.YAMLError as err:
            raise UserError(f"task file {path} does not parse: {' '.join(str(err).split())}") from None
        if not isinstance(parsed, dict):
            raise UserError(f"task file {path} does not parse to a mapping of task keys")


def task_manager(names: Sequence[str], include_path: str | Path | None = None) -> Any:
    """The harness's TaskManager holding every task in `names` (also groups and tags); an unknown
    name is a ValueError naming the nearest known one. Tasks found in `include_path` alone skip
    indexing the harness's thousands of task files."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        folder = Path(include_path)
        if not folder.is_dir():
            raise FileNotFoundError(f"task folder {folder} does not exist")
        _check_task_files(folder)
        local = TaskManager(include_path=str(folder), include_defaults=False)
        if all(name in local.all_tasks for name in names):
            return local
    manager = TaskManager(include_path=None if include_path is None else str(include_path))
    for name in names:
        if name not in manager.all_tasks:
            match = difflib.get_close_matches(name, manager.all_tasks, n=1, cutoff=0.6)
            hint = f" (did you mean {match[0]!r}?)" if match else ""
            raise UserError(f"unknown task {name!r}{hint}")
    return manager


def _environment(results: dict[str, Any]) -> None:
    """The results' environment: jax's and the harness's versions. The harness's own collects
    PyTorch's (importing it where installed and running its probes, seconds at each call)."""
    from importlib.metadata import version

    results.update(pretty_env_info=f"jax {jax.__version__} on {jax.default_backend()}",
                   lm_eval_version=version("lm_eval"))


@contextlib.contextmanager
def _harness_settings(quiet: bool) -> Iterator[None]:
    """The harness's stray prints go to stderr (stdout is the table); its info and warnings are
    silenced; it bootstraps in this process, since its pool forks the process, and a fork of a
    process running JAX's threads can deadlock; its results describe jaxgpt's environment, not
    PyTorch's; with `quiet`, its per-task progress bars are off."""
    import lm_eval.api.task as task_module
    import lm_eval.evaluator as evaluator_module

    logger = logging.getLogger("lm_eval")
    saved = logger.level, os.environ.get("DISABLE_MULTIPROC"), task_module.tqdm, evaluator_module.add_env_info
    logger.setLevel(logging.ERROR)
    os.environ["DISABLE_MULTIPROC"] = "1"
    evaluator_module.add_env_info = _environment
    if quiet:
        task_module.tqdm = functools.partial(saved[2], disable=True)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        logger.setLevel(saved[0])
        if saved[1] is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = saved[1]
        task_module.tqdm, evaluator_module.add_env_info = saved[2], saved[3]


def run_tasks(lm: HarnessLM, names: Sequence[str], *, include_path: str | Path | None = None, manager: Any = None,
              limit: int | None = None, num_fewshot: int | None = None, bootstrap_iters: int = BOOTSTRAP_ITERS,
              quiet: bool = False) -> dict[str, Any]:
    """The harness's results for `names` on `lm` (its `simple_evaluate`, samples left out)."""
    from lm_eval.evaluator import simple_evaluate

    if limit is not None and limit < 1:
        raise UserError(f"limit must be at least one document per task, got {limit}")
    manager = manager if manager is not None else task_manager(names, include_path)
    with _harness_settings(quiet):
        return simple_evaluate(model=lm, tasks=list(names), num_fewshot=num_fewshot, limit=limit,
                               bootstrap_iters=bootstrap_iters, task_manager=manager, log_samples=False,
                               torch_random_seed=None)


def results_table(results: dict[str, Any]) -> str:
    """The harness's markdown table of the results (and of the groups', if any)."""
    tables = [lm_utils.make_table(results)]
    if results.get("groups"):
        tables.append(lm_utils.make_table(results, "groups"))
    return "\n".join(tables)


def results_json(results: dict[str, Any]) -> str:
    return json.dumps(results, indent=2, default=lm_utils.handle_non_serializable) + "\n"


def task_record(results: dict[str, Any], step: int) -> dict[str, Any]:
    """The `eval_tasks` metrics record: each number as TASK/METRIC (METRIC/FILTER beside a filter
    other than the harness's `none`), so TensorBoard draws each beside the val loss."""
    record: dict[str, Any] = {"type": "eval_tasks", "step": step, "tasks": sorted(results["results"]),
                              "n_shot": dict(results.get("n-shot", {})),
                              "samples": {task: n["effective"] for task, n in results.get("n-samples", {}).items()}}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, kept_by = key.partition(",")
            if kept_by and isinstance(value, (int, float)) and not isinstance(value, bool):
                record[f"{task}/{metric}" if kept_by == "none" else f"{task}/{metric}/{kept_by}"] = value
    return record


class TrainingTasks:
    """`train.eval_tasks` on the live parameters. Every process checks the names and loads the
    tasks' data when training starts (so an unknown task or a missing file stops the run before
    its first step, everywhere); one process runs the tasks while the others wait."""

    def __init__(self, train: TrainConfig, tokenizer: Tokenizer) -> None:
        self.names = names_list(train.eval_tasks, "train.eval_tasks")
        self.every, self.limit = train.eval_tasks_every, train.eval_tasks_limit or None
        _check_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.manager = task_manager(self.names, train.eval_tasks_path or None)
        with _harness_settings(quiet=True):
            self.manager.load(list(self.names))  # the harness caches what it downloads

    def due(self, step: int, total: int) -> bool:
        return step % self.every == 0 or step == total

    def run(self, params: Params, cfg: ModelConfig, step: int) -> dict[str, Any]:
        """The step's eval_tasks record on the writer; on the other processes a record without numbers."""
        if jax.process_count() > 1:  # a collective: every process hands over its shards
            from jax.experimental import multihost_utils

            # Arrays spread over the processes' devices are gathered whole; a process's own copy
            # (pmap's, unreplicated) is already whole.
            params = jax.tree.map(lambda x: multihost_utils.process_allgather(x, tiled=True)
                                  if isinstance(x, jax.Array) and not x.is_fully_addressable else x, params)
        record: dict[str, Any] = {"type": "eval_tasks", "step": step}
        if distributed.is_writer():
            lm = HarnessLM(cfg, params, self.tokenizer, progress=False, step=step)
            results = run_tasks(lm, self.names, manager=self.manager, limit=self.limit, bootstrap_iters=0, quiet=True)
            record = task_record(results, step)
        distributed.wait_for_writer(f"jaxgpt-eval-tasks-{step}")
        return record

    @staticmethod
    def summary(record: dict[str, Any]) -> str:
        """One line for the progress bar: each task's metrics (no standard errors)."""
        shown = [f"{name} {value:.4f}" for name, value in record.items()
                 if "/" in name and "_stderr" not in name and isinstance(value, float)]
        return f"step {record['step']}: " + ", ".join(shown)
