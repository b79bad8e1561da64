"""Plans for accelerators this machine does not have, GPUs here (TPUs: test_plan_tpu.py): the
targets, the programs compiled by jax's CUDA compiler plugin (the `targets` extra), the memory
they need, the largest batch that fits, and the errors a user can meet. The compiles for one
target share one compile process (`plans`)."""

import json
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
from jaxgpt_lines import foreign_lines
from plan_models import GIB, LAYERS, SPEEDRUN_BLOCK, TINY, WINDOWED, attention, tiny

from jaxgpt import plan as planning
from jaxgpt.cli.main import main
from jaxgpt.config import ConfigError, load_config
from jaxgpt.plan import compilers, targets
from jaxgpt.plan.programs import compile_train, planned_memory
from jaxgpt.plan.report import largest_batch

REMAT = ["none", "dots", "full"]


@pytest.fixture(scope="module")
def hlo_root(tmp_path_factory):
    return tmp_path_factory.mktemp("hlo")


@pytest.fixture(scope="module")
def h100(hlo_root):
    """For one H100: the attention in bfloat16 (every program, its HLO text written to
    hlo_root/mha), then in float32 and the three remat policies on a 4-layer model (the train
    step); then every program of the speedrun block, and the train step of a long-short windowed model."""
    cfgs = [attention("mha", 256, 64, "float32")]
    cfgs += [load_config(None, [*LAYERS, "train.batch_size=8", f"model.remat={policy}"]) for policy in REMAT]
    cfgs += [attention("gqa", 512, 64, "bfloat16", *WINDOWED)]
    every = [attention("mha", 256, 64, "bfloat16"), SPEEDRUN_BLOCK]
    records = planning.plans([*every, *cfgs], "h100-1", hlo_dirs=[hlo_root / "mha"] + [None] * (len(cfgs) + 1),
                             each=[{}] * len(every) + [{"programs": ("train",)}] * len(cfgs))
    every, trains = records[:2], records[2:]
    return [every[0], *trains[:-1], every[1], trains[-1]]


def test_remat_policies_order_the_memory_none_dots_full(h100):
    none, dots, full = (r["compiled"] for r in h100[2:5])
    assert none["temp_bytes"] > dots["temp_bytes"] > full["temp_bytes"] > 0
    # The state (params, Adam's moments) is the same whatever is recomputed.
    assert none["argument_bytes"] == dots["argument_bytes"] == full["argument_bytes"]


def test_the_gpu_set_compiles_cudnn_attention_for_an_h100(h100):
    bf16, f32 = h100[:2]
    assert bf16["kernels"] == f32["kernels"] == "gpu" and bf16["platform"] == "gpu"
    assert any(call.startswith("__cudnn$fmha") for call in bf16["compiled"]["custom_calls"])
    assert not any(call.startswith("__cudnn$fmha") for call in f32["compiled"]["custom_calls"])  # none in float32


def test_a_plan_compiles_train_eval_and_sampling_and_compares_them_with_the_chip(h100):
    record = h100[0]
    compiled = record["compiled"]
    assert compiled["device_bytes"] == targets.target("h100-1").device_bytes == 84978434048
    for figures in (compiled, compiled["eval"], compiled["decode"]):
        assert figures["total_bytes"] == (figures["argument_bytes"] + figures["output_bytes"] - figures["alias_bytes"]
                                          + figures["temp_bytes"] + figures.get("params_held_bytes", 0)) > 0
    # The bfloat16 model's matrices reach the sampler cast; their float32 originals stay beside them.
    assert compiled["decode"]["params_held_bytes"] > 0
    assert compiled["decode"]["program"] in ("start", "advance", "slide")
    opt = record["opt_state_bytes_per_device"]
    assert record["peak_bytes"] == max(compiled["total_bytes"], compiled["eval"]["total_bytes"] + opt,
                                       compiled["decode"]["total_bytes"] + opt)
    assert record["fits"] is (record["peak_bytes"] <= 0.9 * compiled["device_bytes"])
    assert record["sampler_fits"] is (compiled["decode"]["total_bytes"] <= 0.9 * compiled["device_bytes"])
    assert (record["target"], record["devices"], record["processes"]) == ("h100-1", 1, 1)


def test_a_plan_writes_the_optimised_hlo_of_every_program_it_compiled(h100, hlo_root):
    """The compiled programs' own text: the train step's cuDNN calls as the record counts them,
    the sampler's prefill, its token loop (a while loop) and its slide apart."""
    from jaxgpt.plan.programs import cudnn_attention_calls

    folder = hlo_root / "mha"
    texts = {name: (folder / f"{name}.hlo.txt").read_text() for name in ("train", "eval", "prefill", "decode", "slide")}
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{name}.hlo.txt" for name in texts)
    assert all(text.startswith("HloModule ") for text in texts.values())
    compiled = h100[0]["compiled"]
    assert cudnn_attention_calls(texts["train"]) == compiled["cudnn_attention"] != {}
    assert cudnn_attention_calls(texts["eval"]) == compiled["eval"]["cudnn_attention"] != {}
    assert "fmhaSoftmaxBackward" in texts["train"] and "fmhaSoftmaxBackward" not in texts["eval"]
    assert " while(" in texts["decode"] and texts["decode"] != texts["prefill"]
    assert ("HloModule jit__advance" in texts["decode"]) and ("HloModule jit__start" in texts["prefill"])
    assert "HloModule jit__slide" in texts["slide"] and " while(" not in texts["slide"]


def test_the_token_loop_reads_the_weights_and_the_cache_where_they_lie(h100, hlo_root):
    """An iteration of the H100 decode loop of the bfloat16 model above (tied head, batch one,
    top-k 40) converts no weight (the sampler casts them before the loop), copies and transposes
    no cache (its layout is the read's), holds no branch (a slide is a program of its own) and
    writes no product of a vector with a matrix before summing it (the sampler's matrices lie
    transposed): nothing as large as a layer's cache or its smallest matrix (65,536 elements) is
    written but in place, the cache by the Pallas kernel it is handed."""
    from jaxgpt.plan.loop_ops import loop_ops

    text = (hlo_root / "mha" / "decode.hlo.txt").read_text()
    found = loop_ops(text, large=4 * 256 * 64)
    assert found["conditionals"] == 0 and found["launches"] > 0
    assert found["large_writes"] == []
    # The attention's write and read are the Pallas kernel, which compiled for the H100 here.
    assert text.count('custom_call_target="__gpu$xla.gpu.triton"') == 1 and "jaxgpt_written_attention" in text


def test_dry_run_hlo_writes_what_it_compiled_here_and_needs_a_compile(tmp_path, capsys):
    sets = [arg for item in TINY for arg in ("--set", item)]
    assert main(["dry-run", *sets, "--compile", "--hlo", str(tmp_path / "hlo")]) == 0
    assert sorted(p.name for p in (tmp_path / "hlo").iterdir()) == ["train.hlo.txt"]
    assert (tmp_path / "hlo" / "train.hlo.txt").read_text().startswith("HloModule jit_train_step")
    assert capsys.readouterr().err.strip().endswith(f"in {tmp_path / 'hlo'}: train.hlo.txt")
    assert main(["dry-run", *sets, "--hlo", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.strip() == (
        "jaxgpt dry-run: error: --hlo writes the programs a plan compiles: add --target NAME or --compile")
    assert not (tmp_path / "none").exists()


def test_the_speedrun_block_compiles_every_program_with_cudnn_attention(h100):
    record = h100[-2]
    assert "failure" not in record, record.get("failure")
    assert record["kernels"] == "gpu" and record["fits"] is True
    for program in (record["compiled"], record["compiled"]["eval"], record["compiled"]["decode"]):
        assert any(call.startswith("__cudnn$fmha") for call in program["custom_calls"]), program["custom_calls"]


def test_a_long_short_windowed_model_runs_cudnn_attention_in_both_kinds_of_block(h100):
    """The scanned block's body picks its kernel by the traced window (lax.cond): one forward and
    one backward cuDNN call with the sliding window of 128 keys (the windowed block), one of each
    with none (the whole-context block). A windowed block handed to XLA's masked attention, or a
    window lost on its way to cuDNN, leaves no call with the window."""
    record = h100[-1]
    assert "failure" not in record, record.get("failure")
    assert record["kernels"] == "gpu"  # the probe compiled cuDNN's sliding window and its causal mask
    assert record["compiled"]["cudnn_attention"] == {
        "__cudnn$fmhaSoftmax/0": 1, "__cudnn$fmhaSoftmax/128": 1,
        "__cudnn$fmhaSoftmaxBackward/0": 1, "__cudnn$fmhaSoftmaxBackward/128": 1}


FIT_MODEL = [*LAYERS, "model.n_layers=2", "model.context_length=1024"]
# 2 % of each card (1.6 GB of an H100's 79 GiB): over a hundred of these rows, in programs that stay
# small and quick to compile, far from where XLA's GPU compiler starts recomputing to fit the card.
FIT_HEADROOM = 0.02


def test_fit_finds_the_largest_batch_a_compile_confirms():
    """`dry-run --fit` from the command line: its batch fits (every program compiled at it), the
    next batch the cards split (two rows more), compiled by the search, does not, and stderr holds
    only jaxgpt's lines."""
    sets = [arg for item in FIT_MODEL for arg in ("--set", item)]
    out = subprocess.run([sys.executable, "-m", "jaxgpt", "dry-run", *sets, "--target", "h100-2", "--fit",
                          "--headroom", str(FIT_HEADROOM)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    assert not foreign_lines(out.stderr), out.stderr
    record = json.loads(out.stdout)
    batch = record["largest_batch"]
    assert batch > 100 and batch % 2 == 0 and record["batch_size"] == batch and record["fits"] is True
    assert record["peak_bytes"] <= FIT_HEADROOM * record["compiled"]["device_bytes"]
    searched = dict(record["searched"])
    assert searched[batch] <= record["peak_bytes"] and {"eval", "decode"} <= set(record["compiled"])
    assert searched[batch + 2] is None or searched[batch + 2] > FIT_HEADROOM * record["compiled"]["device_bytes"]


def test_the_search_finds_the_largest_fitting_multiple_in_a_few_compiles():
    mesh = types.SimpleNamespace(devices=np.empty(4))
    cfg = tiny("train.batch_size=8", "train.grad_accum=2")  # a step splits 8 rows: 4 devices x 2 micro-batches

    def need(b):  # 1 MiB fixed, 3 MiB a row, and a step of 50 MiB past 1,000 rows (a layout change)
        return 2**20 + 3 * 2**20 * b + (50 * 2**20 if b > 1000 else 0)

    calls = []
    measure = lambda sized: calls.append(sized.train.batch_size) or need(sized.train.batch_size)
    limit = 4000 * 2**20
    batch = largest_batch(cfg, mesh, int(limit / 0.9) + 1, measure=measure)
    assert batch == max(b for b in range(8, 5000, 8) if need(b) <= limit)
    assert len(calls) <= 12 and all(b % 8 == 0 for b in calls)
    calls.clear()
    assert largest_batch(cfg, mesh, int(limit / 0.9) + 1, measure=measure, most=100) == 96 and calls == [96]
    calls.clear()  # the state's bytes draw the first line: the first guess is the answer, or next to it
    assert largest_batch(cfg, mesh, int(limit / 0.9) + 1, measure=measure, fixed=2**20) == batch
    assert len(calls) <= 4, calls
    assert largest_batch(cfg, mesh, 2**20, measure=measure) is None  # not even 8 rows
    assert largest_batch(cfg, mesh, 10**15, measure=lambda sized: 1) >= 2**19  # gives up past 2**20 rows


def test_compiling_for_this_machine_allocates_nothing():
    cfg = tiny("train.fsdp=4", "train.batch_size=8")
    from jaxgpt.train import sharding

    mesh = sharding.make_mesh(cfg.train)
    before = {id(a) for a in jax.live_arrays()}
    report = compile_train(cfg, mesh)
    assert not [a for a in jax.live_arrays() if id(a) not in before and a.ndim > 0]
    assert report["mesh"] == {"data": 2, "fsdp": 4} and report["compile_s"] > 0 and report["lower_s"] > 0
    params = sum(x.size * 4 for x in jax.tree_util.tree_leaves(sharding.state_shapes(cfg).params))
    assert 0 < report["argument_bytes"] < params  # per device: 1/4 of params, mu and nu
    assert planned_memory(cfg, mesh)["params_bytes_per_device"] == params // 4


def test_fit_on_devices_that_report_no_memory_is_one_line(capsys):
    assert main(["dry-run", *[a for s in TINY for a in ("--set", s)], "--fit"]) == 2
    assert capsys.readouterr().err.strip() == (
        "jaxgpt dry-run: error: these devices report no memory to fit a batch in: plan for a --target")


def test_an_unknown_target_names_the_nearest(capsys):
    assert main(["dry-run", "--target", "v5e-3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxgpt dry-run: error: unknown target 'v5e-3'; nearest: ") and "v5e-4" in err
    assert len(err.splitlines()) == 1


def test_per_plan_options_are_checked_before_a_compiler_starts():
    with pytest.raises(ValueError, match="plans\\(each=...\\) takes fit, programs and headroom, not fits"):
        planning.plans([tiny()], "v5e-1", each=[{"fits": True}])
    with pytest.raises(ValueError, match="1 HLO folders and 2 options for 1 configs"):
        planning.plans([tiny()], "v5e-1", each=[{}, {}])


def test_a_batch_the_chips_cannot_split_is_one_line():
    out = subprocess.run([sys.executable, "-m", "jaxgpt", "dry-run", "--set", "train.batch_size=12",
                          "--target", "h100-8"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "jaxgpt dry-run: error: h100-8: train.batch_size = 12 with train.grad_accum = 1 gives micro-batches of "
        "12 rows, which do not divide over data 8 x fsdp 1 = 8 devices"]


@pytest.mark.parametrize("name, compiler", [("v5e-1", "the TPU compiler (libtpu)"),
                                            ("h200-8", "jax's CUDA compiler plugin")])
def test_a_missing_compiler_is_one_line_naming_the_install(name, compiler, monkeypatch, capsys):
    monkeypatch.setattr(compilers, "installed_plugins", lambda: [])
    assert main(["dry-run", "--target", name]) == 2
    assert capsys.readouterr().err.strip() == (
        f"jaxgpt dry-run: error: planning for {name} needs {compiler}: pip install 'jaxgpt[targets]'")


def test_the_targets_users_rent_are_known():
    expect = {"v4-8": ("tpu", 4, 1, "v4:2x2x1"), "v5e-1": ("tpu", 1, 1, "v5e:1x1"), "v5e-4": ("tpu", 4, 1, "v5e:2x2"),
              "v5e-8": ("tpu", 8, 1, "v5e:2x4"), "v5p-8": ("tpu", 4, 1, "v5:2x2x1"), "v6e-1": ("tpu", 1, 1, "v6e:1x1"),
              "v6e-4": ("tpu", 4, 1, "v6e:2x2"), "v6e-8": ("tpu", 8, 1, "v6e:2x4"), "v5e-32": ("tpu", 32, 8, "v5e:4x8"),
              "v4-64": ("tpu", 32, 8, "v4:2x4x4"), "v6e-256": ("tpu", 256, 64, "v6e:16x16"),
              "a100-1": ("gpu", 1, 1, "1x1x1"), "h100-8": ("gpu", 8, 1, "1x1x8"), "h200-32": ("gpu", 32, 4, "1x4x8")}
    for name, (platform, chips, hosts, topology) in expect.items():
        spec = targets.target(name)
        assert (spec.platform, spec.chips, spec.hosts, spec.topology) == (platform, chips, hosts, topology), name
    assert targets.target("v5e-1").device_bytes == round(15.75 * GIB)
    assert targets.target("h200-8").device_bytes > 140e9 and targets.target("a100-8").device_bytes > 80e9
    assert all(targets.target(name).name == name for name in targets.known_names())
    for bad in ("v5e-2", "v4-6", "h100-12", "tpu", "v7-8"):
        with pytest.raises(ConfigError, match="unknown target"):
            targets.target(bad)


def test_the_gpu_descriptions_ship_with_the_package():
    for model in targets.GPU_MODELS:
        text = targets.target(f"{model}-1").gpu_target_config()
        assert "cuda_compute_capability" in text and f'"{targets.GPU_MODELS[model]}"' in text


def test_cudnn_attention_compiles_per_card_under_fsdp_over_eight_h100s():
    """cuDNN's own partitioner cannot split its attention over an FSDP mesh: the GPU set runs it
    per card (`Kernels.mesh_attention`), and the step compiles with it."""
    [record] = planning.plans([attention("mha", 256, 64, "bfloat16", "train.batch_size=16", "train.fsdp=8")],
                              "h100-8", programs=("train",))
    assert record["mesh"] == {"data": 1, "fsdp": 8} and record["kernels"] == "gpu"
    assert any(call.startswith("__cudnn$fmha") for call in record["compiled"]["custom_calls"])
