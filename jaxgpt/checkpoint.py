"""The public path of a trained run's loading (`from jaxgpt.checkpoint import load_run`); the
checkpoints themselves live in `jaxgpt.train.checkpoint`."""

from jaxgpt.train.checkpoint import load_newest, load_run, load_run_config

__all__ = ["load_newest", "load_run", "load_run_config"]
