"""The peak memory of the commands that read a run (generate, eval, export-hf) beside the size of
its params and of its whole train state.

    .venv/bin/python scripts/bench_readers.py            # 102M params: Day 1's layout at width 1,024, 8 blocks
    .venv/bin/python scripts/bench_readers.py --set model.n_layers=2

Writes a run into a temporary folder (the config, a character tokenizer of a little text, one
checkpoint of a freshly initialised train state: params and AdamW's moments, float32), then runs
each command in a process of its own and reads its peak resident memory (`/usr/bin/time -f %M`).
One JSON record on stdout; run it from the tree whose jaxgpt it measures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import jax

from jaxgpt.config import load_config
from jaxgpt.data.tokenizer import build_char
from jaxgpt.model.decoder import count_params
from jaxgpt.runs.rundir import RunDir
from jaxgpt.train.checkpoint import Checkpointer
from jaxgpt.train.step import init_state

WIDE = ["model.d_model=1024", "model.n_layers=8", "model.n_heads=16"]
TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.\n" * 400


def tree_bytes(tree) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree))


def peak_rss(command: list[str], cwd: Path) -> int:
    """The command's peak resident memory in bytes (it must succeed)."""
    done = subprocess.run(["/usr/bin/time", "-f", "%M", *command], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return int(done.stderr.strip().splitlines()[-1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "experiments" / "day1.toml"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    cfg = load_config(args.config, [*WIDE, "data.tokenizer=char", *args.set])
    with tempfile.TemporaryDirectory() as tmp:
        run, text = Path(tmp) / "run", Path(tmp) / "text.txt"
        text.write_text(TEXT, encoding="utf-8")
        files = RunDir(run)
        run.mkdir()
        files.config.write_text(cfg.to_toml(), encoding="utf-8")
        build_char([TEXT], cfg.model.vocab_size).save(files.tokenizer)
        state = init_state(cfg, jax.random.key(0))
        record = {"parameters": count_params(state.params), "params_bytes": tree_bytes(state.params),
                  "state_bytes": tree_bytes(state)}
        checkpointer = Checkpointer(run, keep=1)
        checkpointer.save(state, {"config": cfg.to_dict()})
        checkpointer.close()
        del state
        jaxgpt = [sys.executable, "-m", "jaxgpt"]
        cwd = Path.cwd()
        record["generate_peak_rss"] = peak_rss([*jaxgpt, "generate", "--run", str(run), "--prompt", "To be",
                                                "--max-new-tokens", "16", "--temperature", "0"], cwd)
        record["eval_peak_rss"] = peak_rss([*jaxgpt, "eval", "--run", str(run), "--data", str(text),
                                            "--batches", "2"], cwd)
        record["export_hf_peak_rss"] = peak_rss([*jaxgpt, "export-hf", "--run", str(run), "--out",
                                                 str(Path(tmp) / "hf")], cwd)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
