"""Worker for test_encoders_dist.py (under torchrun, 2 processes): builds the hybrid, T2T-ViT and VT-ResNet under
deepspeed.zero.Init as `parallelize` does, and the same model the ordinary way from the same seed; writes from rank 0,
per arch, the largest difference between the gathered ZeRO-3 weights (and buffers) and the ordinary ones, and the
share of the weights this rank holds, to OUT/zero3_encoders.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from core.compat.deepspeed import partition_sizes
from core.engine.distributed import init_distributed
from core.engine.setup import deepspeed_config
from core.engine.zero_init import build_partitioned, gathered
from core.models.build import build_model
from core.recipe.config import load_config

ARCHS = {
    "vit_hybrid": "model.arch=vit_hybrid model.hybrid_backbone=resnet_stem model.patch_size=2",
    "t2t_vit": "model.arch=t2t_vit model.t2t_variant='14'",
    "vt_resnet": "model.arch=vt_resnet model.vt_variant=18 model.embed_dim=64",
}
TINY = "model.embed_dim=32 model.depth=2 model.num_heads=2 model.img_size=32"


def compare(arch: str, overrides: str, out: Path, world_size: int) -> dict:
    """Largest |ZeRO-3 - ordinary| over the weights and buffers, the weights' largest magnitude, the held share."""
    tiny = TINY.split() if arch != "vt_resnet" else ["model.img_size=32"]
    cfg = load_config(
        None,
        [*tiny, *overrides.split(), "engine.zero_stage=3", "engine.precision=bf16", "stage=finetune", f"run_dir={out}"],
    )
    torch.manual_seed(0)
    model, _ = build_partitioned(lambda: build_model(cfg, num_classes=4), deepspeed_config(cfg, world_size))
    torch.manual_seed(0)
    plain = build_model(cfg, num_classes=4)
    held, total = partition_sizes(model)
    reference = {**dict(plain.named_parameters()), **dict(plain.named_buffers())}
    with gathered(model.parameters()):
        built = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        assert set(built) == set(reference), sorted(set(built) ^ set(reference))
        diffs = {name: (t.float() - reference[name].float()).abs().max().item() for name, t in built.items()}
        constant = [name for name, t in reference.items() if t.is_floating_point() and t.unique().numel() == 1]
        random = [name for name, t in reference.items() if t.is_floating_point() and t.numel() >= 256 and t.std() > 0]
        std_ratios = [(built[name].std() / reference[name].std()).item() for name in random]
    worst = max(diffs, key=diffs.get)
    return {
        "held_share": held / total,
        "max_diff": diffs[worst],
        "worst": worst,
        "num_tensors": len(diffs),
        "constants_equal": all(diffs[name] == 0 for name in constant),
        "num_constant": len(constant),
        "std_ratios": [min(std_ratios), max(std_ratios)],
    }


def main(out: Path) -> None:
    dist = init_distributed("cpu")
    result = {arch: compare(arch, overrides, out, dist.world_size) for arch, overrides in ARCHS.items()}
    if dist.rank == 0:
        (out / "zero3_encoders.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
