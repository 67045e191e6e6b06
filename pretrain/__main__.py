"""Pretraining entry point (launched by torchrun through launch.sh, or directly for one process).

python -m pretrain RECIPE [section.key=value ...]
python -m pretrain export RUN_DIR [--step N]
"""

from __future__ import annotations

import sys

import torch

from core.config import load_config
from core.engine.checkpoint import find_resume, load_checkpoint
from core.engine.distributed import init_distributed, shutdown
from core.engine.loop import NonFiniteLossError, TrainState, autocast_context, to_device, train
from core.engine.setup import parallelize
from core.engine.stage import (
    export_state_dict,
    gather_state_dict,
    launch_plan,
    parse_stage_args,
    prepare_run_dir,
    seed_everything,
    train_stream,
)
from core.logging import MetricsLogger
from data.pipeline import dataset_size, make_eval_loader, resolve_shards
from data.transforms import eval_transform, pretrain_transform
from pretrain.export import main as export_main
from pretrain.export import pretrain_manifest
from pretrain.objectives import build_objective, visualize


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    args = parse_stage_args("python -m pretrain", argv)

    # Config and distributed init
    cfg = load_config(args.recipe, args.overrides)
    dist = init_distributed(cfg.engine.device)
    run_dir, config_yaml = prepare_run_dir(cfg, dist)
    samples = cfg.data.samples_per_epoch or dataset_size(cfg.data.train)
    total_steps, warmup_steps = cfg.steps(samples)

    # Resume order: this run_dir's latest checkpoint, else from scratch.
    resume = find_resume(run_dir, dist.rank)
    state = TrainState.from_resume(resume)

    # Data
    transform = pretrain_transform(cfg.model.img_size, cfg.data.mean, cfg.data.std, scale=cfg.data.crop_scale)
    batches = train_stream(cfg, dist, transform, skip_batches=state.batches_consumed)

    # Objective and engine (same init on every rank; per-rank seeds afterwards so masks differ across ranks)
    seed_everything(cfg.seed)
    objective = build_objective(cfg)
    engine, optimizer = parallelize(objective, cfg=cfg, dist=dist, run_dir=run_dir)
    seed_everything(cfg.seed + dist.rank)
    if resume is not None:
        load_checkpoint(engine, run_dir=run_dir, resume=resume)

    logger = MetricsLogger(run_dir, enabled=dist.is_main, tensorboard=cfg.logging.tensorboard, total_steps=total_steps)
    logger.console(launch_plan(cfg, dist, total_steps=total_steps, warmup_steps=warmup_steps, samples=samples))
    if resume is not None:
        logger.console(f"[mimpipe] resumed from {run_dir / 'checkpoints' / resume['tag']} at step {state.step}")

    # Reconstructions of one fixed batch with one fixed mask, so pictures are comparable across steps.
    fixed = next(
        iter(
            make_eval_loader(
                resolve_shards(cfg.data.train)[:1],
                transform=eval_transform(cfg.model.img_size, cfg.data.mean, cfg.data.std, crop_pct=1.0),
                batch_size=8,
                rank=0,
                world_size=1,
                num_workers=0,
            )
        )
    )
    fixed = to_device(fixed, dist.device, cfg.engine.precision)

    def log_images(step: int) -> None:
        with torch.no_grad(), torch.random.fork_rng(devices=[]), autocast_context(cfg.engine.precision, dist.device):
            torch.manual_seed(0)
            out = engine(fixed)
        logger.image("train/reconstruction", step, visualize(cfg, fixed, out))

    # Loop
    try:
        state = train(
            cfg=cfg,
            engine=engine,
            optimizer=optimizer,
            batches=batches,
            dist=dist,
            state=state,
            total_steps=total_steps,
            warmup_steps=warmup_steps,
            logger=logger,
            run_dir=run_dir,
            config_yaml=config_yaml,
            log_images=log_images,
        )
    except NonFiniteLossError as err:
        logger.console(f"[mimpipe] {err}")
        return 3

    # Export the encoder (consolidated from every ZeRO stage) in timm's layout.
    state_dict = gather_state_dict(engine, engine.module.encoder, dist)
    if dist.is_main and cfg.checkpoint.export_at_end:
        manifest = pretrain_manifest(cfg, step=state.step, source=args.recipe)
        out = export_state_dict(cfg, state_dict, run_dir / "export", num_classes=0, manifest=manifest)
        logger.console(f"[mimpipe] encoder exported to {out} (timm.create_model('local-dir:{out}', pretrained=True))")
    logger.console(f"[mimpipe] TensorBoard: tensorboard --logdir {run_dir / 'tb'}")
    logger.close()
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
