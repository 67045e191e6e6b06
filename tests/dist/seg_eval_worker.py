"""torchrun worker: segmentation evaluation of one seeded model over the scenes' validation shards.

    seg_eval_worker.py VAL_SHARDS MODE [MODE ...]

Each MODE is "whole" or "slide", evaluated in turn. Every rank streams its own shards; per mode rank 0 prints
`metrics MODE MIOU PIXEL_ACC MEAN_ACC IMAGES` and `confusion MODE` with the confusion matrix's cells, which must not
depend on the world size.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from core.engine.distributed import DistInfo
from core.models.vit import build_vit
from data.pipeline import make_eval_loader
from data.seg_transforms import SegEvalTransform
from data.specs import resolve_shards
from data.worker_process import start_fork_server
from finetune.seg_evaluate import evaluate_segmentation
from finetune.seg_model import Segmentation, SegmentationModel

CROP = (32, 32)


def main() -> None:
    val, modes = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    info = DistInfo(dist.get_rank(), int(os.environ["LOCAL_RANK"]), dist.get_world_size(), torch.device("cpu"))
    torch.manual_seed(0)
    vit = build_vit("tiny", img_size=32, patch_size=4, embed_dim=32, depth=4, num_heads=2, num_classes=0)
    objective = Segmentation(SegmentationModel(vit, "upernet", 11, channels=16)).eval()
    for mode in modes:
        loader = make_eval_loader(
            resolve_shards(val), transform=SegEvalTransform(CROP, (0.5,) * 3, (0.25,) * 3, mode=mode), batch_size=1,
            rank=info.rank, world_size=info.world_size, num_workers=1, labels=False,
        )  # fmt: skip
        stride = (20, 20) if mode == "slide" else None
        metrics, confusion, _ = evaluate_segmentation(
            objective, loader, dist=info, precision="fp32", num_classes=11, crop=CROP, stride=stride
        )
        if info.rank == 0:
            figures = [metrics[k] for k in ("val/miou", "val/pixel_acc", "val/mean_acc", "val/images")]
            print(f"metrics {mode} " + " ".join(repr(f) for f in figures), flush=True)
            print(f"confusion {mode} " + " ".join(map(str, confusion.flatten().tolist())), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    start_fork_server(forked=True)  # as a stage starts it (core/entry/stage.py): the workers fork from these imports
    main()
