"""Convert any checkpoint the hand-off accepts into our export folder (timm `local-dir` layout + manifest).

    python -m finetune convert SRC DST [--num-heads N] [--arch TIMM_NAME] [--trust-checkpoint]
                                       [--push-to-hub ORG/NAME [--private]]

The structure (width, depth, MLP ratio, patch size, image size from the position grid, classes from the head, ...)
is read from the weights; the number of attention heads cannot be. For timm's standard widths it is timm's
(192, 384, 768, 1024, 1280: tiny, small, base, large, huge, with 3, 6, 12, 16, 16 heads) and the export is named
after that architecture (DeiT's distilled one when the checkpoint has a distillation token); any other width needs
`--num-heads`. `--arch` names the timm architecture to build instead (its heads are used unless `--num-heads` is
given). Our own export carries its config.json and needs none of them. The classifier head, if any, is kept;
decoder, mask token and other non-encoder tensors are dropped and listed in the manifest.

A hybrid ViT's weights (timm's `vit_*_r*` layout) are told by the ResNetV2 in front (`model.hybrid_backbone`
resnet_stem, r26 or r50, from its stages), whose stride gives the image size. T2T-ViT and VT-ResNet weights in our
layout (core/models/t2t_vit.py, core/models/vt.py; told by `tokens_to_token.*` and `layer4.*.transformer.*` keys) are
converted the same way: the structure is read from the weights and matched to a registered variant (`t2t_vit_14` ...
`t2t_vit_t_24`, `vt_resnet18` ... `vt_resnet101`; a T2T-ViT of another width needs `--num-heads`). What the weights
cannot show takes the variant's default: T2T's image size (224 px; its position table is fixed, never stored, and
rebuilt for any size) and pooling (class token).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import timm
import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import VisionTransformer
from torch import nn

from core.export.architecture import infer_hybrid_backbone, infer_vit_args, suggested_heads
from core.export.folder import export_model
from core.export.handoff import LoadReport, load_encoder
from core.export.hub import is_hub_spec
from core.export.push import check_push, push_export
from core.export.read import Checkpoint, read_checkpoint
from core.models.build import model_args
from core.models.t2t_vit import VARIANTS as T2T_VARIANTS
from core.models.vt import VARIANTS as VT_VARIANTS
from core.recipe.geometry import HYBRID_ARCHITECTURES, HYBRID_STRIDES

# Official MAE and DeiT weights were trained on ImageNet statistics; timm's plain ViT defaults are 0.5 / 0.5.
IMAGENET_FORMATS = ("mae-pretrain", "mae-finetune", "deit-distilled")

STANDARD_WIDTHS = {
    192: ("vit_tiny_patch16_224", 3),
    384: ("vit_small_patch16_224", 6),
    768: ("vit_base_patch16_224", 12),
    1024: ("vit_large_patch16_224", 16),
    1280: ("vit_huge_patch14_224", 16),
}
"""Width -> (timm architecture, its num_heads): what a checkpoint of that width is converted as without flags."""
DISTILLED_ARCHS = {192: "deit_tiny_distilled_patch16_224", 384: "deit_small_distilled_patch16_224"}
DISTILLED_DEFAULT = "deit_base_distilled_patch16_224"  # the class that keeps a distillation token, at any width
PLAIN_DEFAULT = "vit_base_patch16_224"  # the architecture named for a non-standard width given --num-heads


def main(argv: list[str] | None = None) -> int:
    """Command line: `argv` is what follows `python -m finetune convert`. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m finetune convert", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "src", type=Path, help="checkpoint: export folder, .pth/.bin/.safetensors, MAE/DeiT pickle, hf-hub:ORG/NAME"
    )
    parser.add_argument("dst", type=Path, help="export folder to write (replaced if it holds an earlier export)")
    parser.add_argument(
        "--num-heads", type=int, help="attention heads (needed for widths other than 192, 384, 768, 1024, 1280)"
    )
    parser.add_argument("--arch", help="timm architecture to build (its num_heads is used unless --num-heads)")
    parser.add_argument(
        "--trust-checkpoint", action="store_true", help="allow unpickling non-tensor objects (can run code)"
    )
    parser.add_argument("--push-to-hub", metavar="ORG/NAME", help="upload the export to this Hugging Face Hub repo")
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    args = parser.parse_args(argv)
    if args.private and not args.push_to_hub:
        parser.error("--private needs --push-to-hub ORG/NAME")
    try:
        target = check_push(args.push_to_hub) if args.push_to_hub else None  # before any work
        report = convert(
            args.src, args.dst, arch=args.arch, num_heads=args.num_heads, trust_checkpoint=args.trust_checkpoint
        )
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    print(report.format())
    print(f"[mimpipe] wrote {args.dst}: timm.create_model('local-dir:{args.dst}', pretrained=True)")
    if target is not None:
        message = f"mimpipe convert: {report.checkpoint_format} from {args.src}"
        try:
            url = push_export(args.dst, target, private=args.private, message=message)
        except ValueError as e:
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
            return 2
        print(f"[mimpipe] pushed {args.dst} to {url}: timm.create_model('hf-hub:{target.repo_id}', pretrained=True)")
    return 0


def convert(
    src: str | Path,
    dst: str | Path,
    *,
    arch: str | None = None,
    num_heads: int | None = None,
    trust_checkpoint: bool = False,
) -> LoadReport:
    """Write the checkpoint at `src` as our export at `dst`.

    Args:
        src: Any checkpoint `core.export.handoff.load_encoder` accepts.
        dst: Export folder to write.
        arch: timm architecture to build; None picks one by width (see the module docstring).
        num_heads: Attention heads; None takes them from `arch`, or from the width when it is a standard one.
        trust_checkpoint: Allow a full unpickle of `src`.

    Returns:
        The load report of the weights into the rebuilt model.

    Raises:
        ValueError: An unreadable or untrusted `src`, a non-standard width without `num_heads`, a `num_heads` that
            does not divide the width, an unfitting `arch`, or weights that do not load.
    """
    ckpt = read_checkpoint(src, trust=trust_checkpoint)
    model = build_from_checkpoint(ckpt, arch, num_heads).eval()
    # DeiT's get_classifier() is a pair (head, head_dist); VT-ResNet's classifier is `fc`.
    keep_head = isinstance(model.head if hasattr(model, "head") else model.get_classifier(), nn.Linear)
    report = load_encoder(model, src, head_init="keep", trust_checkpoint=trust_checkpoint, keep_head=keep_head)
    manifest = {
        "method": "convert",
        "checkpoint_format": report.checkpoint_format,
        "source": str(src) if is_hub_spec(src) else str(Path(src).resolve()),
        "pooling_hint": model.global_pool,
        "not_exported": report.dropped,
    }
    if ckpt.manifest:
        manifest["source_manifest"] = ckpt.manifest
    imagenet = {"mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD}
    data_config = imagenet if ckpt.format in IMAGENET_FORMATS else None
    export_model(model, dst, model_args=model_args(model), manifest=manifest, data_config=data_config)
    return report


def build_from_checkpoint(ckpt: Checkpoint, arch: str | None, num_heads: int | None) -> nn.Module:
    """Our export from its config.json; a T2T-ViT or VT-ResNet as the variant its weights match; any other
    checkpoint as a timm ViT with the structure read from its weights and the heads from `num_heads`, `arch` or the
    width, in that order."""
    if arch is None and num_heads is None and ckpt.format == "mimpipe-export":
        return timm.create_model(f"local-dir:{ckpt.source.parent}", pretrained=False)
    if "tokens_to_token.project.weight" in ckpt.state:
        return _build_family(ckpt, arch, *infer_t2t_args(ckpt.state, num_heads), T2T_VARIANTS)
    if "layer4.0.transformer.fc1.weight" in ckpt.state:
        if num_heads is not None:
            raise ValueError("--num-heads does not apply to VT-ResNet (its token transformer has one head)")
        return _build_family(ckpt, arch, *infer_vt_args(ckpt.state), VT_VARIANTS)
    args = infer_vit_args(ckpt.state)
    hybrid = infer_hybrid_backbone(ckpt.state)
    if hybrid is not None:  # the patch embedding reads the backbone's feature map, not the image
        in_chans, stride = hybrid[1], HYBRID_STRIDES[hybrid[0]]
        args.update(in_chans=in_chans, img_size=tuple(side * stride for side in args["img_size"]))
    width = args["embed_dim"]
    if num_heads is not None and (num_heads < 1 or width % num_heads):
        raise ValueError(f"--num-heads {num_heads} does not divide {ckpt.source}'s width {width}")
    if arch is None:
        arch, num_heads = _default_arch(ckpt, width, distilled="dist_token" in ckpt.state, num_heads=num_heads)
        arch = HYBRID_ARCHITECTURES[hybrid[0]][0] if hybrid is not None else arch
    if not timm.is_model(arch):
        raise ValueError(f"--arch {arch!r} is not a timm architecture")
    with torch.device("meta"):
        reference = timm.create_model(arch, pretrained=False)
    if not isinstance(reference, VisionTransformer):
        raise ValueError(f"--arch {arch} builds a {type(reference).__name__}, not a timm VisionTransformer")
    if num_heads is None and reference.embed_dim != width:
        raise ValueError(
            f"--arch {arch} has embed_dim {reference.embed_dim}, {ckpt.source} has {width}: name the architecture "
            "the checkpoint was trained as (its num_heads is used), or give --num-heads"
        )
    if num_heads is not None:
        args["num_heads"] = num_heads
    try:
        return timm.create_model(arch, pretrained=False, **args)
    except (AssertionError, TypeError) as e:  # timm asserts on arguments its variant does not support
        raise ValueError(f"--arch {arch} cannot be built with {args}: {e}") from e


def _default_arch(ckpt: Checkpoint, width: int, *, distilled: bool, num_heads: int | None) -> tuple[str, int]:
    """(architecture, num_heads) for a checkpoint converted without --arch: timm's of its width when standard."""
    standard = STANDARD_WIDTHS.get(width)
    if standard is None and num_heads is None:
        widths = ", ".join(map(str, STANDARD_WIDTHS))
        raise ValueError(
            f"{ckpt.source} is a {ckpt.format} checkpoint of width {width}, not one of timm's standard widths "
            f"({widths}), so its number of attention heads is unknown: pass --num-heads N, a divisor of {width} "
            f"(e.g. --num-heads {suggested_heads(width)}, heads of about 64 channels as in timm's ViTs)"
        )
    arch, heads = standard or (PLAIN_DEFAULT, num_heads)
    if distilled:
        arch = DISTILLED_ARCHS.get(width, DISTILLED_DEFAULT)
    return arch, num_heads or heads


def infer_t2t_args(state: dict[str, torch.Tensor], num_heads: int | None) -> tuple[str, dict]:
    """(the registered T2T-ViT variant, its arguments) that the weights in our layout show (core/models/t2t_vit.py).

    Raises:
        ValueError: A backbone width of no variant without `num_heads`, or a `num_heads` that does not divide it.
    """
    performer = "tokens_to_token.layers.0.kqv.weight" in state
    embed_dim = state["tokens_to_token.project.weight"].shape[0]  # (D, d * 3 * 3)
    args = dict(
        in_chans=state["tokens_to_token.layers.0.norm1.weight"].shape[0] // 7**2,  # the first 7x7 soft split
        embed_dim=embed_dim,
        depth=1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks.")),
        mlp_ratio=state["blocks.0.mlp.fc1.weight"].shape[0] / embed_dim,
        qkv_bias="blocks.0.attn.qkv.bias" in state,
        token_dim=state["tokens_to_token.layers.0.proj.weight"].shape[0],
        num_classes=state["head.weight"].shape[0] if "head.weight" in state else 0,
    )
    kind = "performer" if performer else "transformer"
    same_kind = {name: v for name, v in T2T_VARIANTS.items() if v["t2t_kind"] == kind}
    variant = next(
        (n for n, v in same_kind.items() if (v["embed_dim"], v["depth"]) == (embed_dim, args["depth"])), None
    )
    by_width = next((v for v in same_kind.values() if v["embed_dim"] == embed_dim), None)
    if num_heads is None and by_width is None:
        widths = sorted({v["embed_dim"] for v in same_kind.values()})
        raise ValueError(
            f"T2T-ViT weights of width {embed_dim}, not a variant's ({', '.join(map(str, widths))}): their number "
            f"of attention heads is unknown, pass --num-heads N (a divisor of {embed_dim})"
        )
    if num_heads is not None and (num_heads < 1 or embed_dim % num_heads):
        raise ValueError(f"--num-heads {num_heads} does not divide the T2T-ViT width {embed_dim}")
    args["num_heads"] = num_heads or by_width["num_heads"]
    return variant or next(iter(same_kind)), args


def infer_vt_args(state: dict[str, torch.Tensor]) -> tuple[str, dict]:
    """(the registered VT-ResNet variant, its arguments) that the weights in our layout show (core/models/vt.py).

    Raises:
        ValueError: ResNet stages or VT modules that match no variant.
    """
    bottleneck = "layer1.0.conv3.weight" in state

    def count(prefix: str) -> int:
        return len({k.split(".")[1] for k in state if k.startswith(prefix + ".")})

    layers, num_modules = tuple(count(f"layer{i}") for i in (1, 2, 3)), count("layer4")
    variant = next(
        (name for name, v in VT_VARIANTS.items() if (v["block"].expansion > 1, v["layers"], v["num_vt_modules"])
         == (bottleneck, layers, num_modules)),
        None,
    )  # fmt: skip
    if variant is None:
        block = "Bottleneck" if bottleneck else "BasicBlock"
        raise ValueError(
            f"VT-ResNet weights with {block} stages of {layers} blocks and {num_modules} VT modules match no variant "
            f"({', '.join(VT_VARIANTS)})"
        )
    args = dict(
        in_chans=state["conv1.weight"].shape[1],
        num_tokens=state["layer4.0.tokenizer.filters.weight"].shape[0],  # W_A: (L, C)
        token_dim=state["layer4.0.transformer.fc1.weight"].shape[0],
        num_classes=state["fc.weight"].shape[0] if "fc.weight" in state else 0,
    )
    return variant, args


def _build_family(ckpt: Checkpoint, arch: str | None, variant: str, args: dict, variants: dict) -> nn.Module:
    """The T2T-ViT or VT-ResNet `variant` (or `arch`, a variant of the same family) with `args`."""
    family = "T2T-ViT" if variants is T2T_VARIANTS else "VT-ResNet"
    if arch is not None and arch not in variants:
        raise ValueError(
            f"--arch {arch}: {ckpt.source} holds {family} weights, whose variants are {', '.join(variants)}"
        )
    return timm.create_model(arch or variant, pretrained=False, **args)
