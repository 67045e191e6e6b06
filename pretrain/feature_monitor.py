"""The label-free monitor of pretraining (`eval.features`): RankMe's effective rank and the spread of the normalised
features of unlabelled training images (core/report/collapse.py), every `eval.features.every_steps`.

Each rank embeds its own shards of the images as the kNN monitor embeds its sets (pretrain/knn.py `embed`: eval
mode, no gradients, the run's precision, lock-step under ZeRO-3, training left untouched), the features are gathered
on every rank, and each rank computes both numbers from the same matrix. Logged: `features/effective_rank`,
`features/std`, `features/samples`, `features/seconds`, and a console line.

`monitors` joins it with the kNN monitor into the loop's one `evaluate(step)`, each at its own cadence.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from core.engine.distributed import all_gather_rows
from core.report.collapse import effective_rank, normalised_std
from data.specs import train_sources
from pretrain.knn import embed, knn_monitor, monitor_loader, training_untouched


def feature_monitor(run, engine) -> Callable[[int], dict[str, float]] | None:
    """The label-free `evaluate(step)` (None without `eval.features.enabled`); collective: every rank calls it."""
    cfg, dist = run.cfg, run.dist
    fm = cfg.eval.features
    if not fm.enabled:
        return None
    shards = fm.shards or train_sources(cfg.data.train)[0].shards
    loader = monitor_loader(run, "eval.features.shards", shards, fm.max_samples, fm.batch_size_per_device, labels=False)
    height, width = cfg.model.image_hw

    def evaluate(step: int) -> dict[str, float]:
        start = time.perf_counter()
        with training_untouched(engine.module, dist.device):
            features, _ = embed(
                engine.module.encoder, loader, dist=dist, precision=cfg.engine.precision, pooling=fm.pooling,
                image_shape=(3, height, width),
            )  # fmt: skip
        features = all_gather_rows(features)  # (N, D), the same on every rank
        metrics = {
            "features/effective_rank": effective_rank(features),
            "features/std": normalised_std(features),
            "features/samples": float(len(features)),
            "features/seconds": time.perf_counter() - start,
        }
        run.logger.console(
            f"[mimpipe] step {step} features: effective rank {metrics['features/effective_rank']:.1f} of "
            f"{min(features.shape)}  std x sqrt(D) {metrics['features/std']:.3f}  ({len(features)} images, "
            f"{metrics['features/seconds']:.1f} s)"
        )
        return metrics

    return evaluate


def monitors(run, engine) -> Callable[[int], dict[str, float]] | None:
    """The pretraining loop's `evaluate(step)`: the kNN monitor and the label-free one, each at its multiples of its
    own `every_steps` and at the last step (the loop calls at the common divisor, `Config.eval_every_steps`)."""
    cfg = run.cfg
    parts = [
        (cfg.eval.knn.every_steps, knn_monitor(run, engine)),
        (cfg.eval.features.every_steps, feature_monitor(run, engine)),
    ]
    parts = [(every, monitor) for every, monitor in parts if monitor is not None]
    if not parts:
        return None

    def evaluate(step: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for every, monitor in parts:
            if step % every == 0 or step == run.total_steps:
                metrics |= monitor(step)
        return metrics

    return evaluate
