"""Fine-tuning entry point: hand-off from an exported encoder, classification training, exactly-once evaluation,
export of the best checkpoint.

    python -m finetune RECIPE [section.key=value ...]
"""

from __future__ import annotations

import json
import sys

from core.engine.stage import (
    build_model,
    export_state_dict,
    finish_stage,
    gather_state_dict,
    run_loop,
    seed_everything,
    start_engine,
    start_stage,
    train_stream,
)
from data.pipeline import dataset_classes, make_eval_loader, resolve_shards
from data.transforms import eval_transform, finetune_train_transform
from finetune.classification import Classification
from finetune.evaluate import evaluate
from finetune.handoff import load_encoder


def main(argv: list[str] | None = None) -> int:
    # Config, distributed init, run dir, resume point
    run = start_stage("python -m finetune", argv)
    cfg, dist = run.cfg, run.dist
    classes = dataset_classes(cfg.data.train)
    num_classes = cfg.model.num_classes or len(classes)
    if not num_classes:
        raise ValueError(f"model.num_classes is not set and {cfg.data.train} has no index.json listing classes")

    # Data
    train_tf = finetune_train_transform(cfg.model.img_size, cfg.data.mean, cfg.data.std, scale=cfg.data.crop_scale)
    batches = train_stream(cfg, dist, train_tf, skip_batches=run.state.batches_consumed)
    eval_tf = eval_transform(cfg.model.img_size, cfg.data.mean, cfg.data.std, crop_pct=cfg.data.eval_crop_pct)

    # Model: the timm ViT with a K-class head; hand-off from the pretrained encoder (zero-initialised head).
    seed_everything(cfg.seed)
    model = build_model(cfg, num_classes=num_classes)
    if cfg.model.init:
        report = load_encoder(model, cfg.model.init)
        run.logger.console(f"[mimpipe] hand-off from {cfg.model.init}\n{report.format()}")
        run.logger.text("finetune/load_report", 0, report.format())
        if dist.is_main:
            (run.run_dir / "load_report.json").write_text(json.dumps(report.as_dict(), indent=2))
    engine, optimizer = start_engine(run, Classification(model, label_smoothing=cfg.objective.label_smoothing))

    # Evaluation on data.val; every improvement of top-1 is exported (timm layout, with the head).
    best = {"val/top1": -1.0, "step": 0}

    def export(step: int, metrics: dict[str, float]) -> None:
        state_dict = gather_state_dict(engine, engine.module.model, dist)  # collective under ZeRO-3
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
            export_state_dict(cfg, state_dict, run.run_dir / "export", num_classes=num_classes, manifest=manifest)

    def run_eval(step: int) -> dict[str, float]:
        loader = make_eval_loader(
            resolve_shards(cfg.data.val),
            transform=eval_tf,
            batch_size=cfg.data.eval_batch_size_per_device,
            rank=dist.rank,
            world_size=dist.world_size,
            num_workers=cfg.data.num_workers,
        )
        metrics = evaluate(engine, loader, dist=dist, precision=cfg.engine.precision)
        run.logger.console(
            f"[mimpipe] step {step} eval: top1 {metrics['val/top1']:.4f}  "
            f"top5 {metrics['val/top5']:.4f}  loss {metrics['val/loss']:.4f}  "
            f"({int(metrics['val/samples'])} samples)"
        )
        if metrics["val/top1"] > best["val/top1"]:  # every rank holds the same reduced value
            best.update(metrics, step=step)
            export(step, metrics)
        return metrics

    # Loop
    code = run_loop(run, engine, optimizer, batches, evaluate=run_eval if cfg.data.val else None)
    if code:
        return code
    if cfg.data.val:
        run.logger.console(
            f"[mimpipe] best val top1 {best['val/top1']:.4f} at step {best['step']}; "
            f"exported to {run.run_dir / 'export'}"
        )
    else:
        export(run.state.step, {})
    finish_stage(run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
