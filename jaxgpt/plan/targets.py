"""The accelerators a plan compiles for, by the names users rent them under.

    target("v5e-8")   # Target(platform="tpu", chips=8, hosts=1, device_bytes=16,911,433,728, ...)
    target("h100-16") # two hosts of eight H100s

TPUs by their Cloud TPU names: `v5e-N` and `v6e-N` count chips (1, 4 and 8 on one host, then
4 per host up to 256); `v4-N` and `v5p-N` count TensorCores, two to a chip, which JAX sees as
one device (megacore), 4 chips per host. GPUs as `a100-N`, `h100-N`, `h200-N`: N cards, 8 per
host. Each chip's memory is what its compiler gives a program: for TPUs the HBM libtpu reports
when a program exceeds it, for GPUs the card's memory in its device description (`gpus/`).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from jaxgpt.config import ConfigError
from jaxgpt.errors import nearest

GIB = 2**30


@dataclass(frozen=True)
class TpuGeneration:
    topology: str  # libtpu's name of the generation in a topology ("v5e:2x4")
    device_kind: str  # what JAX calls its devices
    hbm_gib: float  # HBM a program may use per chip, as the TPU compiler states it
    dims: int  # 2-D (v5e, v6e) or 3-D (v4, v5p) torus
    cores_per_chip: int  # the name counts TensorCores (v4-8: 4 chips) or chips (v5e-8: 8 chips)
    single_host_chips: tuple[int, ...]  # slices on one host; larger ones take 4 chips per host
    largest: int  # chips of the largest slice offered here


TPU_GENERATIONS = {
    "v4": TpuGeneration("v4", "TPU v4", 30.75, 3, 2, (4,), 2048),
    "v5p": TpuGeneration("v5", "TPU v5", 95.74, 3, 2, (4,), 2048),
    "v5e": TpuGeneration("v5e", "TPU v5 lite", 15.75, 2, 1, (1, 4, 8), 256),
    "v6e": TpuGeneration("v6e", "TPU v6 lite", 31.25, 2, 1, (1, 4, 8), 256),
}
GPUS_PER_HOST = 8
GPU_MODELS = {"a100": "NVIDIA A100-SXM4-80GB", "h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200"}
LARGEST_GPU_COUNT = 1024


@dataclass(frozen=True)
class Target:
    name: str
    platform: str  # "tpu" | "gpu", as JAX names the backend
    device_kind: str
    chips: int  # devices JAX sees
    hosts: int  # processes that train on it, one per host
    device_bytes: int  # memory a program may use on one chip
    topology: str  # libtpu's "v5e:2x4", or the CUDA topology "slices x hosts x cards"
    chips_per_host: tuple[int, int, int] | None = None  # TPU only
    megacore: bool = False  # TPU only: two TensorCores as one device
    gpu: str | None = None  # GPU only: the file in `gpus/` that describes the card

    @property
    def chips_on_a_host(self) -> int:
        return self.chips // self.hosts

    def gpu_target_config(self) -> str:
        """The card's GpuTargetConfigProto, as text."""
        return _gpu_description(self.gpu)


def _torus(chips: int, dims: int) -> tuple[int, ...]:
    """A slice's chip grid, grown from 1 (2-D) or 2x2x1 (3-D) by doubling one side at a time,
    as Cloud TPU lays its power-of-two slices out (v5e-32 is 4x8, v4-64 is 2x4x4)."""
    if dims == 2:
        shape = [1, 1]
        while shape[0] * shape[1] < chips:
            shape[shape[0] == shape[1]] *= 2  # 1x1, 1x2 -> 2x2, 2x4, 4x4 ...
        return tuple(sorted(shape))
    x, y, z = 2, 2, 1
    while x * y * z < chips:
        if z < x or (x == y == z):
            z *= 2
        elif x == y:
            y *= 2
        else:
            x *= 2
    return x, y, z


def _tpu(name: str, generation: TpuGeneration, count: int) -> Target | None:
    if count % generation.cores_per_chip:
        return None
    chips = count // generation.cores_per_chip
    if chips < 1 or chips & (chips - 1) or chips > generation.largest or (
            generation.dims == 3 and chips < 4):
        return None
    one_host = chips in generation.single_host_chips
    if not one_host and chips < 8:  # a 2-chip v5e, say, is not offered
        return None
    shape = _torus(chips, generation.dims)
    per_host = (*shape, 1)[:3] if one_host else (2, 2, 1)
    hosts = 1 if one_host else chips // 4
    return Target(name=name, platform="tpu", device_kind=generation.device_kind, chips=chips, hosts=hosts,
                  device_bytes=round(generation.hbm_gib * GIB), topology=f"{generation.topology}:"
                  + "x".join(map(str, shape)), chips_per_host=per_host, megacore=generation.cores_per_chip > 1)


def _gpu(name: str, model: str, count: int) -> Target | None:
    if count < 1 or count > LARGEST_GPU_COUNT or (count > GPUS_PER_HOST and count % GPUS_PER_HOST):
        return None
    per_host = min(count, GPUS_PER_HOST)
    hosts = count // per_host
    memory = _device_memory(model)
    return Target(name=name, platform="gpu", device_kind=GPU_MODELS[model], chips=count, hosts=hosts,
                  device_bytes=memory, topology=f"1x{hosts}x{per_host}", gpu=model)


def _gpu_description(model: str) -> str:
    return (resources.files("jaxgpt.plan") / "gpus" / f"{model}.txtpb").read_text()


def _device_memory(model: str) -> int:
    line = next(line for line in _gpu_description(model).splitlines()
                if line.strip().startswith("device_memory_size:"))
    return int(line.split(":", 1)[1])


def _parse(name: str) -> Target | None:
    family, _, count = name.partition("-")
    if not count.isdigit():
        return None
    if family in TPU_GENERATIONS:
        return _tpu(name, TPU_GENERATIONS[family], int(count))
    if family in GPU_MODELS:
        return _gpu(name, family, int(count))
    return None


def known_names() -> list[str]:
    """Every target name, smallest slice first within each family."""
    names = []
    for family, generation in TPU_GENERATIONS.items():
        chips = 1
        while chips <= generation.largest:
            name = f"{family}-{chips * generation.cores_per_chip}"
            if _parse(name) is not None:
                names.append(name)
            chips *= 2
    for family in GPU_MODELS:
        names += [f"{family}-{n}" for n in (1, 2, 4, 8)]
        count = 2 * GPUS_PER_HOST
        while count <= LARGEST_GPU_COUNT:
            names.append(f"{family}-{count}")
            count *= 2
    return names


def target(name: str) -> Target:
    """The target called `name`; an unknown one is a ConfigError naming the nearest known names."""
    found = _parse(name.strip().lower())
    if found is None:
        near = nearest(name.strip().lower(), known_names(), n=3)
        hint = f"; nearest: {', '.join(near)}" if near else ""
        raise ConfigError(f"unknown target {name!r}{hint} (TPUs as v4-8, v5e-1, v5e-8, v5p-8, v6e-4, ...; GPUs as "
                          "a100-N, h100-N, h200-N)")
    return found
