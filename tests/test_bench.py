"""`jaxgpt bench`: record shapes and sane values on a tiny model, FLOPs by hand, the peak. No timing asserts."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types

import jax
import pytest

from jaxgpt.cli.main import main
from jaxgpt.config import ModelConfig, load_config
from jaxgpt.evaluation.generate import generate
from jaxgpt.kernels import choose_kernels
from jaxgpt.model.decoder import init_params
from jaxgpt.model.flops import flops_per_token
from jaxgpt.tools import bench

TINY = ["model.vocab_size=64", "model.context_length=64", "model.d_model=32", "model.n_layers=2",
        "model.n_heads=2", "train.batch_size=4"]


def _finite_positive(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def test_flops_per_token_by_hand() -> None:
    # C=16, L=1, H=K=2 (D=8), F=64, V=64, T=8. qkv 16*(2+4)*8 = 768, out 16*16 = 256,
    # MLP 2*16*64 = 2,048, head 64*16 = 1,024: N = 4,096, 6N = 24,576; 12*L*C*T = 1,536.
    cfg = ModelConfig(vocab_size=64, context_length=8, d_model=16, n_layers=1, n_heads=2, hidden_size=64)
    assert flops_per_token(cfg) == 24_576 + 1_536
    # Paired heads: 2T queries of H/2 heads over 2T keys, twice the block's attention, no more N.
    assert flops_per_token(dataclasses.replace(cfg, paired_head_layers=(0,))) == 24_576 + 2 * 1_536


def test_measured_peak_is_positive_and_finite() -> None:
    assert _finite_positive(bench.measure_matmul_peak(n=256, repeats=2))
    peak, source = bench.peak_flops(repeats=1)  # the test machine is a CPU: measured, not nominal
    assert _finite_positive(peak) and source.startswith("measured f32")
    peak, source = bench.peak_flops(repeats=1, dtype="bfloat16")
    assert _finite_positive(peak) and source.startswith("measured bf16")


@pytest.mark.parametrize("kind, peak", [("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5", 459e12),
                                        ("TPU v6 lite", 918e12), ("NVIDIA A100-SXM4-40GB", 312e12),
                                        ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12)])
def test_nominal_peak_of_known_accelerators(monkeypatch, kind: str, peak: float) -> None:
    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(device_kind=kind)])
    assert bench.peak_flops() == (peak, f"nominal bf16 {kind}")


def test_cli_train_prints_json_records_then_a_table(capsys) -> None:
    sets = [arg for item in [*TINY, "model.kernels=xla"] for arg in ("--set", item)]
    assert main(["bench", "train", *sets, "--repeats", "1"]) == 0
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    assert [(r["remat"], r["dtype"], r["kernels"]) for r in records] == [
        (remat, dtype, "xla") for remat in ("none", "full") for dtype in ("float32", "bfloat16")]
    for r in records:
        assert r["mode"] == "train"
        assert _finite_positive(r["tokens_per_s"], r["step_ms"], r["mfu"], r["compile_s"], r["temp_bytes"])
        assert r["tokens_per_s"] == pytest.approx(4 * 64 / (r["step_ms"] / 1e3))
        assert r["flops_per_token"] == flops_per_token(load_config(None, TINY).model)
    assert err.splitlines()[0].split()[:4] == ["mode", "kernels", "dtype", "remat"] and len(err.splitlines()) == 5


def test_train_grid_times_the_portable_kernels_beside_tuned_ones(monkeypatch) -> None:
    timed = []
    monkeypatch.setattr(bench, "train_record", lambda run, repeats: timed.append(run.model) or {})
    list(bench.bench_train(load_config(None, TINY), 1))
    # Each remat x dtype with the CPU's kernels, then with the portable ones.
    assert [(m.remat, m.dtype, choose_kernels(m).name) for m in timed] == [
        (remat, dtype, kernels) for remat in ("none", "full") for dtype in ("float32", "bfloat16")
        for kernels in ({"float32": "cpu", "bfloat16": "cpu-bf16"}[dtype], "xla")]


def test_forward_records_per_length() -> None:
    records = list(bench.bench_forward(load_config(None, TINY), 1, lengths=(16, 128)))
    assert [r["context"] for r in records] == [16, 128]  # learned positions widened to 128
    for r in records:
        assert r["mode"] == "forward" and r["batch"] == 1
        assert _finite_positive(r["step_ms"], r["tokens_per_s"], r["mfu"], r["compile_s"])


def test_compile_records_and_ratios() -> None:
    records = list(bench.bench_compile(load_config(None, TINY), 1, depths=(1, 3), remat_shape=(2, 32, 2)))
    depth = [r for r in records if "summary" not in r and "remat" not in r]
    assert [(r["scan_layers"], r["layers"]) for r in depth] == [(True, 1), (True, 3), (False, 1), (False, 3)]
    assert all(_finite_positive(r["compile_s"], r["temp_bytes"], r["argument_bytes"]) for r in depth)
    by = {(r["scan_layers"], r["layers"]): r for r in depth}
    assert by[True, 3]["argument_bytes"] > by[True, 1]["argument_bytes"]  # more layers, more params
    ratios = [r for r in records if r.get("summary", "").startswith("compile(")]
    assert [r["scan_layers"] for r in ratios] == [True, False]
    assert ratios[0]["ratio"] == pytest.approx(by[True, 3]["compile_s"] / by[True, 1]["compile_s"])
    remat = {r["remat"]: r for r in records if "remat" in r}
    assert remat["full"]["context"] == 32 and _finite_positive(remat["full"]["temp_bytes"], remat["none"]["step_ms"])
    summary = records[-1]
    assert summary["temp_ratio"] == pytest.approx(remat["full"]["temp_bytes"] / remat["none"]["temp_bytes"])


def test_decode_records() -> None:
    records = list(bench.bench_decode(load_config(None, TINY), 1))
    methods = [r.get("method") or r["summary"] for r in records]
    assert methods[:3] == ["kv_cache", "recompute_prefix", "kv_cache speed-up"]
    assert [r["prompt"] for r in records[3:5]] == [6, 57]  # 100 and 900 scaled to context 64
    for r in records[:2]:
        assert _finite_positive(r["tokens_per_s"], r["step_ms"])
    for r in records[3:5]:  # step_ms is a difference of two calls: at this size it may be noise
        assert _finite_positive(r["tokens_per_s"], r["call_ms"]) and math.isfinite(r["step_ms"])
    assert _finite_positive(records[2]["ratio"], records[-1]["ratio"])


def test_recompute_baseline_decodes_what_the_cache_decodes() -> None:
    # A large init spreads the logits, so greedy choices have no near-ties between the two paths.
    model = ModelConfig(vocab_size=64, context_length=32, d_model=32, n_layers=2, n_heads=2, init_std=0.5)
    params = init_params(model, jax.random.key(3))
    prompt = [5, 9, 1, 33]
    expected = generate(params, model, [prompt], 20, temperature=0.0)[0]
    assert bench.recompute_generate(params, model, prompt, 20) == expected


def test_unknown_mode_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown bench mode 'fast'"):
        bench.run_mode("fast", load_config())


def test_speculative_mode_needs_a_run() -> None:
    with pytest.raises(ValueError, match="needs --run DIR"):
        bench.run_mode("speculative", load_config())


def _script(name: str) -> types.ModuleType:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_no_attention_probe_swaps_the_attention_alone() -> None:
    # scripts/bench_step.py's step-no-attention mode: if the model stopped calling the kernels'
    # attention, the probe would silently time the full step; the other kernels stay the same.
    import dataclasses

    import jax.numpy as jnp

    from jaxgpt.kernels import PORTABLE
    from jaxgpt.model.decoder import forward

    cfg = load_config(None, TINY)
    params = init_params(cfg.model, jax.random.key(0))
    tokens = jnp.arange(2 * 16, dtype=jnp.int32).reshape(2, 16) % cfg.model.vocab_size
    probe = _script("bench_step")._without_attention(PORTABLE)
    real = forward(params, cfg.model, tokens, kernels=PORTABLE)
    assert not jnp.allclose(real, forward(params, cfg.model, tokens, kernels=probe), atol=1e-3)
    same = [f.name for f in dataclasses.fields(PORTABLE) if f.name not in ("name", "attention")]
    assert all(getattr(probe, name) is getattr(PORTABLE, name) for name in same)


def test_attention_bench_times_each_jax_implementation() -> None:
    results = _script("bench_attention").jax_timings(B=1, T=64, H=2, D=8, repeats=1)
    assert set(results) == {"jaxgpt_cpu", "jaxgpt_portable", "jax_dot_product_attention"}
    assert _finite_positive(*results.values())


def test_gpu_bench_times_a_variant_with_its_kernels_and_options_then_profiles_it(tmp_path) -> None:
    bench_gpu = _script("bench_gpu")
    variant = bench_gpu.Variant("plain head, no fusion", plain_head=True,
                                options=(("xla_backend_optimization_level", 0),))
    record, profile = bench_gpu.train_variant(bench_gpu.SMOKE, variant, 1, {"tokens_per_s": 1000.0}, tmp_path)
    assert profile["mode"] == "profile" and profile["source"] == "host" and profile["top"]  # a CPU: no device
    assert record["variant"] == "plain head, no fusion" and record["head_loss"] == "plain"
    assert record["options"] == {"xla_backend_optimization_level": 0}
    assert record["batch"] == 4 and record["context"] == 64 and math.isfinite(record["loss"])
    assert _finite_positive(record["step_ms"], record["tokens_per_s"], record["compile_s"])
    assert record["vs_torch"] == pytest.approx(record["tokens_per_s"] / 1000.0)
    assert "| plain head, no fusion | 4 |" in bench_gpu.table([record])


def test_tpu_bench_smoke_runs_the_tpu_set_in_interpret_mode_and_writes_its_records(tmp_path, capsys) -> None:
    bench_tpu = _script("bench_tpu")
    bench_tpu.main(["--smoke", "--out", str(tmp_path), "--repeats", "1", "--new-tokens", "2",
                    "--variants", "tpu, batch 32;portable, batch 32"])
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in records] == ["versions", "train", "train", "decode", "decode"]
    assert records[0]["interpret"] is True
    tpu, portable = records[1:3]
    assert (tpu["kernels"], tpu["splash"], tpu["head_loss"]) == ("tpu-interpret", True, "fused")
    assert (portable["kernels"], portable["splash"], portable["head_loss"]) == ("xla", False, "plain")
    for r in (tpu, portable):  # batch 32 / 8 in smoke runs; the CPU reports no HBM and has no nominal peak
        assert r["batch"] == 4 and r["context"] == 128 and r["mfu"] is None and r["device_bytes"] is None
        assert _finite_positive(r["step_ms"], r["tokens_per_s"], r["compile_s"], r["temp_bytes"], r["first_loss"])
    assert abs(tpu["first_loss"] - portable["first_loss"]) < 1e-2  # the same first step, in bfloat16
    assert [(r["batch"], r["new_tokens"]) for r in records[3:]] == [(1, 2), (4, 2)]
    assert "| tpu, batch 32 | 4 |" in capsys.readouterr().out


def test_gpu_bench_profile_summary_reads_the_device_streams(tmp_path) -> None:
    # The layout of jax.profiler's perfetto trace on a GPU: a /device: process whose stream
    # threads hold the kernels (other threads repeat them as XLA ops and modules).
    import gzip

    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
            {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
            {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}}]
    kernels = [("gemm", 300.0), ("gemm", 300.0), ("flash_fwd", 250.0), ("loop_fusion", 50.0)]
    events = meta + [{"ph": "X", "pid": 2, "tid": 7, "name": n, "dur": d} for n, d in kernels]
    events += [{"ph": "X", "pid": 2, "tid": 8, "name": "fusion.1", "dur": 5000.0},
               {"ph": "X", "pid": 1, "tid": 3, "name": "PjitFunction", "dur": 9000.0}]
    folder = tmp_path / "plugins/profile/run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = _script("bench_gpu").summarise_trace(tmp_path, top=2)
    assert summary["source"] == "device streams" and summary["total_ms"] == pytest.approx(0.9)
    assert [(t["name"], t["calls"]) for t in summary["top"]] == [("gemm", 2), ("flash_fwd", 1)]
    assert summary["top"][0]["share"] == pytest.approx(600 / 900)
