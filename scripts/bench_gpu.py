"""GPT-2 124M on one GPU, in one run: jaxgpt's train-step variants beside torch.compile, decoding, a profile.

    python scripts/bench_gpu.py --out bench_gpu              # one H200: at most about 8 minutes
    python scripts/bench_gpu.py --smoke --out /tmp/smoke      # a tiny model on the CPU: checks the script

Prints the device and the library versions, then one line per measurement as it finishes, then
a table (markdown). Writes every record to OUT/records.jsonl (one JSON object a line, for diffing
runs) and the profile under OUT/profile/.

1. The PyTorch reference first, in its own process (scripts/torch_gpt2_ref.py: nanoGPT's step,
   torch.compile, bfloat16 autocast, flash attention, fused AdamW), so that its memory is free
   before JAX takes the GPU's.
2. jaxgpt's train step (experiments/gpt2_124m.toml, float32 params and loss), one variant at a
   time, each compiled with its own kernels and XLA options in this process: step time (median),
   tokens/s, MFU against the nominal bf16 peak, compiled memory, compile seconds, the ratio to the
   reference's tokens/s, and whether the step calls cuDNN's fused attention. Variants past
   `--budget-s` are skipped, and say so.
3. Greedy decoding of 512 new tokens after a 16-token prompt at batch 1 and 64, with the params
   as stored, with the matmul weights cast to bfloat16 once before the loop, with the layers
   unrolled (no loop over layers inside the token loop), and with each of two of the GPU
   sampler's decoding options switched back off (`SAMPLER_WITHOUT`: its Pallas cache kernel,
   its folded norms), each way's programs compiled anew; then the same
   decoding in a second process whose XLA_FLAGS capture the whole token loop (`WHILE`,
   `CONDITIONAL`) in CUDA command buffers.
4. A profile of three more steps of the first variant (`jax.profiler`), taken right after its
   timing and summarised: the device's top kernels by time.
5. cuDNN's sliding window against XLA's masked attention (the GPU set's windowed call, bfloat16,
   T 1,024, windows 1, 128, 1,000): the largest difference of the output and of each gradient.
   The tests run the same call through jax's reference implementation; only a GPU runs cuDNN's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_chip import CONFIG, ROOT, SMOKE, Records, Variant, stored_params, time_train_step, variant_kernels, versions  # noqa: E402
from bench_chip import decode_records as chip_decode_records
from bench_chip import table as chip_table

from jaxgpt.config import load_config  # noqa: E402
from jaxgpt.kernels import choose_kernels  # noqa: E402
from jaxgpt.model.decoder import unstack_blocks  # noqa: E402

COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
PACKAGES = ("orbax-checkpoint", "chex", "torch", "transformers")

# docs/speedrun.md's block on GPT-2 124M, as modded-nanogpt ran it in January 2025 (three value
# tables for 12 layers): what its switches cost a step, beside the default row's GPT-2 layout.
SPEEDRUN_BLOCK = ("model.position=rope", "model.norm=rmsnorm", "model.bias=false", "model.qk_norm=true",
                  "model.feed_forward=relu2", "model.zero_init=true", "model.tie_embeddings=false",
                  "model.embed_norm=true", "model.logit_softcap=15", "model.x0_mix=true",
                  "model.unet_skips=true", "model.value_embeds=3")

# In order of what the run must not miss if the budget runs out.
VARIANTS = (
    Variant("default"),
    Variant("speedrun block", SPEEDRUN_BLOCK),
    # The loop keeps XLA from merging a recomputation with the forward pass: these recompute the
    # float32 intermediates of the norms and activations, as the set does not when unrolled.
    Variant("layers in a loop", scan_unroll=1, recompute=True),
    Variant("speedrun block in a loop", SPEEDRUN_BLOCK, scan_unroll=1, recompute=True),
    Variant("plain head", plain_head=True),
    Variant("triton gemm off", options=(("xla_gpu_enable_triton_gemm", False),)),
    Variant("batch 64", ("train.batch_size=64",)),
    Variant("latency-hiding scheduler", options=(("xla_gpu_enable_latency_hiding_scheduler", True),)),
    Variant("remat", ("model.remat=true",)),
    Variant("portable kernels", portable=True),
    Variant("float32", ("model.dtype=float32",)),
)


def train_variant(base: list[str], variant: Variant, repeats: int, reference: dict | None,
                  profile_dir: Path | None = None) -> list[dict[str, Any]]:
    """The variant's record; with `profile_dir`, then a profile of three more of its steps."""
    cfg = load_config(CONFIG, [*base, *variant.overrides])
    kernels = variant_kernels(choose_kernels(cfg.model), cfg, variant)
    record, _, lowered, call = time_train_step(cfg, kernels, repeats)
    record = {**record, "variant": variant.name, "cudnn_attention": "cudnn$fmha" in lowered.as_text()}
    if reference and reference.get("tokens_per_s"):
        record["vs_torch"] = record["tokens_per_s"] / reference["tokens_per_s"]
    if profile_dir is None:
        return [record]
    with jax.profiler.trace(str(profile_dir), create_perfetto_trace=True):
        jax.block_until_ready([call() for _ in range(3)])
    return [record, {**summarise_trace(profile_dir), "variant": variant.name, "steps": 3}]


def torch_reference(args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, str(ROOT / "scripts/torch_gpt2_ref.py"), "--steps", str(args.torch_steps)]
    if args.smoke:
        command += ["--layers", "2", "--width", "64", "--heads", "4", "--vocab", "256", "--context", "64",
                    "--batch", "4", "--warmup", "1", "--no-compile"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.torch_timeout_s)
    except subprocess.TimeoutExpired:
        return {"mode": "train", "variant": "torch.compile", "error": f"timed out after {args.torch_timeout_s} s"}
    if done.returncode != 0:
        return {"mode": "train", "variant": "torch.compile", "error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def bf16_matmul_weights(params: Any) -> Any:
    """The dense layers' kernels in bfloat16: a bfloat16 model casts them to that at every use."""
    def cast(path, leaf):
        return leaf.astype(jnp.bfloat16) if getattr(path[-1], "key", None) == "kernel" else leaf
    return jax.tree_util.tree_map_with_path(cast, params)


# The GPU sampler's decoding options (`Kernels.decoding`) that docs/performance.md counts in
# launching ops a token, each switched back off: what each is worth in tokens/s.
SAMPLER_WITHOUT = (("sampler without its Pallas cache kernel", {"written_attention": None}),
                   ("sampler with its norms unfolded", {"folded_layer_norm": False}))


@contextlib.contextmanager
def sampler_without(options: dict[str, Any]):
    """`generate`'s sampler with `options` of its kernel set replaced, its programs compiled anew
    (its jitted functions choose their kernels inside, keyed by the config alone)."""
    from jaxgpt.evaluation import generate as sampler

    real = sampler._kernels
    sampler._kernels = lambda cfg, mesh: dataclasses.replace(real(cfg, mesh), **options)
    jax.clear_caches()
    try:
        yield
    finally:
        sampler._kernels = real
        jax.clear_caches()


def decode_records(base: list[str], batches: tuple[int, ...], new_tokens: int, label: str,
                   every_way: bool = True) -> list[dict[str, Any]]:
    """Greedy decoding's tokens/s at each batch size: the params as stored, and (`every_way`) with
    bfloat16 matmul weights, with the layers unrolled, and with the sampler's options of
    `SAMPLER_WITHOUT` switched off. Every way decodes the same prompts."""
    model, params = stored_params(base)
    unrolled = dataclasses.replace(model, scan_layers=False)
    ways = [("as stored", model, params, None), ("bf16 matmul weights", model, bf16_matmul_weights(params), None),
            ("layers unrolled", unrolled, unstack_blocks(params, model), None),
            *((name, model, params, options) for name, options in SAMPLER_WITHOUT)][: None if every_way else 1]
    records = []
    for weights, m, p, options in ways:
        with contextlib.nullcontext() if options is None else sampler_without(options):
            records += chip_decode_records(m, p, batches, new_tokens, f"{label}, {weights}")
    return records


def decode_with_flags(args: argparse.Namespace, flags: str) -> list[dict[str, Any]]:
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
    command = [sys.executable, __file__, "--decode-only", "--label", "command buffers"]
    command += ["--smoke"] if args.smoke else []
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.decode_timeout_s)
    except subprocess.TimeoutExpired:
        return [{"mode": "decode", "variant": "command buffers", "error": f"timed out after {args.decode_timeout_s} s"}]
    if done.returncode != 0:
        return [{"mode": "decode", "variant": "command buffers", "error": done.stderr.strip().splitlines()[-3:]}]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def summarise_trace(trace_dir: Path, top: int = 12) -> dict[str, Any]:
    """Top events by summed duration from `jax.profiler`'s perfetto trace: the GPU's kernels (its
    stream threads) where the trace has a device; else (a CPU) the host's events."""
    paths = sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not paths:
        return {"mode": "profile", "error": f"no perfetto_trace.json.gz under {trace_dir}"}
    events = json.load(gzip.open(paths[-1]))
    events = events["traceEvents"] if isinstance(events, dict) else events
    process, thread = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[e["pid"], e.get("tid")] = e["args"]["name"]
    device = {pid for pid, name in process.items() if name.startswith("/device:")}
    streams = {key for key, name in thread.items() if key[0] in device and "stream" in name.lower()}
    if streams:
        chosen, source = (lambda e: (e["pid"], e.get("tid")) in streams), "device streams"
    else:
        chosen, source = (lambda e: e["pid"] in device) if device else (lambda e: True), "device" if device else "host"
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in events:
        if e.get("ph") == "X" and "dur" in e and chosen(e):
            total[e["name"]] += float(e["dur"])
            count[e["name"]] += 1
    overall = sum(total.values())
    ranked = sorted(total, key=total.get, reverse=True)[:top]
    return {"mode": "profile", "source": source, "total_ms": overall / 1e3,
            "top": [{"name": name[:120], "ms": total[name] / 1e3, "calls": count[name],
                     "share": total[name] / overall if overall else None} for name in ranked]}


def window_parity(T: int = 1024, windows: tuple[int, ...] = (1, 128, 1000)) -> list[dict[str, Any]]:
    """The GPU set's windowed attention (cuDNN's sliding window) against XLA's masked attention:
    max |difference| of the output and of dq, dk, dv, in float32, for random bfloat16 inputs."""
    from jaxgpt.kernels import gpu, xla

    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (2, T, 8, 64), jnp.bfloat16) for key in keys[:3])
    k, v = k[:, :, :2], v[:, :, :2]  # grouped KV heads, as GPT-style models run them
    cotangent = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    records = []
    for window in windows:
        def pulled(attend):
            out, pullback = jax.vjp(attend, q, k, v)
            return (out, *pullback(cotangent))
        got, want = jax.jit(lambda: (pulled(lambda q, k, v: gpu.causal_attention(q, k, v, window=window)),
                                     pulled(lambda q, k, v: xla.attention(q, k, v, window=window))))()
        records.append({"mode": "check", "variant": f"cuDNN window {window} against XLA's", "T": T, **{
            f"max_abs_{name}": float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}})
    return records


def table(records: list[dict[str, Any]]) -> str:
    lines = [chip_table(records, ("vs torch", "vs_torch"))]
    for r in records:
        if r.get("mode") == "profile" and "top" in r:
            lines += ["", f"profile of {r['variant']} ({r['steps']} steps, {r['source']}, {r['total_ms']:,.1f} ms):",
                      "| kernel | ms | calls | share |", "| --- | ---: | ---: | ---: |"]
            lines += [f"| {t['name']} | {t['ms']:,.2f} | {t['calls']} | {(t['share'] or 0) * 100:.1f}% |" for t in r["top"]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_gpu")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, for checking the script on a CPU")
    parser.add_argument("--variants", default=",".join(v.name for v in VARIANTS), help="comma-separated names")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=300.0, help="no new train variant after this")
    parser.add_argument("--torch-steps", type=int, default=20)
    parser.add_argument("--torch-timeout-s", type=float, default=150.0)
    parser.add_argument("--decode-timeout-s", type=float, default=90.0)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--decode-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--label", default="default XLA flags", help=argparse.SUPPRESS)
    args = parser.parse_args()
    base = SMOKE if args.smoke else []
    new_tokens = min(args.new_tokens, 32) if args.smoke else args.new_tokens
    batches = (1, 4) if args.smoke else (1, 64)
    if args.decode_only:
        for record in decode_records(base, batches, new_tokens, args.label, every_way=False):
            print(json.dumps(record), flush=True)
        return

    records = Records(Path(args.out))
    reference = torch_reference(args)  # before JAX allocates the GPU's memory
    records.emit({"mode": "versions", **versions(PACKAGES)})
    records.emit(reference)
    wanted = [v for v in VARIANTS if v.name in args.variants.split(",")]
    for number, variant in enumerate(wanted):
        profile = Path(args.out) / "profile" if number == 0 else None
        records.each("train", variant.name, lambda: train_variant(base, variant, args.repeats, reference, profile),
                     args.budget_s)
    records.each("decode", "default XLA flags", lambda: decode_records(base, batches, new_tokens, "default XLA flags"),
                 float("inf"))
    if jax.default_backend() == "gpu":
        for record in decode_with_flags(args, COMMAND_BUFFERS):
            records.emit(record)
        records.each("check", "cuDNN windows", window_parity, float("inf"))
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, {records.elapsed():.0f} s\n")
    print(table(records.all))


if __name__ == "__main__":
    main()
