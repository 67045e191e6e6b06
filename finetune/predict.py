"""Masks for new images from a segmentation export (finetune/segment.py writes it).

    python -m finetune predict EXPORT --images DIR_OR_SHARDS --out DIR [--device cpu|cuda] [--training-ids]

EXPORT is a segmentation run's export folder: its encoder (timm's layout), `seg_head.safetensors` and the
manifest's "segmentation" entry, which rebuild the model, and the recipe it records, which gives the normalisation.
Images are every image file in a folder (sorted; subfolders too) or every sample of shards (a folder with
index.json, a brace pattern, a glob or a local .tar). Each is predicted as the run evaluated (whole, or in sliding
windows), at its own size, and written to DIR/NAME.png as a palette PNG: its pixels are class ids, shown in Pascal
VOC's colours (`core.report.pictures.class_colours`).

The ids are the dataset's own, those of its annotations and of the tools that score them (ADE20K's, mmsegmentation's
`format_results`): a set written with reduce-zero-label (ADE20K's convention, the manifest records it) trained on
ids 0..K-1 for the dataset's 1..K, so training id k is written as k + 1, and 0 ("other") is never predicted.
`--training-ids` writes the training ids instead. DIR/classes.json lists, per class, its name, its colour, the id
written in the masks and its training id.
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
from data.segmentation import dataset_ids
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
    parser.add_argument(
        "--training-ids", action="store_true", help="write the ids the model was trained on, not the dataset's own"
    )
    args = parser.parse_args(argv)
    try:
        model, info, config = load_segmenter(args.export)
        ids = written_ids(info, args.export, training_ids=args.training_ids)
        device = torch.device(args.device)
        count = write_masks(model.to(device), info, ids, config, args.images, args.out, device)
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    which = "training ids" if args.training_ids else "the dataset's own ids"
    print(f"[mimpipe] wrote {count} masks to {args.out} (palette PNGs: pixel = {which}; {args.out}/classes.json)")
    return 0


def written_ids(info: dict, export: Path, *, training_ids: bool) -> list[int]:
    """The id each training class is written as: the dataset's own (`data.segmentation.dataset_ids`, from the
    manifest's reduce_zero_label), or the training ids themselves with `training_ids`.

    Raises:
        ValueError: The export does not record reduce_zero_label (mimpipe before it did): the dataset's ids are not
            known, and guessing would shift every class of an ADE20K-style set.
    """
    if training_ids:
        return list(range(info["num_classes"]))
    if "reduce_zero_label" not in info:
        raise ValueError(
            f"{export / MANIFEST_NAME} does not record whether the set's ids were reduced (exported by an older "
            "mimpipe), so the dataset's own ids are not known: pass --training-ids to write the ids it was trained "
            "on, or export the run again"
        )
    return dataset_ids(info["num_classes"], info["reduce_zero_label"])


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
def write_masks(
    model: Segmentation, info: dict, ids: list[int], config: dict, images: str, out: Path, device: torch.device
) -> int:
    """Predict every image of `images` and write its mask, training class k as id `ids[k]` (see the module
    docstring); returns how many."""
    crop = tuple(info["crop"])
    stride = tuple(info["stride"]) if info["stride"] else None
    data = config["data"]
    transform = SegEvalTransform(
        crop, data["mean"], data["std"], mode=info["eval_mode"], base_size=config["objective"].get("base_size")
    )
    affine = normalisation(data["mean"], data["std"]).to(device)
    lookup = torch.tensor(ids, dtype=torch.uint8, device=device)  # (K,): training id -> written id
    palette = class_colours(max(ids) + 1)[:-1]  # (max id + 1, 3): each written id's colour
    out.mkdir(parents=True, exist_ok=True)
    count = 0
    for name, image in read_images(images):
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)  # (3, H, W) uint8 over an (H, W, 3) buffer
        pixels = transform.resize(pixels)[None].to(device)  # (1, 3, h, w) uint8
        logits = predict(model, normalise(pixels, affine), crop, stride)  # (1, K, h, w)
        logits = F.interpolate(logits, (image.height, image.width), mode="bilinear", align_corners=False)
        mask = Image.fromarray(lookup[logits.argmax(dim=1)[0]].cpu().numpy(), mode="P")
        mask.putpalette(palette.flatten().tolist())
        path = out / f"{name}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        mask.save(path)
        count += 1
    names = info["classes"] or [f"class_{k}" for k in range(info["num_classes"])]
    legend = [
        {"name": name, "colour": palette[ids[k]].tolist(), "id": ids[k], "training_id": k}
        for k, name in enumerate(names)
    ]
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
