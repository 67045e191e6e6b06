"""Pretraining entry point (launched by torchrun through launch.sh, or directly for one process).

python -m pretrain RECIPE [section.key=value ...]
python -m pretrain export RUN_DIR [--step N]
"""

from __future__ import annotations

import sys

import torch

from core.engine.loop import autocast_context, to_device
from core.engine.stage import (
    export_state_dict,
    finish_stage,
    gather_state_dict,
    run_loop,
    seed_everything,
    start_engine,
    start_stage,
    train_stream,
)
from data.pipeline import make_eval_loader
from data.specs import resolve_shards
from data.transforms import eval_transform
from pretrain.export import main as export_main
from pretrain.export import pretrain_manifest
from pretrain.objectives import PICTURES, objective_builder, train_transform, visualize
from pretrain.train_tokenizer import train_tokenizer


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        return export_main(argv[1:])

    # Config, distributed init, run dir, resume point
    run = start_stage("python -m pretrain", argv)
    cfg, dist = run.cfg, run.dist
    if cfg.stage == "tokenizer":
        return train_tokenizer(run)

    # Data: the endless training stream, positioned where the resumed run left it
    batches = train_stream(cfg, dist, train_transform(cfg), skip_batches=run.state.batches_consumed)

    # Objective (same init on every rank) and engine
    seed_everything(cfg.seed)
    engine, optimizer = start_engine(run, objective_builder(cfg))

    # Reconstructions of one fixed batch with one fixed mask, so pictures are comparable across steps.
    fixed_tf = eval_transform(cfg.model.img_size, cfg.data.mean, cfg.data.std, crop_pct=1.0)
    fixed_loader = make_eval_loader(
        resolve_shards(cfg.data.train)[:1], transform=fixed_tf, batch_size=8, rank=0, world_size=1, num_workers=0
    )
    fixed = to_device(next(iter(fixed_loader)), dist.device, cfg.engine.precision)

    def log_images(step: int) -> None:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), autocast_context(cfg.engine.precision, dist.device):
            torch.manual_seed(0)
            out = engine(fixed)
        run.logger.image("train/reconstruction", step, visualize(cfg, fixed, out))

    # Loop
    code = run_loop(run, engine, optimizer, batches, log_images=log_images if cfg.objective.kind in PICTURES else None)
    if code:
        return code

    # Export the encoder (consolidated from every ZeRO stage) in timm's layout.
    state_dict = gather_state_dict(engine, engine.module.encoder, dist)
    if dist.is_main and cfg.checkpoint.export_at_end:
        manifest = pretrain_manifest(
            cfg, step=run.state.step, source=run.recipe, objective_keys=engine.module.state_dict()
        )
        out = export_state_dict(cfg, state_dict, run.run_dir / "export", num_classes=0, manifest=manifest)
        run.logger.console(
            f"[mimpipe] encoder exported to {out} (timm.create_model('local-dir:{out}', pretrained=True))"
        )
    finish_stage(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
