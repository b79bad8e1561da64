"""The seam between the model and the backend: a `Kernels` set, chosen once per config.

    base.py          the Kernels interface: attention, matmuls, the head with its loss
    choose.py        choose_kernels: the set for a config and backend, probed (choose_for: a planned chip's)
    xla.py           the portable set (PORTABLE)
    cpu.py, cpu_attention.py, cpu_matmul.py   the CPU's set
    gpu.py           the GPU's: cuDNN attention
    gpu_decode.py    the GPU sampler's cache write and read in one Pallas kernel
    tpu.py           the TPU's: Pallas splash attention
    head_loss.py     the head fused with its loss, in chunks

Each set's attention lives in its set's module (`Kernels.attention`); `jaxgpt.model.layers` calls
it from `CausalSelfAttention` and its docstring names each one.
"""

from jaxgpt.kernels.base import Kernels
from jaxgpt.kernels.choose import PORTABLE, choose_for, choose_kernels, sampler_usable, usable

__all__ = ["Kernels", "PORTABLE", "choose_for", "choose_kernels", "sampler_usable", "usable"]
