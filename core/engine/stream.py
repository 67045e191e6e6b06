"""The training stream a stage reads: the recipe's sources, this rank's share, positioned where a resumed run left
it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from core.config import Config
from core.engine.distributed import DistInfo
from data.pipeline import make_train_loader
from data.specs import train_sources


def train_stream(
    cfg: Config, dist: DistInfo, transform: Callable, *, skip_batches: int, labels: bool
) -> Iterator[dict]:
    """The endless per-rank training stream, positioned after `skip_batches` micro-batches.

    Args:
        cfg: The recipe (`data` section, per-device batch size, seed).
        dist: This process's rank and the world size.
        transform: The per-sample training transform.
        skip_batches: Micro-batches this rank already consumed (`TrainState.batches_consumed`).
        labels: Read each sample's class as `data.label_field` says (fine-tuning); False streams every sample with an
            image and labels it -1 (pretraining).
    """
    return iter(
        make_train_loader(
            train_sources(cfg.data.train),
            transform=transform,
            batch_size=cfg.batch_size_per_device(dist.world_size),
            seed=cfg.seed,
            rank=dist.rank,
            world_size=dist.world_size,
            num_workers=cfg.data.num_workers,
            shuffle_buffer=cfg.data.shuffle_buffer,
            resampled=cfg.data.resampled,
            skip_batches=skip_batches,
            labels=labels,
            label_field=cfg.data.label_field,
            num_open_shards=cfg.data.num_open_shards,
            timeout_s=cfg.data.loader_timeout_s,
        )
    )
