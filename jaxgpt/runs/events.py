"""TensorBoard event files of scalars, written with the standard library alone.

TensorBoard reads `events.out.tfevents.*` files: TFRecords (a little-endian uint64 length, the
masked CRC-32C of those 8 bytes, the payload, the masked CRC-32C of the payload), each payload a
serialized `Event` protobuf. Scalars need three messages, encoded here by hand:

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

Writing these few bytes directly keeps a TensorBoard library (and the PyTorch it probes for) out
of every run's start.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

_CRC32C_POLY = 0x82F63B78  # Castagnoli, reflected


def _crc_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (_CRC32C_POLY if crc & 1 else 0)
        table.append(crc)
    return tuple(table)


_CRC_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: the CRC rotated right by 15 bits plus a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # int64 fields: a negative value is its 10-byte two's complement
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, *, file_version: str | None = None, summary: bytes | None = None) -> bytes:
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3 | 0) + _varint(step)
    if file_version is not None:
        out += _length_delimited(3, file_version.encode())
    if summary is not None:
        out += _length_delimited(5, summary)
    return out


def _scalar_summary(tag: str, value: float) -> bytes:
    value_message = _length_delimited(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value)
    return _length_delimited(1, value_message)


def tfrecord(payload: bytes) -> bytes:
    header = struct.pack("<Q", len(payload))
    return (header + struct.pack("<I", masked_crc32c(header)) + payload
            + struct.pack("<I", masked_crc32c(payload)))


class EventWriter:
    """Appends scalar events to a new event file in `log_dir`; each write reaches the file at once."""

    def __init__(self, log_dir: str | Path) -> None:
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        # The name TensorBoard looks for; the pid keeps two writers started in one second apart.
        self.path = log_dir / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}"
        self._file = self.path.open("ab")
        self._write(_event(now, 0, file_version="brain.Event:2"))

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._write(_event(time.time(), step, summary=_scalar_summary(tag, float(value))))

    def _write(self, event: bytes) -> None:
        if self._file is None:
            raise RuntimeError(f"EventWriter for {self.path} is closed")
        self._file.write(tfrecord(event))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
