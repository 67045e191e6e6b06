"""The ViT paper's inspection of a trained encoder, as PNGs and numbers (core/report/vit_inspection.py).

    python -m finetune inspect EXPORT --images DIR_OR_SHARDS --out DIR [--num-images 8] [--device cpu]
                               [--arch TIMM_NAME] [--num-heads N] [--trust-checkpoint]

EXPORT is any of our exports of a plain ViT (pretraining, fine-tuning or segmentation: its config.json rebuilds the
encoder in timm), or any checkpoint the hand-off accepts (an official MAE or DeiT file, a timm state dict), rebuilt
as `python -m finetune convert` does (`--arch`, `--num-heads` and `--trust-checkpoint` as there). Images are the
first `--num-images` image files of a folder or samples of shards, resized to the encoder's input size and
normalised with the export's recipe (ImageNet's statistics when it records none). DIR gets:
    filters.png              the first 28 principal components of the patch-embedding filters
    position_similarity.png  each position embedding's cosine similarity with every other, a grid of grids
    attention_distance.png   mean attention distance (px) of every head in every block, over the images
    attention_rollout.png    each image and what of it reaches the output token (attention rollout)
    inspection.json          the numbers behind them (the position similarities as an N x N list)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import timm
import torch
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models.vision_transformer import VisionTransformer
from torchvision.utils import save_image

from core.export.manifest import MANIFEST_NAME
from core.report.vit_pictures import inspectable, inspection
from data.device import normalisation, normalise
from finetune.convert import convert
from finetune.predict import read_images


def main(argv: list[str] | None = None) -> int:
    """Command line: `argv` is what follows `python -m finetune inspect`. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m finetune inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path, help="an export folder of a plain ViT")
    parser.add_argument("--images", required=True, help="a folder of images, or shards (folder, pattern, .tar)")
    parser.add_argument("--out", required=True, type=Path, help="folder for the pictures (created)")
    parser.add_argument("--num-images", type=int, default=8, help="images to average over and draw (default: 8)")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument("--arch", default=None, help="a checkpoint's timm architecture (as `finetune convert`)")
    parser.add_argument("--num-heads", type=int, default=None, help="a checkpoint's attention heads (as `convert`)")
    parser.add_argument("--trust-checkpoint", action="store_true", help="allow a full unpickle (as `convert`)")
    args = parser.parse_args(argv)
    try:
        if not (args.export / "config.json").is_file():  # a checkpoint: rebuilt as an export first
            with tempfile.TemporaryDirectory() as tmp:
                convert(args.export, Path(tmp) / "export", arch=args.arch, num_heads=args.num_heads,
                        trust_checkpoint=args.trust_checkpoint)  # fmt: skip
                vit, mean, std = load_vit(Path(tmp) / "export")
        else:
            vit, mean, std = load_vit(args.export)
        images = load_images(args.images, args.num_images, vit.patch_embed.img_size)
        numbers = inspect(vit.to(args.device), images.to(args.device), mean, std, args.out)
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"[mimpipe] inspected {args.export} on {len(images)} images: {args.out}/ ({', '.join(numbers['files'])})")
    return 0


def load_vit(export: Path) -> tuple[VisionTransformer, list[float], list[float]]:
    """The export's encoder in eval mode and the normalisation its recipe trained with.

    Raises:
        ValueError: The folder is not an export, or its encoder is not a plain ViT (patch and position embeddings).
    """
    if not (export / "config.json").is_file():
        raise ValueError(f"{export} is not an export folder (no config.json)")
    vit = timm.create_model(f"local-dir:{export}", pretrained=True).eval()
    if not inspectable(vit):
        raise ValueError(
            f"{export} holds a {type(vit).__name__}; inspection needs a plain ViT's patch and position embeddings"
        )
    manifest_path = export / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    data = manifest.get("config", {}).get("data", {})
    return vit, data.get("mean") or list(IMAGENET_DEFAULT_MEAN), data.get("std") or list(IMAGENET_DEFAULT_STD)


def load_images(spec: str, count: int, size: tuple[int, int]) -> torch.Tensor:
    """The first `count` images of `spec` resized to `size`, (B, 3, H, W) uint8."""
    pictures = []
    for _, image in itertools.islice(read_images(spec), count):
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).float()[None]  # (1, 3, h, w) in 0..255
        resized = F.interpolate(pixels, size=tuple(size), mode="bilinear", antialias=True, align_corners=False)
        pictures.append(resized.round().clamp(0, 255).to(torch.uint8))
    if not pictures:
        raise ValueError(f"--images {spec}: no images")
    return torch.cat(pictures)


def inspect(vit: VisionTransformer, images: torch.Tensor, mean, std, out: Path) -> dict:
    """The four inspections on uint8 `images` (B, 3, H, W), normalised as the training data was, written to `out` as
    PNGs and inspection.json; returns the numbers (the JSON's content)."""
    normalised = normalise(images, normalisation(mean, std).to(images.device))
    pictures, numbers = inspection(vit, normalised, mean, std)
    out.mkdir(parents=True, exist_ok=True)
    for name, picture in pictures.items():
        save_image(picture, out / f"{name}.png")
    numbers = {"files": [f"{name}.png" for name in pictures], **numbers}
    (out / "inspection.json").write_text(json.dumps(numbers))
    return numbers
