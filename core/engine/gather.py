"""A module's full weights out of the engine (ZeRO-3 partitions gathered, fp16 runs' fp32 masters), and their export
as the plain timm model the recipe describes."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from core.engine.distributed import DistInfo
from core.engine.export import export_model
from core.engine.fp16 import fp32_master_weights
from core.models.build import build_model, model_args
from core.recipe.config import Config


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


def export_state_dict(cfg: Config, state_dict: dict, out_dir: Path, *, num_classes: int, manifest: dict) -> Path:
    """Rebuild the plain timm model on CPU, load `state_dict` strictly and export it (timm HF layout)."""
    model = build_model(cfg, num_classes=num_classes)
    model.load_state_dict(state_dict, strict=True)
    data_config = {
        "mean": cfg.data.mean,
        "std": cfg.data.std,
        "interpolation": "bicubic",
        "crop_pct": cfg.data.eval_crop_pct,
    }
    return export_model(model, out_dir, model_args=model_args(model), manifest=manifest, data_config=data_config)
