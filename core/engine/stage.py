"""Plain functions both stage entry points share: run-dir set-up, the launch plan, the training stream,
gathering a module's full weights (ZeRO-3 included) and exporting them."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
import torch
from torch import nn

from core.config import Config, dump_config
from core.engine.distributed import DistInfo
from core.engine.export import export_model
from core.models import build_vit, vit_model_args
from data.pipeline import make_train_loader, resolve_shards


def parse_stage_args(prog: str, argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description="Run a recipe: RECIPE [section.key=value ...]")
    parser.add_argument("recipe", help="YAML recipe")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.base_lr=1e-4")
    return parser.parse_args(argv)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def prepare_run_dir(cfg: Config, dist: DistInfo) -> tuple[Path, str]:
    """Create run_dir and write the resolved config to run_dir/config.yaml (rank 0)."""
    run_dir = Path(cfg.run_dir)
    config_yaml = dump_config(cfg)
    if dist.is_main:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_yaml)
    return run_dir, config_yaml


def launch_plan(cfg: Config, dist: DistInfo, *, total_steps: int, warmup_steps: int, samples: int | None) -> str:
    """What the run will do, printed once at launch: batch arithmetic and the lr actually used."""
    per_device = cfg.batch_size_per_device(dist.world_size)
    rule = (
        f"base_lr {cfg.optim.base_lr:g} x {cfg.data.global_batch_size} / {cfg.optim.lr_base_batch}"
        if cfg.optim.lr_rule == "scaled"
        else "absolute"
    )
    epochs = (
        f" (~{total_steps * cfg.data.global_batch_size / samples:.2f} epochs of {samples} samples)" if samples else ""
    )
    return (
        f"[mimpipe] stage {cfg.stage} | objective {cfg.objective.kind} | run_dir {cfg.run_dir}\n"
        f"[mimpipe] world size {dist.world_size} on {dist.device.type} | ZeRO-{cfg.engine.zero_stage} | "
        f"precision {cfg.engine.precision}\n"
        f"[mimpipe] global batch {cfg.data.global_batch_size} = {per_device} per device x "
        f"{cfg.engine.grad_accum_steps} accumulation x {dist.world_size} ranks\n"
        f"[mimpipe] lr {cfg.peak_lr:.4g} ({rule}), min {cfg.optim.min_lr:g}, warmup {warmup_steps} of "
        f"{total_steps} steps{epochs}"
    )


def train_stream(cfg: Config, dist: DistInfo, transform, *, skip_batches: int):
    """The endless per-rank training stream, positioned after `skip_batches` micro-batches."""
    return iter(
        make_train_loader(
            resolve_shards(cfg.data.train),
            transform=transform,
            batch_size=cfg.batch_size_per_device(dist.world_size),
            seed=cfg.seed,
            rank=dist.rank,
            world_size=dist.world_size,
            num_workers=cfg.data.num_workers,
            shuffle_buffer=cfg.data.shuffle_buffer,
            resampled=cfg.data.resampled,
            skip_batches=skip_batches,
        )
    )


def build_model(cfg: Config, num_classes: int = 0) -> nn.Module:
    """The timm ViT the recipe describes."""
    m = cfg.model
    return build_vit(
        m.size,
        img_size=m.img_size,
        patch_size=m.patch_size,
        num_classes=num_classes,
        global_pool=m.global_pool,
        drop_path_rate=m.drop_path_rate,
        embed_dim=m.embed_dim,
        depth=m.depth,
        num_heads=m.num_heads,
    )


def gather_state_dict(engine, module: nn.Module, dist: DistInfo) -> dict[str, torch.Tensor] | None:
    """Full fp32 CPU copy of `module`'s weights on rank 0 (None elsewhere); all ranks must call it (ZeRO-3 gathers)."""
    params = list(module.parameters())
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            return _cpu_copy(module) if dist.is_main else None
    return _cpu_copy(module) if dist.is_main else None


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
    return export_model(model, out_dir, model_args=vit_model_args(model), manifest=manifest, data_config=data_config)
