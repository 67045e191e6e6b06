"""What the engine's precision means for the forwards that do not go through `engine(...)`, and for the batch every
model is fed: shared by the loop, the utilisation meter, evaluation and the stages' monitors; and `engine.precision:
auto` made concrete for a rank's device (core/launch/precision.py says what each machine gets)."""

from __future__ import annotations

import contextlib

import torch

from core.launch.precision import Machine, PrecisionChoice, choose_precision, cpu_machine, cuda_machine
from core.recipe.config import Config
from data.device import batch_to_device


def device_machine(device: torch.device) -> Machine:
    """The `core.launch.precision.Machine` that `device` is: its GPU (name, compute capability) or this CPU."""
    if device.type == "cuda":
        return cuda_machine(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
    return cpu_machine()


def resolve_precision(cfg: Config, device: torch.device) -> PrecisionChoice:
    """Write the precision this run uses on `device` into `cfg.engine.precision` (`auto` made concrete; an explicit
    one kept), so that everything after reads a concrete "bf16", "fp16" or "fp32".

    Raises:
        ValueError: The recipe asks for bf16 on a GPU without it (the launcher's pre-flight refuses it first).
    """
    choice = choose_precision(cfg.engine.precision, device_machine(device))
    if choice.problem is not None:
        raise ValueError(f"engine.precision: {choice.problem}")
    cfg.engine.precision = choice.precision
    return choice


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
