"""This tree against an older revision: the compiled programs, or the train step's speed, side by side.

    .venv/bin/python scripts/compare_revisions.py main --programs-only
    .venv/bin/python scripts/compare_revisions.py main --programs-only --configs experiments/*.toml
    .venv/bin/python scripts/compare_revisions.py main --rounds 3 --config experiments/day1.toml

OLD_REV is checked out into a temporary git worktree. `--programs-only` compiles, in each tree (a
subprocess with PYTHONPATH set to it), the train and eval steps of the Day 1 config (float32,
bfloat16, each with and without remat) and of 6 layers x 384 (T 256, B 16), and the forward
pass, a prefill and one decoding step of both, with the backend's kernels (with `--configs`, the
same programs of each experiment's config as it stands), and prints for each program whether its
optimized HLO is identical (modulo names and metadata). Otherwise it times
the train step of `jaxgpt bench train` (its `train_record`, each dtype x remat, the backend's
kernels; the portable ones are not timed) in both trees, alternating, for `--rounds` rounds, in
the environment the `jaxgpt` command runs in (huge-page malloc), and prints each measurement's
median step time in both and the new/old ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "day1": [],
    "6x384": ["model.n_layers=6", "model.d_model=384", "model.n_heads=6", "model.context_length=256",
              "train.batch_size=16"],
}
VARIANTS = {"f32": [], "bf16": ["model.dtype=bfloat16"], "f32-remat": ["model.remat=true"],
            "bf16-remat": ["model.dtype=bfloat16", "model.remat=true"]}


@contextlib.contextmanager
def old_tree(rev: str):
    with tempfile.TemporaryDirectory(prefix="jaxgpt-old-") as tmp:
        path = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(path), rev], check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=True)


def run_in(tree: Path, args: list[str], environ: dict[str, str] | None = None) -> str:
    env = {**(environ or os.environ), "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, *args], env=env, cwd=tree, check=True, capture_output=True,
                          text=True).stdout


# ---------------------------------------------------------------- programs (the child side)


def _normalise(hlo: str) -> str:
    """Optimized HLO without what names the source: metadata, the module's name, and the tables of
    source files, functions and stack frames (between `FileNames` and the first computation)."""
    hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
    hlo = re.sub(r"^HloModule \S+", "HloModule", hlo, flags=re.M)
    return re.sub(r"^FileNames\n.*?(?=^(%|ENTRY))", "", hlo, flags=re.M | re.S)


def child_programs(shape: str) -> dict[str, str]:
    import jax
    import jax.numpy as jnp

    from jaxgpt.config import load_config
    from jaxgpt.model import forward, forward_cached, init_cache, init_params

    try:  # this tree, or an older one with its modules side by side
        from jaxgpt.train.step import compile_steps, init_state, window_length
    except ImportError:
        from jaxgpt.step import compile_steps, init_state, window_length

    import jaxgpt

    # Asked by folder, not by import: an editable install would find this checkout's kernels.
    if (Path(jaxgpt.__file__).parent / "kernels").is_dir():
        from jaxgpt.kernels import choose_kernels
    else:  # a revision before the kernels seam: the model chooses them itself
        choose_kernels = None
    programs = {}
    # A shape of Day 1 in every variant, or an experiment's config (a .toml path) as it stands.
    experiment = ".toml" in shape
    variants = {"as-is": []} if experiment else VARIANTS
    for variant, overrides in variants.items():
        if experiment:
            cfg = _experiment(shape)
        else:
            cfg = load_config(str(ROOT / "experiments/day1.toml"), SHAPES[shape] + overrides)
        model = cfg.model
        state = init_state(cfg, jax.random.key(0))
        try:  # the rows' width: with data.document_mask, the segment ids after the tokens
            from jaxgpt.data.batches import batch_width
            width = batch_width(cfg)
        except ImportError:
            width = window_length(model)
        batch = jnp.zeros((cfg.train.batch_size, width), jnp.int32)
        train, evaluate = compile_steps(cfg)
        programs[f"{shape} {variant} train"] = train.lower(state, batch).compile().as_text()
        programs[f"{shape} {variant} eval"] = evaluate.lower(state.params, batch).compile().as_text()
        if "remat" in variant:
            continue
        kw = {} if choose_kernels is None else {"kernels": choose_kernels(model)}
        params = init_params(model, jax.random.key(0))
        T = model.context_length
        tokens = jnp.zeros((1, T), jnp.int32)
        fwd = jax.jit(lambda p, x: forward(p, model, x, **kw))
        programs[f"{shape} {variant} forward"] = fwd.lower(params, tokens).compile().as_text()
        cache = init_cache(model, 1, T)
        prefill = jax.jit(lambda p, x, c: forward_cached(p, model, x, c, fresh=True, **kw))
        programs[f"{shape} {variant} prefill"] = prefill.lower(params, tokens[:, : T // 2], cache).compile().as_text()
        decode = jax.jit(lambda p, x, c: forward_cached(p, model, x, c, **kw))
        programs[f"{shape} {variant} decode"] = decode.lower(params, tokens[:, :1], cache).compile().as_text()
    return {name: _normalise(text) for name, text in programs.items()}


def run_configs(paths: list[str]) -> list[str]:
    """What each path holds: a run's config (the path itself), or a sweep's variants
    ("path#variant", each a config of its own, those equal to an earlier one but for the
    optimiser's numbers a sweep varies left out); a search's spec is neither (named, skipped)."""
    from jaxgpt.config import ConfigError, UserError, load_config
    from jaxgpt.tools.sweep import load_sweep, shared_config

    kept, seen = [], set()
    for path in paths:
        try:
            configs = {path: load_config(str(ROOT / path))}
        except ConfigError:
            try:
                configs = {f"{path}#{v.name}": v.config for v in load_sweep(ROOT / path).variants}
            except UserError as err:
                print(f"{path:50s} skipped (neither a run's config nor a sweep's: {err})", flush=True)
                continue
        for name, cfg in configs.items():
            key = shared_config(cfg).to_toml()
            if key not in seen:
                seen.add(key)
                kept.append(name)
    return kept


def _experiment(name: str):
    """The config `run_configs` named: a path's, or a sweep variant's ("path#variant")."""
    from jaxgpt.config import load_config

    path, _, variant = name.partition("#")
    if not variant:
        return load_config(str(ROOT / path))
    from jaxgpt.tools.sweep import load_sweep

    return next(v.config for v in load_sweep(ROOT / path).variants if v.name == variant)


def compare_programs(old: Path, configs: list[str]) -> bool:
    same = True
    for shape in [*SHAPES, *run_configs(configs)]:
        new_programs = json.loads(run_in(ROOT, [__file__, "--child", shape]))
        old_programs = json.loads(run_in(old, [__file__, "--child", shape]))
        for name, text in new_programs.items():
            identical = old_programs.get(name) == text
            same &= identical
            print(f"{name:50s} {'identical' if identical else 'DIFFERENT'}", flush=True)
    return same


# ---------------------------------------------------------------- timing


def child_bench(config: str, overrides: list[str], repeats: int) -> list[dict]:
    """`jaxgpt bench train`'s records with the backend's kernels, in the tree on PYTHONPATH."""
    import dataclasses

    try:  # this tree, or an older one with its modules side by side
        from jaxgpt.tools.bench import train_record
    except ImportError:
        from jaxgpt.bench import train_record
    from jaxgpt.config import load_config

    cfg = load_config(config, overrides)
    return [train_record(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=remat, dtype=dtype)), repeats)
            for remat in (False, True) for dtype in ("float32", "bfloat16")]


def bench_train(tree: Path, config: str, overrides: list[str], repeats: int) -> dict[tuple, float]:
    """step_ms by (dtype, remat), timed in a process of `tree` started as the `jaxgpt` command starts."""
    from jaxgpt.cli.main import hugepage_malloc_env

    args = [__file__, "--bench-child", config, "--repeats", str(repeats)]
    for item in overrides:
        args += ["--set", item]
    records = json.loads(run_in(tree, args, hugepage_malloc_env(os.environ)).splitlines()[-1])
    return {(r["dtype"], r["remat"]): r["step_ms"] for r in records}


def compare_speed(old: Path, config: str, overrides: list[str], rounds: int, repeats: int) -> None:
    times: dict[str, dict[tuple, list[float]]] = {"new": {}, "old": {}}
    for _ in range(rounds):
        for label, tree in (("old", old), ("new", ROOT)):
            for key, ms in bench_train(tree, str(Path(config).resolve()), overrides, repeats).items():
                times[label].setdefault(key, []).append(ms)
    for key in times["new"]:
        new, old_ms = statistics.median(times["new"][key]), statistics.median(times["old"][key])
        print(json.dumps({"dtype": key[0], "remat": key[1], "new_step_ms": round(new, 1),
                          "old_step_ms": round(old_ms, 1), "new/old": round(new / old_ms, 3),
                          "rounds": rounds}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_rev", nargs="?")
    parser.add_argument("--programs-only", action="store_true")
    parser.add_argument("--config", default="experiments/day1.toml")
    parser.add_argument("--configs", nargs="*", default=[], metavar="TOML",
                        help="with --programs-only: these experiments' configs too, as they stand "
                             "(paths relative to the repository)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--bench-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child_programs(args.child)))
        return
    if args.bench_child:
        print(json.dumps(child_bench(args.bench_child, args.set, args.repeats)))
        return
    if not args.old_rev:
        parser.error("OLD_REV is required")
    with old_tree(args.old_rev) as old:
        if args.programs_only:
            sys.exit(0 if compare_programs(old, args.configs) else 1)
        compare_speed(old, args.config, args.set, args.rounds, args.repeats)


if __name__ == "__main__":
    main()
