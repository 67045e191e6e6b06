"""Recipe keys a stage does not read. Setting one to anything but its default (in the recipe, a `base:` it inherits, or
an override) is an error that names the key and the stage, instead of a silent no-op; a key at its default (as a
run_dir/config.yaml dump holds every key) passes.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

IGNORED: dict[str, dict[str, str]] = {
    "pretrain": {
        "model.num_classes": "pretraining builds the encoder without a classifier",
        "model.head_init": "pretraining builds the encoder without a classifier",
        "model.head_init_std": "pretraining builds the encoder without a classifier",
        "augment": "it is fine-tuning's augmentation; pretraining crops and flips (data.crop_scale)",
        "distill": "distillation is a fine-tuning method",
        "eval.every_steps": "pretraining evaluates with eval.knn and eval.features at their own every_steps",
        "eval.per_class": "it is fine-tuning's per-class table",
    },
    "tokenizer": {
        "model": "the VQ-VAE's shape is objective.* (img_size, downsample, codebook_size, ...)",
        "augment": "it is fine-tuning's augmentation",
        "distill": "distillation is a fine-tuning method",
    },
}
"""Stage -> {dotted key or section: why the stage does not read it}."""


def check_ignored(config: BaseModel, stage: str) -> None:
    """Raise ValueError naming the first key of `IGNORED[stage]` that `config` sets to a value other than its default
    (a section: the first of its keys that differs)."""
    for key, why in IGNORED.get(stage, {}).items():
        changed = _changed(config, key)
        if changed:
            raise ValueError(f"{changed} is set, but stage {stage} does not read it: {why}; remove it from the recipe")


def _changed(config: BaseModel, dotted: str) -> str | None:
    """The dotted key (or the first key under a section) whose value differs from its default, else None."""
    *parents, name = dotted.split(".")
    section = config
    for part in parents:
        section = getattr(section, part)
    value = getattr(section, name)
    if isinstance(value, BaseModel):
        default = _flat(type(value)().model_dump(mode="json"))
        return next(
            (f"{dotted}.{k}" for k, v in _flat(value.model_dump(mode="json")).items() if default.get(k) != v), None
        )
    return dotted if value != getattr(type(section)(), name) else None


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        out |= _flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}
    return out
