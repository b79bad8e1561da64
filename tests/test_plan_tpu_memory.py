"""TPU memory from libtpu's own figures (the `targets` extra): each generation's HBM as its
compiler states it, planned side by side (the largest batch a chip takes: test_plan_tpu.py)."""

from concurrent.futures import ThreadPoolExecutor

from plan_models import GIB, tiny

from jaxgpt import plan as planning
from jaxgpt.plan import targets


def beyond_the_chip(chips: int):
    """A tiny model at a batch whose activations are many times any chip's memory."""
    return tiny("model.context_length=1024", "model.d_model=64", f"train.batch_size={2**15 * chips}")


def test_each_tpu_generation_holds_what_its_compiler_says_planned_side_by_side():
    """libtpu locks a host's chips for one process; a plan opens none, so the three generations'
    compile processes run at once."""
    names = ["v4-8", "v5p-8", "v6e-1"]

    def refused(name):
        [record] = planning.plans([beyond_the_chip(targets.target(name).chips)], name, programs=("train",))
        return record

    with ThreadPoolExecutor(len(names)) as pool:
        records = list(pool.map(refused, names))
    for name, record in zip(names, records):
        spec = targets.target(name)
        assert record["device_kind"] == spec.device_kind and record["devices"] == spec.chips
        assert abs(record["compiled"]["available_bytes"] - spec.device_bytes) < 0.01 * GIB  # two decimals
    assert [r["device_kind"] for r in records] == ["TPU v4", "TPU v5", "TPU v6 lite"]
