"""Worker for test_zero_init_dist.py (run under torchrun, 2 processes): builds the MAE and BEiT objectives under
deepspeed.zero.Init as `parallelize` does, with their optimizer groups, then one through the engine; trains MAE at
ZeRO-3, ZeRO-0, ZeRO-1 and ZeRO-2 from the same weights on the same batches; writes from rank 0 what it saw to
OUT/zero_init.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import torch

from core.compat.deepspeed import partition_sizes
from core.engine.distributed import init_distributed
from core.engine.setup import build_optimizer, deepspeed_config, parallelize
from core.engine.zero_init import build_partitioned, gathered
from core.models.pos_embed import sincos_pos_embed_2d
from core.recipe.config import load_config
from pretrain.objectives import objective_builder

MODEL = "model.size=tiny model.embed_dim=32 model.depth=2 model.num_heads=2 model.img_size=16 model.patch_size=4"
KINDS = {
    "mae": "objective.kind=mae objective.decoder_embed_dim=32 objective.decoder_depth=1 objective.decoder_num_heads=2",
    "beit": "objective.kind=beit objective.target.kind=mean_color_3bit objective.head=mlp",
}


def summary(cfg, objective, optimizer) -> dict:
    """Full-value statistics of the built objective and its optimizer's groups (by parameter name)."""
    name_of = {id(p): n for n, p in objective.named_parameters()}
    groups = sorted((sorted(name_of[id(p)] for p in g["params"]), g["weight_decay"]) for g in optimizer.param_groups)
    params = list(objective.parameters())
    with deepspeed.zero.GatheredParameters(params):
        qkv = objective.encoder.blocks[0].attn.qkv.weight
        pos = objective.encoder.pos_embed
        out = {
            "groups": groups,
            "qkv_std": qkv.std().item(),
            "qkv_fan": [qkv.shape[0], qkv.shape[1]],
            "norm_weights": objective.encoder.blocks[1].norm2.weight.unique().tolist(),
            "biases_zero": bool((objective.encoder.blocks[0].mlp.fc1.bias == 0).all()),
            "pos_is_sincos": bool(torch.allclose(pos, sincos_pos_embed_2d(pos.shape[-1], cfg.model.grid, 1))),
        }
        if cfg.objective.kind == "beit":
            out["head_std"] = objective.head[0].weight.std().item()
    return out


# The optional DeepSpeed patches (off by default) each run turns on, so that 2 ranks check them against ZeRO-0.
OPTIONAL_PATCHES = {
    0: [],
    1: ["engine.share_zero12_masters=true"],
    2: ["engine.share_zero12_masters=true"],
    3: ["engine.share_zero3_masters=true", "engine.skip_identity_grad_passes=true"],
}


def trained(out: Path, dist, stage: int, grad_clip: float, start: dict | None) -> tuple[dict, dict, object]:
    """MAE's trainable weights (by name) before and after 3 fp32 SGD steps through `parallelize` at `stage`, each rank
    on its own batches, starting from `start` or from the build's own initialisation; and the engine. (SGD: an update
    is the gradient times the lr, so a difference in the gradients shows at its own size; Adam would blow up rounding
    noise in gradients that are zero in exact arithmetic, such as the attention's key bias.)"""
    overrides = [*MODEL.split(), *KINDS["mae"].split(), f"engine.zero_stage={stage}", "engine.precision=fp32"]
    overrides += OPTIONAL_PATCHES[stage]
    overrides += [
        f"optim.grad_clip={grad_clip}",
        "optim.kind=sgd",
        "optim.base_lr=64",
        "data.global_batch_size=4",
        f"run_dir={out}",
    ]
    cfg = load_config(None, overrides)
    torch.manual_seed(0)
    engine, _ = parallelize(objective_builder(cfg), cfg=cfg, dist=dist, run_dir=out)
    params = {name: p for name, p in engine.module.named_parameters() if p.requires_grad}  # MAE's sin-cos are fixed
    with gathered(params.values()):
        if start is not None:
            for name, p in params.items():
                p.data.copy_(start[name])
        initial = {name: p.detach().clone() for name, p in params.items()}
    for step in range(3):
        torch.manual_seed(100 * step + dist.rank)  # the batch and MAE's masks
        loss = engine({"image": torch.randn(2, 3, 16, 16)})["loss"]
        engine.backward(loss)
        engine.step()
    with gathered(params.values()):
        return initial, {name: p.detach().clone() for name, p in params.items()}, engine


def main(out: Path) -> None:
    dist = init_distributed("cpu")
    result = {}
    for kind, overrides in KINDS.items():
        cfg = load_config(
            None,
            [
                *MODEL.split(),
                *overrides.split(),
                "engine.zero_stage=3",
                "engine.precision=bf16",
                *OPTIONAL_PATCHES[3],
                f"run_dir={out}",
            ],
        )
        torch.manual_seed(0)
        objective, layout = build_partitioned(objective_builder(cfg), deepspeed_config(cfg, dist.world_size))
        optimizer = build_optimizer(objective, cfg, layout)
        held, total = partition_sizes(objective)
        plain = objective_builder(cfg)()  # the same objective built the ordinary way, for its groups
        result[kind] = {
            **summary(cfg, objective, optimizer),
            "held_share": held / total,
            "plain_groups": sorted(
                (sorted(n for n, q in plain.named_parameters() if any(q is p for p in g["params"])), g["weight_decay"])
                for g in build_optimizer(plain, cfg).param_groups
            ),
        }
    # The engine's optimizer (here for the last objective, BEiT) steps the fp32 parameter partitions themselves with
    # engine.share_zero3_masters: no second fp32 master copy.
    engine, _ = parallelize(objective_builder(cfg), cfg=cfg, dist=dist, run_dir=out)
    zero = engine.optimizer
    pairs = list(zip(zero.fp32_partitioned_groups_flat, zero.fp16_partitioned_groups_flat, strict=True))
    result["master_is_partition"] = [m.data_ptr() == p.data_ptr() and m.numel() == p.numel() for m, p in pairs]
    # ZeRO-3's trimmed step (zero3_runtime.py: per-block gathering, Linear32; engine.skip_identity_grad_passes: no norm
    # / unscale without clipping) against ZeRO-0, without and with clipping (0.01 clips every step here).
    for clip in (0.0, 0.01):
        start, zero3, _ = trained(out, dist, 3, clip, None)
        _, zero0, _ = trained(out, dist, 0, clip, start)
        updates = {k: (zero3[k] - start[k]).abs().max().item() for k in zero3}
        result[f"clip_{clip}"] = {
            "max_relative_diff": max((zero3[k] - zero0[k]).abs().max().item() / updates[k] for k in zero3),
            "updates": [min(updates.values()), max(updates.values())],
        }
    # ZeRO-1/2 step each rank's partition of the fp32 parameters itself (engine.share_zero12_masters), and
    # move every parameter as ZeRO-0 does (the last start and ZeRO-0 run, with clipping).
    for stage in (1, 2):
        _, moved, engine = trained(out, dist, stage, 0.01, start)
        zero = engine.optimizer
        own = [parts[dist.rank] for parts in zero.parallel_partitioned_bit16_groups]
        result[f"zero{stage}"] = {
            "master_is_partition": [
                m.data_ptr() == p.data_ptr() and m.numel() == p.numel() > 0
                for m, p in zip(zero.single_partition_of_fp32_groups, own, strict=True)
            ],
            "max_diff": max((moved[k] - zero0[k]).abs().max().item() for k in moved),
        }
    if dist.rank == 0:
        (out / "zero_init.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
