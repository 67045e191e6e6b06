"""What the engine's precision means for the forwards that do not go through `engine(...)`, and for the batch every
model is fed: shared by the loop, the utilisation meter, evaluation and the stages' monitors."""

from __future__ import annotations

import contextlib

import torch

from data.device import batch_to_device


def autocast_context(precision: str, device: torch.device):
    """bf16 autocast for forwards that do not go through `engine(...)` (which enters its own, see setup.py): the kNN
    monitor's encoder, the pictures, the FLOP count."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_device(batch: dict, device: torch.device, precision: str) -> dict:
    """The model's input: the batch copied, its uint8 images normalised, erased and mixed on `device` in float32
    (`data.device.batch_to_device`, shared by every path that feeds a model), then cast to half under fp16."""
    out = batch_to_device(batch, device)
    if precision == "fp16":
        out = {k: v.half() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in out.items()}
    return out
