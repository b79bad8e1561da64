"""W&B's offline runs read back from their files, for the tracker tests.

An offline run is a folder `offline-run-TIME-ID` holding `run-ID.wandb`: W&B's record log, after
a 7-byte header (":W&B", a 2-byte magic, a version byte) the LevelDB log layout (32 KiB blocks,
each chunk a 7-byte header: CRC-32, length, type FULL 1 / FIRST 2 / MIDDLE 3 / LAST 4), each whole
record a `Record` protobuf of wandb's own schema.
"""

import json
import struct
from pathlib import Path

BLOCK = 32768
HEADER = 7


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", path
    out, offset, pending = [], HEADER, b""
    while offset + HEADER <= len(data):
        room = BLOCK - offset % BLOCK
        if room < HEADER:  # the block's tail is padding
            offset += room
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + HEADER])
        if length == 0 and kind == 0:
            offset += room
            continue
        chunk = data[offset + HEADER:offset + HEADER + length]
        offset += HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def offline_runs(folder: Path) -> dict[str, list[Path]]:
    """run id -> its offline folders' record files, oldest first (a resumed run adds a folder)."""
    runs: dict[str, list[Path]] = {}
    for path in sorted(Path(folder).glob("offline-run-*/run-*.wandb")):
        runs.setdefault(path.stem[len("run-"):], []).append(path)
    return runs


def read_run(paths: list[Path]) -> dict:
    """One W&B run from its record files: its config, group, history rows {step: {key: value}}, summary."""
    config, history, summary, group = {}, {}, {}, None
    for path in paths:
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                group = record.run.run_group or group
                for item in record.run.config.update:
                    config[item.key] = json.loads(item.value_json)
            elif kind == "config":
                for item in record.config.update:
                    config[item.key] = json.loads(item.value_json)
            elif kind == "history":
                row = {("/".join(item.nested_key) or item.key): json.loads(item.value_json) for item in record.history.item}
                history.setdefault(record.history.step.num, {}).update(
                    {k: v for k, v in row.items() if not k.startswith("_")})
            elif kind == "summary":
                for item in record.summary.update:
                    summary["/".join(item.nested_key) or item.key] = json.loads(item.value_json)
    return {"config": config, "group": group, "history": history, "summary": summary}
