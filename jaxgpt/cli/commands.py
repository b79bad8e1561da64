"""The bodies of the `jaxgpt` commands: each takes the parsed arguments, calls into the modules
and returns the exit code (`jaxgpt.cli.main` parses the command line and turns errors into one line)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from jaxgpt.config import load_config
from jaxgpt.errors import UserError
from jaxgpt.runs.rundir import RunDir

if TYPE_CHECKING:
    from jaxgpt.config import RunConfig
    from jaxgpt.tools.sweep import Sweep


def cmd_dry_run(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    from jaxgpt.kernels.choose import choose_kernels
    from jaxgpt.model.decoder import count_params, forward, init_params
    from jaxgpt.plan.api import plan
    from jaxgpt.plan.programs import hlo_file_names, planned_memory
    from jaxgpt.plan.report import HEADROOM, PROGRAMS
    from jaxgpt.train import sharding

    cfg = load_config(args.config, args.overrides)
    if args.target is not None:
        from jaxgpt.plan.targets import target

        target(args.target)  # an unknown name, before any work
    headroom = HEADROOM if args.headroom is None else args.headroom
    if not 0.0 < headroom <= 1.0:
        raise UserError(f"--headroom {args.headroom}: a share of the chip's memory, in (0, 1]")
    compiles = args.target is not None or args.compile or args.fit
    if args.hlo is not None and not compiles:
        raise UserError("--hlo writes the programs a plan compiles: add --target NAME or --compile")
    model = cfg.model
    seq_len = args.seq_len or model.context_length
    params = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((args.batch_size, seq_len), jnp.int32)
    logits = jax.eval_shape(lambda p, t: forward(p, model, t), params, tokens)
    record = {"config_sha256": cfg.fingerprint(), "parameters": count_params(params),
              "logits_shape": list(logits.shape)}
    programs = PROGRAMS if args.target is not None else ("train",)
    if compiles:
        record.update(plan(cfg, args.target, fit=args.fit, programs=programs, headroom=headroom, hlo_dir=args.hlo))
    else:
        mode = sharding.resolve_mode(cfg.train, jax.device_count())
        mesh = sharding.make_mesh(cfg.train) if mode == "sharded" else None
        record.update({"kernels": choose_kernels(model).name, "mode": mode, "devices": jax.device_count(),
                       **planned_memory(cfg, mesh)})
    if args.hlo is not None:
        written = ", ".join(hlo_file_names(programs, cfg))
        print(f"jaxgpt dry-run: the optimised HLO of each program in {args.hlo}: {written}", file=sys.stderr)
    if record.get("fits") is False and record.get("sampler_fits"):
        print(f"jaxgpt dry-run: training does not fit {args.target}, but the params and the sampler do: "
              "generate, eval and the harness run on it (they read the params alone)", file=sys.stderr)
    print(json.dumps(record))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from jaxgpt.process import signals
    from jaxgpt.process.distributed import maybe_initialize_distributed

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
    from jaxgpt.data.from_config import prepare_data
    from jaxgpt.process import signals

    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers {args.workers}: at least one encoding process is needed")
    cfg = load_config(args.config, _with_data(args))
    with signals.handled():
        signals.check("before the token store was prepared")
        started = time.perf_counter()
        data = prepare_data(cfg, workers=args.workers, progress=not args.no_progress)
    tokens = data.tokens
    print(json.dumps({"store": str(tokens.folder), "train_tokens": len(tokens.train), "val_tokens": len(tokens.val),
                      "shards": len(tokens.train.shards) + len(tokens.val.shards), "val_bytes": tokens.val_bytes,
                      "tokenizer_vocab": data.tokenizer.vocab_size, "eot_id": data.tokenizer.eot_id,
                      "bos_id": data.tokenizer.bos_id,
                      "data_sha256": tokens.fingerprint, "seconds": round(time.perf_counter() - started, 2)}))
    return 0


def _train(args: argparse.Namespace) -> int:
    from jaxgpt.process.distributed import is_writer
    from jaxgpt.runs.metrics import read_metrics
    from jaxgpt.train.loop import train

    overrides = _with_data(args)
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    base, hf_dir = None, None
    if args.init_from is not None:
        from jaxgpt.config import DataConfig, RunConfig
        from jaxgpt.hf.importer import model_config, resolve_source, tokenizer_source

        hf_dir = resolve_source(args.init_from)
        own_tokenizer = tokenizer_source(hf_dir)  # pretrained weights mean nothing under another one
        data = DataConfig(tokenizer=own_tokenizer) if own_tokenizer else DataConfig()
        base = RunConfig(model=model_config(hf_dir), data=data)
    cfg = load_config(args.config, overrides, base=base)
    if hf_dir is not None and own_tokenizer is None and cfg.data.tokenizer in ("bpe", "char"):
        raise UserError(f"--init-from {args.init_from}: the folder has no tokenizer.json (nor GPT-2's "
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
    if args.core is not None and args.tasks is not None:
        raise UserError("--core and --tasks are two evaluations: run one at a time")
    if args.max_per_task is not None and args.core is None:
        raise UserError("--max-per-task applies to CORE: name its bundle with --core")
    if args.core is not None:
        return _eval_core(args)
    if args.tasks is not None:
        return _eval_tasks(args)
    harness_only = [flag for flag, value in (("--include-path", args.include_path), ("--limit", args.limit),
                    ("--num-fewshot", args.num_fewshot), ("--batch-size", args.batch_size), ("--out", args.out))
                    if value is not None]
    if harness_only:
        raise UserError(f"{harness_only[0]} applies to harness tasks: name them with --tasks")

    import functools

    import jax

    from jaxgpt.data.batches import evaluate
    from jaxgpt.data.from_config import prepare_data
    from jaxgpt.train.checkpoint import load_run_config, read_params
    from jaxgpt.train.step import eval_step

    cfg = load_run_config(args.run)
    if args.data is not None:
        cfg = cfg.replace("data", source=args.data)
    if args.batches is not None:
        cfg = cfg.replace("train", eval_batches=args.batches)
    data = prepare_data(cfg, Path(args.run))
    params, _ = read_params(args.run, cfg)
    loss = jax.jit(functools.partial(eval_step, cfg))
    result = evaluate(lambda batch: loss(params, batch), cfg, data)
    print(json.dumps({"loss": result["val_loss"], "perplexity": result["val_perplexity"],
                      "bits_per_byte": result["val_bits_per_byte"], "batches": cfg.train.eval_batches}))
    return 0


def _eval_tasks(args: argparse.Namespace) -> int:
    from jaxgpt.config import names_list

    if args.data is not None or args.batches is not None:
        raise UserError("--data and --batches set the validation loss; --tasks runs harness tasks: use one or the other")
    names = names_list(args.tasks, "--tasks")
    if not names:
        raise UserError("--tasks names no task")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError(f"--num-fewshot {args.num_fewshot}: the number of examples cannot be negative")
    from jaxgpt.data.tokenizer import Tokenizer
    from jaxgpt.evaluation.harness import DEFAULT_BATCH_SIZE, HarnessLM
    from jaxgpt.evaluation.tasks import results_json, results_table, run_tasks, task_manager, task_record
    from jaxgpt.runs.trackers import require
    from jaxgpt.train.checkpoint import load_run_config, read_params

    run_cfg = load_run_config(args.run)
    require(run_cfg.train.trackers)  # the results go to the run's trackers too
    manager = task_manager(names, args.include_path)  # before the checkpoint is read: a typo costs nothing
    params, step = read_params(args.run, run_cfg)  # the newest good checkpoint, with the run's tokenizer
    lm = HarnessLM(run_cfg.model, params, Tokenizer.load(RunDir(args.run).tokenizer), step=step,
                   documents=run_cfg.data.document_mask,
                   batch_size=DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size)
    results = run_tasks(lm, names, manager=manager, limit=args.limit, num_fewshot=args.num_fewshot)
    print(results_table(results))
    _add_to_run(args.run, run_cfg, task_record(results, lm.step))
    if args.out:
        from jaxgpt.runs.rundir import write_atomic

        write_atomic(args.out, results_json(results))
    return 0


def _add_to_run(run: str, run_cfg: RunConfig, record: dict) -> None:
    """An evaluation's record in the run's metrics.jsonl and its own trackers, at its step."""
    from jaxgpt.runs.metrics import MetricsWriter
    from jaxgpt.runs.trackers import TrackerContext, open_trackers

    context = TrackerContext(Path(run), run_cfg, start_step=record["step"], resumed=True, attach=True)
    with MetricsWriter(Path(run), trackers=open_trackers(context)) as writer:
        writer.write(record)


def _eval_core(args: argparse.Namespace) -> int:
    """CORE on the run's newest good checkpoint: the tasks' progress on stderr, the JSON result
    the last line of stdout, a core record in the run's metrics and trackers."""
    unused = [flag for flag, value in (("--data", args.data), ("--batches", args.batches),
              ("--include-path", args.include_path), ("--limit", args.limit), ("--num-fewshot", args.num_fewshot),
              ("--out", args.out)) if value is not None]
    if unused:
        raise UserError(f"{unused[0]} does not apply to CORE (--core BUNDLE_DIR [--max-per-task N] [--batch-size N])")
    if args.max_per_task is not None and args.max_per_task < 1:
        raise UserError(f"--max-per-task {args.max_per_task}: at least one example per task")
    if args.batch_size is not None and args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: at least one row per batch")
    from jaxgpt.data.tokenizer import Tokenizer
    from jaxgpt.evaluation.core import DEFAULT_BATCH_SIZE, core_record, evaluate_core, load_bundle, local_mesh
    from jaxgpt.runs.trackers import require
    from jaxgpt.train.checkpoint import load_run_config, read_params

    run_cfg = load_run_config(args.run)
    require(run_cfg.train.trackers)
    tasks = load_bundle(args.core)  # before the checkpoint is read: a bad bundle costs nothing
    params, step = read_params(args.run, run_cfg)
    result = evaluate_core(params, run_cfg.model, Tokenizer.load(RunDir(args.run).tokenizer), tasks,
                           max_per_task=args.max_per_task or 0, documents=run_cfg.data.document_mask,
                           mesh=local_mesh(),
                           batch_size=DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size)
    for label, values in result["tasks"].items():
        print(f"{label:<35} accuracy {values['accuracy']:.4f}  centered {values['centered']:.4f}", file=sys.stderr)
    _add_to_run(args.run, run_cfg, core_record(result, step))
    print(json.dumps(result))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxgpt.data.tokenizer import Tokenizer
    from jaxgpt.evaluation.generate import generate_tokens
    from jaxgpt.train.checkpoint import load_run_config, read_params

    tokenizer = Tokenizer.load(RunDir(args.run).tokenizer)
    run_cfg = load_run_config(args.run)
    model, (params, _) = run_cfg.model, read_params(args.run, run_cfg)
    documents = run_cfg.data.document_mask  # the model reads one document at a time
    if tokenizer.bos_id is not None:  # a model whose documents open with BOS (nanochat's) starts from it
        prompt = [tokenizer.bos_id, *tokenizer.encode(args.prompt)]
    else:
        prompt = list(tokenizer.encode(args.prompt)) if args.prompt else list(tokenizer.encode("\n")) or [0]
    stop_token = None
    if args.stop is not None:
        stop_ids = [int(i) for i in tokenizer.encode(args.stop)]
        if len(stop_ids) != 1:
            raise UserError(f"--stop {args.stop!r} encodes to {len(stop_ids)} tokens {stop_ids}; it must be one token")
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
                                  speculative=args.speculative, stats=stats,
                                  document_token=tokenizer.document_token if documents else None):
        if tokens[0] < 0:
            break
        emitted.append(int(tokens[0]))
        text = tokenizer.decode(emitted)
        if not text.endswith("\ufffd"):  # hold back a byte sequence that is not complete yet
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    sys.stdout.write(tokenizer.decode(emitted)[len(printed):] + "\n")
    if args.stats:  # first_token_s holds the compiles; tokens_per_s is decoding alone (jaxgpt.evaluation.generate)
        seconds = time.perf_counter() - started
        print(json.dumps({"tokens": len(emitted), "seconds": round(seconds, 3), **stats}), file=sys.stderr)
    return 0


def cmd_coordcheck(args: argparse.Namespace) -> int:
    from jaxgpt.tools.coordcheck import coordcheck

    cfg = load_config(args.config, args.overrides)
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        raise UserError(f"coordcheck: --widths {args.widths!r} must be integers, comma-separated") from None
    out = Path(args.out)
    coordcheck(cfg, widths, args.steps, out, progress=not args.no_progress)
    print(f"coordcheck: {out / 'coordcheck.json'}, {out / 'coordcheck.png'}", file=sys.stderr)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from jaxgpt.config import ConfigError
    from jaxgpt.process.distributed import is_writer, maybe_initialize_distributed
    from jaxgpt.tools.sweep import load_sweep, run_sweep
    from jaxgpt.tools.sweep_report import markdown_table, summarise

    only = tuple(name.strip() for name in args.variants.split(",")) if args.variants else None
    if args.target and not args.dry_run:
        raise ConfigError("--target plans a sweep for a chip: add --dry-run")
    if (args.overrides or only) and not args.out and not args.dry_run:
        # The report and plot of a changed or partial grid describe that grid alone: the file's own
        # folder keeps the file's whole grid.
        raise ConfigError("with --set or --variants, name an --out folder (runs/sweep-NAME holds the file's "
                          "whole grid)")
    if not args.dry_run:
        maybe_initialize_distributed()  # `jaxgpt launch -n N -- sweep ...`: one sweep over every process's devices
    sweep = load_sweep(args.sweep, seeds=args.seeds, overrides=tuple(args.overrides), only=only)
    if args.dry_run:
        return _sweep_plan(sweep, args.target)
    out = Path(args.out or f"runs/sweep-{sweep.name}")
    records = run_sweep(sweep, out, progress=not args.no_progress)
    if is_writer():
        print(markdown_table(summarise(sweep, records), sweep.reference), end="")
        print(f"results: {out / 'results.jsonl'}, {out / 'results.md'}, {out / 'val_loss.png'}", file=sys.stderr)
    return 0


def _sweep_plan(sweep: Sweep, target_name: str | None) -> int:
    """`sweep --dry-run [--target NAME]`: a JSON line per group on stdout, a line each on stderr."""
    from jaxgpt.tools.sweep import group_members, members, shared_config

    groups = group_members(members(sweep))
    if target_name is None:
        import jax

        from jaxgpt.train.sweep_mesh import layout_for

        devices = len(jax.devices())
        layouts = [layout_for(shared_config(group[0].config), len(group)) for group in groups]
        plans = [{"target": None, "devices": layout.devices, "mesh": {"members": layout.members, "data": layout.data}}
                 for layout in layouts]
    else:
        from jaxgpt.plan.api import plan_groups
        from jaxgpt.plan.targets import target

        devices = target(target_name).chips
        plans = plan_groups([(shared_config(g[0].config), len(g)) for g in groups], target_name)
    for number, (group, plan) in enumerate(zip(groups, plans), start=1):
        if "error" in plan or "failure" in plan:
            raise UserError(plan.get("error") or f"the compiler failed: {plan['failure']} (its traceback is above)")
        mesh = plan.get("mesh") or plan["compiled"]["mesh"]
        variants = list(dict.fromkeys(m.variant for m in group))
        record = {"group": number, "variants": variants, "members": [f"{m.variant}/{m.seed}" for m in group],
                  **{k: v for k, v in plan.items() if k != "members"}, "mesh": mesh}
        print(json.dumps(record))
        line = (f"group {number} [{', '.join(variants)}] x{len(group)}: {plan['devices']} of {devices} devices "
                f"(members {mesh['members']} x data {mesh['data']})")
        compiled = plan.get("compiled", {})
        if compiled.get("total_bytes") is not None:
            line += f", {compiled['total_bytes'] / 2**30:.2f} GiB a chip"
        if "refused" in compiled:
            line += ", refused by the compiler for memory"
        if plan.get("fits") is not None:
            line += ", fits" if plan["fits"] else ", does not fit"
        print(line, file=sys.stderr)
    return 0


def cmd_import_hf(args: argparse.Namespace) -> int:
    from jaxgpt.train.imported import import_hf_run

    run_dir = import_hf_run(args.hf_dir, args.out)
    print(json.dumps({"run": str(run_dir), "from": args.hf_dir}))
    return 0


def cmd_import_nanochat(args: argparse.Namespace) -> int:
    from jaxgpt.train.imported import import_nanochat_run

    run_dir, step = import_nanochat_run(args.checkpoint_dir, args.out, step=args.step, tokenizer_dir=args.tokenizer)
    print(json.dumps({"run": str(run_dir), "from": args.checkpoint_dir, "step": step}))
    return 0


def cmd_export_nanochat(args: argparse.Namespace) -> int:
    from jaxgpt.train.imported import export_nanochat_run

    folder = export_nanochat_run(args.run, args.out, step=args.step)
    print(json.dumps({"checkpoint_dir": str(folder), "base_dir": args.out, "from": args.run}))
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from jaxgpt.hf.exporter import check_export_dir, dropped_on_export, export_hf
    from jaxgpt.train.checkpoint import load_run

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
    from jaxgpt.tools.bench import run_mode, table

    records = []
    for record in run_mode(args.mode, load_config(args.config, args.overrides), repeats=args.repeats, run=args.run):
        print(json.dumps(record), flush=True)
        records.append(record)
    print(table(records), file=sys.stderr)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from jaxgpt.tools.launch import launch

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return launch(command, args.processes, args.devices_per_process, all_output=args.all_output)
