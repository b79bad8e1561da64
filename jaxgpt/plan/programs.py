"""The run's programs compiled from shapes alone, and the memory each needs on one device.

Nothing is allocated or run: the train state, the batch and the params are `ShapeDtypeStruct`s
placed on a mesh, of this machine's devices or of a target's compile-only ones (`jaxgpt.plan`),
and XLA's `memory_analysis()` of each compiled program gives its per-device bytes.

    figures = compile_train(cfg, mesh)   # {"argument_bytes": ..., "temp_bytes": ..., "total_bytes": ...}
    figures = compile_eval(cfg, mesh)    # the sharded eval step
    figures = compile_decode(cfg, mesh)  # the sampler's prefill and decode loop, the larger of the two
    figures = compile_group(cfg, 8, devices)  # a sweep group of 8 members, one vmapped train step

A compiler that refuses a program for memory (the TPU's says RESOURCE_EXHAUSTED when the
temporaries alone exceed the chip) gives `{"refused": its message, "total_bytes": what it said
the program needs, "available_bytes": what it said the chip has}` instead of raising.
"""

from __future__ import annotations

import collections
import functools
import re
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxgpt.config import RunConfig
from jaxgpt.kernels.base import Kernels
from jaxgpt.train import sharding
from jaxgpt.train.optim import OptHParams
from jaxgpt.train.state_layout import leaf_names
from jaxgpt.train.step import TrainState, batch_width
from jaxgpt.train.sweep_mesh import GroupPrograms, group_mesh, layout_for

MEMORY_FIELDS = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "generated_code_bytes": "generated_code_size_in_bytes",
}
# "...required for HLO temporaries (279.40G) exceeds available HBM (15.75G)" and "Used 17.68G of 15.75G hbm"
_TEMPORARIES = (re.compile(r"temporaries \(([\d.]+)([KMGT]?)\)"),)
_USED = (re.compile(r"Used ([\d.]+)([KMGT]?) of"),)
_AVAILABLE = (re.compile(r"available HBM \(([\d.]+)([KMGT]?)\)"), re.compile(r"of ([\d.]+)([KMGT]?) hbm"))
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def memory_figures(compiled: Any) -> dict[str, int | None]:
    """A compiled program's per-device bytes: XLA's `memory_analysis()` fields (None where the
    backend gives none) and `total_bytes` = arguments + outputs - aliased (donated) + temporaries."""
    try:
        memory = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError, AttributeError):
        memory = None
    if isinstance(memory, (list, tuple)):
        memory = memory[0] if memory else None
    figures: dict[str, int | None] = {}
    for key, attribute in MEMORY_FIELDS.items():
        value = getattr(memory, attribute, None) if memory is not None else None
        figures[key] = None if value is None else int(value)
    parts = [figures[k] for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")]
    figures["total_bytes"] = None if None in parts else parts[0] + parts[1] - parts[2] + parts[3]
    return figures


def device_memory_bytes(device: jax.Device) -> int | None:
    """The memory a device gives its programs (an accelerator's HBM); None where it does not say (a CPU)."""
    try:
        stats = device.memory_stats()
    except (NotImplementedError, RuntimeError, AttributeError):
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def compile_lowered(lowered: Any, arguments: Any, compiler_options: dict[str, Any] | None = None,
                    hlo_path: Path | None = None) -> dict[str, Any]:
    """`memory_figures` of `lowered` compiled, with `compile_s`; a refusal for memory is a record
    with `refused` and, where the compiler said it, `total_bytes` = the temporaries it needed plus
    the `arguments`' bytes. `hlo_path`: where to write the compiled program's optimised HLO text."""
    start = time.perf_counter()
    try:
        compiled = lowered.compile(compiler_options=compiler_options)
    except Exception as error:  # XLA's runtime error; only a refusal for memory is ours to report
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        message = str(error).strip().splitlines()[0]
        temp, used = _stated_bytes(message, _TEMPORARIES), _stated_bytes(message, _USED)
        total = used if used is not None else None if temp is None else temp + sharding.bytes_per_device(arguments)
        return {"refused": message, "temp_bytes": temp, "total_bytes": total,
                "available_bytes": _stated_bytes(message, _AVAILABLE)}
    text = program_text(compiled)
    if hlo_path is not None:
        Path(hlo_path).write_text(text, encoding="utf-8")
    return {**memory_figures(compiled), "custom_calls": custom_calls(text),
            "cudnn_attention": cudnn_attention_calls(text), "compile_s": round(time.perf_counter() - start, 3)}


def _stated_bytes(message: str, patterns: tuple[re.Pattern, ...]) -> int | None:
    """Bytes a compiler's message states ("279.40G": GiB, to its two decimals), or None."""
    found = next((m for m in (p.search(message) for p in patterns) if m), None)
    return None if found is None else round(float(found.group(1)) * _UNITS[found.group(2)])


def program_text(compiled: Any) -> str:
    """The optimised HLO text of a compiled program ("" where the backend cannot print it)."""
    try:
        return compiled.as_text() or ""
    except Exception:  # a backend that cannot print its program
        return ""


def custom_calls(text: str) -> list[str]:
    """The custom calls an HLO program makes (a Pallas kernel's `tpu_custom_call`, cuDNN's
    `__cudnn$fmha...`): which hand-written kernels made it into the program."""
    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))


_CUDNN_CALL = re.compile(r'custom_call_target="(__cudnn\$fmha\w*)".*?"sliding_window_length":\s*"?(\d+)')


def cudnn_attention_calls(text: str) -> dict[str, int]:
    """How many of cuDNN's attention calls an HLO program makes, by kind and sliding window:
    "__cudnn$fmhaSoftmax/128" for the forward pass of a block whose queries read their last 128
    keys, ".../0" for a whole-context one. Each call site counts once (a scanned block stack's
    body holds one per kind of block)."""
    calls = collections.Counter(f"{found.group(1)}/{int(found.group(2))}"
                                for found in map(_CUDNN_CALL.search, text.splitlines()) if found)
    return dict(sorted(calls.items()))


def planned_memory(cfg: RunConfig, mesh: Mesh | None) -> dict[str, Any]:
    """Bytes of params and optimiser state per device, from shapes alone (nothing allocated)."""
    state = sharding.state_shapes(cfg) if mesh is None else abstract_state(cfg, mesh)
    return {"mesh": None if mesh is None else {axis: int(size) for axis, size in mesh.shape.items()},
            "params_bytes_per_device": sharding.bytes_per_device(state.params),
            "opt_state_bytes_per_device": sharding.bytes_per_device(state.opt_state)}


def abstract_state(cfg: RunConfig, mesh: Mesh) -> TrainState:
    """The train state as `ShapeDtypeStruct`s in the shardings it trains in on `mesh`."""
    shapes = sharding.state_shapes(cfg)
    return sharding.placed(shapes, sharding.state_shardings(mesh, shapes, mesh.shape["fsdp"]))


def _batch(cfg: RunConfig, mesh: Mesh) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((cfg.train.batch_size, batch_width(cfg)), jnp.int32,
                                sharding=sharding.batch_sharding(mesh))


def _shardings(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda leaf: leaf.sharding, tree)


def _hlo_file(hlo_dir: Path | None, name: str) -> Path | None:
    return None if hlo_dir is None else Path(hlo_dir) / f"{name}.hlo.txt"


def hlo_file_names(programs: Sequence[str], cfg: RunConfig) -> list[str]:
    """The HLO files a plan of `programs` ("train", "eval", "decode") writes to its `hlo_dir`
    (a model whose cache is a ring has no slide)."""
    from jaxgpt.model.cache import ring_cache_length

    names: list[str] = []
    for program in programs:
        sampler = [name for name in DECODE_FILES.values() if name != "slide" or not ring_cache_length(cfg.model)]
        names += sampler if program == "decode" else [program]
    return [f"{name}.hlo.txt" for name in names]


def compile_train(cfg: RunConfig, mesh: Mesh, compiler_options: dict[str, Any] | None = None,
                  kernels: Kernels | None = None, hlo_dir: Path | None = None) -> dict[str, Any]:
    """The sharded train step (its state donated) on `mesh`: `compile_lowered`'s record with the
    mesh and the lowering seconds. `kernels`: by default those chosen for the model; `hlo_dir`: a
    folder to write the compiled program's HLO text to (`train.hlo.txt`)."""
    sharding.check_batch(cfg.train, mesh.shape["data"], mesh.shape["fsdp"])
    state, batch = abstract_state(cfg, mesh), _batch(cfg, mesh)
    start = time.perf_counter()
    lowered = sharding.sharded_train_step(cfg, mesh, _shardings(state), kernels).lower(state, batch)
    lower_s = time.perf_counter() - start
    return {"mesh": {axis: int(size) for axis, size in mesh.shape.items()},
            **compile_lowered(lowered, (state, batch), compiler_options, _hlo_file(hlo_dir, "train")),
            "lower_s": round(lower_s, 3)}


def compile_eval(cfg: RunConfig, mesh: Mesh, hlo_dir: Path | None = None) -> dict[str, Any]:
    """The sharded eval step on `mesh`, at the train batch (as the training loop evaluates);
    `hlo_dir`: where to write its HLO text (`eval.hlo.txt`)."""
    params, batch = abstract_state(cfg, mesh).params, _batch(cfg, mesh)
    lowered = sharding.sharded_eval_step(cfg, mesh, _shardings(params)).lower(params, batch)
    return compile_lowered(lowered, (params, batch), hlo_path=_hlo_file(hlo_dir, "eval"))


# The sampler's programs (`generate.lower_decoding`) by the names their HLO files take.
DECODE_FILES = {"start": "prefill", "advance": "decode", "slide": "slide"}


def compile_decode(cfg: RunConfig, mesh: Mesh, hlo_dir: Path | None = None) -> dict[str, Any]:
    """The sampler's programs (`generate.lower_decoding`: the prefill, the token loop and a row's
    slide, with `jaxgpt generate`'s sampling defaults) for one prompt and the samples the training loop draws
    (`train.sample_tokens`), the params in their training shardings: the figures of the one that
    needs most (its `total_bytes` with `params_held_bytes`: the params as stored, of the leaves
    the sampler casts or transposes, which stay alive beside the converted copies), and the custom calls of them all
    (the prefill's and the slide's attention kernel; on a GPU the loop's Pallas kernel, which reads and
    writes its cache). `hlo_dir`: where to write their HLO text
    (`prefill.hlo.txt`, `decode.hlo.txt`, `slide.hlo.txt`)."""
    from jaxgpt.evaluation.generate import decoding_weights, lower_decoding

    params = abstract_state(cfg, mesh).params
    lowered = lower_decoding(params, cfg.model, max_new_tokens=max(cfg.train.sample_tokens, 1),
                             placed=sharding.replicated(mesh))
    records = {name: compile_lowered(program, params, hlo_path=_hlo_file(hlo_dir, DECODE_FILES[name]))
               for name, program in lowered.items()}
    # The programs take the params as the sampler converts them (cast, transposed: a leaf of
    # another name, or folded with a norm); the params as stored stay alive beside.
    read = dict(leaf_names(decoding_weights(params, cfg.model).params))
    held = sharding.bytes_per_device([leaf for name, leaf in leaf_names(params) if read.get(name) is not leaf])
    for record in records.values():
        if record.get("total_bytes") is not None:
            record.update(params_held_bytes=held, total_bytes=record["total_bytes"] + held)
    worst = max(records, key=lambda name: records[name]["total_bytes"] or 0)
    calls = sorted({call for record in records.values() for call in record.get("custom_calls", [])})
    cudnn = collections.Counter()
    for record in records.values():
        cudnn.update(record.get("cudnn_attention", {}))
    return {"program": worst, **records[worst], "custom_calls": calls, "cudnn_attention": dict(sorted(cudnn.items()))}


def compile_group(cfg: RunConfig, n_members: int, devices: Sequence[jax.Device]) -> dict[str, Any]:
    """The group's train step compiled from shapes on `devices` (this machine's, or a target's
    compile-only ones): its layout and `compile_lowered`'s per-device record."""
    layout = layout_for(cfg, n_members, devices)
    programs = GroupPrograms(cfg, group_mesh(layout, devices), n_members)
    state = sharding.placed(programs.state_shapes, programs.state_shardings)
    batch = jax.ShapeDtypeStruct((n_members, cfg.train.batch_size, batch_width(cfg)), jnp.int32,
                                 sharding=programs.rows)
    scalar = functools.partial(jax.ShapeDtypeStruct, (n_members,), sharding=programs.replicated)
    hparams = OptHParams(*(scalar(jnp.int32 if name == "warmup_steps" else jnp.float32)
                           for name in OptHParams._fields))
    start = time.perf_counter()
    lowered = programs.step.lower(state, batch, hparams, scalar(jnp.int32), {})
    return {"mesh": {"members": layout.members, "data": layout.data}, "devices": layout.devices,
            **compile_lowered(lowered, (state, batch)), "lower_s": round(time.perf_counter() - start, 3)}


def mesh_for(cfg: RunConfig, devices: Sequence[jax.Device]) -> Mesh:
    """The mesh `cfg` trains on over `devices`: all of them in the sharded and pmap modes (pmap's
    per-device memory is data parallelism's), the first alone in the single mode."""
    mode = sharding.resolve_mode(cfg.train, len(devices))
    return sharding.make_mesh(cfg.train, devices if mode != "single" else list(devices)[:1])
