"""How the model card (core/export/card.py) names things: the model as built, which timm's architecture name may not
say (config.json's `architecture` is the registered name closest to it, its `model_args` set the shape), and how the
weights a run started from were made (a pretraining method, a converted official checkpoint, a fine-tuning)."""

from __future__ import annotations

import re

from core.export.card_facts import InitFacts
from core.recipe.geometry import VIT_SIZES

PRETRAINING = ("mae", "beit", "simmim", "data2vec2", "ijepa")
METHOD_NAMES = {"mae": "MAE", "beit": "BEiT", "simmim": "SimMIM", "data2vec2": "data2vec 2.0", "ijepa": "I-JEPA"}
FORMAT_NAMES = {
    "mae-pretrain": "MAE pretraining, official checkpoint layout",
    "mae-finetune": "MAE fine-tuning, official checkpoint layout",
    "deit-distilled": "DeiT distillation, official checkpoint layout",
    "timm": "a timm state dict",
}
"""core/export/read.py's checkpoint formats, as the card names an init or a converted checkpoint."""
TIMM_VIT_NAME = re.compile(
    r"(?P<family>vit|deit)_(?P<size>[a-z]+)(?P<distilled>_distilled)?_patch(?P<patch>\d+)_(?P<img>\d+)"
)
"""A timm ViT name (`vit_tiny_patch16_224`, `deit_base_distilled_patch16_224`): family, size, patch, image side."""


def model_name(config: dict) -> str:
    """The model as built: timm's architecture name when its arguments are what the name says, else the family and
    its shape from config.json's model_args (`ViT (128 wide, 4 blocks, patch 4, 28 px)` for a `vit_tiny_patch16_224`
    built 128 wide, 4 blocks deep, at patch 4 and 28 px); the name as it is for one it does not spell out (a hybrid)."""
    arch, args = str(config.get("architecture") or "model"), config.get("model_args") or {}
    named = TIMM_VIT_NAME.fullmatch(arch)
    if named is None:
        return arch
    size = VIT_SIZES.get(named["size"], {})
    width, depth = args.get("embed_dim", size.get("embed_dim")), args.get("depth", size.get("depth"))
    patch, img = _sides(args.get("patch_size", named["patch"])), _sides(args.get("img_size", named["img"]))
    as_named = (size.get("embed_dim"), size.get("depth"), _sides(named["patch"]), _sides(named["img"]))
    if None in (width, depth, patch, img) or (width, depth, patch, img) == as_named:
        return arch
    family = {"vit": "ViT", "deit": "DeiT"}[named["family"]] + (" distilled" if named["distilled"] else "")
    return f"{family} ({width} wide, {depth} blocks, patch {_pair_text(patch)}, {_pair_text(img)} px)"


def _sides(value: object) -> tuple[int, int] | None:
    """An image or patch size as (height, width): from an int, a numeric string or a pair (None otherwise)."""
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        return int(value), int(value)
    if isinstance(value, list | tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    return None


def _pair_text(pair: tuple[int, int]) -> str:
    """28 for (28, 28), 28x32 otherwise."""
    return str(pair[0]) if pair[0] == pair[1] else f"{pair[0]}x{pair[1]}"


def init_origin(init: InitFacts) -> str:
    """How the weights a run started from were made, e.g. "MAE pretraining, step 700" ("" when not known)."""
    manifest = init.manifest
    method, fmt = str(manifest.get("method") or ""), manifest.get("checkpoint_format") or init.checkpoint_format
    step = f", step {manifest['step']:,}" if isinstance(manifest.get("step"), int) else ""
    if method in PRETRAINING:
        return f"{METHOD_NAMES[method]} pretraining{step}"
    if method == "convert":
        run_method = (manifest.get("source_manifest") or {}).get("method")
        made = f"{METHOD_NAMES[run_method]} pretraining" if run_method in PRETRAINING else FORMAT_NAMES.get(fmt, fmt)
        return f"{made}, converted by mimpipe" if made else "converted by mimpipe"
    if method == "segmentation":
        return f"semantic segmentation fine-tuning{step}"
    if method.startswith("deit-distill"):
        return f"DeiT distillation{step}"
    if method == "finetune":
        how = "linear probe" if manifest.get("mode") == "linear_probe" else "fine-tuning"
        return f"image classification {how}{step}"
    return FORMAT_NAMES.get(init.checkpoint_format or "", "")
