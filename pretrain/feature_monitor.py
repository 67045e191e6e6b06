"""The label-free monitor of pretraining (`eval.features`): RankMe's effective rank and the spread of the normalised
features of unlabelled training images (core/report/collapse.py), every `eval.features.every_steps`.

Each rank embeds its own shards of the images as the kNN monitor embeds its sets (pretrain/knn.py `embed`: eval
mode, no gradients, the run's precision, lock-step under ZeRO-3, training left untouched), the features are gathered
on every rank, and each rank computes both numbers from the same matrix. Logged: `features/effective_rank`,
`features/std`, `features/samples`, `features/reused_knn_bank`, `features/seconds`, and a console line.

`monitors` joins it with the kNN monitor into the loop's one `evaluate(step)`, each at its own cadence. When both
watch the same images (`features_are_knn_bank`: the same shards, `max_samples` and pooling), a step where both run
embeds them once: the label-free numbers come from the kNN bank's gathered features (`features/reused_knn_bank` 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from core.engine.distributed import all_gather_rows
from core.report.collapse import effective_rank, normalised_std
from data.specs import resolve_shards, train_sources
from pretrain.export import exported_module
from pretrain.knn import embed, knn_monitor, monitor_loader, training_untouched
from pretrain.target_monitor import target_monitor


def feature_monitor(run, engine) -> Callable[..., dict[str, float]] | None:
    """The label-free `evaluate(step, features=None)` (None without `eval.features.enabled`); collective: every rank
    calls it. Given `features` (the (N, D) gathered features of these same images), it computes from them instead of
    embedding the images again."""
    cfg, dist = run.cfg, run.dist
    fm = cfg.eval.features
    if not fm.enabled:
        return None
    loader = monitor_loader(
        run, "eval.features.shards", _feature_shards(cfg), fm.max_samples, fm.batch_size_per_device, labels=False
    )
    height, width = cfg.model.image_hw

    def evaluate(step: int, features: torch.Tensor | None = None) -> dict[str, float]:
        start = time.perf_counter()
        reused = features is not None
        if features is None:
            with training_untouched(engine.module, dist.device):
                features, _ = embed(
                    exported_module(cfg, engine.module), loader, dist=dist, precision=cfg.engine.precision,
                    pooling=fm.pooling, image_shape=(3, height, width),
                )  # fmt: skip
            features = all_gather_rows(features)  # (N, D), the same on every rank
        metrics = {
            "features/effective_rank": effective_rank(features),
            "features/std": normalised_std(features),
            "features/samples": float(len(features)),
            "features/reused_knn_bank": float(reused),
            "features/seconds": time.perf_counter() - start,
        }
        source = "the kNN bank's features" if reused else "embedded"
        run.logger.console(
            f"[mimpipe] step {step} features: effective rank {metrics['features/effective_rank']:.1f} of "
            f"{min(features.shape)}  std x sqrt(D) {metrics['features/std']:.3f}  ({len(features)} images, "
            f"{source}, {metrics['features/seconds']:.1f} s)"
        )
        return metrics

    return evaluate


def features_are_knn_bank(cfg) -> bool:
    """Whether the label-free monitor and the kNN monitor's bank are the same images seen the same way: both on, the
    same shards, the same `max_samples` and pooling. Both unset, they are the training shards (with a mixture in
    data.train the bank must be named); else the resolved lists compare."""
    fm, knn = cfg.eval.features, cfg.eval.knn
    if not (fm.enabled and knn.enabled) or (fm.pooling, fm.max_samples) != (knn.pooling, knn.bank.max_samples):
        return False
    if fm.shards is None and knn.bank.shards is None:
        return True
    return resolve_shards(_feature_shards(cfg)) == resolve_shards(knn.bank.shards or cfg.data.train)


def _feature_shards(cfg):
    """eval.features.shards, or the training data's (its first source's for a mixture)."""
    return cfg.eval.features.shards or train_sources(cfg.data.train)[0].shards


def monitors(run, engine) -> Callable[[int], dict[str, float]] | None:
    """The pretraining loop's `evaluate(step)`: the kNN monitor and the label-free one (with it, the teacher targets'
    effective rank of the latent-target objectives), each at its multiples of its own `every_steps` and at the last
    step (the loop calls at the common divisor, `Config.eval_every_steps`); at a step where both run on the same
    images, the label-free one reuses the kNN bank's features."""
    cfg = run.cfg
    knn, features, targets = knn_monitor(run, engine), feature_monitor(run, engine), target_monitor(run, engine)
    if knn is None and features is None:
        return None
    reuse = features_are_knn_bank(cfg)

    def due(every: int, step: int) -> bool:
        return step % every == 0 or step == run.total_steps

    def evaluate(step: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        bank: list[torch.Tensor] = []
        if knn is not None and due(cfg.eval.knn.every_steps, step):
            metrics |= knn(step, on_bank=bank.append if reuse else None)
        if features is not None and due(cfg.eval.features.every_steps, step):
            metrics |= features(step, bank[0] if bank else None)
            if targets is not None:  # the teacher's targets, at the same cadence (pretrain/target_monitor.py)
                metrics |= targets(step)
        return metrics

    return evaluate
