"""Disk space for a run's checkpoints: how much one takes, how many are on disk at once, what is free.

A checkpoint holds the objective's state dict (fp32 weights, plus buffers, frozen parts such as a BEiT tokenizer and
the EMA of the weights when there is one) and the optimizer state of its trained parameters: an fp32 master copy and
AdamW's two moments (12 bytes per parameter; SGD and LARS keep one momentum: 8). That is an upper estimate: ZeRO-0
without fp16 keeps no master copy, and an fp16 run saves 2-byte weights. Saving writes the new checkpoint before the
oldest of the `checkpoint.keep_last` is removed, so `keep_last + 1` are on disk at the peak.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from torch import nn

OPTIMIZER_BYTES = {"adamw": 12, "sgd": 8, "lars": 8}
"""Optimizer state per trained parameter: the fp32 master copy and the moments (two for AdamW, one for momentum)."""


def checkpoint_bytes(module: nn.Module, optimizer: str) -> int:
    """About how many bytes one checkpoint of `module` (built on any device, the meta device included) takes.

    Args:
        module: What the engine wraps and saves: the objective (with its EMA, if any).
        optimizer: `optim.kind`.
    """
    weights = sum(t.numel() * max(t.element_size(), 4 if t.is_floating_point() else 0) for t in _tensors(module))
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return weights + trained * OPTIMIZER_BYTES[optimizer]


def _tensors(module: nn.Module):
    """Every tensor of the state dict once (tied weights counted once)."""
    seen = set()
    for tensor in module.state_dict(keep_vars=True).values():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor


def folder_bytes(path: Path) -> int:
    """Bytes of the files under `path` (a checkpoint's tag folder)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def free_bytes(path: str | Path) -> tuple[int, Path]:
    """Free bytes on the filesystem that holds `path`, or would hold it: measured at its nearest existing parent,
    which is returned with them."""
    path = Path(path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    return shutil.disk_usage(existing).free, existing


def describe_bytes(num: float) -> str:
    """'1.5 GB', '340 MB', '12 kB' (powers of 1000, as `df -H`)."""
    if num < 1000:
        return f"{num:.0f} B"
    for unit in ("kB", "MB", "GB"):
        num /= 1000
        if num < 1000:
            return f"{num:.1f} {unit}"
    return f"{num / 1000:.1f} TB"
