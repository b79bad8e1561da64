"""The `jaxgpt` command: argument parsing and messages; each command calls into the modules."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence

from jaxgpt.config import load_config
from jaxgpt.rundir import RunDir

EXPECTED_ERRORS = (ValueError, ImportError, FileNotFoundError, NotADirectoryError, PermissionError)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (default: the built-in Day 1 baseline)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key; repeatable")


def cmd_dry_run(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    from jaxgpt import parallel
    from jaxgpt.kernels import choose_kernels
    from jaxgpt.model import count_params, forward, init_params

    cfg = load_config(args.config, args.overrides)
    model = cfg.model
    seq_len = args.seq_len or model.context_length
    params = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((args.batch_size, seq_len), jnp.int32)
    kernels = choose_kernels(model)
    logits = jax.eval_shape(lambda p, t: forward(p, model, t, kernels=kernels), params, tokens)
    record = {"config_sha256": cfg.fingerprint(), "parameters": count_params(params),
              "logits_shape": list(logits.shape), "kernels": kernels.name}
    mode = parallel.resolve_mode(cfg.train, jax.device_count())
    mesh = parallel.make_mesh(cfg.train) if mode == "sharded" else None
    record.update({"mode": mode, "devices": jax.device_count(), **parallel.planned_memory(cfg, mesh)})
    if args.compile:
        record["compiled"] = parallel.aot_compile(cfg, parallel.planning_mesh(cfg))
    print(json.dumps(record))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from jaxgpt import signals
    from jaxgpt.distributed import maybe_initialize_distributed

    # Before anything else touches the devices, and before our handlers: joining a job installs
    # JAX's own SIGTERM notifier, which would otherwise take SIGTERM from them.
    maybe_initialize_distributed()
    with signals.handled():  # records a signal held since the first instruction, and any later one
        signals.check()  # one that came during the imports stops the run before any work
        return _train(args)


def _with_data(args: argparse.Namespace) -> list[str]:
    """The --set overrides, with --data as data.source."""
    overrides = list(args.overrides)
    if args.data is not None:
        overrides.append(f"data.source={json.dumps(args.data)}")
    return overrides


def cmd_prepare(args: argparse.Namespace) -> int:
    from jaxgpt import signals
    from jaxgpt.data import prepare_data

    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers {args.workers}: at least one encoding process is needed")
    cfg = load_config(args.config, _with_data(args))
    with signals.handled():
        signals.check("before the token store was prepared")
        started = time.perf_counter()
        data = prepare_data(cfg, workers=args.workers, progress=not args.no_progress)
    tokens = data.tokens
    print(json.dumps({"store": str(tokens.folder), "train_tokens": len(tokens.train), "val_tokens": len(tokens.val),
                      "shards": len(tokens.train.shards) + len(tokens.val.shards), "val_bytes": tokens.val_bytes,
                      "tokenizer_vocab": data.tokenizer.vocab_size, "eot_id": data.tokenizer.eot_id,
                      "data_sha256": tokens.fingerprint, "seconds": round(time.perf_counter() - started, 2)}))
    return 0


def _train(args: argparse.Namespace) -> int:
    from jaxgpt.distributed import is_writer
    from jaxgpt.metrics import read_metrics
    from jaxgpt.train import train

    overrides = _with_data(args)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    base, hf_dir = None, None
    if args.init_from is not None:
        from jaxgpt.config import DataConfig, RunConfig
        from jaxgpt.hf import model_config, resolve_source, tokenizer_source

        hf_dir = resolve_source(args.init_from)
        own_tokenizer = tokenizer_source(hf_dir)  # pretrained weights mean nothing under another one
        data = DataConfig(tokenizer=own_tokenizer) if own_tokenizer else DataConfig()
        base = RunConfig(model=model_config(hf_dir), data=data)
    cfg = load_config(args.config, overrides, base=base)
    if hf_dir is not None and own_tokenizer is None and cfg.data.tokenizer in ("bpe", "char"):
        raise ValueError(f"--init-from {args.init_from}: the folder has no tokenizer.json (nor GPT-2's "
                         "vocab.json + merges.txt), and a new tokenizer would not match its weights; "
                         "add one, or name one with --set data.tokenizer=PATH")
    summary = train(cfg, out_dir=args.out, resume=args.resume, force=args.force, progress=not args.no_progress,
                    init_from=hf_dir)
    if summary["event"] == "finished earlier":
        return 0  # train has said so in one line
    if not is_writer():  # one process speaks for the job
        return 128 + summary["signal"] if "signal" in summary else 0
    samples = [r for r in read_metrics(RunDir(args.out).metrics) if r["type"] == "sample"]
    if samples:
        print(f"--- sample at step {samples[-1]['step']} ---\n{samples[-1]['text']}\n---")
    print(json.dumps(summary))
    if "signal" in summary:
        print(f"stopped at step {summary['step']} with a checkpoint; continue with: "
              f"jaxgpt train --out {args.out} --resume (and the same --config/--set/--data)", file=sys.stderr)
        return 128 + summary["signal"]
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    if args.tasks is not None:
        return _eval_tasks(args)
    harness_only = [flag for flag, value in (("--include-path", args.include_path), ("--limit", args.limit),
                    ("--num-fewshot", args.num_fewshot), ("--batch-size", args.batch_size), ("--out", args.out))
                    if value is not None]
    if harness_only:
        raise ValueError(f"{harness_only[0]} applies to harness tasks: name them with --tasks")
    import dataclasses

    import functools

    import jax

    from jaxgpt.checkpoint import load_run, load_run_config
    from jaxgpt.step import eval_step
    from jaxgpt.data import evaluate, prepare_data

    cfg = load_run_config(args.run)
    if args.data is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source=args.data))
    if args.batches is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_batches=args.batches))
    data = prepare_data(cfg, Path(args.run))
    _, params = load_run(args.run)
    loss = jax.jit(functools.partial(eval_step, cfg))
    result = evaluate(lambda batch: loss(params, batch), cfg, data)
    print(json.dumps({"loss": result["val_loss"], "perplexity": result["val_perplexity"],
                      "bits_per_byte": result["val_bits_per_byte"], "batches": cfg.train.eval_batches}))
    return 0


def _eval_tasks(args: argparse.Namespace) -> int:
    from jaxgpt.config import names_list

    if args.data is not None or args.batches is not None:
        raise ValueError("--data and --batches set the validation loss; --tasks runs harness tasks: use one or the other")
    names = names_list(args.tasks, "--tasks")
    if not names:
        raise ValueError("--tasks names no task")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise ValueError(f"--num-fewshot {args.num_fewshot}: the number of examples cannot be negative")
    from jaxgpt.harness import DEFAULT_BATCH_SIZE, HarnessLM, results_json, results_table, run_tasks, task_manager, task_record
    from jaxgpt.metrics import MetricsWriter

    manager = task_manager(names, args.include_path)  # before the checkpoint is read: a typo costs nothing
    lm = HarnessLM.from_run(args.run, batch_size=DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size)
    results = run_tasks(lm, names, manager=manager, limit=args.limit, num_fewshot=args.num_fewshot)
    print(results_table(results))
    with MetricsWriter(Path(args.run)) as writer:
        writer.write(task_record(results, lm.step))
    if args.out:
        from jaxgpt.rundir import write_atomic

        write_atomic(args.out, results_json(results))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxgpt.checkpoint import load_run
    from jaxgpt.generate import generate_tokens
    from jaxgpt.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(RunDir(args.run).tokenizer)
    model, params = load_run(args.run)
    prompt = list(tokenizer.encode(args.prompt)) if args.prompt else list(tokenizer.encode("\n")) or [0]
    stop_token = None
    if args.stop is not None:
        stop_ids = [int(i) for i in tokenizer.encode(args.stop)]
        if len(stop_ids) != 1:
            raise ValueError(f"--stop {args.stop!r} encodes to {len(stop_ids)} tokens {stop_ids}; it must be one token")
        stop_token = stop_ids[0]
    if args.speculative and args.temperature != 0:
        print("note: --speculative decodes greedily; using --temperature 0", file=sys.stderr)
        args.temperature = 0.0
    stats: dict = {}
    sys.stdout.write(args.prompt)
    emitted: list[int] = []
    printed = ""
    started = time.perf_counter()
    for tokens in generate_tokens(params, model, [prompt], args.max_new_tokens, temperature=args.temperature,
                                  top_k=args.top_k or None, top_p=args.top_p, seed=args.seed,
                                  stop_token=stop_token, vocab_limit=tokenizer.vocab_size,
                                  speculative=args.speculative, stats=stats):
        if tokens[0] < 0:
            break
        emitted.append(int(tokens[0]))
        text = tokenizer.decode(emitted)
        if not text.endswith("\ufffd"):  # hold back a byte sequence that is not complete yet
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    sys.stdout.write(tokenizer.decode(emitted)[len(printed):] + "\n")
    if args.stats:
        seconds = time.perf_counter() - started  # compile included: a first call's figure
        print(json.dumps({"tokens": len(emitted), "seconds": round(seconds, 3),
                          "tokens_per_s": round(len(emitted) / seconds, 1), **stats}), file=sys.stderr)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from jaxgpt.config import ConfigError
    from jaxgpt.sweep import load_sweep, run_sweep
    from jaxgpt.sweep_report import markdown_table, summarise

    only = tuple(name.strip() for name in args.variants.split(",")) if args.variants else None
    if (args.overrides or only) and not args.out:
        # A rerun drops the records of members the sweep no longer has: the file's own grid is kept
        # out of reach of a changed or partial one.
        raise ConfigError("with --set or --variants, name an --out folder (runs/sweep-NAME holds the file's "
                          "whole grid)")
    sweep = load_sweep(args.sweep, seeds=args.seeds, overrides=tuple(args.overrides), only=only)
    out = Path(args.out or f"runs/sweep-{sweep.name}")
    records = run_sweep(sweep, out, progress=not args.no_progress)
    print(markdown_table(summarise(sweep, records), sweep.reference), end="")
    print(f"results: {out / 'results.jsonl'}, {out / 'results.md'}, {out / 'val_loss.png'}", file=sys.stderr)
    return 0


def cmd_import_hf(args: argparse.Namespace) -> int:
    from jaxgpt.hf import import_hf_run

    run_dir = import_hf_run(args.hf_dir, args.out)
    print(json.dumps({"run": str(run_dir), "from": args.hf_dir}))
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from jaxgpt.checkpoint import load_run
    from jaxgpt.hf_export import check_export_dir, dropped_on_export, export_hf

    check_export_dir(args.out, args.force)  # before the checkpoint is read: a refusal costs nothing
    model, params = load_run(args.run)
    tokenizer = RunDir(args.run).tokenizer
    out = export_hf(model, params, args.out, tokenizer=tokenizer if tokenizer.is_file() else None, force=args.force)
    dropped = dropped_on_export(params)
    if dropped:
        print(f"note: not exported: MTP adapters {', '.join(dropped)} (GPT-2 and Llama have no "
              "multi-token prediction heads)", file=sys.stderr)
    print(json.dumps({"hf_dir": str(out), "from": args.run, "dropped": dropped}))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from jaxgpt.bench import run_mode, table

    records = []
    for record in run_mode(args.mode, load_config(args.config, args.overrides), repeats=args.repeats, run=args.run):
        print(json.dumps(record), flush=True)
        records.append(record)
    print(table(records), file=sys.stderr)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from jaxgpt.launch import launch

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return launch(command, args.processes, args.devices_per_process, all_output=args.all_output)


class _CommandListFormatter(argparse.RawDescriptionHelpFormatter):
    """`jaxgpt --help`: one line per command, without argparse's "{a,b,c}" header line."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=16)

    def _format_action(self, action: argparse.Action) -> str:
        if isinstance(action, argparse._SubParsersAction):
            return "".join(self._format_action(command) for command in action._get_subactions())
        return super()._format_action(action)


def _command(sub: argparse._SubParsersAction, name: str, line: str, description: str | None = None
             ) -> argparse.ArgumentParser:
    """A subcommand: `line` is its line in `jaxgpt --help` (keep it to one) and, unless a longer
    `description` is given, the head of its own help."""
    return sub.add_parser(name, prog=f"jaxgpt {name}", help=line, description=description or line)


DATA_HELP = ("data.source: stdlib, a text, JSONL or Parquet file, a folder or glob of them, a folder of llm.c "
             "token shards, or hf:NAME[:SPLIT]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxgpt", usage="jaxgpt COMMAND [options]", formatter_class=_CommandListFormatter,
        description="Train, evaluate and sample small GPT-style language models with JAX.",
        epilog="`jaxgpt COMMAND --help` lists the options of a command.")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command", required=True)
    # Commands that take SIGINT and SIGTERM over from `signals.hold()` themselves; main releases
    # them for the others.
    parser.set_defaults(handles_signals=False)

    dry = _command(sub, "dry-run", "check a config: parameters, logits shape, device memory")
    _add_config_args(dry)
    dry.add_argument("--batch-size", type=int, default=1)
    dry.add_argument("--seq-len", type=int, default=None, help="default: model.context_length")
    dry.add_argument("--compile", action="store_true",
                     help="also compile the train step ahead of time for this mesh and report its memory")
    dry.set_defaults(func=cmd_dry_run)

    pre = _command(sub, "prepare", "encode a data source into its token store, ahead of training",
                   "Encode a data source into its token store (llm.c shards in the cache, $JAXGPT_CACHE), "
                   "as train would on its first start; run again, it continues an interrupted preparation")
    _add_config_args(pre)
    pre.add_argument("--data", help=DATA_HELP)
    pre.add_argument("--workers", type=int, default=None, metavar="N",
                     help="encoding processes (default: one per core for a source of 4 MB or more, else 1)")
    pre.add_argument("--no-progress", action="store_true", help="no progress bar")
    pre.set_defaults(func=cmd_prepare, handles_signals=True)

    tr = _command(sub, "train", "train a model into a run directory, or resume one")
    _add_config_args(tr)
    tr.add_argument("--data", help=DATA_HELP)
    tr.add_argument("--steps", type=int, help="train.steps")
    tr.add_argument("--out", default="runs/default", help="the run directory (default: runs/default)")
    tr.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    tr.add_argument("--force", action="store_true",
                    help="with --resume: accept changed [train] and [data] keys (never the model or tokenizer)")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.add_argument("--init-from", metavar="HF_DIR",
                    help="fine-tune from a Hugging Face GPT-2 or Llama checkpoint: a local directory, or a "
                         "hub name (downloaded; needs network). Its config.json sets [model] and its "
                         "tokenizer.json the tokenizer, under --config and --set")
    tr.set_defaults(func=cmd_train, handles_signals=True)

    ev = _command(sub, "eval", "validation loss of a run, or lm-evaluation-harness tasks on it",
                  "Validation loss, perplexity and bits per byte of a run's newest checkpoint (JSON); with "
                  "--tasks, lm-evaluation-harness tasks on it (pip install 'jaxgpt[eval]'): the harness's "
                  "table, an eval_tasks record in the run's metrics")
    ev.add_argument("--run", required=True, help="a run directory")
    ev.add_argument("--data", help="evaluate on another data source with the run's tokenizer")
    ev.add_argument("--batches", type=int, help="number of val batches (default: train.eval_batches)")
    ev.add_argument("--tasks", metavar="NAME[,NAME...]",
                    help="harness tasks, groups or tags: the harness's own (from the Hugging Face hub) or "
                         "--include-path's")
    ev.add_argument("--include-path", metavar="DIR",
                    help="a folder of task YAML files, e.g. experiments/tasks (local JSONL files, offline)")
    ev.add_argument("--limit", type=int, metavar="N", help="the first N documents of each task (default: all)")
    ev.add_argument("--num-fewshot", type=int, metavar="K", help="examples before each document (default: the task's)")
    ev.add_argument("--batch-size", type=int, metavar="N",
                    help="requests per forward pass (default: 16)")
    ev.add_argument("--out", metavar="FILE", help="also write the harness's results as JSON to FILE")
    ev.set_defaults(func=cmd_eval)

    gen = _command(sub, "generate", "sample text from a run, streamed as it is produced")
    gen.add_argument("--run", required=True, help="a run directory")
    gen.add_argument("--prompt", default="", metavar="TEXT", help="the text to continue (default: a newline)")
    gen.add_argument("--max-new-tokens", type=int, default=200, metavar="N", help="tokens to add (default: 200)")
    gen.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 for greedy (default: 0.8)")
    gen.add_argument("--top-k", type=int, default=0, metavar="K",
                     help="sample from the K most likely tokens; 0 for all (default: 0)")
    gen.add_argument("--top-p", type=float, default=None, metavar="P",
                     help="sample from the fewest tokens whose probabilities sum to P (default: off)")
    gen.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (default: 0)")
    gen.add_argument("--stop", default=None, metavar="TEXT",
                     help="end the text once this token (TEXT must encode to exactly one token) is produced "
                          "(default: off)")
    gen.add_argument("--speculative", action="store_true",
                     help="MTP self-speculative decoding (greedy; needs model.mtp_depth >= 1): same text, fewer "
                          "passes (default: off)")
    gen.add_argument("--stats", action="store_true",
                     help="print one JSON line to stderr: tokens, seconds, tokens/s, forward passes, acceptance "
                          "rate (default: off)")
    gen.set_defaults(func=cmd_generate)

    ben = _command(sub, "bench", "benchmarks: step time, tokens/s, MFU, compile, decoding",
                   description="benchmarks: JSON per measurement on stdout, a table on stderr")
    ben.add_argument("mode", choices=("train", "forward", "compile", "decode", "speculative"),
                     help="train: step time, tokens/s, MFU (remat x dtype); forward: batch-one latency "
                          "at 128..2048 tokens; compile: compile time and memory against depth, remat "
                          "memory; decode: KV cache against recomputation, cost against position; "
                          "speculative: MTP self-speculative against plain greedy on --run's val text")
    _add_config_args(ben)
    ben.add_argument("--run", help="speculative mode: a trained run directory with model.mtp_depth >= 1")
    ben.add_argument("--repeats", type=int, default=5, help="timed repeats; medians are reported")
    ben.set_defaults(func=cmd_bench)

    sw = _command(sub, "sweep", "train variants x seeds; write a results table and a plot",
                  description="train variants x seeds (vmapped where only seeds or optimiser values differ); "
                              "write results.jsonl, results.md, val_loss.png")
    sw.add_argument("sweep", help="a sweep TOML file (format: jaxgpt/sweep.py)")
    sw.add_argument("--seeds", type=int, default=None, help="seeds per variant (default: the file's seeds, else 1)")
    sw.add_argument("--out", default=None, help="output folder (default: runs/sweep-NAME, NAME the file's stem)")
    sw.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config key of every variant, after the file's set; repeatable")
    sw.add_argument("--variants", metavar="A,B,...", help="train only these variants (the baseline among them)")
    sw.add_argument("--no-progress", action="store_true", help="no progress bars")
    sw.set_defaults(func=cmd_sweep)

    imp = _command(sub, "import-hf", "make a run from a Hugging Face GPT-2 or Llama folder")
    imp.add_argument("hf_dir", help="a directory with config.json and model.safetensors")
    imp.add_argument("--out", required=True, help="the run directory to create")
    imp.set_defaults(func=cmd_import_hf)

    exp = _command(sub, "export-hf", "write a run's newest checkpoint as a Hugging Face model")
    exp.add_argument("--run", required=True, help="a run directory")
    exp.add_argument("--out", required=True, help="the Hugging Face directory to write (new or empty)")
    exp.add_argument("--force", action="store_true", help="write into a non-empty --out, replacing its model files")
    exp.set_defaults(func=cmd_export_hf)
    la = _command(sub, "launch", "train as N processes of one JAX job on this machine",
                  "Train as N processes of one JAX job on this machine, e.g. "
                  "jaxgpt launch -n 2 --devices-per-process 4 -- train --out runs/a")
    la.add_argument("-n", "--processes", type=int, required=True, help="number of processes")
    la.add_argument("--devices-per-process", type=int, default=None,
                    help="run on the CPU with this many devices in each process (to try a layout on one machine)")
    la.add_argument("--all-output", action="store_true",
                    help="show every process's output, prefixed [N] (default: process 0's, and the others' "
                         "last lines when they fail)")
    la.add_argument("command", nargs=argparse.REMAINDER, help="-- then the jaxgpt command and its arguments")
    la.set_defaults(func=cmd_launch, handles_signals=True)
    return parser


HUGEPAGE_MALLOC = "glibc.malloc.hugetlb=1"


def hugepage_malloc_env(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment to re-run the command in so that glibc backs large blocks with transparent
    huge pages, or None where that does not apply or the user has set GLIBC_TUNABLES themselves.

    XLA on CPU allocates a step's temporary buffer afresh every step (100 MB at Day 1, batch 32);
    glibc serves a block that large with a new mmap, and the step then takes a page fault per
    4 KB page, 25,000 a step. With huge pages it takes a few dozen: the Day 1 train step takes
    138 ms against 151 ms without (float32) and 83 against 100 ms (bfloat16), by `jaxgpt bench
    train --config experiments/day1.toml` run alternately with and without the re-exec
    (JAXGPT_HUGEPAGE_MALLOC=0). glibc reads GLIBC_TUNABLES only at process start, hence the
    re-exec. JAXGPT_HUGEPAGE_MALLOC=0 turns this off.
    """
    if sys.platform != "linux" or "GLIBC_TUNABLES" in environ or environ.get("JAXGPT_HUGEPAGE_MALLOC") == "0":
        return None
    libc, version = platform.libc_ver()
    if libc != "glibc" or tuple(int(part) for part in version.split(".")[:2]) < (2, 35):  # the tunable's first
        return None
    return {**environ, "GLIBC_TUNABLES": HUGEPAGE_MALLOC}


def entry() -> int:
    """The console command: `main` in a process whose malloc uses huge pages (see above)."""
    from jaxgpt import signals

    signals.hold()  # the re-exec keeps the block and any signal pending under it
    env = hugepage_malloc_env(os.environ)
    if env is not None:
        os.execve(sys.executable, [sys.executable, "-m", "jaxgpt", *sys.argv[1:]], env)
    return main()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        if not args.handles_signals:
            from jaxgpt import signals

            signals.release()  # Python's own handling from here: Ctrl-C is a KeyboardInterrupt
        return func(args)
    except EXPECTED_ERRORS as err:
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(f"jaxgpt {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        from jaxgpt.signals import Stopped

        if isinstance(err, Stopped):
            print(f"jaxgpt {args.command}: {err}", file=sys.stderr)
            return err.exit_code
        print(f"jaxgpt {args.command}: interrupted", file=sys.stderr)
        return 130
