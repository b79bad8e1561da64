"""The compiled-program cache (jaxgpt.process.compile_cache): on by default, never a failed or noisy run,
reused by the next process, never reused by a changed program; and the start measured
(`bench startup`, `generate --stats`). Every test here starts its processes on a cache folder of
its own, never the suite's shared one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import xla_flags
from jaxgpt_lines import foreign_lines
from test_train import write_corpus

from jaxgpt.process import compile_cache

ROOT = Path(__file__).resolve().parents[1]
SETS = ["model.context_length=32", "model.d_model=32", "model.n_heads=2", "model.n_layers=1",
        "model.vocab_size=64", "data.tokenizer=char", "train.batch_size=4", "train.steps=2",
        "train.eval_every=2", "train.eval_batches=1", "train.sample_tokens=8"]
NOTE = "note: compiled programs"


def env_with(cache: Path | str | None, **extra: str) -> dict[str, str]:
    """This process's environment for a jaxgpt process: one device, and `cache` as its cache folder
    (None: the cache turned off)."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("JAX_COMPILATION_CACHE_DIR", compile_cache.OFF)}
    env.update(XLA_FLAGS=xla_flags(1), **extra)
    if cache is None:
        env[compile_cache.OFF] = "0"
    else:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    return env


def start(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxgpt", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen) -> tuple[dict, list[str]]:
    """The process's summary (its last stdout line) and its stderr lines; it must succeed."""
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err.splitlines()


def train(corpus: Path, run: Path, cache: Path | str | None, *sets: str, **extra: str) -> tuple[dict, list[str]]:
    return finish(start("train", "--no-progress", "--data", str(corpus), "--out", str(run),
                        *[a for s in [*SETS, *sets] for a in ("--set", s)], env=env_with(cache, **extra)))


def result(summary: dict) -> dict:
    """What a run computed, without its timings."""
    return {key: summary[key] for key in ("step", "train_loss", "val_loss", "parameters")}


@pytest.fixture(scope="module")
def uncached(tmp_path_factory):
    """A run with the cache off: the corpus, the run, its summary and its stderr lines."""
    folder = tmp_path_factory.mktemp("uncached")
    corpus = write_corpus(folder / "corpus.txt")
    summary, lines = train(corpus, folder / "run", None)
    return corpus, folder / "run", summary, lines


def test_the_folder_is_under_the_project_cache_unless_jax_is_given_one(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("JAXGPT_CACHE", str(tmp_path / "cache"))
    assert compile_cache.folder() == tmp_path / "cache" / "xla"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.folder() == tmp_path / "mine"


@pytest.mark.parametrize("where", ["/proc/jaxgpt-xla", "under-a-file"])
def test_a_folder_that_cannot_be_made_is_one_note_and_the_same_run(uncached, tmp_path, where):
    corpus, _, expected, expected_lines = uncached
    if where == "under-a-file":
        (tmp_path / "a-file").write_text("")
        where = str(tmp_path / "a-file" / "xla")
    project_cache = tmp_path / "project-cache"
    summary, lines = train(corpus, tmp_path / "run", where, JAXGPT_CACHE=str(project_cache))
    assert result(summary) == result(expected)
    extra = [line for line in lines if line not in expected_lines]
    assert len(extra) == 1 and extra[0].startswith(f"{NOTE} are not kept: {where} cannot be written"), lines
    assert foreign_lines("\n".join(lines)) == []
    assert not (project_cache / "xla").exists()  # no folder of its own chosen instead


def test_reads_and_writes_that_fail_after_the_start_are_one_note(uncached, tmp_path):
    corpus, _, expected, expected_lines = uncached
    cache = tmp_path / "xla"
    (cache / ".lockfile").mkdir(parents=True)  # the folder is writable; every entry's lock fails
    summary, lines = train(corpus, tmp_path / "run", cache)
    assert result(summary) == result(expected)
    extra = [line for line in lines if line not in expected_lines]
    assert len(extra) == 1 and extra[0].startswith(f"{NOTE} could not be kept in {cache}"), lines
    assert sorted(p.name for p in cache.iterdir()) == [".lockfile"]


def test_runs_that_start_together_on_a_cold_cache_all_succeed_quietly(uncached, tmp_path):
    corpus, _, expected, expected_lines = uncached
    cache = tmp_path / "xla"
    processes = [start("train", "--no-progress", "--data", str(corpus), "--out", str(tmp_path / f"run-{i}"),
                       *[a for s in SETS for a in ("--set", s)], env=env_with(cache)) for i in range(3)]
    for summary, lines in map(finish, processes):
        assert result(summary) == result(expected)
        assert lines == expected_lines  # not one line about the cache
    assert any(cache.glob("*-cache"))


def compiled(lines: list[str]) -> tuple[list[str], list[str]]:
    """The programs JAX loaded from the cache and those it compiled, by name (its debug log)."""
    def named(marker: str) -> list[str]:
        return sorted(line.split(marker)[1].split("'")[1] for line in lines if marker in line)
    return named("Persistent compilation cache hit for "), named("PERSISTENT COMPILATION CACHE MISS for ")


def test_a_second_process_loads_the_first_ones_programs_and_a_changed_model_compiles_its_own(uncached, tmp_path):
    corpus, _, expected, _ = uncached
    cache, log = tmp_path / "xla", {"JAX_DEBUG_LOG_MODULES": "jax._src.compiler"}
    _, first = train(corpus, tmp_path / "first", cache, **log)
    hits, misses = compiled(first)
    assert hits == [] and {"jit_train_step", "jit_eval_step", "jit_init_state"} <= set(misses)
    summary, second = train(corpus, tmp_path / "second", cache, **log)
    assert compiled(second) == (misses, [])  # every program loaded, none compiled
    assert result(summary) == result(expected)
    _, changed = train(corpus, tmp_path / "changed", cache, "model.d_model=48", **log)
    hits, misses = compiled(changed)
    assert {"jit_train_step", "jit_eval_step", "jit_init_state"} <= set(misses)
    assert not {"jit_train_step", "jit_eval_step", "jit_init_state"} & set(hits)


def generate_stats(run: Path, cache: Path, tokens: int) -> dict:
    done = subprocess.run([sys.executable, "-m", "jaxgpt", "generate", "--run", str(run), "--max-new-tokens",
                           str(tokens), "--stats"], cwd=ROOT, env=env_with(cache), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stderr.strip().splitlines()[-1])


def test_generate_stats_keeps_the_compile_out_of_tokens_per_s(uncached, tmp_path):
    # A model whose tokens cost more than a chunk's fixed cost (a tiny one's decoding is all overhead).
    corpus, run = uncached[0], tmp_path / "run"
    train(corpus, run, None, "model.d_model=128", "model.n_layers=2", "model.n_heads=4", "model.context_length=64",
          "train.sample_tokens=0")
    generate_stats(run, tmp_path / "warm", 200)  # fills the warm cache
    # The cold call's compiles are in its first token, not in its decoding speed (with them, it is
    # tens of times slower). Its decoding is 24 tokens in two chunks, milliseconds that a process
    # descheduled once can double, as it can the warm call's: up to three pairs of a warm start and
    # a cold one (on an empty cache), until one holds.
    for attempt in range(3):
        warm = generate_stats(run, tmp_path / "warm", 200)
        assert warm["tokens"] == 200 and warm["first_token_s"] > 0
        cold = generate_stats(run, tmp_path / f"cold-{attempt}", 40)
        assert cold["tokens"] == 40 and cold["first_token_s"] > 0
        if warm["tokens_per_s"] / 3 <= cold["tokens_per_s"] <= warm["tokens_per_s"] * 3:
            break
    else:
        raise AssertionError(f"cold {cold}, warm {warm}")


def test_bench_startup_prints_cold_and_warm_starts(tmp_path):
    source = f"data.source={json.dumps(str(write_corpus(tmp_path / 'corpus.txt')))}"
    done = subprocess.run([sys.executable, "-m", "jaxgpt", "bench", "startup", "--repeats", "1",
                           *[a for s in [*SETS, source] for a in ("--set", s)]], cwd=ROOT, env=env_with(tmp_path / "xla"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    train_record, generate_record = (json.loads(line) for line in done.stdout.splitlines())
    for record, program in ((train_record, "train"), (generate_record, "generate")):
        assert record["mode"] == "startup" and record["program"] == program and record["repeats"] == 1
        assert 0 < record["warm_s"] <= record["warm_wall_s"] and 0 < record["cold_s"] <= record["cold_wall_s"]
        assert record["ratio"] == round(record["warm_s"] / record["cold_s"], 3)
    stages = train_record["warm"]
    assert set(stages) == {"imports_s", "checks_s", "data_s", "setup_s", "first_step_s", "compile_s", "cache_load_s"}
    assert stages["cache_load_s"] > 0  # the warm start loaded its programs
    assert set(generate_record["warm"]) == {"before_the_call_s", "first_token_s", "decode_tokens_per_s"}
