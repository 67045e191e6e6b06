"""Masks for new images from a segmentation export (finetune/segment.py writes it).

    python -m finetune predict EXPORT --images DIR_OR_SHARDS --out DIR [--device cpu|cuda]

EXPORT is a segmentation run's export folder: its encoder (timm's layout), `seg_head.safetensors` and the
manifest's "segmentation" entry, which rebuild the model, and the recipe it records, which gives the normalisation.
Images are every image file in a folder (sorted; subfolders too) or every sample of shards (a folder with
index.json, a brace pattern, a glob or a local .tar). Each is predicted as the run evaluated (whole, or in sliding
windows), at its own size, and written to DIR/NAME.png as a palette PNG: its pixels are the class ids, shown in
Pascal VOC's colours (`core.report.pictures.class_colours`). DIR/classes.json lists the class names and colours.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import safetensors.torch
import timm
import torch
import torch.nn.functional as F
from PIL import Image

from core.export.manifest import MANIFEST_NAME
from core.report.pictures import class_colours
from data.decode import IMAGE_FIELDS, decode_rgb, image_field
from data.device import normalisation, normalise
from data.index import shard_samples
from data.seg_transforms import SegEvalTransform
from data.specs import resolve_shards
from finetune.seg_evaluate import predict
from finetune.seg_model import Segmentation, SegmentationModel

IMAGE_SUFFIXES = tuple(f".{field}" for field in IMAGE_FIELDS)


def main(argv: list[str] | None = None) -> int:
    """Command line: `argv` is what follows `python -m finetune predict`. Returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m finetune predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path, help="a segmentation run's export folder")
    parser.add_argument("--images", required=True, help="a folder of images, or shards (folder, pattern, .tar)")
    parser.add_argument("--out", required=True, type=Path, help="folder for the masks (created)")
    parser.add_argument("--device", default="cpu", help="torch device to predict on (default: cpu)")
    args = parser.parse_args(argv)
    try:
        model, info, config = load_segmenter(args.export)
        count = write_masks(model.to(args.device), info, config, args.images, args.out, torch.device(args.device))
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"[mimpipe] wrote {count} masks to {args.out} (palette PNGs: pixel = class id; {args.out}/classes.json)")
    return 0


def load_segmenter(export: Path) -> tuple[Segmentation, dict, dict]:
    """The model of a segmentation export in eval mode, its manifest's "segmentation" entry (with "classes"), and
    the recipe it was trained with.

    Raises:
        ValueError: The folder is not a segmentation export, or its head's weights do not fit the head it describes.
    """
    manifest_path = export / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    info = manifest.get("segmentation")
    if info is None:
        raise ValueError(f"{export} is not a segmentation export: {manifest_path} has no 'segmentation' entry")
    encoder = timm.create_model(f"local-dir:{export}", pretrained=True)
    model = SegmentationModel(encoder, info["head"], info["num_classes"], channels=info["channels"], aux=info["aux"])
    head = safetensors.torch.load_file(str(export / info["head_file"]))
    missing, unexpected = model.load_state_dict(head, strict=False)
    not_encoder = [key for key in missing if not key.startswith("encoder.")]
    if unexpected or not_encoder:
        raise ValueError(
            f"{export / info['head_file']} does not fit a {info['head']} head: unexpected {unexpected[:3]}, "
            f"missing {not_encoder[:3]}"
        )
    return Segmentation(model).eval(), {**info, "classes": manifest.get("classes") or []}, manifest["config"]


@torch.no_grad()
def write_masks(model: Segmentation, info: dict, config: dict, images: str, out: Path, device: torch.device) -> int:
    """Predict every image of `images` and write its mask (see the module docstring); returns how many."""
    crop = tuple(info["crop"])
    stride = tuple(info["stride"]) if info["stride"] else None
    data = config["data"]
    transform = SegEvalTransform(
        crop, data["mean"], data["std"], mode=info["eval_mode"], base_size=config["objective"].get("base_size")
    )
    affine = normalisation(data["mean"], data["std"]).to(device)
    colours = class_colours(info["num_classes"])
    out.mkdir(parents=True, exist_ok=True)
    count = 0
    for name, image in read_images(images):
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)  # (3, H, W) uint8 over an (H, W, 3) buffer
        pixels = transform.resize(pixels)[None].to(device)  # (1, 3, h, w) uint8
        logits = predict(model, normalise(pixels, affine), crop, stride)  # (1, K, h, w)
        logits = F.interpolate(logits, (image.height, image.width), mode="bilinear", align_corners=False)
        mask = Image.fromarray(logits.argmax(dim=1)[0].to(torch.uint8).cpu().numpy(), mode="P")
        mask.putpalette(colours[:-1].flatten().tolist())
        path = out / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        mask.save(path)
        count += 1
    names = info["classes"] or [f"class_{k}" for k in range(info["num_classes"])]
    legend = [{"id": k, "name": n, "colour": colours[k].tolist()} for k, n in enumerate(names)]
    (out / "classes.json").write_text(json.dumps(legend, indent=1) + "\n")
    return count


def read_images(spec: str) -> Iterator[tuple[str, Image.Image]]:
    """(name, RGB image) of every image file under a folder without an index.json, else of every shard sample."""
    if os.path.isdir(spec) and not os.path.isfile(os.path.join(spec, "index.json")):
        files = sorted(p for p in Path(spec).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ValueError(f"--images {spec}: no image files ({', '.join(IMAGE_SUFFIXES)}) and no index.json")
        for path in files:
            yield str(path.relative_to(spec).with_suffix("")), decode_rgb(path.read_bytes())
        return
    for shard in resolve_shards(spec):
        for sample in shard_samples(shard, frozenset(IMAGE_FIELDS)):
            field = image_field(sample)
            if field is not None:
                yield sample["__key__"], decode_rgb(sample[field])
