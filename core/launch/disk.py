"""Disk space for a run's checkpoints: how much one takes, how many are on disk at once, what is free.

A checkpoint holds the objective's state dict (fp32 weights, plus buffers, frozen parts such as a BEiT tokenizer and
the EMA of the weights when there is one) and the optimizer state of its trained parameters: an fp32 master copy and
AdamW's two moments (12 bytes per parameter; SGD and LARS keep one momentum: 8). That is an upper estimate: ZeRO-0
without fp16 keeps no master copy, and an fp16 run saves 2-byte weights. Saving writes the new checkpoint before the
oldest of the `checkpoint.keep_last` is removed, so `keep_last + 1` are on disk at the peak.

Rank 0 checks the room before its engine is built (`checkpoint_room`, core/engine/run.py `check_room`), with the
objective in hand: launch.sh's check would have to import torch and timm to build one (seconds).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from core.launch.rundir import resumed_checkpoint
from core.recipe.config import Config

if TYPE_CHECKING:
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


def checkpoint_room(cfg: Config, objective: Callable[[], nn.Module]) -> tuple[str | None, str]:
    """Whether the filesystem of `run_dir` has room for `checkpoint.keep_last + 1` checkpoints (the peak while
    saving) less those already there. One checkpoint's size is that of the one a resume loads, else the estimate from
    the module `objective()` returns (called only then; it may build one on the meta device).

    Returns:
        (the problem in one line, or None; what was found, for the log).
    """
    ckpt_dir = Path(cfg.run_dir) / "checkpoints"
    saved = [p for p in ckpt_dir.glob("step_*") if p.is_dir()] if ckpt_dir.is_dir() else []
    resumed = resumed_checkpoint(cfg.run_dir)
    if resumed is not None and (ckpt_dir / resumed.tag).is_dir():
        size, how = folder_bytes(ckpt_dir / resumed.tag), f"as checkpoints/{resumed.tag}"
    else:
        module = objective()
        size = checkpoint_bytes(module, cfg.optim.kind)
        how = f"estimated from {sum(p.numel() for p in module.parameters()):,} parameters"
    count = max(1, cfg.checkpoint.keep_last + 1 - len(saved))
    free, where = free_bytes(cfg.run_dir)
    needed = f"{count} checkpoint{'s' if count > 1 else ''} of about {describe_bytes(size)} each ({how})"
    if free < count * size:
        return (
            f"{cfg.run_dir}: {describe_bytes(free)} free on the filesystem of {where}, the run needs room for "
            f"{needed}: checkpoint.keep_last {cfg.checkpoint.keep_last} + 1 while saving; free space or set run_dir "
            "elsewhere"
        ), ""
    return None, f"run_dir: {describe_bytes(free)} free for {needed}"
