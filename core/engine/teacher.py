"""The EMA teacher inside the DeepSpeed engine (pretrain/teacher.py is the module): moved towards the student after
each applied optimizer step, at every ZeRO stage, without a copy of the optimizer's state.

- ZeRO-0/1/2: every rank holds the whole student (DeepSpeed writes the updated weights back into the module after
  each step) and the whole teacher, in fp32; every rank makes the same update, so the teachers stay equal.
- ZeRO-3: the teacher is partitioned like the student (both are built inside `deepspeed.zero.Init`), the same
  parameter split the same way, so each rank lerps its own partition of the teacher towards its own partition of
  the student: no rank holds a full teacher, and nothing is communicated. A small parameter ZeRO-3 keeps gathered
  (below `stage3_param_persistence_threshold`) is lerped in its gathered form too, so the next forward sees the
  update.

The decay is a function of the step (`objective.ema`), so a checkpoint needs no more than the teacher's weights:
DeepSpeed saves them as frozen parameters (the module state at ZeRO-0/1, the frozen fragments at ZeRO-2/3, each
rank's partition at ZeRO-3) and restores them on resume with the same world size. A universal checkpoint (a resume
at another world size) restores only what the optimizer owns; `restore_frozen` reads the teacher back from the
original checkpoint's model files.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from core.compat.deepspeed import is_released, is_zero3_param
from core.engine.gather import saved_frozen


def has_teacher(objective: nn.Module) -> bool:
    """Whether `objective` carries an EMA teacher (`teacher` with `pairs` and `decay_at`)."""
    return hasattr(getattr(objective, "teacher", None), "pairs")


@torch.no_grad()
def follow_student(objective: nn.Module, weight: float | torch.Tensor) -> None:
    """teacher += weight * (student - teacher) for every parameter, on this rank's partition under ZeRO-3.

    Args:
        objective: The engine's module, with `teacher` (pretrain/teacher.py) and `encoder` (the student).
        weight: 1 - decay, scaled by whether the step's update was applied (a 0-d device tensor: no host sync);
            1.0 copies the student.
    """
    teacher, student = [], []
    for t, s in objective.teacher.pairs(objective.encoder):
        if is_zero3_param(t):
            teacher.append(t.ds_tensor)
            student.append(s.ds_tensor)
            if _gathered_copy(t) and not is_released(s):  # kept gathered: both copies
                teacher.append(t.data)
                student.append(s.data)
        else:
            teacher.append(t.data)
            student.append(s.data)
    if teacher[0].dtype != torch.float32:
        raise ValueError(f"the EMA teacher's weights are {teacher[0].dtype}, not float32 (engine.precision fp16?)")
    student = [p.float() for p in student]
    if isinstance(weight, torch.Tensor):
        torch._foreach_lerp_(teacher, student, weight.to(teacher[0].device, torch.float32))
    else:
        torch._foreach_lerp_(teacher, student, float(weight))


def _gathered_copy(param: torch.Tensor) -> bool:
    """Whether ZeRO-3 keeps `param` gathered in a tensor of its own beside the rank's partition (a parameter below
    `stage3_param_persistence_threshold`), which the forward reads. At world size 1 the gathered tensor is the
    partition itself: updated once, through the partition."""
    return (
        not is_released(param)
        and param.numel() == param.ds_numel
        and param.data.untyped_storage().data_ptr() != param.ds_tensor.untyped_storage().data_ptr()
    )


def teacher_hook(engine):
    """The loop's `after_update` hook: the teacher follows the update just applied with the step's decay, and stays
    where it is after a skipped one (`applied` 0.0)."""
    objective = engine.module

    def after_update(step: int, applied: torch.Tensor) -> None:
        decay = objective.teacher.decay_at(step)
        objective.teacher.decay.fill_(decay)
        follow_student(objective, (1.0 - decay) * applied)

    return after_update


@torch.no_grad()
def restore_frozen(engine, tag_dir: Path) -> list[str]:
    """Load the frozen parameters (the teacher) of checkpoint `tag_dir`, written at any world size and ZeRO stage,
    into the engine's module at this one: after a universal checkpoint's load, which restores only what the
    optimizer owns. Each old rank's file is memory-mapped and only this rank's slice of each parameter is read.

    Returns:
        The names of the parameters restored.

    Raises:
        ValueError: The checkpoint holds no value for one of the module's frozen parameters (another objective's).
    """
    saved = saved_frozen(tag_dir)
    restored = []
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            continue
        if name not in saved:
            raise ValueError(f"checkpoint {tag_dir} has no {name} (written by another objective?)")
        full = saved[name]().flatten()  # (numel,) on the CPU
        if is_zero3_param(param):
            part = param.ds_tensor
            rank, size = torch.distributed.get_rank(), part.numel()
            piece = full[rank * size : (rank + 1) * size]
            part.zero_()
            part[: piece.numel()].copy_(piece)
            if _gathered_copy(param):  # the copy the next forward reads: DeepSpeed gathered it before this load
                param.data.copy_(full.view_as(param))
        else:
            param.data.copy_(full.view_as(param))
        restored.append(name)
    return restored


def saved_teacher_missing(engine, tag_dir: Path) -> list[str]:
    """The module's frozen parameters (its teacher) that checkpoint `tag_dir` does not hold: all of them for a
    checkpoint of an objective without a teacher."""
    saved = saved_frozen(tag_dir)
    return [name for name, p in engine.module.named_parameters() if not p.requires_grad and name not in saved]


def start_teacher(engine, tag_dir: Path | None, *, universal: bool) -> str | None:
    """The teacher at the start of a launch: the student's values on a fresh run (after any warm start), the
    checkpoint's on a resume (DeepSpeed loaded them; a universal checkpoint's load did not, so they are read from the
    original checkpoint here). Returns the console line to print, or None without a teacher."""
    if not has_teacher(engine.module):
        return None
    if tag_dir is None:
        follow_student(engine.module, 1.0)
        return "[mimpipe] EMA teacher: a copy of the student, then an average of its weights after every step"
    if universal:
        restored = restore_frozen(engine, tag_dir)
        return f"[mimpipe] EMA teacher: {len(restored)} tensors read back from {tag_dir} at the new world size"
    return None
