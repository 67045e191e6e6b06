"""The training stream a stage reads: the recipe's sources, this rank's share, positioned where a resumed run left
it (data/cursor.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader

from core.engine.checkpoint import saved_states
from core.engine.distributed import DistInfo
from core.engine.precision import to_device
from core.engine.stage import StageRun
from core.recipe.config import Config
from data.pipeline import make_eval_loader, make_train_loader
from data.specs import resolve_shards, train_sources


def train_stream(run: StageRun, transform: Callable, *, labels: bool) -> Iterator[dict]:
    """The endless per-rank training stream of a stage, continuing from the resumed checkpoint's data position.

    `run.state.data_position` becomes the position the streams start from (after an elastic resume, what the old
    streams left, dealt out to the new ones), so that a checkpoint saved before every worker has given a batch keeps
    it; the loop then advances it batch by batch (`TrainState.consume`).

    Args:
        run: The stage: config, ranks, the resume point and its train state.
        transform: The per-sample training transform.
        labels: Read each sample's class as `data.label_field` says (fine-tuning); False streams every sample with an
            image and labels it -1 (pretraining).

    Raises:
        ValueError: If the resumed checkpoint holds no data position (written before mimpipe saved one).
    """
    loader = train_loader(run.cfg, run.dist, transform, labels=labels, positions=_resume_positions(run))
    run.state.data_position = loader.dataset.position
    return iter(loader)


def train_loader(
    cfg: Config, dist: DistInfo, transform: Callable, *, labels: bool, positions: list[dict | None] | None
) -> DataLoader:
    """The per-rank training loader the recipe's data section describes (see `data.pipeline.make_train_loader`).

    Args:
        cfg: The recipe (`data` section, per-device batch size, seed).
        dist: This process's rank and the world size.
        transform: The per-sample training transform.
        labels: See `train_stream`.
        positions: The data position of each rank of the resumed run, by rank (see `data.cursor.start_position`);
            None starts afresh.
    """
    return make_train_loader(
        train_sources(cfg.data.train),
        transform=transform,
        batch_size=cfg.batch_size_per_device(dist.world_size),
        seed=cfg.seed,
        rank=dist.rank,
        world_size=dist.world_size,
        num_workers=cfg.data.num_workers,
        shuffle_buffer=cfg.data.shuffle_buffer,
        resampled=cfg.data.resampled,
        positions=positions,
        labels=labels,
        label_field=cfg.data.label_field,
        num_open_shards=cfg.data.num_open_shards,
        read_policy=cfg.data.read_policy(),
        timeout_s=cfg.data.loader_timeout_s,
    )


def _resume_positions(run: StageRun) -> list[dict | None] | None:
    """The saved data positions the streams continue from, by rank: with the world size and worker count that wrote
    the checkpoint this rank's own (from its train state; the other ranks' are not read); otherwise every rank's,
    read from the checkpoint's rank files. None for a fresh run."""
    if run.resume is None:
        return None
    own = run.state.data_position
    if own is None and run.state.batches_consumed == 0:
        return None
    if own is None:
        raise ValueError(
            f"checkpoint {run.run_dir / 'checkpoints' / run.resume['tag']} holds no data position (written before "
            "mimpipe saved one): its data streams cannot be continued; resume it with the mimpipe that wrote it, or "
            "start afresh with another run_dir"
        )
    same_layout = "from_world_size" not in run.resume and len(own["streams"]) == max(run.cfg.data.num_workers, 1)
    if same_layout:
        return [own if rank == run.dist.rank else None for rank in range(run.dist.world_size)]
    return [train.get("data_position") for train in saved_states(run.run_dir, run.resume["tag"], "train")]


def num_train_shards(cfg: Config) -> int:
    """The distinct shards of the recipe's training sources (the skipped-shard budget's floor, data/shard_read.py)."""
    return len({shard for source in train_sources(cfg.data.train) for shard in source.shards})


FIXED_BATCH_SIZE = 8
"""Images in the fixed batch the pictures are drawn from."""


def fixed_batch(cfg: Config, transform: Callable, device: torch.device, batch_size: int = FIXED_BATCH_SIZE) -> dict:
    """The first `batch_size` samples of the first training shard under `transform`, on `device`: what the pictures
    are drawn from, the same at every picture step.

    The data pipeline seeds each sample's transform from its position, so random parts of `transform` (masks) are
    the same in every run and after every resume.
    """
    loader = make_eval_loader(
        resolve_shards(cfg.data.train)[:1], transform=transform, batch_size=batch_size, rank=0, world_size=1,
        num_workers=0, labels=False, read_policy=cfg.data.read_policy(),
    )  # fmt: skip
    return to_device(next(iter(loader)), device, cfg.engine.precision)
