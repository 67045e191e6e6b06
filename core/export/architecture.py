"""The encoder `model.init` names, as recipe keys: what a checkpoint fixes, and the recipe completed from it.

`timm.create_model("local-dir:EXPORT")` needs nothing but the folder, and neither does a stage that takes `model.init`:
the recipe states what changes, and every architecture key it leaves out is the checkpoint's.

    our export (a folder,        config.json: arch and size (its architecture's name), embed_dim, depth, num_heads,
    or hf-hub:ORG/NAME)          patch_size, img_size, reg_tokens, class_token, LayerScale, T2T's and VT's variants;
                                 data.mean/std (its pretrained_cfg); mimpipe.json's recipe where the name does not say
    a state dict (official MAE   its shapes (a ViT's): embed_dim, depth, patch_size, img_size (a square grid),
    or DeiT, timm; .pth, ...)    reg_tokens, class_token, LayerScale, a hybrid's backbone. num_heads, which no shape
                                 shows: the recipe's (`model.num_heads`, or its `model.size`'s), else timm's for a
                                 standard width (core/recipe/geometry.py VIT_SIZES); another width needs model.num_heads

"Set by the recipe" means set in the recipe file, its `base:` or an override: pydantic's `model_fields_set` of the
`model` and `data` sections (the layers are merged into one tree before it is validated, core/recipe/tree.py). A key
the recipe sets wins where the hand-off adapts the checkpoint to it (`model.img_size` and `model.patch_size`: position
embeddings and patch kernel resized; `data.mean/std`); any other that disagrees with the checkpoint (`model.embed_dim`,
`model.depth`, `model.num_heads`, `model.arch`, ..., or a `model.size` whose preset does) is refused in one line
naming the key and both values (`InitMismatch`, a `ConfigError`: launch.sh's pre-flight and the stage's start print
it and exit 2). The sections keep the recipe's `model_fields_set` through the resolution, so resolving again takes,
and reports, the same keys.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
from pydantic import ValidationError
from timm.layers import to_2tuple

from core.export.read import Checkpoint, has_module, read_checkpoint
from core.recipe.config import Config, ConfigError
from core.recipe.geometry import HYBRID_ARCHITECTURES, HYBRID_STRIDES, VIT_SIZES
from core.recipe.sections import Section

CONFIG_JSON, MANIFEST, WEIGHTS = "config.json", "mimpipe.json", "the weights"
CHECKED = ("arch", "hybrid_backbone", "t2t_variant", "vt_variant", "vt_tokenizer", "resnet_variant", "embed_dim",
           "depth", "num_heads", "reg_tokens", "class_token", "layer_scale_init")  # fmt: skip
"""Keys a recipe may set only to the checkpoint's value (LayerScale: on or off; its values are loaded)."""
ORDER = ("arch", "size", "hybrid_backbone", "t2t_variant", "vt_variant", "vt_tokenizer", "resnet_variant", "embed_dim",
         "depth", "num_heads", "patch_size", "img_size", "reg_tokens", "class_token", "layer_scale_init")  # fmt: skip
"""The keys a plan line lists, in this order: `CHECKED`, the size and the two the hand-off resizes to."""
VIT_ARCHS = ("vit", "vit_hybrid")
SIZED = ("embed_dim", "depth", "num_heads")
"""What `model.size` presets for a ViT."""
STANDARD_SIZES = {dims["embed_dim"]: size for size, dims in VIT_SIZES.items()}
"""timm's standard widths -> their size (192 tiny ... 1280 huge), whose num_heads a state dict of that width gets."""
BUILT_MLP_RATIO = 4.0  # what every ViT `core/models` builds has; no recipe key changes it
DATA_KEYS = ("mean", "std")
HYBRID_BY_NAME = {name: backbone for backbone, (name, _) in HYBRID_ARCHITECTURES.items()}
T2T_NAME = re.compile(r"t2t_vit_((?:t_)?\d+)")
VT_NAME = re.compile(r"vt_resnet(\d+)")
RESNET_NAME = re.compile(r"resnet(\d+)")
VIT_NAME = re.compile(r"(?:vit|deit)_(tiny|small|base|large|huge)_")


class InitMismatch(ConfigError):
    """A recipe key that `model.init`'s checkpoint contradicts, or a completed recipe that does not validate."""

    def __init__(self, key: str, detail: str):
        super().__init__(f"{key}: {detail}")
        self.key, self.detail = key, detail


@dataclass
class Fixed:
    """What a checkpoint fixes about its encoder, as recipe keys, each with where it was read."""

    source: str
    """The checkpoint as the recipe names it."""
    model: dict[str, tuple[object, str]] = field(default_factory=dict)
    """`model.*` key -> (value, where: config.json, mimpipe.json, the weights)."""
    data: dict[str, tuple[tuple[float, ...], str]] = field(default_factory=dict)
    """data.mean / data.std -> (value, where)."""
    mlp_ratio: tuple[float, str] | None = None
    """The MLP ratio of a ViT (no recipe key sets it: the checkpoint must have the one `core/models` builds)."""


@dataclass
class InitArchitecture:
    """What the resolution took from `model.init`: the keys the recipe leaves out that the checkpoint changes from the
    schema's defaults, and where the number of heads came from when the checkpoint does not show it."""

    source: str
    taken: dict[str, tuple[object, str]] = field(default_factory=dict)
    """`model.*` key or `data.mean` / `data.std` -> (value, where)."""
    heads: str = ""
    """For a state dict: 'num_heads 2 from the recipe', 'num_heads 12 from model.size base'; '' otherwise."""

    def line(self) -> str:
        """'model from runs/quickstart/export: size tiny, embed_dim 128, depth 4, num_heads 4, patch_size 4, img_size
        28, mean/std (config.json)': what the plan and the load report say."""
        groups: dict[str, list[str]] = {}
        for key, (value, origin) in self.taken.items():
            if key.startswith("model."):
                groups.setdefault(origin, []).append(f"{key.removeprefix('model.')} {_show(value)}")
        normalisation = [key.removeprefix("data.") for key in self.taken if key.startswith("data.")]
        if normalisation:
            groups.setdefault(self.taken[f"data.{normalisation[0]}"][1], []).append("/".join(normalisation))
        own = sorted(groups, key=lambda origin: origin not in (CONFIG_JSON, MANIFEST, WEIGHTS))  # the file's first
        parts = [f"{', '.join(groups[origin])} ({origin})" for origin in own]
        parts += [self.heads] if self.heads else []
        return f"model from {self.source}: {'; '.join(parts) or 'the recipe sets every key the checkpoint fixes'}"


def resolve_architecture(cfg: Config, ckpt: Checkpoint | None = None) -> InitArchitecture | None:
    """Complete `cfg.model` and `cfg.data.mean/std` in place from `model.init` (see the module docstring); None
    without one.

    Args:
        cfg: The stage's config, as loaded.
        ckpt: `model.init` already read (shapes are enough); read here otherwise.

    Raises:
        InitMismatch: A recipe key the checkpoint contradicts, an unknown number of heads, or a completed recipe that
            fails the schema's checks (one line naming the key).
        ValueError: `model.init` cannot be read (the message names the file).
    """
    if not cfg.model.init:
        return None
    model, data, found = _complete(cfg, ckpt)
    try:
        cfg.model = _with_values(cfg.model, model)  # Config's cross-field checks run on each assignment
        cfg.data = _with_values(cfg.data, data)
    except ValidationError as err:
        reasons = "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
        raise InitMismatch(
            "model.init", f"{cfg.model.init} completes the recipe to an invalid one: {reasons}"
        ) from None
    return found


def init_architecture(cfg: Config, ckpt: Checkpoint | None = None) -> InitArchitecture | None:
    """What `resolve_architecture` takes (or took: the result is the same after it) from `model.init`, without
    changing `cfg`; None without `model.init`.

    Raises:
        InitMismatch, ValueError: As `resolve_architecture`.
    """
    return _complete(cfg, ckpt)[2] if cfg.model.init else None


def read_fixed(ckpt: Checkpoint, source: str | None = None) -> Fixed:
    """What `ckpt` fixes: from its config.json when it has timm's `architecture` and `model_args` (any export folder),
    else from its tensors' shapes."""
    source = source or str(ckpt.source)
    if ckpt.config.get("architecture") and isinstance(ckpt.config.get("model_args"), dict):
        return _from_config(ckpt, source)
    return _from_weights(ckpt, source)


def standard_heads(width: int) -> tuple[int, str] | None:
    """(num_heads, size) timm gives a ViT of this width (192 tiny ... 1280 huge); None for another width."""
    size = STANDARD_SIZES.get(width)
    return (VIT_SIZES[size]["num_heads"], size) if size else None


def suggested_heads(width: int) -> int:
    """The divisor of `width` whose head size is closest to 64 (timm's ViTs)."""
    return min((d for d in range(1, width + 1) if width % d == 0), key=lambda d: abs(width / d - 64))


def vit_shape_args(state: dict[str, torch.Tensor]) -> dict:
    """timm VisionTransformer arguments a ViT state dict's shapes show, but for img_size (`infer_vit_args`) and the
    number of heads (no shape shows it)."""
    embed_dim, in_chans, ph, pw = state["patch_embed.proj.weight"].shape  # (D, C, ph, pw)
    return dict(
        patch_size=(ph, pw),
        in_chans=in_chans,
        embed_dim=embed_dim,
        depth=1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks.")),
        mlp_ratio=state["blocks.0.mlp.fc1.weight"].shape[0] / embed_dim,
        qkv_bias="blocks.0.attn.qkv.bias" in state,
        qk_norm="blocks.0.attn.q_norm.weight" in state,
        init_values=1.0 if "blocks.0.ls1.gamma" in state else None,  # LayerScale; its values are loaded
        class_token="cls_token" in state,
        reg_tokens=state["reg_token"].shape[1] if "reg_token" in state else 0,  # (1, R, D)
        num_classes=state["head.weight"].shape[0] if "head.weight" in state else 0,
        global_pool="avg" if has_module(state, "fc_norm") and not has_module(state, "norm") else "token",
    )


def infer_vit_args(state: dict[str, torch.Tensor]) -> dict:
    """timm VisionTransformer arguments read from a state dict (all but num_heads, which weights do not show).

    Raises:
        ValueError: A position grid that is not square (its image size cannot be told from the weights).
    """
    args = vit_shape_args(state)
    side = _grid_side(state)
    if side is None:
        num_patches = state["pos_embed"].shape[1] - _num_prefix(state)
        raise ValueError(f"pos_embed holds {num_patches} grid positions, not a square grid: cannot infer img_size")
    ph, pw = args["patch_size"]
    return {"img_size": (side * ph, side * pw), **args}


def infer_hybrid_backbone(state: dict[str, torch.Tensor]) -> tuple[str, int] | None:
    """(`model.hybrid_backbone`, image channels) of a hybrid ViT's weights, told by its ResNetV2's stages; None for
    a plain ViT.

    Raises:
        ValueError: ResNetV2 stages of none of `core.recipe.geometry.HYBRID_ARCHITECTURES`.
    """
    prefix = "patch_embed.backbone."
    if "patch_embed.backbone.conv.weight" in state:  # the stem alone: (64, C, 7, 7)
        return "resnet_stem", state["patch_embed.backbone.conv.weight"].shape[1]
    if f"{prefix}stem.conv.weight" not in state:
        return None
    stages = sorted({int(k.split(".")[3]) for k in state if k.startswith(f"{prefix}stages.")})
    blocks = tuple(len({k.split(".")[5] for k in state if k.startswith(f"{prefix}stages.{i}.blocks.")}) for i in stages)
    backbone = {(2, 2, 2, 2): "r26", (3, 4, 9): "r50"}.get(blocks)
    if backbone is None:
        raise ValueError(
            f"hybrid ViT weights whose ResNetV2 has {blocks} blocks per stage: not r26 (2, 2, 2, 2) or r50 (3, 4, 9)"
        )
    return backbone, state[f"{prefix}stem.conv.weight"].shape[1]


def _complete(cfg: Config, ckpt: Checkpoint | None) -> tuple[dict, dict, InitArchitecture]:
    """(`model` values, `data` values, the report) that complete `cfg` from `model.init`."""
    m = cfg.model
    if ckpt is None:
        ckpt = read_checkpoint(m.init, trust=m.trust_checkpoint, shapes_only=True)
    fixed = read_fixed(ckpt, m.init)
    user, found = m.model_fields_set, InitArchitecture(m.init)
    values = {}
    for key, (value, origin) in fixed.model.items():
        if key not in user:
            values[key] = value
        elif key in CHECKED and not _agrees(key, getattr(m, key), value):
            raise InitMismatch(
                f"model.{key}",
                f"the recipe sets {_show(getattr(m, key))}, {m.init} has {_show(value)} ({origin}); leave it out to "
                "take the checkpoint's",
            )
    if values.get("arch", m.arch) in VIT_ARCHS:
        _check_size(m, fixed)
        found.heads = _heads(m, fixed, values)
        _check_mlp_ratio(m.init, fixed)
    defaults = type(m).model_fields
    for key in ORDER:
        if key in values and values[key] != defaults[key].default:
            found.taken[f"model.{key}"] = (values[key], fixed.model[key][1])
    data = {key: value for key, (value, _) in fixed.data.items() if key not in cfg.data.model_fields_set}
    for key, value in data.items():
        if value != type(cfg.data).model_fields[key].default:
            found.taken[f"data.{key}"] = (value, fixed.data[key][1])
    return values, data, found


def _check_size(m, fixed: Fixed) -> None:
    """A `model.size` the recipe sets presets width, depth and heads: each it does not set itself must be the
    checkpoint's."""
    if "size" not in m.model_fields_set:
        return
    preset = VIT_SIZES[m.size]
    for key in SIZED:
        if key in fixed.model and key not in m.model_fields_set and fixed.model[key][0] != preset[key]:
            value, origin = fixed.model[key]
            raise InitMismatch(
                "model.size",
                f"the recipe sets {m.size} ({key} {preset[key]}), {m.init} has {key} {value} ({origin}); leave "
                f"model.size out to take the checkpoint's",
            )


def _heads(m, fixed: Fixed, values: dict) -> str:
    """For a checkpoint that does not fix num_heads (a state dict): the recipe's (or its size's), else timm's for a
    standard width (put into `values` and `fixed`, with that size when the recipe sets none); returns the plan's words
    for heads the recipe gave ('' otherwise).

    Raises:
        InitMismatch: No heads for a width that is not standard, or heads that do not divide the width.
    """
    if "num_heads" in fixed.model or "embed_dim" not in fixed.model:
        return ""
    width, user = fixed.model["embed_dim"][0], m.model_fields_set
    standard = standard_heads(width)
    if standard is not None and "size" not in user:
        values["size"] = standard[1]
        fixed.model["size"] = (standard[1], f"timm's standard for width {width}")
    if "num_heads" in user:
        heads, where = m.num_heads, "from the recipe"
    elif "size" in user:
        heads, where = VIT_SIZES[m.size]["num_heads"], f"from model.size {m.size}"
    elif standard is not None:
        values["num_heads"] = standard[0]
        fixed.model["num_heads"] = (standard[0], f"timm's standard for width {width}")
        return ""
    else:
        widths = ", ".join(map(str, STANDARD_SIZES))
        raise InitMismatch(
            "model.num_heads",
            f"not set, and {m.init} is {width} wide, not one of timm's standard widths ({widths}); its weights do "
            f"not show the heads: set model.num_heads (e.g. {suggested_heads(width)})",
        )
    if width % heads:
        raise InitMismatch("model.num_heads", f"{heads} ({where}) does not divide {m.init}'s width {width}")
    return f"num_heads {heads} {where} (the weights do not show heads)"


def _check_mlp_ratio(init: str, fixed: Fixed) -> None:
    if fixed.mlp_ratio is not None and not math.isclose(fixed.mlp_ratio[0], BUILT_MLP_RATIO):
        ratio, origin = fixed.mlp_ratio
        raise InitMismatch(
            "model.init",
            f"{init} has MLP ratio {ratio:g} ({origin}); the recipe's ViT is built with {BUILT_MLP_RATIO:g} (no "
            "model key changes it)",
        )


def _from_config(ckpt: Checkpoint, source: str) -> Fixed:
    """config.json's architecture name and model_args; mimpipe.json's recipe for what the name does not say."""
    fixed, args = Fixed(source), ckpt.config["model_args"]
    name = ckpt.config["architecture"]
    recipe = (ckpt.manifest.get("config") or {}).get("model") or {}
    named = _family(name) or {}
    family = named or ({"arch": recipe["arch"]} if recipe.get("arch") else {})
    for key, value in family.items():
        fixed.model[key] = (value, CONFIG_JSON if key in named else MANIFEST)
    arch = family.get("arch")
    if recipe.get("arch") == arch and recipe.get("size") and arch in VIT_ARCHS:
        named = fixed.model.get("size", (None, ""))[0]
        fixed.model["size"] = (recipe["size"], CONFIG_JSON if recipe["size"] == named else MANIFEST)
    if arch in VIT_ARCHS:
        _vit_args(fixed, args, CONFIG_JSON)
        fixed.mlp_ratio = (args.get("mlp_ratio", BUILT_MLP_RATIO), CONFIG_JSON)
    elif arch == "t2t_vit":
        fixed.model |= {key: (args[key], CONFIG_JSON) for key in SIZED if key in args}
    elif arch == "vt_resnet":
        renamed = {"embed_dim": args.get("token_dim"), "vt_tokenizer": args.get("tokenizer")}
        fixed.model |= {key: (value, CONFIG_JSON) for key, value in renamed.items() if value is not None}
    if "img_size" in args and arch in ("t2t_vit", "vt_resnet"):  # a ViT's is `_vit_args`'; a ResNet takes any size
        fixed.model["img_size"] = (_side(args["img_size"]), CONFIG_JSON)
    pretrained = ckpt.config.get("pretrained_cfg") or {}
    for key in DATA_KEYS:
        value = pretrained.get(key)
        if isinstance(value, list | tuple) and len(value) == 3:
            fixed.data[key] = (tuple(float(v) for v in value), CONFIG_JSON)
    return fixed


def _from_weights(ckpt: Checkpoint, source: str) -> Fixed:
    """What a state dict's shapes fix: a ViT's (or hybrid's) structure but its heads; only the arch of the others."""
    fixed, state = Fixed(source), ckpt.state
    if "patch_embed.proj.weight" not in state:
        arch = "t2t_vit" if "tokens_to_token.project.weight" in state else None
        arch = arch or ("vt_resnet" if "layer4.0.transformer.fc1.weight" in state else "resnet")
        fixed.model["arch"] = (arch, WEIGHTS)
        return fixed
    try:
        hybrid = infer_hybrid_backbone(state)
    except ValueError:  # a ResNetV2 of no known hybrid: the arch is told, the backbone left to the recipe
        hybrid = ("?", 3)
    fixed.model["arch"] = ("vit" if hybrid is None else "vit_hybrid", WEIGHTS)
    if hybrid is not None and hybrid[0] in HYBRID_ARCHITECTURES:
        fixed.model["hybrid_backbone"] = (hybrid[0], WEIGHTS)
    args = vit_shape_args(state)
    side = _grid_side(state)
    stride = 1 if hybrid is None else HYBRID_STRIDES.get(hybrid[0])
    if side is not None and stride is not None:  # a hybrid's grid is its feature map's, the backbone's stride finer
        args["img_size"] = tuple(side * p * stride for p in args["patch_size"])
    _vit_args(fixed, args, WEIGHTS)
    fixed.mlp_ratio = (args["mlp_ratio"], WEIGHTS)
    return fixed


def _vit_args(fixed: Fixed, args: dict, origin: str) -> None:
    """A ViT's model_args (timm's names) as recipe keys."""
    for key in ("embed_dim", "depth", "num_heads"):
        if key in args:
            fixed.model[key] = (int(args[key]), origin)
    patch = to_2tuple(args.get("patch_size", 16))
    if patch[0] == patch[1]:  # model.patch_size is square; another kernel is resampled to the recipe's
        fixed.model["patch_size"] = (int(patch[0]), origin)
    if "img_size" in args:
        fixed.model["img_size"] = (_side(args["img_size"]), origin)
    fixed.model["reg_tokens"] = (int(args.get("reg_tokens", 0)), origin)
    fixed.model["class_token"] = (bool(args.get("class_token", True)), origin)
    fixed.model["layer_scale_init"] = (args.get("init_values"), origin)


def _family(name: str) -> dict | None:
    """`model.arch` and its variant keys from a timm architecture name; None for a name this code does not build."""
    if name in HYBRID_BY_NAME:
        return {"arch": "vit_hybrid", "hybrid_backbone": HYBRID_BY_NAME[name]}
    if match := T2T_NAME.fullmatch(name):
        return {"arch": "t2t_vit", "t2t_variant": match.group(1)}
    if match := VT_NAME.fullmatch(name):
        return {"arch": "vt_resnet", "vt_variant": int(match.group(1))}
    if match := RESNET_NAME.fullmatch(name):
        return {"arch": "resnet", "resnet_variant": int(match.group(1))}
    if match := VIT_NAME.match(name):
        return {"arch": "vit", "size": match.group(1)}
    return None


def _grid_side(state: dict[str, torch.Tensor]) -> int | None:
    """The side of a square position grid (pos_embed without its prefix positions), else None."""
    if "pos_embed" not in state:
        return None
    num_patches = state["pos_embed"].shape[1] - _num_prefix(state)  # pos_embed: (1, P + N, D)
    side = math.isqrt(max(num_patches, 0))
    return side if side and side * side == num_patches else None


def _num_prefix(state: dict[str, torch.Tensor]) -> int:
    num_reg = state["reg_token"].shape[1] if "reg_token" in state else 0
    return int("cls_token" in state) + int("dist_token" in state) + num_reg


def _side(img_size) -> int | tuple[int, int]:
    """An image size as `model.img_size` writes it: an int for a square."""
    h, w = to_2tuple(img_size)
    return int(h) if h == w else (int(h), int(w))


def _agrees(key: str, recipe: object, checkpoint: object) -> bool:
    if key == "layer_scale_init":  # on or off; the values themselves are loaded
        return (recipe is None) == (checkpoint is None)
    return recipe == checkpoint


def _show(value: object) -> str:
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return f"{value[0]}x{value[1]}"
    return str(value)


def _with_values(section: Section, values: dict) -> Section:
    """`section` with `values` validated in, still counting as set only the keys the recipe set (so that resolving
    again finds the same keys left to the checkpoint)."""
    if not values:
        return section
    kind = type(section)
    validated = kind.model_validate({**section.model_dump(exclude_unset=True), **values})
    return kind.model_construct(_fields_set=set(section.model_fields_set), **dict(validated))
