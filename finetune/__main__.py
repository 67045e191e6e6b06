"""Fine-tuning entry point: hand-off from an exported encoder, classification training, exactly-once evaluation,
export of the best checkpoint.

    python -m finetune RECIPE [section.key=value ...]
"""

from __future__ import annotations

import json
import sys

from core.config import load_config
from core.engine.checkpoint import find_resume, load_checkpoint
from core.engine.distributed import init_distributed, shutdown
from core.engine.loop import NonFiniteLossError, TrainState, train
from core.engine.setup import parallelize
from core.engine.stage import (
    build_model,
    export_state_dict,
    gather_state_dict,
    launch_plan,
    parse_stage_args,
    prepare_run_dir,
    seed_everything,
    train_stream,
)
from core.logging import MetricsLogger
from data.pipeline import dataset_classes, dataset_size, make_eval_loader, resolve_shards
from data.transforms import eval_transform, finetune_train_transform
from finetune.classification import Classification
from finetune.evaluate import evaluate
from finetune.handoff import load_encoder


def main(argv: list[str] | None = None) -> int:
    args = parse_stage_args("python -m finetune", argv)

    # Config and distributed init
    cfg = load_config(args.recipe, args.overrides)
    dist = init_distributed(cfg.engine.device)
    run_dir, config_yaml = prepare_run_dir(cfg, dist)
    classes = dataset_classes(cfg.data.train)
    num_classes = cfg.model.num_classes or len(classes)
    if not num_classes:
        raise ValueError(f"model.num_classes is not set and {cfg.data.train} has no index.json listing classes")
    samples = cfg.data.samples_per_epoch or dataset_size(cfg.data.train)
    total_steps, warmup_steps = cfg.steps(samples)
    resume = find_resume(run_dir, dist.rank)
    state = TrainState.from_resume(resume)
    logger = MetricsLogger(run_dir, enabled=dist.is_main, tensorboard=cfg.logging.tensorboard, total_steps=total_steps)

    # Data
    train_tf = finetune_train_transform(cfg.model.img_size, cfg.data.mean, cfg.data.std, scale=cfg.data.crop_scale)
    batches = train_stream(cfg, dist, train_tf, skip_batches=state.batches_consumed)
    eval_tf = eval_transform(cfg.model.img_size, cfg.data.mean, cfg.data.std, crop_pct=cfg.data.eval_crop_pct)

    # Model: the timm ViT with a K-class head; hand-off from the pretrained encoder (zero-initialised head).
    seed_everything(cfg.seed)
    model = build_model(cfg, num_classes=num_classes)
    if cfg.model.init:
        report = load_encoder(model, cfg.model.init)
        logger.console(f"[mimpipe] hand-off from {cfg.model.init}\n{report.format()}")
        logger.text("finetune/load_report", 0, report.format())
        if dist.is_main:
            (run_dir / "load_report.json").write_text(json.dumps(report.as_dict(), indent=2))
    objective = Classification(model, label_smoothing=cfg.objective.label_smoothing)

    # Engine and resume
    engine, optimizer = parallelize(objective, cfg=cfg, dist=dist, run_dir=run_dir)
    seed_everything(cfg.seed + dist.rank)
    if resume is not None:
        load_checkpoint(engine, run_dir=run_dir, resume=resume)
    logger.console(launch_plan(cfg, dist, total_steps=total_steps, warmup_steps=warmup_steps, samples=samples))

    best = {"val/top1": -1.0}

    def run_eval(step: int) -> dict[str, float]:
        if not cfg.data.val:
            return {}
        loader = make_eval_loader(
            resolve_shards(cfg.data.val),
            transform=eval_tf,
            batch_size=cfg.data.eval_batch_size_per_device,
            rank=dist.rank,
            world_size=dist.world_size,
            num_workers=cfg.data.num_workers,
        )
        metrics = evaluate(engine, loader, dist=dist, precision=cfg.engine.precision)
        logger.console(
            f"[mimpipe] step {step} eval: top1 {metrics['val/top1']:.4f}  top5 {metrics['val/top5']:.4f}"
            f"  loss {metrics['val/loss']:.4f}  ({int(metrics['val/samples'])} samples)"
        )
        if metrics["val/top1"] > best["val/top1"]:  # every rank sees the same reduced value
            best.update(metrics, step=step)
            export_best(step, metrics)
        return metrics

    def export_best(step: int, metrics: dict[str, float]) -> None:
        state_dict = gather_state_dict(engine, engine.module.model, dist)
        if dist.is_main and cfg.checkpoint.export_at_end:
            manifest = {
                "method": "finetune",
                "step": step,
                "source": cfg.model.init,
                "classes": classes,
                "metrics": metrics,
                "config": cfg.model_dump(mode="json"),
                "pooling_hint": cfg.model.global_pool,
            }
            export_state_dict(cfg, state_dict, run_dir / "export", num_classes=num_classes, manifest=manifest)

    # Loop
    try:
        train(
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
            evaluate=run_eval,
        )
    except NonFiniteLossError as err:
        logger.console(f"[mimpipe] {err}")
        return 3
    if cfg.data.val:
        logger.console(
            f"[mimpipe] best val top1 {best['val/top1']:.4f} at step {best['step']}; exported to {run_dir / 'export'}"
        )
    logger.console(f"[mimpipe] TensorBoard: tensorboard --logdir {run_dir / 'tb'}")
    logger.close()
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
