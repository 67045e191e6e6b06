"""The tokenizer stage (`stage: tokenizer`, run by `python -m pretrain`): train the VQ-VAE of pretrain/tokenizer.py on
the same shards with the same engine, log reconstructions and codebook usage, export it for BEiT-style targets.

    ./launch.sh recipes/quickstart_tokenizer.yaml   ->   RUN_DIR/export/{tokenizer.safetensors, mimpipe.json}
"""

from __future__ import annotations

import torch

from core.config import Config
from core.engine.distributed import all_reduce
from core.engine.loop import autocast_context, to_device
from core.engine.stage import (
    StageRun,
    finish_stage,
    gather_state_dict,
    run_loop,
    seed_everything,
    start_engine,
    train_stream,
)
from core.sections import VQVAEObjective
from data.pipeline import make_eval_loader
from data.specs import resolve_shards
from data.transforms import eval_transform, pretrain_transform
from pretrain.tokenizer import VQVAE, export_tokenizer, tokenizer_grid


def build_tokenizer(cfg: Config) -> VQVAE:
    o: VQVAEObjective = cfg.objective
    return VQVAE(
        img_size=o.img_size,
        downsample=o.downsample,
        codebook_size=o.codebook_size,
        code_dim=o.code_dim,
        hidden_dim=o.hidden_dim,
        commitment=o.commitment,
        ema_decay=o.ema_decay,
        dead_code_threshold=o.dead_code_threshold,
    )


def train_tokenizer(run: StageRun) -> int:
    """Sections as in the other stages: data, model and engine, loop, export. Returns the exit code."""
    cfg, dist = run.cfg, run.dist
    img_size = cfg.objective.img_size

    # Data: MAE's crop-and-flip at the tokenizer's resolution
    transform = pretrain_transform(img_size, cfg.data.mean, cfg.data.std, scale=cfg.data.crop_scale)
    batches = train_stream(cfg, dist, transform, skip_batches=run.state.batches_consumed)

    # Model (same init on every rank). Its EMA codebook statistics are summed over ranks so every rank keeps the
    # same codebook: the one piece of distribution the tokenizer needs, applied here from outside.
    seed_everything(cfg.seed)
    tokenizer = build_tokenizer(cfg)
    tokenizer.quantizer.reduce = all_reduce
    engine, optimizer = start_engine(run, tokenizer)

    fixed_tf = eval_transform(img_size, cfg.data.mean, cfg.data.std, crop_pct=1.0)
    fixed_loader = make_eval_loader(
        resolve_shards(cfg.data.train)[:1], transform=fixed_tf, batch_size=8, rank=0, world_size=1, num_workers=0
    )
    fixed = to_device(next(iter(fixed_loader)), dist.device, cfg.engine.precision)

    def log_images(step: int) -> None:
        with torch.no_grad(), autocast_context(cfg.engine.precision, dist.device):
            recon = engine.module.decode_codes(engine.module.encode(fixed["image"]))
        picture = tokenizer_grid(fixed["image"].float(), recon.float(), cfg.data.mean, cfg.data.std)
        run.logger.image("train/reconstruction", step, picture)

    # Loop
    code = run_loop(run, engine, optimizer, batches, log_images=log_images)
    if code:
        return code

    # Export (consolidated from any ZeRO stage)
    state_dict = gather_state_dict(engine, engine.module, dist)
    if dist.is_main and cfg.checkpoint.export_at_end:
        model = build_tokenizer(cfg)
        model.load_state_dict(state_dict, strict=True)
        manifest = {
            "method": "vqvae",
            "step": run.state.step,
            "source": run.recipe,
            "data": cfg.data.model_dump(mode="json")["train"],  # a mixture as plain mappings
            "mean": list(cfg.data.mean),
            "std": list(cfg.data.std),
        }
        out = export_tokenizer(model, run.run_dir / "export", manifest=manifest)
        run.logger.console(f"[mimpipe] tokenizer exported to {out} (objective.target.path for BEiT-style pretraining)")
    finish_stage(run)
    return 0
