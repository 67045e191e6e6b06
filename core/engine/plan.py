"""The launch plan a stage prints once: batch arithmetic, the lr actually used, and a mixture's sources."""

from __future__ import annotations

from core.engine.distributed import DistInfo
from core.engine.setup import resolve_attention
from core.recipe.config import Config
from core.recipe.objective_kinds import copies_note
from core.recipe.sections import TrainSource
from data.quickstart import SYNTHETIC_WARNING
from data.specs import dataset_size, describe_shards


def launch_plan(
    cfg: Config,
    dist: DistInfo,
    *,
    total_steps: int,
    warmup_steps: int,
    samples: int | None,
    precision_reason: str = "",
    synthetic: bool = False,
) -> str:
    """What the run will do, printed once at launch: batch arithmetic, the precision and why, the lr actually used, a
    mixture's sources."""
    per_device = cfg.batch_size_per_device(dist.world_size)
    rule = (
        f"base_lr {cfg.optim.base_lr:g} x {cfg.data.global_batch_size} / {cfg.optim.lr_base_batch}"
        if cfg.optim.lr_rule == "scaled"
        else "absolute"
    )
    epochs = (
        f" (~{total_steps * cfg.data.global_batch_size / samples:.2f} epochs of {samples} samples)" if samples else ""
    )
    precision = f"{cfg.engine.precision} ({precision_reason})" if precision_reason else cfg.engine.precision
    copies = copies_note(cfg.objective, per_device)
    plan = (
        f"[mimpipe] stage {cfg.stage} | objective {cfg.objective.kind} | run_dir {cfg.run_dir}\n"
        f"[mimpipe] world size {dist.world_size} on {dist.device.type} | ZeRO-{cfg.engine.zero_stage} | "
        f"precision {precision} | attention {resolve_attention(cfg.engine.attention, dist.device)}\n"
        f"[mimpipe] global batch {cfg.data.global_batch_size} = {per_device} per device x "
        f"{cfg.engine.grad_accum_steps} accumulation x {dist.world_size} ranks{copies}\n"
        f"[mimpipe] lr {cfg.peak_lr:.4g} ({rule}), min {cfg.optim.min_lr:g}, warmup {warmup_steps} of "
        f"{total_steps} steps{epochs}"
    )
    if cfg.data.is_mixture:
        plan += "\n" + mixture_plan(cfg.data.train, total_steps * cfg.data.global_batch_size)
    if synthetic:
        plan += f"\n[mimpipe] data.train holds {SYNTHETIC_WARNING} (its index.json: source synthetic)"
    return plan


def mixture_plan(sources: list[TrainSource], num_samples: int) -> str:
    """One line per source of a mixture: its share of the `num_samples` the run draws and, where index.json gives
    its size, how many passes over it that makes."""
    total_weight = sum(source.weight for source in sources)
    lines = []
    for i, source in enumerate(sources):
        share = source.weight / total_weight
        size = dataset_size(source.shards)
        passes = f", ~{share * num_samples / size:.2f} passes over its {size} samples" if size else ""
        spec = describe_shards(source.shards) if isinstance(source.shards, list) else source.shards
        lines.append(f"[mimpipe] data.train[{i}] {spec}: weight {source.weight:g}, {share:.1%} of the samples{passes}")
    return "\n".join(lines)
