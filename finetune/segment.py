"""The segmentation fine-tuning stage (`objective.kind: segmentation`, run by `python -m finetune`): the hand-off of
any encoder the classification stage accepts, a segmentation head (finetune/seg_model.py), per-pixel training on
segmentation shards (data/segmentation.py), mIoU on data.val every `eval.every_steps`, the best weights exported.

The export is the encoder in timm's layout (it loads into `timm.create_model` as every export does) plus the neck's
and heads' weights (`seg_head.safetensors`) and what rebuilds them in the manifest's "segmentation" entry.
"""

from __future__ import annotations

import safetensors.torch
import torch
from timm.layers import to_2tuple

from core.engine.gather import gather_state_dict
from core.engine.inspection_hook import inspection_hook
from core.engine.loop import LoopHooks
from core.engine.run import run_loop, seed_everything, start_engine
from core.engine.stage import StageRun
from core.engine.stream import train_stream
from core.engine.sync_batchnorm import synchronise_batchnorm
from core.export.folder import export_state_dict
from core.models.build import build_model
from core.recipe.config import Config
from core.report.metrics import segmentation_scores
from data.pipeline import make_eval_loader
from data.seg_transforms import SegEvalTransform, SegTrainTransform
from data.segmentation import dataset_ids
from data.specs import resolve_shards, segmentation_info
from finetune.best import finish_with_export
from finetune.evaluate import markdown_table
from finetune.handoff import hand_off
from finetune.seg_evaluate import evaluate_segmentation, segmentation_picture
from finetune.seg_model import Segmentation, SegmentationModel

HEAD_FILE = "seg_head.safetensors"
"""The export's neck and head weights (the encoder's are timm's `model.safetensors`)."""
ENCODER_PREFIX = "encoder."
PICTURE_ROWS = 4  # validation images in TensorBoard's `val/segmentation` (image | prediction | ground truth)


def main_segmentation(run: StageRun) -> int:
    """Train, evaluate and export; returns the exit code (see `core.engine.run.run_loop`)."""
    cfg, o = run.cfg, run.cfg.objective
    info = segmentation_info(cfg.data.train)
    num_classes = cfg.model.num_classes or info["num_classes"]
    if num_classes != info["num_classes"]:
        raise ValueError(
            f"model.num_classes {num_classes} but the masks of {cfg.data.train} hold {info['num_classes']} classes"
        )
    crop = to_2tuple(cfg.model.img_size)
    train_tf = SegTrainTransform(
        crop, cfg.data.mean, cfg.data.std, base_size=o.base_size, scale=o.scale, hflip=cfg.augment.hflip,
        photometric=o.photometric,
    )  # fmt: skip
    batches = train_stream(run, train_tf, labels=False)

    seed_everything(cfg.seed)
    engine, optimizer = start_engine(run, build_objective(cfg, run, num_classes))
    evaluation = SegEvaluation(
        run, engine, classes=info["classes"], reduce_zero_label=info["reduce_zero_label"], num_classes=num_classes,
        crop=crop,
    )  # fmt: skip

    hooks = LoopHooks(
        evaluate=evaluation.evaluate if cfg.data.val else None, log_images=inspection_hook(run, engine.module)
    )
    code = run_loop(run, engine, optimizer, batches, hooks)
    return code or finish_with_export(run, evaluation.export, f"mIoU {run.state.best_miou:.4f}")


def build_objective(cfg: Config, run: StageRun, num_classes: int) -> Segmentation:
    """The encoder after the hand-off (no classifier; position embeddings resized to the crop) under a fresh head,
    its BatchNorm layers synchronised across ranks."""
    encoder = build_model(encoder_config(cfg), num_classes=0, plain=True)
    hand_off(encoder, run)
    o = cfg.objective
    model = SegmentationModel(encoder, o.head, num_classes, channels=o.channels, aux=o.aux_weight > 0)
    synchronise_batchnorm(model)
    return Segmentation(model, aux_weight=o.aux_weight, freeze_encoder=o.freeze_encoder)


def encoder_config(cfg: Config) -> Config:
    """The recipe with `model.global_pool: token`: no head pools here, and the class-token layout keeps the encoder's
    final norm as `norm` (the linear head reads it), where average pooling would move it to `fc_norm`."""
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"global_pool": "token"})})


class SegEvaluation:
    """The loop's `evaluate` hook: mIoU on data.val, the per-class IoU table at the last step, the best exported.

    Args:
        run: The stage.
        engine: The DeepSpeed engine around the `Segmentation` objective.
        classes: The class names (the index's).
        reduce_zero_label: The set's ids were shifted down from the dataset's own (ADE20K's): the pictures, the
            per-class table and the export's masks (`finetune predict`) name each class by its id in the dataset's
            own masks (`data.segmentation.dataset_ids`).
        num_classes: K.
        crop: The model's input size.
    """

    def __init__(
        self,
        run: StageRun,
        engine,
        *,
        classes: list[str],
        reduce_zero_label: bool,
        num_classes: int,
        crop: tuple[int, int],
    ):
        self.run, self.engine, self.classes, self.num_classes, self.crop = run, engine, classes, num_classes, crop
        self.reduce_zero_label = reduce_zero_label
        self.ids = dataset_ids(num_classes, reduce_zero_label)
        o = run.cfg.objective
        self.stride = None
        if o.eval_mode == "slide":
            self.stride = to_2tuple(o.eval_stride) if o.eval_stride else tuple(2 * side // 3 for side in crop)

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluate (collective), report, and export on a new best mIoU."""
        run = self.run
        metrics, confusion, examples = evaluate_segmentation(
            self.engine, self._loader(), dist=run.dist, precision=run.cfg.engine.precision,
            num_classes=self.num_classes, crop=self.crop, stride=self.stride, keep=PICTURE_ROWS,
        )  # fmt: skip
        if examples:  # rank 0's logger writes
            run.logger.image("val/segmentation", step, segmentation_picture(examples, self.classes, self.ids))
        run.logger.console(
            f"[mimpipe] step {step} eval: mIoU {metrics['val/miou']:.4f}  pixel acc {metrics['val/pixel_acc']:.4f}  "
            f"mean acc {metrics['val/mean_acc']:.4f}  ({int(metrics['val/images'])} images)"
        )
        if step == run.total_steps and run.cfg.eval.per_class:
            table = per_class_iou_table(confusion, self.classes, self.ids)
            run.logger.console(f"[mimpipe] per-class IoU at step {step}:\n{table}")
            run.logger.text("val/per_class_iou", step, table)
        if metrics["val/miou"] > run.state.best_miou:  # the same reduced value on every rank
            run.state.best_miou, run.state.best_step = metrics["val/miou"], step
            self.export(step, metrics)
        return metrics

    def export(self, step: int, metrics: dict[str, float]) -> None:
        """The encoder (timm layout) and the head's weights at `step`; collective under ZeRO-3."""
        run, cfg = self.run, self.run.cfg
        state_dict = gather_state_dict(self.engine, self.engine.module.model, run.dist)
        if not (run.dist.is_main and cfg.checkpoint.export_at_end):
            return
        encoder = {k.removeprefix(ENCODER_PREFIX): v for k, v in state_dict.items() if k.startswith(ENCODER_PREFIX)}
        head = {k: v.contiguous() for k, v in state_dict.items() if not k.startswith(ENCODER_PREFIX)}
        o = cfg.objective
        manifest = {
            "method": "segmentation",
            "step": step,
            "source": cfg.model.init,
            "classes": self.classes,
            "metrics": metrics,
            "config": cfg.model_dump(mode="json"),
            "segmentation": {
                "head": o.head, "channels": self.engine.module.model.channels, "aux": o.aux_weight > 0,
                "num_classes": self.num_classes, "reduce_zero_label": self.reduce_zero_label,
                "crop": list(self.crop), "eval_mode": o.eval_mode, "stride": self.stride and list(self.stride),
                "head_file": HEAD_FILE,
            },
        }  # fmt: skip
        out = run.run_dir / "export"
        export_state_dict(
            encoder_config(cfg), encoder, out, num_classes=0, manifest=manifest, run_dir=run.run_dir,
            extra_files={HEAD_FILE: lambda path: safetensors.torch.save_file(head, str(path))},
        )  # fmt: skip

    def _loader(self):
        cfg, dist = self.run.cfg, self.run.dist
        return make_eval_loader(
            resolve_shards(cfg.data.val),
            transform=SegEvalTransform(self.crop, cfg.data.mean, cfg.data.std, mode=cfg.objective.eval_mode),
            batch_size=1,  # masks keep their own size
            rank=dist.rank,
            world_size=dist.world_size,
            num_workers=cfg.data.num_workers,
            labels=False,
            read_policy=cfg.data.read_policy(),
            timeout_s=cfg.data.loader_timeout_s,
        )


def per_class_iou_table(confusion: torch.Tensor, classes: list[str], ids: list[int]) -> str:
    """class | id | pixels | IoU as a markdown table (id: the class's id in the dataset's own masks; pixels: how many
    the class covers; IoU "-" for a class that neither occurs nor is predicted), padded for a monospaced font."""
    scores = segmentation_scores(confusion)
    rows = [["class", "id", "pixels", "IoU"]]
    for name, k, pixels, iou in zip(classes, ids, confusion.sum(dim=1).tolist(), scores["iou"], strict=True):
        rows.append([name.replace("|", "\\|"), str(k), str(pixels), "-" if iou is None else f"{iou:.4f}"])
    return "\n".join([*markdown_table(rows), "", f"mIoU {scores['miou']:.4f}  pixel acc {scores['pixel_acc']:.4f}"])
