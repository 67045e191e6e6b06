"""The ViT paper's inspection of a trained encoder, as PNGs and numbers (core/report/vit_inspection.py).

    python -m finetune inspect EXPORT --images DIR_OR_SHARDS --out DIR [--num-images 8] [--device cpu]

EXPORT is any of our exports of a plain ViT (pretraining, fine-tuning or segmentation: its config.json rebuilds the
encoder in timm). Images are the first `--num-images` image files of a folder or samples of shards, resized to the
encoder's input size and normalised with the export's recipe (ImageNet's statistics when it records none). DIR gets:
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
from pathlib import Path

import numpy as np
import timm
import torch
import torch.nn.functional as F
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import PatchEmbed
from timm.models.vision_transformer import VisionTransformer
from torchvision.utils import save_image

from core.export.manifest import MANIFEST_NAME
from core.report.vit_inspection import (
    attention_rollout,
    attention_weights,
    filter_components,
    mean_attention_distance,
    output_token_map,
    patch_distances,
    position_similarity,
)
from core.report.vit_pictures import distance_picture, filters_picture, rollout_picture, similarity_picture
from finetune.predict import read_images

NUM_COMPONENTS = 28  # the ViT paper's figure 7 (left)


def main(argv: list[str] | None = None) -> int:
    """Command line: `argv` is what follows `python -m finetune inspect`. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m finetune inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path, help="an export folder of a plain ViT")
    parser.add_argument("--images", required=True, help="a folder of images, or shards (folder, pattern, .tar)")
    parser.add_argument("--out", required=True, type=Path, help="folder for the pictures (created)")
    parser.add_argument("--num-images", type=int, default=8, help="images to average over and draw (default: 8)")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    args = parser.parse_args(argv)
    try:
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
    plain = isinstance(vit, VisionTransformer) and isinstance(vit.patch_embed, PatchEmbed)
    if not (plain and vit.pos_embed is not None):
        raise ValueError(
            f"{export} holds a {type(vit).__name__} ({vit.patch_embed.__class__.__name__ if plain else 'no ViT'}); "
            "inspection needs a plain ViT's patch and position embeddings"
        )
    manifest_path = export / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    data = manifest.get("config", {}).get("data", {})
    return vit, data.get("mean") or list(IMAGENET_DEFAULT_MEAN), data.get("std") or list(IMAGENET_DEFAULT_STD)


def load_images(spec: str, count: int, size: tuple[int, int]) -> torch.Tensor:
    """The first `count` images of `spec` resized to `size`, (B, 3, H, W) in [0, 1]."""
    pictures = []
    for _, image in itertools.islice(read_images(spec), count):
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).float()[None] / 255
        pictures.append(F.interpolate(pixels, size=tuple(size), mode="bilinear", antialias=True, align_corners=False))
    if not pictures:
        raise ValueError(f"--images {spec}: no images")
    return torch.cat(pictures).clamp(0, 1)


@torch.no_grad()
def inspect(vit: VisionTransformer, images: torch.Tensor, mean, std, out: Path) -> dict:
    """Compute the four inspections on `images` (B, 3, H, W in [0, 1]), write the PNGs and inspection.json to
    `out`; returns the numbers (also the JSON's content)."""
    grid, patch = tuple(vit.patch_embed.grid_size), vit.patch_embed.patch_size[0]
    num_prefix = 0 if vit.no_embed_class else vit.num_prefix_tokens
    normalised = (images - torch.tensor(mean)[:, None, None].to(images)) / torch.tensor(std)[:, None, None].to(images)
    attentions = attention_weights(vit, normalised)
    distances = torch.stack([mean_attention_distance(a, patch_distances(grid, patch).to(a), vit.num_prefix_tokens)
                             for a in attentions])  # fmt: skip
    components, shares = filter_components(vit.patch_embed.proj.weight, NUM_COMPONENTS)
    similarity = position_similarity(vit.pos_embed, num_prefix)
    heat = output_token_map(attention_rollout(attentions), vit.num_prefix_tokens, grid)
    out.mkdir(parents=True, exist_ok=True)
    pictures = {
        "filters.png": filters_picture(components),
        "position_similarity.png": similarity_picture(similarity.cpu(), grid),
        "attention_distance.png": distance_picture(distances.cpu(), patch),
        "attention_rollout.png": rollout_picture(images.cpu(), heat.cpu()),
    }
    for name, picture in pictures.items():
        save_image(picture, out / name)
    numbers = {
        "files": list(pictures),
        "grid": list(grid),
        "patch": patch,
        "images": len(images),
        "filter_variance_share": shares.tolist(),
        "mean_attention_distance_px": distances.tolist(),  # [block][head]
        "position_similarity": similarity.tolist(),
    }
    (out / "inspection.json").write_text(json.dumps(numbers))
    return numbers
