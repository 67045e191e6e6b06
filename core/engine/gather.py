"""A module's full weights out of the engine (ZeRO-3 partitions gathered, fp16 runs' fp32 masters) or out of a saved
checkpoint of any ZeRO stage: what core/export/folder.py's `export_state_dict` then writes."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from core.compat import deepspeed as ds_compat
from core.engine.distributed import DistInfo
from core.engine.fp16 import fp32_master_weights, zero0_masters_from_checkpoint


def gather_state_dict(engine, module: nn.Module, dist: DistInfo) -> dict[str, torch.Tensor] | None:
    """Full fp32 CPU copy of `module`'s weights on rank 0 (None elsewhere); all ranks must call it (ZeRO-3 gathers,
    and fp16 runs read the optimizer's fp32 master weights, see fp16.py)."""
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = _cpu_copy(module) if dist.is_main else None
    else:
        state = _cpu_copy(module) if dist.is_main else None
    if engine.fp16_enabled():
        masters = fp32_master_weights(engine, module)
        if state is not None:
            state.update(masters)
    return state


def _cpu_copy(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


def consolidated_state_dict(ckpt_dir: Path, tag: str, zero_stage: int) -> dict[str, torch.Tensor]:
    """fp32 weights of the whole objective from a DeepSpeed checkpoint, without starting any process group."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ds_compat.check("checkpoint_files", "zero0_fp16_masters")
    if zero_stage == 0:
        path = ckpt_dir / tag / ds_compat.MODEL_STATES_FILE
        states = torch.load(path, map_location="cpu", weights_only=False)
        weights = {k: v.float() for k, v in states["module"].items()}
        if ds_compat.checkpoint_fp32_groups(states) is not None:  # fp16: the module is the fp16 copy
            weights.update(zero0_masters_from_checkpoint(states, path))
        return weights
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    weights = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    # DeepSpeed's conversion holds what the optimizer owns, and the frozen parameters only where ZeRO-2/3 saved their
    # fragments: at ZeRO-1 MAE's fixed position embedding and an EMA teacher are in the module state alone.
    for name, value in saved_frozen(ckpt_dir / tag).items():
        if name not in weights:
            weights[name] = value().float()
    return weights


def saved_frozen(tag_dir: Path) -> dict[str, Callable[[], torch.Tensor]]:
    """{parameter name: a function returning its whole value} for the parameters a DeepSpeed checkpoint holds outside
    the optimizer's partitions (frozen ones: MAE's fixed position embedding, an EMA teacher), at any ZeRO stage and
    world size: ZeRO-3's per-rank frozen fragments concatenated in rank order (the padding cut), else the one model
    file's frozen fragments (ZeRO-2) or its module state (ZeRO-0/1; it holds every parameter there). The files are
    memory-mapped: a value is read when its function is called."""
    ranked = sorted(tag_dir.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"), key=lambda p: int(p.name.split("_")[3]))
    if ranked:
        files = [torch.load(f, map_location="cpu", mmap=True, weights_only=False) for f in ranked]
        shapes = files[0].get("frozen_param_shapes") or {}

        def whole(name: str) -> torch.Tensor:
            shape = torch.Size(shapes[name])
            flat = torch.cat([f["frozen_param_fragments"][name].flatten() for f in files])
            return flat[: shape.numel()].view(shape)

        return {name: functools.partial(whole, name) for name in shapes}
    state = torch.load(tag_dir / ds_compat.MODEL_STATES_FILE, map_location="cpu", mmap=True, weights_only=False)
    values = {**(state.get("module") or {}), **(state.get("frozen_param_fragments") or {})}
    return {name: functools.partial(lambda v: v, value) for name, value in values.items()}
