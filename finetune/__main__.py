"""Fine-tuning entry point: hand-off from any accepted checkpoint, classification training (full fine-tuning, linear
probe, or DeiT distillation), exactly-once evaluation, export of the best checkpoint.

    python -m finetune RECIPE [section.key=value ...]
    python -m finetune convert SRC DST [--arch TIMM_NAME] [--trust-checkpoint]
"""

from __future__ import annotations

import json
import sys

import torch

from core.engine.failure import run_guarded
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
from data.mixing import build_mix, mixed
from data.pipeline import make_eval_loader
from data.specs import dataset_classes, resolve_shards
from data.transforms import eval_transform, finetune_train_transform
from finetune.classification import Classification
from finetune.distillation import Distillation, to_distilled
from finetune.evaluate import confusion_image, evaluate, per_class_table
from finetune.handoff import load_encoder, read_pooling_hint
from finetune.probe_ema import WeightEMA, fold_probe_head, make_linear_probe
from finetune.teacher import load_teacher


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert"]:
        from finetune.convert import main as convert_main

        return convert_main(argv[1:])

    # Config, distributed init, run dir, resume point; pooling from the checkpoint's hint unless the recipe says
    run = start_stage("python -m finetune", argv)
    cfg, dist = run.cfg, run.dist
    if cfg.model.global_pool == "auto":
        init, trust = cfg.model.init, cfg.model.trust_checkpoint
        hint = read_pooling_hint(init, trust_checkpoint=trust) if init and cfg.distill.kind == "none" else None
        cfg.model.global_pool = hint or "token"
    classes = dataset_classes(cfg.data.train)
    num_classes = cfg.model.num_classes or len(classes)
    if not num_classes:
        raise ValueError(f"model.num_classes is not set and {cfg.data.train} has no index.json listing classes")

    # Data: the augmented stream, mixed batch by batch (Mixup / CutMix) when the recipe asks
    a = cfg.augment
    train_tf = finetune_train_transform(
        cfg.model.img_size, cfg.data.mean, cfg.data.std, scale=cfg.data.crop_scale, hflip=a.hflip,
        auto_augment=a.auto_augment, re_prob=a.re_prob,
    )  # fmt: skip
    mix = build_mix(
        num_classes=num_classes, mixup=a.mixup, cutmix=a.cutmix, prob=a.mix_prob, switch_prob=a.mix_switch_prob,
        label_smoothing=cfg.objective.label_smoothing,
    )  # fmt: skip
    batches = mixed(train_stream(cfg, dist, train_tf, skip_batches=run.state.batches_consumed, labels=True), mix)
    eval_tf = eval_transform(cfg.model.img_size, cfg.data.mean, cfg.data.std, crop_pct=cfg.data.eval_crop_pct)

    # Model and objective (same init on every rank); the resumed checkpoint, if any, is loaded over them
    seed_everything(cfg.seed)
    objective = build_objective(cfg, run, num_classes, label_smoothing=0.0 if mix else cfg.objective.label_smoothing)
    engine, optimizer = start_engine(run, objective)
    ema = engine.module.ema

    # Evaluation on data.val; every improvement of top-1 is exported (timm layout, with the head). The best so far is
    # in run.state, which every checkpoint saves: a resumed run does not overwrite a better export.

    def export(step: int, metrics: dict[str, float]) -> None:
        state_dict = gather_state_dict(engine, engine.module.model, dist)  # collective under ZeRO-3
        if dist.is_main and cfg.checkpoint.export_at_end:
            manifest = {
                "method": "finetune" if cfg.distill.kind == "none" else f"deit-distill-{cfg.distill.kind}",
                "mode": cfg.objective.mode,
                "step": step,
                "source": cfg.model.init,
                "classes": classes,
                "metrics": metrics,
                "config": cfg.model_dump(mode="json"),
                "pooling_hint": cfg.model.global_pool,
            }
            out = run.run_dir / "export"
            export_state_dict(cfg, fold_probe_head(state_dict), out, num_classes=num_classes, manifest=manifest)

    def run_eval(step: int) -> dict[str, float]:
        final = step == run.total_steps and cfg.eval.per_class
        confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64) if final else None
        loader = _eval_loader(cfg, dist, eval_tf)
        metrics = evaluate(engine, loader, dist=dist, precision=cfg.engine.precision, confusion=confusion)
        _report(run, step, metrics, confusion, classes or [str(k) for k in range(num_classes)])
        if metrics["val/top1"] > run.state.best_top1:  # every rank holds the same reduced value
            run.state.best_top1, run.state.best_step = metrics["val/top1"], step
            export(step, metrics)
        if ema is not None:
            precision = "fp32" if cfg.engine.precision == "fp16" else cfg.engine.precision  # the EMA stays fp32
            ema_metrics = evaluate(
                Classification(ema.module), _eval_loader(cfg, dist, eval_tf), dist=dist, precision=precision
            )
            metrics |= {k.replace("val/", "val_ema/"): v for k, v in ema_metrics.items()}
            run.logger.console(f"[mimpipe] step {step} eval (EMA weights): top1 {ema_metrics['val/top1']:.4f}")
        return metrics

    # Loop
    code = run_loop(
        run, engine, optimizer, batches, evaluate=run_eval if cfg.data.val else None,
        after_update=(lambda step: ema.update(engine.module.model)) if ema is not None else None,
    )  # fmt: skip
    if code:
        return code
    if cfg.data.val:
        run.logger.console(
            f"[mimpipe] best val top1 {run.state.best_top1:.4f} at step {run.state.best_step}; "
            f"exported to {run.run_dir / 'export'}"
        )
    else:
        export(run.state.step, {})
    finish_stage(run)
    return 0


def build_objective(cfg, run, num_classes: int, *, label_smoothing: float):
    """The classifier after the hand-off, as a full fine-tune, a linear probe or a distilled student, with its EMA."""
    model = build_model(cfg, num_classes=num_classes, plain=True)
    if cfg.model.init:
        report = load_encoder(
            model, cfg.model.init, head_init=cfg.model.head_init, head_init_std=cfg.model.head_init_std,
            pos_embed_resize=cfg.model.pos_embed_resize, trust_checkpoint=cfg.model.trust_checkpoint,
        )  # fmt: skip
        run.logger.console(f"[mimpipe] hand-off from {cfg.model.init}\n{report.format()}")
        run.logger.text("finetune/load_report", 0, report.format())
        if run.dist.is_main:
            (run.run_dir / "load_report.json").write_text(json.dumps(report.as_dict(), indent=2))
    if cfg.objective.mode == "linear_probe":
        model = make_linear_probe(model)
    if cfg.distill.kind == "none":
        objective = Classification(model, label_smoothing=label_smoothing)
    else:
        student = build_model(cfg, num_classes=num_classes)
        new = to_distilled(model, student)
        run.logger.console(f"[mimpipe] distillation student: {', '.join(new)} initialised from the class token/head")
        teacher = load_teacher(cfg, num_classes, run.logger, run.dist.device)
        d = cfg.distill
        objective = Distillation(
            student, teacher, kind=d.kind, tau=d.tau, alpha=d.alpha, label_smoothing=label_smoothing
        )
    objective.ema = WeightEMA(objective.model, cfg.optim.ema_decay) if cfg.optim.ema_decay else None
    return objective


def _eval_loader(cfg, dist, transform):
    return make_eval_loader(
        resolve_shards(cfg.data.val),
        transform=transform,
        batch_size=cfg.data.eval_batch_size_per_device,
        rank=dist.rank,
        world_size=dist.world_size,
        num_workers=cfg.data.num_workers,
        label_field=cfg.data.label_field,
    )


def _report(run, step: int, metrics: dict[str, float], confusion, class_names: list[str]) -> None:
    run.logger.console(
        f"[mimpipe] step {step} eval: top1 {metrics['val/top1']:.4f}  top5 {metrics['val/top5']:.4f}  "
        f"loss {metrics['val/loss']:.4f}  ({int(metrics['val/samples'])} samples)"
    )
    if confusion is not None:
        table = per_class_table(confusion, class_names)
        run.logger.console(f"[mimpipe] per-class accuracy at step {step}:\n{table}")
        run.logger.text("val/per_class", step, table)
        run.logger.image("val/confusion_matrix", step, confusion_image(confusion, class_names))


if __name__ == "__main__":
    sys.exit(run_guarded(main))
