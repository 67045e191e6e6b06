"""The collapse watch of the latent-target objectives: the effective rank (RankMe, core/report/collapse.py) of the
EMA teacher's targets on a fixed batch of the label-free monitor's images, at the label-free monitor's cadence
(`eval.features`). Loss spikes in these methods are partial collapse: the teacher's targets lose directions, the
loss falls for the wrong reason. Logged as `features/target_effective_rank`; a one-line console warning when it
falls below `WARN_FRACTION` of the highest seen in this launch.

Each rank takes the first batch of its own share of the monitor's images once and keeps it; the targets' rows (one per
image token) are gathered, so every rank computes the same number. Collective: every rank calls it (the teacher's
forward gathers its partitions under ZeRO-3).
"""

from __future__ import annotations

from collections.abc import Callable

from core.engine.distributed import all_gather_rows
from core.engine.precision import autocast_context, to_device
from core.report.collapse import effective_rank
from pretrain.knn import monitor_loader, training_untouched

WARN_FRACTION = 0.5
"""The warning's threshold: the rank below this fraction of the highest rank seen in this launch."""
MAX_IMAGES = 32
"""Images per rank in the fixed batch (x tokens per image rows: plenty for a rank up to the width)."""


def target_monitor(run, engine) -> Callable[[int], dict[str, float]] | None:
    """`evaluate(step)` for an objective with `teacher_targets`; None for others or without `eval.features`."""
    cfg, dist = run.cfg, run.dist
    objective = engine.module
    if not (hasattr(objective, "teacher_targets") and cfg.eval.features.enabled):
        return None
    shards = cfg.eval.features.shards or cfg.data.train
    loader = monitor_loader(run, "eval.features.shards", shards, None, MAX_IMAGES, labels=False)
    batch = to_device(next(iter(loader)), dist.device, cfg.engine.precision)  # kept for every later call
    best = {"rank": 0.0, "step": 0}

    def evaluate(step: int) -> dict[str, float]:
        with training_untouched(objective, dist.device), autocast_context(cfg.engine.precision, dist.device):
            target = objective.teacher_targets(batch["image"])  # (B, L, D)
        rows = all_gather_rows(target.flatten(0, 1).float())  # (ranks x B x L, D)
        rank = effective_rank(rows)
        if rank >= best["rank"]:
            best.update(rank=rank, step=step)
        elif rank < WARN_FRACTION * best["rank"]:
            run.logger.console(
                f"[mimpipe] warning: step {step}: the teacher's targets' effective rank fell to {rank:.1f} from "
                f"{best['rank']:.1f} at step {best['step']}: partial collapse (docs/data2vec2.md)"
            )
        return {"features/target_effective_rank": rank}

    return evaluate
