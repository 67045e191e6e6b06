"""Convert any checkpoint the hand-off accepts into our export folder (timm `local-dir` layout + manifest).

    python -m finetune convert SRC DST [--arch TIMM_NAME] [--trust-checkpoint]

The structure (width, depth, MLP ratio, patch size, image size from the position grid, classes from the head, ...)
is read from the weights; the number of attention heads cannot be, so a bare checkpoint needs `--arch`, a timm
architecture of the checkpoint's width (e.g. vit_base_patch16_224 for D = 768, deit_base_distilled_patch16_224 to
keep a DeiT distillation token). Our own export carries its config.json and needs none. The classifier head, if
any, is kept; decoder, mask token and other non-encoder tensors are dropped and listed in the manifest.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import timm
import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import VisionTransformer

from core.engine.export import export_model
from core.models import vit_model_args
from finetune.checkpoints import Checkpoint, has_module, read_checkpoint
from finetune.handoff import LoadReport, load_encoder

# Official MAE and DeiT weights were trained on ImageNet statistics; timm's plain ViT defaults are 0.5 / 0.5.
IMAGENET_FORMATS = ("mae-pretrain", "mae-finetune", "deit-distilled")


def main(argv: list[str] | None = None) -> int:
    """Command line: `argv` is what follows `python -m finetune convert`. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m finetune convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="checkpoint: export folder, .pth/.bin/.safetensors, MAE/DeiT pickle")
    parser.add_argument("dst", type=Path, help="export folder to write (replaced if it holds an earlier export)")
    parser.add_argument("--arch", help="timm architecture of the checkpoint's width (gives num_heads)")
    parser.add_argument(
        "--trust-checkpoint", action="store_true", help="allow unpickling non-tensor objects (can run code)"
    )
    args = parser.parse_args(argv)
    try:
        report = convert(args.src, args.dst, arch=args.arch, trust_checkpoint=args.trust_checkpoint)
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    print(report.format())
    print(f"[mimpipe] wrote {args.dst}: timm.create_model('local-dir:{args.dst}', pretrained=True)")
    return 0


def convert(src: str | Path, dst: str | Path, *, arch: str | None = None, trust_checkpoint: bool = False) -> LoadReport:
    """Write the checkpoint at `src` as our export at `dst`.

    Args:
        src: Any checkpoint `finetune.handoff.load_encoder` accepts.
        dst: Export folder to write.
        arch: timm architecture name; required unless `src` is our export.
        trust_checkpoint: Allow a full unpickle of `src`.

    Returns:
        The load report of the weights into the rebuilt model.

    Raises:
        ValueError: An unreadable or untrusted `src`, a missing or unfitting `arch`, or weights that do not load.
    """
    ckpt = read_checkpoint(src, trust=trust_checkpoint)
    model = _build_model(ckpt, arch).eval()
    keep_head = isinstance(model.head, torch.nn.Linear)
    report = load_encoder(model, src, head_init="keep", trust_checkpoint=trust_checkpoint, keep_head=keep_head)
    manifest = {
        "method": "convert",
        "checkpoint_format": report.checkpoint_format,
        "source": str(Path(src).resolve()),
        "pooling_hint": model.global_pool,
        "not_exported": report.dropped,
    }
    if ckpt.manifest:
        manifest["source_manifest"] = ckpt.manifest
    imagenet = {"mean": IMAGENET_DEFAULT_MEAN, "std": IMAGENET_DEFAULT_STD}
    data_config = imagenet if ckpt.format in IMAGENET_FORMATS else None
    export_model(model, dst, model_args=vit_model_args(model), manifest=manifest, data_config=data_config)
    return report


def infer_vit_args(state: dict[str, torch.Tensor]) -> dict:
    """timm VisionTransformer arguments read from a state dict (all but num_heads, which weights do not show).

    Raises:
        ValueError: A position grid that is not square (its image size cannot be told from the weights).
    """
    embed_dim, in_chans, ph, pw = state["patch_embed.proj.weight"].shape  # (D, C, ph, pw)
    num_reg = state["reg_token"].shape[1] if "reg_token" in state else 0
    num_prefix = int("cls_token" in state) + int("dist_token" in state) + num_reg
    num_patches = state["pos_embed"].shape[1] - num_prefix  # pos_embed: (1, P + N, D)
    side = math.isqrt(num_patches)
    if side * side != num_patches:
        raise ValueError(f"pos_embed holds {num_patches} grid positions, not a square grid: cannot infer img_size")
    args = dict(
        img_size=(side * ph, side * pw),
        patch_size=(ph, pw),
        in_chans=in_chans,
        embed_dim=embed_dim,
        depth=1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks.")),
        mlp_ratio=state["blocks.0.mlp.fc1.weight"].shape[0] / embed_dim,
        qkv_bias="blocks.0.attn.qkv.bias" in state,
        qk_norm="blocks.0.attn.q_norm.weight" in state,
        init_values=1.0 if "blocks.0.ls1.gamma" in state else None,  # LayerScale; its values are loaded
        class_token="cls_token" in state,
        reg_tokens=num_reg,
        num_classes=state["head.weight"].shape[0] if "head.weight" in state else 0,
        global_pool="avg" if has_module(state, "fc_norm") and not has_module(state, "norm") else "token",
    )
    return args


def _build_model(ckpt: Checkpoint, arch: str | None) -> VisionTransformer:
    """Our export from its config.json; any other checkpoint as `arch` with the structure read from its weights."""
    if arch is None:
        if ckpt.format != "mimpipe-export":
            raise ValueError(
                f"{ckpt.source} is a {ckpt.format} checkpoint: pass --arch, a timm architecture of its width "
                "(num_heads cannot be read from weights), e.g. vit_base_patch16_224"
            )
        return timm.create_model(f"local-dir:{ckpt.source.parent}", pretrained=False)
    if not timm.is_model(arch):
        raise ValueError(f"--arch {arch!r} is not a timm architecture")
    args = infer_vit_args(ckpt.state)
    with torch.device("meta"):
        reference = timm.create_model(arch, pretrained=False)
    if not isinstance(reference, VisionTransformer):
        raise ValueError(f"--arch {arch} builds a {type(reference).__name__}, not a timm VisionTransformer")
    if reference.embed_dim != args["embed_dim"]:
        raise ValueError(
            f"--arch {arch} has embed_dim {reference.embed_dim}, {ckpt.source} has {args['embed_dim']}: name the "
            "architecture the checkpoint was trained as (its num_heads is used)"
        )
    try:
        return timm.create_model(arch, pretrained=False, **args)
    except (AssertionError, TypeError) as e:  # timm asserts on arguments its variant does not support
        raise ValueError(f"--arch {arch} cannot be built with {args}: {e}") from e
