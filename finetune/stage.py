"""The fine-tuning stage, as `python -m finetune` runs it (finetune/__main__.py): hand-off from any accepted checkpoint,
classification training (full fine-tuning, linear probe, or DeiT distillation), exactly-once evaluation, export of
the best checkpoint; semantic segmentation (finetune/segment.py); or `convert SRC DST`, `predict EXPORT ...`,
`evaluate CHECKPOINT ...` (finetune/report_card.py)."""

from __future__ import annotations

import sys
from functools import partial

import torch

from core.engine.inspection_hook import inspection_hook
from core.engine.loop import LoopHooks
from core.engine.run import run_loop, seed_everything, start_engine, start_stage
from core.engine.stream import train_stream
from core.models.build import build_model
from data.mixing import build_mix, mixed
from data.specs import dataset_classes
from data.transforms import eval_transform, finetune_train_transform
from finetune.best import BestExport, finish_with_export
from finetune.classification import Classification
from finetune.distillation import Distillation, to_distilled
from finetune.handoff import hand_off, resolve_init
from finetune.probe_ema import WeightEMA, make_linear_probe
from finetune.segment import main_segmentation
from finetune.teacher import load_teacher


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert"]:
        from finetune.convert import main as convert_main

        return convert_main(argv[1:])
    if argv[:1] == ["predict"]:
        from finetune.predict import main as predict_main

        return predict_main(argv[1:])
    if argv[:1] == ["inspect"]:
        from finetune.inspect_vit import main as inspect_main

        return inspect_main(argv[1:])
    if argv[:1] == ["evaluate"]:
        from finetune.report_card import main as evaluate_main

        return evaluate_main(argv[1:])

    # Config (model.init's architecture, normalisation and pooling where the recipe leaves them out), distributed init,
    # run dir, resume point
    run = start_stage("python -m finetune", argv, resolve=resolve_init)
    cfg = run.cfg
    if cfg.objective.kind == "segmentation":
        return main_segmentation(run)
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
    batches = mixed(train_stream(run, train_tf, labels=True), mix)
    eval_tf = eval_transform(cfg.model.img_size, cfg.data.mean, cfg.data.std, crop_pct=cfg.data.eval_crop_pct)

    # Model and objective (same init on every rank); the resumed checkpoint, if any, is loaded over them
    seed_everything(cfg.seed)
    objective = build_objective(cfg, run, num_classes, label_smoothing=0.0 if mix else cfg.objective.label_smoothing)
    engine, optimizer = start_engine(run, objective)

    # Evaluation on data.val, every improvement of top-1 exported (see finetune/best.py)
    best = BestExport(run, engine, classes=classes, num_classes=num_classes, transform=eval_tf)

    # Loop, with the ViT paper's inspection pictures at the picture cadence
    hooks = LoopHooks(
        evaluate=best.evaluate if cfg.data.val else None,
        log_images=inspection_hook(run, engine.module),
        after_update=partial(update_ema, engine) if engine.module.ema is not None else None,
    )
    code = run_loop(run, engine, optimizer, batches, hooks)
    return code or finish_with_export(run, best.export, f"top1 {run.state.best_top1:.4f}")


def update_ema(engine, step: int, applied: torch.Tensor) -> None:
    """The loop's `after_update` hook: the EMA follows the update just applied (`applied` 1.0), and stays where it
    is after a skipped one (0.0)."""
    engine.module.ema.update(engine.module.model, applied)


def build_objective(cfg, run, num_classes: int, *, label_smoothing: float):
    """The classifier after the hand-off, as a full fine-tune, a linear probe or a distilled student, with its EMA."""
    model = build_model(cfg, num_classes=num_classes, plain=True)
    hand_off(model, run)
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
