"""Reading back what an offline W&B run wrote: wandb 0.31 keeps a run's records only in its `run-<id>.wandb` file
(no wandb-summary.json or history file offline), a LevelDB-style log of protobuf `Record`s: a 7-byte header
(":W&B", a magic number, a version), then 32 KiB blocks of chunks, each with a 7-byte header (CRC-32, length, type:
1 a whole record, 2 / 3 / 4 its first / middle / last part); a block's tail shorter than a header is padding."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import wandb
from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = struct.Struct("<IHB")  # CRC-32, length, chunk type
FULL, FIRST, LAST = 1, 2, 4


def records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    """Every record of one `.wandb` file, in the order written."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    pos, parts = 7, b""
    while pos + HEADER.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER.size:  # padding up to the next block
            pos += left
            continue
        _, length, kind = HEADER.unpack_from(data, pos)
        parts += data[pos + HEADER.size : pos + HEADER.size + length]
        pos += HEADER.size + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record
            parts = b""


def offline_runs(wandb_dir: Path) -> list[Path]:
    """The `.wandb` files of the offline runs under `wandb_dir` (a run's `dir`), one per launch, oldest first.

    W&B's service process of this process writes a file's last records after the run's `finish()` has returned; it
    is shut down first (`wandb.teardown`, which waits for it) so that the files are whole.
    """
    wandb.teardown()
    return sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"), key=lambda path: path.stat().st_mtime)


def history(path: Path) -> dict[int, dict]:
    """One `.wandb` file's history rows by step: {step: {key: value}} (W&B's own `_step`, `_runtime` and
    `_timestamp` left out; a media value as W&B's JSON description of it)."""
    rows = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}
            rows[record.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
    return rows


def run_ids(path: Path) -> set[str]:
    """The run ids named by one `.wandb` file's run records."""
    return {r.run.run_id for r in records(path) if r.WhichOneof("record_type") == "run"}
