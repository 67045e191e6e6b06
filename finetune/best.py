"""Evaluation during fine-tuning and the export of the best weights.

Every improvement of `val/top1` is exported (timm layout, with the head) to run_dir/export. The best score so far is
in the run's TrainState, which every checkpoint saves: a resumed run does not overwrite a better export. A run with an
EMA of its weights evaluates those too, logged as `val_ema/*`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from core.engine.gather import gather_state_dict
from core.engine.run import finish_stage
from core.engine.stage import StageRun
from core.export.folder import export_state_dict
from data.pipeline import make_eval_loader
from data.specs import resolve_shards
from finetune.classification import Classification
from finetune.evaluate import confusion_image, evaluate, per_class_table
from finetune.probe_ema import fold_probe_head


class BestExport:
    """The loop's `evaluate` hook of a fine-tuning run, and the export of the weights it finds best.

    Args:
        run: The stage.
        engine: The DeepSpeed engine around the objective (`.module.model` the classifier, `.module.ema` its EMA).
        classes: Class names from the training set's index.json (may be empty).
        num_classes: Classifier outputs.
        transform: The evaluation transform.
    """

    def __init__(self, run: StageRun, engine, *, classes: list[str], num_classes: int, transform):
        self.run, self.engine, self.classes, self.num_classes = run, engine, classes, num_classes
        self.transform = transform

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluate on `data.val` (per class at the last step, when `eval.per_class`), export on a new best top-1.
        Collective: every rank calls it."""
        run, cfg = self.run, self.run.cfg
        final = step == run.total_steps and cfg.eval.per_class
        confusion = torch.zeros(self.num_classes, self.num_classes, dtype=torch.int64) if final else None
        metrics = evaluate(
            self.engine, self._loader(), dist=run.dist, precision=cfg.engine.precision, confusion=confusion
        )
        self._report(step, metrics, confusion)
        if metrics["val/top1"] > run.state.best_top1:  # every rank holds the same reduced value
            run.state.best_top1, run.state.best_step = metrics["val/top1"], step
            self.export(step, metrics)
        ema = self.engine.module.ema
        if ema is not None:
            precision = "fp32" if cfg.engine.precision == "fp16" else cfg.engine.precision  # the EMA stays fp32
            ema_metrics = evaluate(Classification(ema.module), self._loader(), dist=run.dist, precision=precision)
            metrics |= {k.replace("val/", "val_ema/"): v for k, v in ema_metrics.items()}
            run.logger.console(f"[mimpipe] step {step} eval (EMA weights): top1 {ema_metrics['val/top1']:.4f}")
        return metrics

    def export(self, step: int, metrics: dict[str, float]) -> None:
        """Export the classifier's weights at `step`, with `metrics` in its manifest. Collective under ZeRO-3."""
        run, cfg = self.run, self.run.cfg
        state_dict = gather_state_dict(self.engine, self.engine.module.model, run.dist)
        if run.dist.is_main and cfg.checkpoint.export_at_end:
            manifest = {
                "method": "finetune" if cfg.distill.kind == "none" else f"deit-distill-{cfg.distill.kind}",
                "mode": cfg.objective.mode,
                "step": step,
                "source": cfg.model.init,
                "classes": self.classes,
                "metrics": metrics,
                "config": cfg.model_dump(mode="json"),
                "pooling_hint": cfg.model.global_pool,
            }
            out = run.run_dir / "export"
            export_state_dict(
                cfg, fold_probe_head(state_dict), out, num_classes=self.num_classes, manifest=manifest,
                run_dir=run.run_dir,
            )  # fmt: skip

    def _loader(self):
        cfg, dist = self.run.cfg, self.run.dist
        return make_eval_loader(
            resolve_shards(cfg.data.val),
            transform=self.transform,
            batch_size=cfg.data.eval_batch_size_per_device,
            rank=dist.rank,
            world_size=dist.world_size,
            num_workers=cfg.data.num_workers,
            label_field=cfg.data.label_field,
            read_policy=cfg.data.read_policy(),
            timeout_s=cfg.data.loader_timeout_s,
        )

    def _report(self, step: int, metrics: dict[str, float], confusion: torch.Tensor | None) -> None:
        logger = self.run.logger
        logger.console(
            f"[mimpipe] step {step} eval: top1 {metrics['val/top1']:.4f}  top5 {metrics['val/top5']:.4f}  "
            f"loss {metrics['val/loss']:.4f}  ({int(metrics['val/samples'])} samples)"
        )
        if confusion is not None:
            class_names = self.classes or [str(k) for k in range(self.num_classes)]
            table = per_class_table(confusion, class_names)
            logger.console(f"[mimpipe] per-class accuracy at step {step}:\n{table}")
            logger.text("val/per_class", step, table)
            logger.image("val/confusion_matrix", step, confusion_image(confusion, class_names))


def finish_with_export(run: StageRun, export: Callable[[int, dict], None], best: str) -> int:
    """The end of a fine-tuning run whose loop finished: the best evaluation's line (`best`, e.g. "top1 0.8511") when
    data.val was evaluated, else the export of the last weights; then the stage's end. Returns 0."""
    if run.cfg.data.val:
        run.logger.console(
            f"[mimpipe] best val {best} at step {run.state.best_step}; exported to {run.run_dir / 'export'}"
        )
    else:
        export(run.state.step, {})
    finish_stage(run)
    return 0
