"""Sweeps on many devices (jaxgpt.train.sweep_mesh): each group's members spread over the devices, the
same results on 1, 2 and 8 devices and as 2 processes × 4 devices through `jaxgpt launch`, a lost
process, a rerun on another device count, and the plan of a sweep (`sweep --dry-run`)."""

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest
from jaxgpt_lines import foreign_lines
from test_launch import _env, _wait_for, kill_process_one
from test_sweep import LR_VARIANT, base_file, sweep_text, write_sweep  # noqa: F401  (base_file: a fixture)

from jaxgpt.cli.main import main
from jaxgpt.tools.sweep import load_sweep, run_sweep
from jaxgpt.train.sweep_mesh import Layout, group_layout

ROOT = Path(__file__).resolve().parents[1]
# Two groups: the baseline with an optimiser variant (4 members), and an architecture variant (2).
VARIANTS = [("baseline", []), ("lr", LR_VARIANT), ("rmsnorm", ["model.norm=rmsnorm"])]
SETS = ["train.batch_size=8"]
RUN_TIMEOUT_S = 600


@pytest.mark.parametrize("members, devices, micro, layout", [
    (8, 8, 32, (8, 1)),  # a member a device
    (24, 8, 4, (8, 1)),  # three members a device
    (3, 8, 32, (1, 8)),  # fewer members than devices: each member's rows over all eight
    (6, 8, 4, (2, 4)),  # members and rows both split
    (3, 8, 4, (3, 2)),  # the most devices the batch allows: six
    (5, 1, 4, (1, 1)),
])
def test_the_layout_uses_the_most_devices_the_members_and_rows_divide_over(members, devices, micro, layout):
    assert group_layout(members, devices, micro) == Layout(*layout)


def _sweep(folder: Path, base: Path):
    return load_sweep(write_sweep(folder, sweep_text(base, 2, *VARIANTS)), overrides=tuple(SETS))


def _by_member(records: list[dict]) -> dict[tuple[str, int], dict]:
    return {(r["variant"], r["seed"]): r for r in records}


@pytest.fixture(scope="module")
def on_devices(base_file, tmp_path_factory):  # noqa: F811
    """The sweep trained on 1, 2 and 8 devices of this process: {count: (records, traces)}."""
    folder = tmp_path_factory.mktemp("sweep-devices")
    sweep = _sweep(folder, base_file)
    found = {}
    for count in (1, 2, 8):
        traces: Counter[str] = Counter()
        records = run_sweep(sweep, folder / f"on-{count}", progress=False, traces=traces,
                            devices=jax.devices()[:count])
        found[count] = (_by_member(records), traces)
    return found


def assert_same_members(records: dict, expected: dict) -> None:
    assert records.keys() == expected.keys()
    for member, record in records.items():
        for key in ("val_loss", "train_loss"):
            np.testing.assert_allclose(record[key], expected[member][key], rtol=1e-4, err_msg=f"{member} {key}")
        np.testing.assert_allclose([e["val_loss"] for e in record["evals"]],
                                   [e["val_loss"] for e in expected[member]["evals"]], rtol=1e-4)


def test_members_train_alike_on_one_two_and_eight_devices(on_devices):
    one, _ = on_devices[1]
    for count in (2, 8):
        records, traces = on_devices[count]
        assert_same_members(records, one)
        assert traces == Counter(train=2, eval=2)  # a compile per group, whatever the devices
    # The first group (4 members, 8 rows): 2 devices, then 4 × 2; the second (2 members): 2, then 2 × 4.
    assert {m: r["devices"] for m, r in on_devices[8][0].items()} == {m: 8 for m in one}
    assert {m: r["devices"] for m, r in on_devices[2][0].items()} == {m: 2 for m in one}
    assert {m: r["devices"] for m, r in one.items()} == {m: 1 for m in one}


def test_a_rerun_on_another_device_count_trains_only_the_missing_members(on_devices, base_file, tmp_path):  # noqa: F811
    records, _ = on_devices[8]
    sweep = _sweep(tmp_path, base_file)
    out = tmp_path / "out"
    out.mkdir()
    kept = [r for r in records.values() if r["variant"] != "rmsnorm"]
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    traces: Counter[str] = Counter()
    rerun = _by_member(run_sweep(sweep, out, progress=False, traces=traces, devices=jax.devices()[:2]))
    assert traces == Counter(train=1, eval=1)  # the rmsnorm group alone
    assert all(rerun[(r["variant"], r["seed"])] == r for r in kept)
    assert [r["devices"] for m, r in rerun.items() if m[0] == "rmsnorm"] == [2, 2]
    assert_same_members(rerun, records)


def _launch_sweep(sweep_file: Path, out: Path, *sets: str) -> list[str]:
    return [sys.executable, "-m", "jaxgpt", "launch", "-n", "2", "--devices-per-process", "4", "--", "sweep",
            str(sweep_file), "--out", str(out), "--no-progress", *[a for s in [*SETS, *sets] for a in ("--set", s)]]


def test_two_processes_of_four_devices_run_one_sweep(on_devices, base_file, tmp_path):  # noqa: F811
    sweep_file = write_sweep(tmp_path, sweep_text(base_file, 2, *VARIANTS))
    out = tmp_path / "out"
    done = subprocess.run(_launch_sweep(sweep_file, out), env=_env(tmp_path / "cache"), capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert foreign_lines(done.stderr) == [], done.stderr[-3000:]
    assert done.stdout.count("| variant") == 1  # one process prints the table
    lines = (out / "results.jsonl").read_text().splitlines()
    records = _by_member([json.loads(line) for line in lines])
    assert len(lines) == len(records) == 6  # one writer: every member once
    assert {r["devices"] for r in records.values()} == {8}
    assert_same_members(records, on_devices[1][0])


def test_a_lost_process_ends_the_sweep_and_keeps_the_finished_groups(base_file, tmp_path):  # noqa: F811
    # The second group trains for long enough to be killed in; the first is in results.jsonl by then.
    variants = [("baseline", ["train.steps=6"]), ("long", ["model.norm=rmsnorm", "train.steps=100000"])]
    sweep_file = write_sweep(tmp_path, sweep_text(base_file, 1, *variants))
    out, log = tmp_path / "out", tmp_path / "launch.log"
    with log.open("w") as err:
        launcher = subprocess.Popen(_launch_sweep(sweep_file, out, "train.eval_every=100000"),
                                    env=_env(tmp_path / "cache"), stdout=subprocess.DEVNULL, stderr=err)
    try:
        _wait_for(lambda: (out / "results.jsonl").is_file(), "the first group's results", launcher)
        time.sleep(1)  # into the second group's training
        code, stopped_s = kill_process_one(log, launcher)
    finally:
        launcher.kill()
    assert "jaxgpt launch: process 1 was lost (killed by SIGKILL)" in log.read_text()
    assert code == 128 + signal.SIGKILL and stopped_s < 60
    [kept] = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert (kept["variant"], kept["devices"]) == ("baseline", 8)


def test_dry_run_lists_the_groups_and_the_devices_each_gets(base_file, tmp_path, capsys):  # noqa: F811
    sweep_file = write_sweep(tmp_path, sweep_text(base_file, 2, *VARIANTS))
    assert main(["sweep", str(sweep_file), "--dry-run", *[a for s in SETS for a in ("--set", s)]]) == 0
    out, err = capsys.readouterr()
    first, second = (json.loads(line) for line in out.splitlines())
    assert first["variants"] == ["baseline", "lr"] and first["members"] == ["baseline/0", "baseline/1", "lr/0", "lr/1"]
    assert (first["devices"], first["mesh"]) == (8, {"members": 4, "data": 2})
    assert (second["variants"], second["devices"], second["mesh"]) == (["rmsnorm"], 8, {"members": 2, "data": 4})
    assert err.splitlines()[0] == "group 1 [baseline, lr] x4: 8 of 8 devices (members 4 x data 2)"
    assert not (tmp_path / "runs").exists() and not Path("runs/sweep-s").exists()  # nothing trained


def test_dry_run_for_a_target_compiles_each_group_for_its_chips(base_file, tmp_path, capsys):  # noqa: F811
    sweep_file = write_sweep(tmp_path, sweep_text(base_file, 2, *VARIANTS))
    sets = [a for s in SETS for a in ("--set", s)]
    assert main(["sweep", str(sweep_file), "--dry-run", "--target", "v5e-8", *sets]) == 0
    out, err = capsys.readouterr()
    first, second = (json.loads(line) for line in out.splitlines())
    for record in (first, second):
        assert record["target"] == "v5e-8" and record["device_kind"] == "TPU v5 lite" and record["fits"] is True
        compiled = record["compiled"]
        assert 0 < compiled["total_bytes"] < compiled["device_bytes"] / 100  # a tiny model on a 16 GB chip
    assert (first["devices"], first["mesh"]) == (8, {"members": 4, "data": 2})
    assert (second["devices"], second["mesh"]) == (8, {"members": 2, "data": 4})
    # A chip holds one member's state in both groups (members spread, not copied): the 4-member
    # group's arguments are about the 2-member group's, not twice them.
    assert first["compiled"]["argument_bytes"] < 1.5 * second["compiled"]["argument_bytes"]
    assert [line.endswith(", fits") for line in err.splitlines() if line.startswith("group ")] == [True, True]
