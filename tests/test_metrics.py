import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboardX.crc32c import crc32c as reference_crc32c
from tensorboardX.proto import event_pb2

from jaxgpt.config import ModelConfig
from jaxgpt.model.flops import flops_per_token, mfu
from jaxgpt.runs.events import EventWriter, masked_crc32c
from jaxgpt.runs.metrics import MetricsWriter, Throughput, plot_losses, read_metrics

RECORDS = [
    {"type": "train", "step": 10, "loss": 5.5, "lr": 1e-3},
    {"type": "train", "step": 20, "loss": 4.25, "lr": 2e-3},
    {"type": "eval", "step": 20, "val_loss": 4.5, "val_perplexity": 90.0},
    {"type": "sample", "step": 20, "text": "once upon"},
]


def test_jsonl_round_trip(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path) as writer:
        for record in RECORDS:
            writer.write(record)
        # Before close: each line already flushed, so a crash here would lose nothing.
        assert read_metrics(tmp_path / "metrics.jsonl") == RECORDS
    assert read_metrics(tmp_path / "metrics.jsonl") == RECORDS


def test_numpy_scalars_are_written_as_numbers(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path) as writer:
        writer.write({"type": "train", "step": np.int64(3), "loss": np.float32(2.5)})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"type": "train", "step": 3, "loss": 2.5}]


def test_truncated_last_line_is_skipped_and_repaired_on_reopen(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps(r) for r in RECORDS[:2]]
    path.write_text("\n".join(lines) + '\n{"type": "train", "st')  # crash mid-write
    assert read_metrics(path) == RECORDS[:2]
    with MetricsWriter(tmp_path) as writer:  # a resumed run appends
        writer.write(RECORDS[2])
    assert read_metrics(path) == RECORDS[:3]


def test_corrupt_line_in_the_middle_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n{oops\n" + json.dumps(RECORDS[1]) + "\n")
    with pytest.raises(ValueError, match=":2:"):
        read_metrics(path)


@pytest.mark.parametrize("bad", [{"step": 1}, {"type": "train"}, {"type": "bogus", "step": 1},
                                 {"type": "train", "step": 1.5}])
def test_invalid_records_are_rejected(tmp_path: Path, bad: dict) -> None:
    with MetricsWriter(tmp_path) as writer, pytest.raises(ValueError):
        writer.write(bad)


def reference_masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC-32C, from tensorboardX's own CRC implementation."""
    crc = reference_crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_scalars(event_dir: Path) -> dict[tuple[str, int], float]:
    """Parse TFRecord-framed Event protos (u64 length, u32 crc, payload, u32 crc), checking both CRCs."""
    scalars = {}
    for path in event_dir.glob("events.out.tfevents.*"):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            header, (header_crc,) = data[offset:offset + 8], struct.unpack("<I", data[offset + 8:offset + 12])
            (length,) = struct.unpack("<Q", header)
            payload = data[offset + 12:offset + 12 + length]
            (payload_crc,) = struct.unpack("<I", data[offset + 12 + length:offset + 16 + length])
            assert (header_crc, payload_crc) == (reference_masked_crc(header), reference_masked_crc(payload))
            event = event_pb2.Event.FromString(payload)
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars[value.tag, event.step] = value.simple_value
    return scalars


def test_tensorboard_scalars_under_type_and_key(tmp_path: Path) -> None:
    with MetricsWriter(tmp_path) as writer:
        for record in RECORDS:
            writer.write(record)
    scalars = read_scalars(tmp_path / "tensorboard")
    assert scalars == {
        ("train/loss", 10): 5.5, ("train/lr", 10): pytest.approx(1e-3),
        ("train/loss", 20): 4.25, ("train/lr", 20): pytest.approx(2e-3),
        ("eval/val_loss", 20): 4.5, ("eval/val_perplexity", 20): 90.0,
    }


def test_event_file_starts_with_the_version_event_and_keeps_large_steps(tmp_path: Path) -> None:
    writer = EventWriter(tmp_path)
    writer.scalar("train/loss", np.float32(0.25), 2**40 + 3)
    writer.close()
    assert read_scalars(tmp_path) == {("train/loss", 2**40 + 3): 0.25}
    first_length = struct.unpack("<Q", writer.path.read_bytes()[:8])[0]
    first = event_pb2.Event.FromString(writer.path.read_bytes()[12:12 + first_length])
    assert first.file_version == "brain.Event:2"


@pytest.mark.parametrize("data", [b"", b"a", b"123456789", bytes(range(256)) * 3])
def test_masked_crc_matches_tensorboardx(data: bytes) -> None:
    assert masked_crc32c(data) == reference_masked_crc(data)


def test_writing_metrics_imports_no_tensorboard_library_or_torch(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from jaxgpt.runs.metrics import MetricsWriter\n"
        f"with MetricsWriter({str(tmp_path)!r}) as w:\n"
        "    w.write({'type': 'train', 'step': 1, 'loss': 2.0})\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorboardX', 'tensorboard')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
    assert read_scalars(tmp_path / "tensorboard") == {("train/loss", 1): 2.0}


def test_disabled_writer_writes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with MetricsWriter(run_dir, enabled=False) as writer:
        writer.write(RECORDS[0])
    assert not run_dir.exists()


def test_a_writer_without_jsonl_feeds_its_trackers_alone(tmp_path: Path) -> None:
    """A sweep member's writer: its records reach the trackers, no metrics.jsonl is written, and
    a closed writer still refuses a record."""
    class Kept:
        def __init__(self) -> None:
            self.records, self.closed = [], False

        def write(self, record: dict) -> None:
            self.records.append(record)

        def close(self) -> None:
            self.closed = True

    kept = Kept()
    with MetricsWriter(tmp_path / "member", trackers=[kept], jsonl=False) as writer:
        for record in RECORDS:
            writer.write(record)
    assert kept.records == RECORDS and kept.closed
    assert not (tmp_path / "member" / "metrics.jsonl").exists()
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(RECORDS[0])


def test_plot_losses_writes_png(tmp_path: Path) -> None:
    run_dir = tmp_path / "my-run"
    with MetricsWriter(run_dir) as writer:
        for record in RECORDS:
            writer.write(record)
    out = run_dir / "loss.png"
    plot_losses(run_dir / "metrics.jsonl", out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 1000
    assert [p.name for p in run_dir.iterdir() if p.name.startswith(".")] == []  # no temp left


def test_flops_per_token_day1() -> None:
    # Day 1: V=1024, C=128, L=2, H=K=4, D=32, F=512, T=128.
    # attention per layer: qkv 128*(4+2*4)*32 = 49,152 + out 128*128 = 16,384 -> 65,536
    # gelu MLP per layer: 2*128*512 = 131,072;  per layer 196,608;  two layers 393,216
    # head: 1024*128 = 131,072;  N = 524,288;  6N = 3,145,728
    # attention scores: 12*L*C*T = 12*2*128*128 = 393,216;  total 3,538,944
    day1 = ModelConfig(vocab_size=1024, d_model=128, n_layers=2, n_heads=4, hidden_size=512,
                       context_length=128)
    assert flops_per_token(day1) == 3_538_944
    assert flops_per_token(day1, seq_len=64) == 3_538_944 - 12 * 2 * 128 * 64


def test_flops_per_token_gqa_swiglu() -> None:
    # C=64, H=8 (D=8), K=2, F=96, L=1, V=100, T=16:
    # qkv 64*(8+4)*8 = 6,144; out 64*64 = 4,096; swiglu 3*64*96 = 18,432; head 6,400
    # N = 35,072; 6N = 210,432; 12*1*64*16 = 12,288; total 222,720
    cfg = ModelConfig(vocab_size=100, context_length=16, d_model=64, n_layers=1, n_heads=8,
                      kv_heads=2, hidden_size=96, feed_forward="swiglu")
    assert flops_per_token(cfg) == 222_720


def test_mfu() -> None:
    assert mfu(1000.0, 3e6, 1e12) == pytest.approx(3e-3)
    with pytest.raises(ValueError):
        mfu(1000.0, 3e6, 0.0)


def test_throughput_uses_only_the_window() -> None:
    now = [0.0]
    meter = Throughput(window=2, clock=lambda: now[0])
    assert meter.tokens_per_s is None
    for elapsed in (10.0, 1.0, 1.0):  # a slow first step (compilation), then two fast ones
        now[0] += elapsed
        rate = meter.update(100)
    assert rate == pytest.approx(200 / 2.0)  # the slow step has left the window
    meter.reset()
    assert meter.tokens_per_s is None
