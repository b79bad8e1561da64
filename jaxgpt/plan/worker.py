"""`python -m jaxgpt.plan.worker`: plan one config for one target, in a process that compiles for it.

Reads one JSON request on stdin, {"target": "v5e-1", "plans": [{"config": {...}, "fit": false,
"programs": [...], "headroom": 0.9, "hlo_dir": null}, ...]} (a plan with "members": M is a sweep group's), and writes progress lines ("jaxgpt plan: ...") and
then a JSON list on stdout, one line: each plan's record, or {"error": "..."} where the user
asked for what cannot be planned (a batch the target's chips cannot split, say), or
{"failure": "..."} where the compiler failed (its traceback on stderr). Many configs share one process, one topology and the
compiler's start. `jaxgpt.plan.compilers.run_worker` starts it, with the environment that keeps
JAX on the CPU.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

from jaxgpt.config import build_config
from jaxgpt.errors import UserError
from jaxgpt.plan.targets import Target, target


def target_devices(spec: Target) -> list[Any]:
    """The compile-only devices of `spec`, as its compiler describes them."""
    from jax.experimental import topologies

    if spec.platform == "tpu":
        options = {"chip_config_name": "megacore"} if spec.megacore else {}
        topology = topologies.get_topology_desc(platform="tpu", topology_name=spec.topology,
                                                chips_per_host_bounds=spec.chips_per_host, **options)
    else:
        topology = topologies.get_topology_desc(platform="cuda", target_config=spec.gpu_target_config(),
                                                topology=spec.topology)
    devices = list(topology.devices)
    if len(devices) != spec.chips:
        raise RuntimeError(f"{spec.name}: the compiler made {len(devices)} devices of {spec.topology}, not {spec.chips}")
    return devices


def say(line: str) -> None:
    """A progress line, on stdout before the records: the compilers' C++ logging writes to stderr
    in pieces, and a line of ours there could land inside one of theirs."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def plan_target(spec: Target, devices: list[Any], request: dict[str, Any]) -> dict[str, Any]:
    from jaxgpt.plan.report import HEADROOM, PROGRAMS, plan_group_on, plan_on

    cfg = build_config(request["config"])
    about = {"target": spec.name, "platform": spec.platform, "device_kind": spec.device_kind}
    if "members" in request:  # a sweep group (`jaxgpt sweep --dry-run --target`)
        say(f"jaxgpt plan: {spec.name}, a sweep group of {request['members']} members")
        return {**about, **plan_group_on(cfg, request["members"], devices, spec.device_bytes,
                                         request.get("headroom", HEADROOM))}
    record = plan_on(cfg, devices, spec.device_bytes, fit=request.get("fit", False),
                     programs=request.get("programs", PROGRAMS), headroom=request.get("headroom", HEADROOM),
                     progress=lambda line: say(f"jaxgpt plan: {spec.name}, {line}"), hlo_dir=request.get("hlo_dir"))
    return {**about, "devices": spec.chips, "processes": spec.hosts,
            "rows_per_process": record["batch_size"] // spec.hosts, **record}


def main() -> int:
    from jaxgpt.kernels.choose import choose_for
    from jaxgpt.process import compile_cache

    compile_cache.disable()  # a program compiled for an absent chip can be kept, never loaded
    request = json.loads(sys.stdin.read())
    spec = target(request["target"])
    devices = target_devices(spec)
    choose_for(devices[0])
    records = []
    for one in request["plans"]:
        try:
            records.append(plan_target(spec, devices, one))
        except UserError as error:  # what the user asked for cannot be planned
            records.append({"error": f"{spec.name}: {error}"})
        except Exception as error:  # the compiler failed on a program: said with its traceback, and the next plan goes on
            traceback.print_exc()
            records.append({"failure": f"{spec.name}: {type(error).__name__}: {str(error).strip().splitlines()[0]}"})
    print(json.dumps(records), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
