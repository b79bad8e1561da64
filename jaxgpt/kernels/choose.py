"""The seam between the model and the backend: a `Kernels` set, chosen once per config.

    kernels = choose_kernels(cfg.model)          # where the train step and the generator are built
    logits = forward(params, cfg.model, tokens, kernels=kernels)

`model.kernels = "auto"` picks the set tuned for the backend and compute dtype: the CPU's
(`cpu`: float32 or bfloat16-operand matmuls, blocked and tiled attention), the GPU's (`gpu`:
cuDNN attention) and the TPU's (`tpu`: Pallas splash attention), both with the head fused with
its loss; the portable ones elsewhere. `"xla"` forces the portable ones (`xla`) everywhere. A tuned
set whose kernels fail to compile for the model's shapes is replaced by the portable one, with
one warning line saying why.

A process that compiles for chips it does not have (`jaxgpt.plan`) calls `choose_for(device)`
first: from then on the kernels are chosen for that device's backend, probed by its compiler.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp

from jaxgpt.config import ModelConfig
from jaxgpt.kernels import xla
from jaxgpt.kernels.base import Kernels

__all__ = ["Kernels", "PORTABLE", "choose_for", "choose_kernels", "sampler_usable", "usable"]

PORTABLE = xla.KERNELS
# What a kernel that does not apply raises when traced or compiled.
COMPILE_ERRORS = (RuntimeError, ValueError, NotImplementedError)
log = logging.getLogger("jaxgpt.kernels")


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


# The compile-only device whose backend `choose_kernels` chooses for, where a plan set one.
_target_device: jax.Device | None = None


def choose_for(device: jax.Device | None) -> None:
    """Choose kernels for `device`'s backend (a compile-only device of an accelerator this process
    plans for), the probes compiled for it; None: for this process's own backend again."""
    global _target_device
    _target_device = device


def choose_kernels(model: ModelConfig, backend: str | None = None, *, interpret: bool = False) -> Kernels:
    """The kernels for `model` on `backend` (default: the planned device's, see `choose_for`, else
    JAX's default backend). `interpret`: Pallas kernels in interpret mode, so that the TPU's set
    runs on a CPU (tests, smoke runs)."""
    device = _target_device if backend is None else None
    return _choose(model, backend or (device.platform if device else jax.default_backend()), interpret, device)


@functools.lru_cache(maxsize=None)
def _choose(model: ModelConfig, backend: str, interpret: bool, device: jax.Device | None) -> Kernels:
    if model.kernels == "xla":
        return PORTABLE
    W, every_block = model.attention_window, 0 not in model.block_windows()
    if backend == "cpu":  # plain XLA ops, which XLA CPU always compiles: no probe
        from jaxgpt.kernels import cpu

        kernels = cpu.BF16 if model.dtype == "bfloat16" else cpu.F32
        return cpu.windowed(kernels, W, every_block) if W else kernels
    if backend == "gpu":
        from jaxgpt.kernels import gpu

        return sampler_usable(usable(gpu.windowed(W, every_block) if W else gpu.KERNELS, model, device=device),
                              model, device)
    if backend == "tpu":
        from jaxgpt.kernels import tpu

        # Probed at the whole context: the kernel's blocks follow the sequence length.
        return usable(tpu.kernels(interpret=interpret, window=W, every_block=every_block), model,
                      COMPILE_ERRORS + tpu.LOWERING_ERRORS,
                      probe_length=model.context_length, device=device)
    return PORTABLE


choose_kernels.cache_clear = _choose.cache_clear  # every choice made anew (tests)


def sampler_usable(kernels: Kernels, model: ModelConfig, device: jax.Device | None = None) -> Kernels:
    """`kernels` if the sampler's attention kernel among its `decoding` options (the GPU set's
    Pallas kernel) compiles for the model's heads on `device`; else the set without it (the
    sampler then runs XLA's ops), with one warning line."""
    options = dict(kernels.decoding)
    if options.get("written_attention") is None:
        return kernels
    from jaxgpt.kernels import gpu_decode

    dtype = jnp.bfloat16 if model.dtype == "bfloat16" else jnp.float32
    try:
        gpu_decode.probe(model.n_heads, model.kv_heads, model.head_size, dtype, device)
    except (*COMPILE_ERRORS, AttributeError) as error:  # AttributeError: a Pallas without what the kernel calls
        log.warning("jaxgpt: the %s sampler's attention kernel unavailable (%s); decoding runs XLA's ops",
                    kernels.name, _first_line(error))
        return dataclasses.replace(kernels, decoding=tuple((k, v) for k, v in kernels.decoding if k != "written_attention"))
    return kernels


def usable(kernels: Kernels, model: ModelConfig, errors: tuple[type[BaseException], ...] = COMPILE_ERRORS,
           probe_length: int = 256, device: jax.Device | None = None) -> Kernels:
    """`kernels` if its attention compiles, forward and backward, at the model's head shape
    (one sequence of up to `probe_length` positions; a windowed model's blocks both whole and
    windowed) for `device` (default: this backend's); else the portable kernels, with one warning
    line. `errors`: what compiling raises where the kernel cannot run."""
    dtype = jnp.bfloat16 if model.dtype == "bfloat16" else jnp.float32
    T, H, K, D = min(model.context_length, probe_length), model.n_heads, model.kv_heads, model.head_size
    placed = {} if device is None else {"sharding": jax.sharding.SingleDeviceSharding(device)}
    q = jax.ShapeDtypeStruct((1, T, H, D), dtype, **placed)
    kv = jax.ShapeDtypeStruct((1, T, K, D), dtype, **placed)

    def loss(q, k, v):
        attend = functools.partial(kernels.attention, q, k, v, train=True, remat=model.remat != "none")
        total = attend().astype(jnp.float32).sum()
        if model.attention_window:
            total = total + attend(window=jnp.asarray(model.attention_window, jnp.int32)).astype(jnp.float32).sum()
        return total

    try:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
    except errors as error:
        log.warning("jaxgpt: %s kernels unavailable (%s); using the portable xla kernels",
                    kernels.name, _first_line(error))
        return PORTABLE
    return kernels
