"""TPU memory from libtpu's own figures (the `targets` extra): each generation's HBM as its
compiler states it, the largest batch a chip takes, and plans side by side."""

import pytest
from plan_models import GIB, LAYERS, tiny

from jaxgpt import plan as planning
from jaxgpt.config import load_config
from jaxgpt.plan import targets


def beyond_the_chip(chips: int):
    """A tiny model at a batch whose activations are many times any chip's memory."""
    return tiny("model.context_length=1024", "model.d_model=64", f"train.batch_size={2**15 * chips}")


@pytest.mark.parametrize("name", ["v4-8", "v5p-8", "v6e-1"])
def test_each_tpu_generation_holds_what_its_compiler_says(name):
    spec = targets.target(name)
    [record] = planning.plans([beyond_the_chip(spec.chips)], name, programs=("train",))
    assert record["device_kind"] == spec.device_kind and record["devices"] == spec.chips
    assert abs(record["compiled"]["available_bytes"] - spec.device_bytes) < 0.01 * GIB  # two decimals


def test_the_largest_batch_for_a_tpu_fits_and_twice_it_does_not():
    """Below a small share of the chip (`headroom`), so that the batches stay small and quick to compile."""
    headroom = 0.004  # 68 MB of the v5e's 15.75 GiB
    batch, record = planning.largest_fitting_batch(load_config(None, LAYERS), "v5e-1", headroom=headroom)
    assert batch == record["largest_batch"] == record["batch_size"] and record["fits"] is True
    assert record["peak_bytes"] <= headroom * record["compiled"]["device_bytes"]
    [twice] = planning.plans([load_config(None, [*LAYERS, f"train.batch_size={2 * batch}"])], "v5e-1",
                             headroom=headroom, programs=("train",))
    assert twice["fits"] is False


def test_plans_for_tpus_run_side_by_side():
    """libtpu locks a host's chips for one process; a plan opens none, so several run at once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        records = list(pool.map(lambda name: planning.plans([tiny()], name, programs=("train",))[0],
                                ["v5e-1", "v6e-1"]))
    assert [r["device_kind"] for r in records] == ["TPU v5 lite", "TPU v6 lite"]
