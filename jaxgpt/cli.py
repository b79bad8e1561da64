"""The `jaxgpt` command: argument parsing and messages; each command calls into the modules."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from jaxgpt.config import load_config

EXPECTED_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (default: the built-in Day 1 baseline)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config key; repeatable")


def cmd_dry_run(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    from jaxgpt.model import count_params, forward, init_params

    cfg = load_config(args.config, args.overrides)
    model = cfg.model
    seq_len = args.seq_len or model.context_length
    params = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((args.batch_size, seq_len), jnp.int32)
    logits = jax.eval_shape(lambda p, t: forward(p, model, t), params, tokens)
    print(json.dumps({
        "config_sha256": cfg.fingerprint(),
        "parameters": count_params(params),
        "logits_shape": list(logits.shape),
    }))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxgpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    dry = sub.add_parser("dry-run", help="validate a config; print its fingerprint, parameter count and logits shape")
    _add_config_args(dry)
    dry.add_argument("--batch-size", type=int, default=1)
    dry.add_argument("--seq-len", type=int, default=None, help="default: model.context_length")
    dry.set_defaults(func=cmd_dry_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except EXPECTED_ERRORS as err:
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(f"jaxgpt {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"jaxgpt {args.command}: interrupted", file=sys.stderr)
        return 130
