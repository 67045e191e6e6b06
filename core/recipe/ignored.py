"""Recipe keys a stage does not read. Setting one to anything but its default (in the recipe, a `base:` it inherits, or
an override) is an error that names the key and the stage, instead of a silent no-op; a key at its default (as a
run_dir/config.yaml dump holds every key) passes. A stage's entry applies to all its objectives, a `stage/kind` entry
to one objective (segmentation fine-tuning reads less than classification).

Keys a stage reads only in some settings (data.val without the kNN monitor) are not listed: they are read somewhere in
that stage, and the cross-checks in core/recipe/config.py refuse the combinations that make them meaningless.
"""

from __future__ import annotations

from pydantic import BaseModel

from core.recipe.tree import flatten

IGNORED: dict[str, dict[str, str]] = {
    "pretrain": {
        "model.num_classes": "pretraining builds the encoder without a classifier",
        "model.head_init": "pretraining builds the encoder without a classifier",
        "model.head_init_std": "pretraining builds the encoder without a classifier",
        "augment": "it is fine-tuning's augmentation; pretraining crops and flips (data.crop_scale)",
        "distill": "distillation is a fine-tuning method",
        "eval.every_steps": "pretraining evaluates with eval.knn and eval.features at their own every_steps",
        "eval.per_class": "it is fine-tuning's per-class table",
        "data.eval_batch_size_per_device": "the monitors batch with eval.knn/eval.features.batch_size_per_device",
    },
    "tokenizer": {
        "model": "the VQ-VAE's shape is objective.* (img_size, downsample, codebook_size, ...)",
        "augment": "it is fine-tuning's augmentation",
        "distill": "distillation is a fine-tuning method",
        "eval": "the tokenizer stage evaluates nothing (its codebook usage is logged as it trains)",
        "data.val": "the tokenizer stage evaluates nothing on held-out images",
        "data.label_field": "the VQ-VAE reads images only",
        "data.eval_crop_pct": "the tokenizer stage evaluates nothing",
        "data.eval_batch_size_per_device": "the tokenizer stage evaluates nothing",
        "engine.attention": "the VQ-VAE has no attention layers",
        "optim.layer_decay": "the VQ-VAE has no blocks to decay the learning rate over",
    },
    "finetune": {
        "data.decode": "fine-tuning's crops (policies, erasing, segmentation's) decode in the data workers",
        "data.hflip": "fine-tuning flips with augment.hflip",
    },
    "finetune/segmentation": {
        "model.head_init": "the encoder gets no classifier; the segmentation head has its own init",
        "model.head_init_std": "the encoder gets no classifier; the segmentation head has its own init",
        "data.crop_scale": "segmentation crops with objective.scale around objective.base_size",
        "data.eval_crop_pct": "segmentation evaluates whole images (objective.eval_mode)",
        "data.eval_batch_size_per_device": "segmentation evaluates one image at a time (objective.eval_mode)",
        "data.label_field": "segmentation reads masks, not class labels",
        "augment.mix_prob": "segmentation mixes no images (no Mixup / CutMix)",
        "augment.mix_switch_prob": "segmentation mixes no images (no Mixup / CutMix)",
    },
}
"""Stage or `stage/objective kind` -> {dotted key or section: why it is not read there}."""


def check_ignored(config: BaseModel, stage: str, kind: str) -> None:
    """Raise ValueError naming the first key of `IGNORED[stage]` or `IGNORED[f"{stage}/{kind}"]` that `config` sets to
    a value other than its default (a section: the first of its keys that differs)."""
    for scope, where in ((stage, f"stage {stage}"), (f"{stage}/{kind}", f"stage {stage} with objective {kind}")):
        for key, why in IGNORED.get(scope, {}).items():
            changed = _changed(config, key)
            if changed:
                raise ValueError(f"{changed} is set, but {where} does not read it: {why}; remove it from the recipe")


def _changed(config: BaseModel, dotted: str) -> str | None:
    """The dotted key (or the first key under a section) whose value differs from its default, else None."""
    *parents, name = dotted.split(".")
    section = config
    for part in parents:
        section = getattr(section, part)
    value = getattr(section, name)
    if isinstance(value, BaseModel):
        default = flatten(type(value)().model_dump(mode="json"))
        return next(
            (f"{dotted}.{k}" for k, v in flatten(value.model_dump(mode="json")).items() if default.get(k) != v), None
        )
    return dotted if value != getattr(type(section)(), name) else None
