"""Plans for TPUs, compiled by libtpu (the `targets` extra) on this CPU: the TPU kernels through
Mosaic for every shape, a batch beyond the chip, the largest batch a chip takes, FSDP and slices
of many hosts (each generation's memory: test_plan_tpu_memory.py). The compiles for one target
share one compile process (`plans(each=...)`): starting libtpu costs about 9 s of CPU."""

import itertools

import pytest
from plan_models import LAYERS, SPEEDRUN_BLOCK, WINDOWED, attention, tiny

from jaxgpt import plan as planning
from jaxgpt.config import load_config
from jaxgpt.plan import targets

# A pairwise covering array of the TPU set's shapes: every value of every pair of the four
# factors (attention kind, length, head size, dtype) meets in some row.
MOSAIC_ROWS = [("mha", 128, 64, "float32"), ("mha", 200, 64, "float32"), ("mha", 1024, 128, "bfloat16"),
               ("gqa", 128, 64, "float32"), ("gqa", 200, 64, "bfloat16"), ("gqa", 1024, 128, "bfloat16"),
               ("mqa", 128, 128, "bfloat16"), ("mqa", 200, 128, "float32"), ("mqa", 1024, 64, "float32")]


def test_the_mosaic_rows_cover_every_pair():
    factors = [sorted({row[i] for row in MOSAIC_ROWS}, key=str) for i in range(4)]
    assert [len(f) for f in factors] == [3, 3, 2, 2]
    for a, b in itertools.combinations(range(4), 2):
        assert {(r[a], r[b]) for r in MOSAIC_ROWS} == set(itertools.product(factors[a], factors[b]))


def beyond_the_chip(chips: int):
    """A tiny model at a batch whose activations are many times any chip's memory."""
    return tiny("model.context_length=1024", "model.d_model=64", f"train.batch_size={2**15 * chips}")


# Long-short windows over packed documents: splash's local mask with segment ids, and its causal mask.
WINDOWED_DOCUMENTS = attention("gqa", 512, 64, "bfloat16", *WINDOWED, "data.document_mask=true")
EVERY_PROGRAM = [attention("mha", 256, 64, "bfloat16"), SPEEDRUN_BLOCK, WINDOWED_DOCUMENTS]
FIT_HEADROOM = 0.004  # 68 MB of the v5e's 15.75 GiB: the batches stay small and quick to compile


@pytest.fixture(scope="module")
def v5e_1():
    """One compile process for one TPU v5e chip: every program (train, eval, the sampler) of a
    plain model, the speedrun block under muP and a long-short windowed model over packed
    documents, first, at lengths no probe compiled before; then the Mosaic rows' train steps, a
    batch far beyond the chip (with its sampler), and the search for the largest batch of a
    4-layer model."""
    train = {"programs": ("train",)}
    cfgs = [*EVERY_PROGRAM, *(attention(*row) for row in MOSAIC_ROWS), beyond_the_chip(1), load_config(None, LAYERS)]
    each = [{}] * len(EVERY_PROGRAM) + [train] * len(MOSAIC_ROWS) + [{"programs": ("train", "decode")}] + [
        {**train, "fit": True, "headroom": FIT_HEADROOM}]
    records = planning.plans(cfgs, "v5e-1", each=each)
    every = len(EVERY_PROGRAM)
    return {"every_program": records[:every], "mosaic": records[every:-2], "beyond": records[-2], "fit": records[-1]}


def test_the_tpu_set_compiles_through_mosaic_for_every_shape_without_falling_back(v5e_1):
    for row, record in zip(MOSAIC_ROWS, v5e_1["mosaic"], strict=True):
        assert record["kernels"] == "tpu", row  # the probe compiled splash attention: no fallback
        assert "tpu_custom_call" in record["compiled"]["custom_calls"], row  # ... and the step runs it
        assert record["fits"] is True and record["device_kind"] == "TPU v5 lite"


def test_a_program_the_compiler_refuses_for_memory_does_not_fit_and_says_what_it_needs(v5e_1):
    record = v5e_1["beyond"]
    compiled = record["compiled"]
    assert "RESOURCE_EXHAUSTED" in compiled["refused"] and record["fits"] is False
    # Its params and sampler fit where training does not: what generate and eval need.
    assert record["sampler_fits"] is True and compiled["decode"]["total_bytes"] <= 0.9 * compiled["available_bytes"]
    assert compiled["total_bytes"] > compiled["temp_bytes"] > targets.target("v5e-1").device_bytes
    # What the compiler says the chip holds is the catalogue's figure.
    assert compiled["available_bytes"] == targets.target("v5e-1").device_bytes


def test_the_largest_batch_for_a_tpu_fits_and_one_row_more_does_not(v5e_1):
    """The search's own compile of the next batch up shows the batch it found is the largest."""
    record = v5e_1["fit"]
    batch, limit = record["largest_batch"], FIT_HEADROOM * record["compiled"]["device_bytes"]
    assert batch == record["batch_size"] and record["fits"] is True
    assert record["peak_bytes"] <= limit and "eval" not in record["compiled"]  # the train step alone
    searched = dict(record["searched"])
    assert searched[batch] == record["peak_bytes"]
    assert searched[batch + 1] is None or searched[batch + 1] > limit


@pytest.fixture(scope="module")
def v5e_4():
    """One compile process for four v5e chips: a model's train step laid out over the data, and
    every program of it laid out over FSDP."""
    return planning.plans([attention("mha", 256, 64, "bfloat16", "train.batch_size=8"),
                           attention("mha", 256, 64, "bfloat16", "train.batch_size=8", "train.fsdp=4",
                                     "model.n_layers=2")], "v5e-4",
                          each=[{"programs": ("train",)}, {}])


def test_fsdp_over_four_v5e_chips_runs_splash_attention_per_device_and_splits_the_state(v5e_4):
    full, split = v5e_4
    assert split["kernels"] == "tpu" and "tpu_custom_call" in split["compiled"]["custom_calls"]
    assert split["mesh"] == {"data": 1, "fsdp": 4} and full["mesh"] == {"data": 4, "fsdp": 1}
    assert split["opt_state_bytes_per_device"] < full["opt_state_bytes_per_device"] / 2
    assert split["mode"] == "sharded" and split["rows_per_process"] == 8


def test_a_slice_of_many_hosts_says_its_processes_and_the_rows_each_reads():
    [record] = planning.plans([tiny("train.batch_size=64", "train.fsdp=4")], "v5e-16", programs=("train",))
    assert (record["devices"], record["processes"], record["rows_per_process"]) == (16, 4, 16)
    assert record["mesh"] == {"data": 4, "fsdp": 4} and record["fits"] is True


def test_every_program_dry_run_compiles_builds_the_splash_kernel_in_the_trace_that_asks(v5e_1):
    # Train, eval and the sampler in one process at a length no probe compiles first: the
    # sampler's window pass takes splash attention after the train step's gradient did.
    record = v5e_1["every_program"][0]
    assert "failure" not in record, record.get("failure")
    assert {"eval", "decode"} <= set(record["compiled"]) and record["kernels"] == "tpu"
    assert "tpu_custom_call" in record["compiled"]["eval"]["custom_calls"]


@pytest.mark.parametrize("which", [1, 2], ids=["speedrun block", "long-short windows over documents"])
def test_the_speedrun_models_compile_every_program_with_splash_attention(v5e_1, which):
    record = v5e_1["every_program"][which]
    assert "failure" not in record, record.get("failure")
    assert record["kernels"] == "tpu" and record["fits"] is True
    for program in (record["compiled"], record["compiled"]["eval"], record["compiled"]["decode"]):
        assert "tpu_custom_call" in program["custom_calls"]


def test_the_sampler_on_four_chips_runs_splash_attention_on_every_chip_over_all_its_rows(v5e_4):
    # 256 positions: the sampler's window pass (128, a slide) takes splash attention, which XLA's
    # partitioner cannot split over the FSDP-sharded parameters' mesh. Two layers: the pass keeps
    # the cache alone, so a layer's attention runs only where the next layer's keys read it.
    record = v5e_4[1]
    assert "failure" not in record, record.get("failure")
    assert "tpu_custom_call" in record["compiled"]["decode"]["custom_calls"] and record["kernels"] == "tpu"
