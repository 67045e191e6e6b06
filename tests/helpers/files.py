"""Bit rot on purpose: damaged checkpoint files for the tests of what reads them back."""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path


def flip_a_bit(path: Path, at: int) -> None:
    """Bit rot: one bit of byte `at` of `path` flipped; the size stays."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def rot_a_tensor(path: Path) -> None:
    """Bit rot in the bytes of the first tensor `torch.save` wrote to `path` (a zip archive, one record per tensor)."""
    with zipfile.ZipFile(path) as archive:
        record = next(info for info in archive.infolist() if "/data/" in info.filename)
    with open(path, "rb") as f:
        f.seek(record.header_offset)
        header = f.read(30)  # a zip local file header, then the name and the extra field, then the data
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    flip_a_bit(path, record.header_offset + 30 + name_len + extra_len + record.file_size // 2)
