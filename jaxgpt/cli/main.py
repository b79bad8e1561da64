"""The `jaxgpt` command: argument parsing, the huge-page re-exec and one-line errors; the
commands' bodies are in `jaxgpt.cli.commands`."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence

from jaxgpt.cli.commands import (
    cmd_bench,
    cmd_coordcheck,
    cmd_dry_run,
    cmd_eval,
    cmd_export_hf,
    cmd_export_nanochat,
    cmd_generate,
    cmd_import_hf,
    cmd_import_nanochat,
    cmd_launch,
    cmd_prepare,
    cmd_sweep,
    cmd_train,
)
from jaxgpt.errors import Failure, UserError

# One line each (jaxgpt.errors); any other exception is a bug and keeps its traceback.
USER_ERRORS = (UserError, OSError, ImportError)
# The commands that compile programs, which the compilation cache serves (jaxgpt.process.compile_cache).
COMPILING = ("train", "eval", "generate", "sweep", "bench", "dry-run", "import-hf", "export-hf", "coordcheck",
             "import-nanochat", "export-nanochat")


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (default: the built-in Day 1 baseline)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key; repeatable")



class _CommandListFormatter(argparse.RawDescriptionHelpFormatter):
    """`jaxgpt --help`: one line per command, without argparse's "{a,b,c}" header line."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=19)

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

    dry = _command(sub, "dry-run", "check a config (parameters, memory); --target plans a chip",
                   "Check a config: parameters, logits shape, device memory. With --target, compile its train, "
                   "eval and sampling programs for that accelerator, on any machine (pip install "
                   "'jaxgpt[targets]'), and say whether they fit its memory")
    _add_config_args(dry)
    dry.add_argument("--batch-size", type=int, default=1, help="rows of the logits-shape check (default 1)")
    dry.add_argument("--seq-len", type=int, default=None, help="default: model.context_length")
    dry.add_argument("--compile", action="store_true",
                     help="also compile the train step ahead of time for this mesh and report its memory")
    dry.add_argument("--target", metavar="NAME",
                     help="plan for an accelerator: v4-8, v5e-1, v5e-4, v5e-8, v5p-8, v6e-1, v6e-4, v6e-8 and larger "
                          "slices; a100-N, h100-N, h200-N")
    dry.add_argument("--fit", action="store_true",
                     help="also find the largest global batch (train.batch_size) that fits the target's chips")
    dry.add_argument("--hlo", metavar="DIR",
                     help="with --target or --compile: write the optimised HLO text of each program compiled to DIR "
                          "(train.hlo.txt, eval.hlo.txt, prefill.hlo.txt, decode.hlo.txt, slide.hlo.txt)")
    dry.add_argument("--headroom", type=float, default=None, metavar="SHARE",
                     help="the share of each chip's memory the programs may fill to fit (default 0.9; less leaves "
                          "room for another process on the chip)")
    dry.set_defaults(func=cmd_dry_run)

    pre = _command(sub, "prepare", "encode a data source into its token store, before training",
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

    ev = _command(sub, "eval", "a run's val loss, harness tasks or CORE",
                  "Validation loss, perplexity and bits per byte of a run's newest checkpoint (JSON); with "
                  "--tasks, lm-evaluation-harness tasks on it (pip install 'jaxgpt[eval]'): the harness's "
                  "table, an eval_tasks record in the run's metrics; with --core, nanochat's CORE score on "
                  "an eval bundle (JSON, a core record in the run's metrics)")
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
    ev.add_argument("--core", metavar="BUNDLE_DIR",
                    help="score CORE on nanochat's eval bundle (core.yaml, eval_data/, eval_meta_data.csv)")
    ev.add_argument("--max-per-task", type=int, metavar="N",
                    help="CORE: the first N examples of each task after its shuffle (default: all)")
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
    ben.add_argument("mode", choices=("train", "forward", "compile", "decode", "speculative", "startup"),
                     help="train: step time, tokens/s, MFU (remat x dtype); forward: batch-one latency "
                          "at 128..2048 tokens; compile: compile time and memory against depth, remat "
                          "memory; decode: KV cache against recomputation, cost against position; "
                          "speculative: MTP self-speculative against plain greedy on --run's val text; "
                          "startup: fresh processes to the first train step and the first generated "
                          "token, compilation cache empty and filled")
    _add_config_args(ben)
    ben.add_argument("--run", help="speculative mode: a trained run directory with model.mtp_depth >= 1")
    ben.add_argument("--repeats", type=int, default=5, help="timed repeats; medians are reported")
    ben.set_defaults(func=cmd_bench)

    sw = _command(sub, "sweep", "train variants x seeds; write a results table and a plot",
                  description="train variants x seeds (vmapped where only seeds or optimiser values differ); "
                              "write results.jsonl, results.md, val_loss.png")
    sw.add_argument("sweep", help="a sweep TOML file (format: jaxgpt/tools/sweep.py)")
    sw.add_argument("--seeds", type=int, default=None, help="seeds per variant (default: the file's seeds, else 1)")
    sw.add_argument("--out", default=None, help="output folder (default: runs/sweep-NAME, NAME the file's stem)")
    sw.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config key of every variant, after the file's set; repeatable")
    sw.add_argument("--variants", metavar="A,B,...", help="train only these variants (the baseline among them)")
    sw.add_argument("--no-progress", action="store_true", help="no progress bars")
    sw.add_argument("--dry-run", action="store_true",
                    help="train nothing: list the groups, their members and the devices each gets")
    sw.add_argument("--target", metavar="NAME", help="with --dry-run: each group's train step compiled for a chip "
                    "(v5e-8, h100-8, ...: see `dry-run --target`), its memory a chip and whether it fits")
    sw.set_defaults(func=cmd_sweep)

    cc = _command(sub, "coordcheck", "muP's coordinate check: activations against width",
                  description="train the config's model at each width a few steps and record each layer's mean "
                              "|activation|; write coordcheck.json and coordcheck.png (flat in width under muP)")
    _add_config_args(cc)
    cc.add_argument("--widths", default="64,128,256,512", metavar="W,W,...",
                    help="d_model values, each a multiple of the config's head width (default: 64,128,256,512)")
    cc.add_argument("--steps", type=int, default=5, help="train steps per width (default: 5)")
    cc.add_argument("--out", required=True, help="the folder to write coordcheck.json and coordcheck.png into")
    cc.add_argument("--no-progress", action="store_true", help="no progress bar")
    cc.set_defaults(func=cmd_coordcheck)

    imp = _command(sub, "import-hf", "make a run from a Hugging Face GPT-2 or Llama folder")
    imp.add_argument("hf_dir", help="a directory with config.json and model.safetensors")
    imp.add_argument("--out", required=True, help="the run directory to create")
    imp.set_defaults(func=cmd_import_hf)

    exp = _command(sub, "export-hf", "write a run's newest checkpoint as a Hugging Face model")
    exp.add_argument("--run", required=True, help="a run directory")
    exp.add_argument("--out", required=True, help="the Hugging Face directory to write (new or empty)")
    exp.add_argument("--force", action="store_true", help="write into a non-empty --out, replacing its model files")
    exp.set_defaults(func=cmd_export_hf)
    inc = _command(sub, "import-nanochat", "make a run from a nanochat checkpoint folder",
                   "Make a run from a nanochat checkpoint folder (model_NNNNNN.pt, meta_NNNNNN.json) and its "
                   "tokenizer.pkl: the run is at nanochat's step and trains on with nanochat's optimizer "
                   "(docs/nanochat.md). Needs PyTorch (jaxgpt[nanochat]).")
    inc.add_argument("checkpoint_dir", help="nanochat's folder of one model, e.g. BASE/base_checkpoints/d20")
    inc.add_argument("--out", required=True, help="the run directory to create")
    inc.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    inc.add_argument("--tokenizer", default=None, metavar="DIR",
                     help="the folder of its tokenizer.pkl (default: BASE/tokenizer, two levels above the checkpoint folder)")
    inc.set_defaults(func=cmd_import_nanochat)
    exn = _command(sub, "export-nanochat", "write a run as nanochat's base directory",
                   "Write a run's newest checkpoint (or --step's) as nanochat's base directory: "
                   "OUT/base_checkpoints/dL/model_NNNNNN.pt and meta_NNNNNN.json, OUT/tokenizer/tokenizer.pkl, "
                   "so nanochat's scripts run on it with NANOCHAT_BASE_DIR=OUT. Needs PyTorch (jaxgpt[nanochat]).")
    exn.add_argument("--run", required=True, help="a run directory (one imported from nanochat: it carries nanochat's tokenizer)")
    exn.add_argument("--out", required=True, help="nanochat's base directory to write into")
    exn.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest good one)")
    exn.set_defaults(func=cmd_export_nanochat)
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

    XLA on CPU allocates a step's temporary buffer afresh every step; glibc serves a block that
    large with a new mmap, and the step then takes a page fault per 4 KB page. With huge pages it
    takes a few dozen, and the step is faster (docs/performance.md, "Huge-page malloc"). glibc
    reads GLIBC_TUNABLES only at process start, hence the re-exec. JAXGPT_HUGEPAGE_MALLOC=0 turns
    this off.
    """
    if sys.platform != "linux" or "GLIBC_TUNABLES" in environ or environ.get("JAXGPT_HUGEPAGE_MALLOC") == "0":
        return None
    libc, version = platform.libc_ver()
    if libc != "glibc" or tuple(int(part) for part in version.split(".")[:2]) < (2, 35):  # the tunable's first
        return None
    return {**environ, "GLIBC_TUNABLES": HUGEPAGE_MALLOC}


def entry() -> int:
    """The console command: `main` in a process whose malloc uses huge pages (see above)."""
    from jaxgpt.process import signals

    signals.hold()  # the re-exec keeps the block and any signal pending under it
    env = hugepage_malloc_env(os.environ)
    if env is not None:
        os.execve(sys.executable, [sys.executable, "-m", "jaxgpt", *sys.argv[1:]], env)
    return main()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        if args.command in COMPILING:
            from jaxgpt.process import compile_cache

            compile_cache.enable()  # before the first compile: programs compiled before are kept
        if not args.handles_signals:
            from jaxgpt.process import signals

            signals.release()  # Python's own handling from here: Ctrl-C is a KeyboardInterrupt
        return func(args)
    except (*USER_ERRORS, Failure) as err:
        if os.environ.get("JAXGPT_DEBUG") == "1":
            traceback.print_exc()
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(f"jaxgpt {args.command}: error: {message}", file=sys.stderr)
        return 1 if isinstance(err, Failure) else 2
    except KeyboardInterrupt as err:
        from jaxgpt.process.signals import Stopped

        if isinstance(err, Stopped):
            print(f"jaxgpt {args.command}: {err}", file=sys.stderr)
            return err.exit_code
        print(f"jaxgpt {args.command}: interrupted", file=sys.stderr)
        return 130
