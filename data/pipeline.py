"""Streams WebDataset shards into batches for training (endless, resumable) and evaluation (one pass).

Each stream runs inside one DataLoader worker (or in-process when num_workers=0):
    shards, several open at once (per mixture source) -> source drawn by weight -> shuffle buffer
        -> decode + transform -> batch (+ the stream's cursor, training)
Batches are built in the worker and passed through by DataLoader(batch_size=None). data/order.py says in which
order the raw samples come.

Distributed layout: a stream's global id is g = rank * W + worker with W = max(num_workers, 1), and there
are G = world_size * W streams. Without resampling, stream g reads shards[g::G] of the epoch's shard
permutation (of each source), which every rank computes from the seed alone, so the streams never overlap.

Determinism: every random choice comes from a generator seeded with a purpose tag plus (seed, rank,
worker, ...), and each sample's augmentation runs under RNGs seeded from its position in its stream.
The caller's global torch/python/numpy RNG state is restored after every batch, so an in-process
loader never disturbs the trainer's randomness (e.g. MAE mask noise).

Images: a transform with a `normalisation` attribute (data/transforms.py) emits uint8 images, which cross from the
workers in a quarter of float32's shared memory; every batch carries that attribute as "normalise", and
`data.device.batch_to_device` normalises the images on the device. With `data.decode: device` the pretraining crop
emits most JPEGs undecoded, with their box and flip, and the batch's "image" carries both kinds
(data/device_decode.py `DeviceCrops`), turned into pixels by `batch_to_device` as well.

Shards: each is read by data/shard_read.py, with a timeout and retries. A training shard that fails every try is
skipped, logged and counted ("num_shard_reads" and "num_skipped_shards" travel with the batches as "num_corrupt"
does), and too many skipped shards stop the run; an evaluation shard that fails every try stops the pass.

Samples: any sample with an image field (`jpg`, `jpeg`, `png`, `webp`, `bmp`, any case) streams; its label is read only
when the loader needs labels (`.cls`, or an integer field of its `.json`), otherwise "label" is -1. Samples with no
image field and images that do not decode are skipped, logged and counted ("num_corrupt"); a missing label stops.
A segmentation transform (data/seg_transforms.py, with a `seg_field`) also gets each sample's mask: a mask that does
not decode or does not fit its image is skipped and counted the same way; a missing one stops (`MaskError`).

Resume: every training batch carries "cursor", where its stream stands right after it (data/cursor.py); the
training process keeps the last one per worker (`data.cursor.advance`), and a loader given those positions restarts
each stream there, reading only the shards it had open and those its shuffle buffer held: the same batches as the
uninterrupted run, at a cost that does not grow with the position.

Shapes: B batch size, H/W image height/width after the transform.
"""

import functools
import itertools
import logging
import math
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from core.compat import webdataset as wds_compat
from data.cursor import StreamCursor, start_position
from data.decode import CORRUPT_IMAGE_ERRORS, IMAGE_FIELDS, decode_rgb, image_field, read_label
from data.device_decode import stack_images
from data.order import TrainOrder
from data.segmentation import decode_mask
from data.shard_read import ShardCounts, ShardReadPolicy, read_shard
from data.specs import WeightedShards, dataset_size, describe_shards, sample_quotas
from data.worker_process import LOADER_TIMEOUT_S
from data.workers import worker_loader

log = logging.getLogger(__name__)

NO_LABEL = -1
"""The "label" of every sample in a batch from a loader that reads no labels (pretraining)."""
_PER_SAMPLE_FIELDS = ("label", "key", "num_corrupt", "index")
_IMAGE_TYPES = ", ".join(IMAGE_FIELDS)
# Purpose tags mixed into seeds so the RNGs drawn from one user seed are independent of each other.
_SEED_ORDER, _SEED_AUGMENT, _SEED_LOADER, _SEED_MASKS = range(4)
# The default shuffle buffer holds at most this many bytes of encoded samples; without an index.json to size it
# from, this many samples.
_SHUFFLE_BUFFER_BYTES, _SHUFFLE_BUFFER_FALLBACK = 256 * 2**20, 1000


def make_train_loader(
    shards: list[str] | list[WeightedShards],
    *,
    transform: Callable[[Image.Image], Any],
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    num_workers: int,
    shuffle_buffer: int | None = None,
    resampled: bool = True,
    positions: list[dict | None] | None = None,
    labels: bool = True,
    label_field: str | None = None,
    num_open_shards: int = 8,
    read_policy: ShardReadPolicy | None = None,
    timeout_s: float = LOADER_TIMEOUT_S,
) -> DataLoader:
    """An endless, deterministic stream of training batches for one rank.

    Args:
        shards: Shard paths or URLs (see `resolve_shards`), or the weighted sources of a mixture (see
            `train_sources`): each next sample comes from source i with probability weight_i / sum of weights.
        transform: Maps an RGB PIL image to a (3, H, W) tensor, or to a dict of tensors that includes
            "image" (extra entries, e.g. per-sample masks, are stacked into the batch as well). Its
            `normalisation`, if it has one, goes into every batch as "normalise" (see the module docstring).
        batch_size: Samples per batch (per device).
        seed: Seed (>= 0) for shard order, shuffling and augmentation.
        rank: This process's rank.
        world_size: Number of ranks.
        num_workers: DataLoader workers; 0 runs the stream in this process.
        shuffle_buffer: Samples (still encoded) held by each worker's shuffle buffer; 0 disables shuffling. None:
            what `num_open_shards` shards hold together (from index.json), at most 256 MiB of them (their size on
            disk); 1,000 without an index.
        resampled: Each (rank, worker) walks through the shards in its own random order, pass after pass, instead
            of splitting each epoch's shard permutation over all streams (see data/order.py).
        positions: Where to continue from: the data position each rank of the resumed run saved, by rank (see
            `data.cursor.start_position`: with this world size and worker count only this rank's is read, with
            another every one is); None starts afresh.
        labels: Read each sample's label; a sample without one raises `LabelError`. False (pretraining) reads
            none and gives every sample the label -1 (`NO_LABEL`).
        label_field: Where labels are read from: None reads `.cls`, a name reads that integer field of the
            sample's `.json` (`data.label_field`).
        num_open_shards: Shards each worker reads at once per source, interleaving their samples at random.
        read_policy: Timeout, retries and skipped-shard budget of every shard read; None: `ShardReadPolicy()`.
        timeout_s: Seconds to wait for one batch from the workers before `DataWorkerTimeout` (data/workers.py).

    Returns:
        A DataLoader of batch dicts: "image" (B, 3, H, W) (uint8 from our transforms), "label" (B,) int64, "key"
        list of B str, "num_corrupt" int64 scalar (samples without a usable image the producing worker skipped since
        its last batch), "num_shard_reads" and "num_skipped_shards" int64 scalars (shard reads the producing worker
        began, and gave up after its last try, since its last batch), "normalise" with the transform's
        `normalisation`, "cursor" (`data.cursor.StreamCursor`).
    """
    sources = list(shards) if shards and isinstance(shards[0], WeightedShards) else [WeightedShards(list(shards), 1.0)]
    all_shards = [shard for source in sources for shard in source.shards]
    _check_loader_args(all_shards, batch_size, seed, rank, world_size, num_workers)
    for i, source in enumerate(sources):
        name = f"mixture source {i}, " if len(sources) > 1 else ""
        _check_source(source, name, resampled=resampled, world_size=world_size, num_workers=num_workers)
    if (shuffle_buffer is not None and shuffle_buffer < 0) or num_open_shards < 1:
        raise ValueError(f"need shuffle_buffer >= 0, num_open_shards >= 1; got {shuffle_buffer}, {num_open_shards}")
    if shuffle_buffer is None:
        shuffle_buffer = _default_shuffle_buffer(all_shards, num_open_shards)
    position = None
    if positions is not None:
        position = start_position(
            positions, rank=rank, world_size=world_size, num_workers=num_workers, sources=sources,
            resampled=resampled, rng=_order_rng(seed),
        )  # fmt: skip
    stream = _ShardStream(
        all_shards,
        sources=sources,
        num_open_shards=num_open_shards,
        transform=transform,
        batch_size=batch_size,
        seed=seed,
        rank=rank,
        world_size=world_size,
        train=True,
        shuffle_buffer=shuffle_buffer,
        resampled=resampled,
        position=position,
        labels=labels,
        label_field=label_field,
        read_policy=read_policy,
    )
    return _make_loader(stream, num_workers, timeout_s)


def make_eval_loader(
    shards: list[str],
    *,
    transform: Callable[[Image.Image], Any],
    batch_size: int,
    rank: int,
    world_size: int,
    num_workers: int,
    labels: bool = True,
    label_field: str | None = None,
    max_samples: int | None = None,
    read_policy: ShardReadPolicy | None = None,
    timeout_s: float = LOADER_TIMEOUT_S,
) -> DataLoader:
    """One pass over the shards in order; across all ranks and workers every sample appears once.

    Uses fewer workers when there are fewer than `world_size * num_workers` shards. Each worker's last
    batch may be partial. `max_samples` limits the pass to the first samples of every shard, `max_samples` in all
    (see `sample_quotas`: the same samples for any world size). A shard that fails every try of `read_policy` stops
    the pass (`ShardReadError`): a metric over the shards that happened to read would change without a word. Other
    arguments and batches are as in `make_train_loader`.
    """
    _check_loader_args(shards, batch_size, 0, rank, world_size, num_workers)
    if len(shards) < world_size:
        raise ValueError(
            f"shard spec {describe_shards(shards)}: {len(shards)} shards for {world_size} ranks; need >= 1 each"
        )
    stream = _ShardStream(
        shards, transform=transform, batch_size=batch_size, seed=0, rank=rank, world_size=world_size, train=False,
        labels=labels, label_field=label_field, read_policy=read_policy,
        quotas=None if max_samples is None else sample_quotas(shards, max_samples),
    )  # fmt: skip
    return _make_loader(stream, min(num_workers, len(shards) // world_size), timeout_s)


class _ShardStream(IterableDataset):
    """The batches of one rank; each DataLoader worker iterates its own part (see module docstring)."""

    def __init__(
        self,
        shards: list[str],
        *,
        transform: Callable[[Image.Image], Any],
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        train: bool,
        shuffle_buffer: int = 0,
        resampled: bool = False,
        position: dict | None = None,
        labels: bool = True,
        label_field: str | None = None,
        sources: list[WeightedShards] | None = None,
        num_open_shards: int = 1,
        quotas: list[int] | None = None,
        read_policy: ShardReadPolicy | None = None,
    ) -> None:
        super().__init__()
        self.shards, self.transform, self.batch_size = list(shards), transform, batch_size
        self.seed, self.rank, self.world_size, self.train = seed, rank, world_size, train
        self.shuffle_buffer, self.resampled = shuffle_buffer, resampled
        self.position = position  # train: this rank's data position to start from (data/cursor.py); None: afresh
        self.labels, self.label_field = labels, label_field
        self.sources, self.num_open_shards = sources or [WeightedShards(self.shards, 1.0)], num_open_shards
        self.quotas = quotas  # eval: samples (with an image) to read from the start of each shard; None: all
        self.read_policy = read_policy or ShardReadPolicy()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        loader_worker, num_workers = _worker_position()
        label_of = functools.partial(read_label, label_field=self.label_field) if self.labels else _no_label
        normalisation = getattr(self.transform, "normalisation", None)
        if self.train:
            return _restore_global_rngs(self._train_batches(loader_worker, num_workers, label_of, normalisation))
        stream_id, num_streams = self.rank * num_workers + loader_worker, self.world_size * num_workers
        counts = ShardCounts(self.read_policy, len(self.shards), f"by rank {self.rank} data worker {loader_worker}")
        read = functools.partial(read_shard, policy=self.read_policy, counts=None)  # evaluation stops on a bad shard
        if self.quotas is None:
            samples = _read_shards(self.shards[stream_id::num_streams], read)
        else:
            own = zip(self.shards[stream_id::num_streams], self.quotas[stream_id::num_streams], strict=True)
            samples = (sample for url, quota in own for sample in _first_image_samples(read(url), quota))
        decoded = _decode(samples, self.transform, label_of, (self.seed, _SEED_AUGMENT, self.rank, loader_worker), 0)
        collate = functools.partial(_collate, normalisation=normalisation, counts=counts)
        return _restore_global_rngs(wds.batched(self.batch_size, collation_fn=collate, partial=True)(decoded))

    def _train_batches(self, loader_worker: int, num_workers: int, label_of, normalisation) -> Iterator[dict[str, Any]]:
        """This stream's endless batches, each with the stream's cursor right after it (see data/cursor.py)."""
        # DataLoader takes batches round-robin from its workers, starting at worker 0 at every iter(). A resumed
        # run must start with the worker whose batch comes next, so DataLoader worker w plays worker (w + next) % W.
        position = self.position or {"next_worker": 0, "streams": [None] * num_workers}
        worker = (loader_worker + position["next_worker"]) % num_workers
        start = position["streams"][worker] or {"index": 0, "order": None}
        num_shards = len({shard for source in self.sources for shard in source.shards})
        counts = ShardCounts(self.read_policy, num_shards, f"by rank {self.rank} data worker {worker}")
        if start.get("reads") is not None:  # the skipped shards are part of the cursor: they go on resting
            counts.load(start["reads"])
        read = functools.partial(read_shard, policy=self.read_policy, counts=counts)  # skips a shard after its tries
        order = TrainOrder(
            self.sources,
            read,
            _order_rng(self.seed),
            rank=self.rank,
            worker=worker,
            stream_id=self.rank * num_workers + worker,
            num_streams=self.world_size * num_workers,
            resampled=self.resampled,
            num_open=self.num_open_shards,
            shuffle_buffer=self.shuffle_buffer,
            state=start["order"],
            reopen=functools.partial(read, reopened=True),  # counted by the interrupted stream already
        )
        seed_prefix = (self.seed, _SEED_AUGMENT, self.rank, worker)
        decoded = _decode(order, self.transform, label_of, seed_prefix, start["index"])
        collate = functools.partial(_collate, normalisation=normalisation, counts=counts)
        batch_masks = getattr(self.transform, "batch_masks", None)  # per-batch masks (I-JEPA's, data/multiblock.py)
        mask_seed = _mix_seed(self.seed, _SEED_MASKS, self.rank, worker)
        while True:
            samples = list(itertools.islice(decoded, self.batch_size))  # no read-ahead: the cursor is right after
            batch = collate(samples)
            if batch_masks is not None:  # seeded by the batch's place in the stream: the same masks on resume
                batch_masks.add_to_batch(batch, random.Random(_sample_seed(mask_seed, samples[0]["index"])))
            state = {"index": samples[-1]["index"] + 1, "order": order.state(), "reads": counts.state()}
            batch["cursor"] = StreamCursor(worker, num_workers, state)
            yield batch


# Object-store schemes go into webdataset's gopen table once its internals have been checked
# (core/compat/webdataset.py): at import, so that DataLoader workers, forked from a fork server that imports this
# module, have them too.
wds_compat.install()


def _read_shards(
    urls: Iterator[str] | list[str], read: Callable[[str], Iterator[dict[str, Any]]]
) -> Iterator[dict[str, Any]]:
    """Raw samples (dicts of bytes keyed by extension, plus `__key__` and `__url__`) of each shard in turn."""
    for url in urls:
        yield from read(url)


def _first_image_samples(samples: Iterator[dict[str, Any]], count: int) -> Iterator[dict[str, Any]]:
    """`samples` up to and including the `count`-th with an image field (the imageless ones among them too)."""
    seen = 0
    for sample in samples:
        if seen == count:
            return
        seen += image_field(sample) is not None
        yield sample


def _no_label(sample: dict[str, Any]) -> int:
    """The label of every sample when none are read."""
    return NO_LABEL


def _decode(
    samples: Iterator[dict[str, Any]],
    transform: Callable[[Image.Image], Any],
    label_of: Callable[[dict[str, Any]], int],
    seed_prefix: tuple[int, ...],
    first_index: int,
) -> Iterator[dict[str, Any]]:
    """Decodes images to RGB and transforms them; samples with no image or a corrupt one are skipped, logged, counted.

    Sample `first_index + i` of the stream (counting samples with an image field) is transformed under RNGs
    seeded from (seed_prefix, index) (see `_sample_seed`). Each output carries "num_corrupt": the samples skipped
    right before it, the label `label_of(sample)` gives, and its "index".

    Raises:
        LabelError: From `label_of`, for a sample whose label is missing or not an integer.
    """
    num_corrupt, index, stream_seed = 0, first_index - 1, _mix_seed(*seed_prefix)
    for sample in samples:
        key, url, field = sample["__key__"], sample["__url__"], image_field(sample)
        if field is None:
            names = ", ".join(sorted(name for name in sample if not name.startswith("__")))
            log.warning("skipping sample %s in shard %s: no image field (%s), has %s", key, url, _IMAGE_TYPES, names)
            num_corrupt += 1
            continue
        index += 1
        label = label_of(sample)
        seg_field, what = _mask_field(sample, transform), f"image {field}"
        try:
            image = getattr(transform, "decode", decode_rgb)(sample[field])  # a transform may decode its own input
            what = f"mask {seg_field}"
            inputs = (image,) if seg_field is None else (image, _decode_mask(sample[seg_field], image))
        except CORRUPT_IMAGE_ERRORS as exn:
            log.warning("skipping corrupt %s of sample %s in shard %s: %s", what, key, url, exn)
            num_corrupt += 1
            continue
        _seed_global_rngs(_sample_seed(stream_seed, index))  # restored by _restore_global_rngs
        out = transform(*inputs)
        fields = out if isinstance(out, dict) else {"image": out}
        yield {**fields, "label": label, "key": key, "num_corrupt": num_corrupt, "index": index}
        num_corrupt = 0


def _mask_field(sample: dict[str, Any], transform: Callable) -> str | None:
    """The field of the sample's mask, for a transform with a `seg_field` (data/seg_transforms.py); None for others.

    Raises:
        MaskError: The sample has no mask (segmentation shards carry one per image).
    """
    seg_field = getattr(transform, "seg_field", None)
    if seg_field is not None and seg_field not in sample:
        names = ", ".join(sorted(name for name in sample if not name.startswith("__")))
        raise MaskError(
            f"sample {sample['__key__']} in shard {sample['__url__']} has no .{seg_field} mask (fields: {names}); "
            "segmentation reads shards written with one per image (python -m data write --source segfolder)"
        )
    return seg_field


def _decode_mask(data: bytes, image: Image.Image) -> np.ndarray:
    """The mask's class ids, (H, W) uint8; a ValueError (the sample is skipped as corrupt) when its size is not the
    image's or it does not decode as a mask."""
    seg = decode_mask(data)
    if seg.shape != (image.height, image.width):
        raise ValueError(f"mask of {seg.shape[1]}x{seg.shape[0]} for an image of {image.width}x{image.height}")
    return seg


class MaskError(ValueError):
    """A segmentation sample without its mask; the message names the key, the shard and the fields it has."""


def _collate(
    samples: list[dict[str, Any]], normalisation: dict[str, torch.Tensor] | None, counts: ShardCounts
) -> dict[str, Any]:
    """Stacks the transform outputs into (B, ...) tensors ("image" a `DeviceCrops` when it holds JPEGs for the
    device, `data.device_decode.stack_images`); labels (B,) (all -1 without labels), keys, num_corrupt, the shard
    reads `counts` took since the last batch, and the transform's `normalisation` (None: none)."""
    stack = {"image": stack_images}
    names = [name for name in samples[0] if name not in _PER_SAMPLE_FIELDS]
    batch = {name: stack.get(name, torch.stack)([s[name] for s in samples]) for name in names}
    batch["label"] = torch.tensor([s["label"] for s in samples], dtype=torch.int64)  # (B,)
    batch["key"] = [s["key"] for s in samples]
    batch["num_corrupt"] = torch.tensor(sum(s["num_corrupt"] for s in samples), dtype=torch.int64)
    num_reads, num_skipped = counts.take()
    batch["num_shard_reads"] = torch.tensor(num_reads, dtype=torch.int64)
    batch["num_skipped_shards"] = torch.tensor(num_skipped, dtype=torch.int64)
    if normalisation is not None:
        batch["normalise"] = normalisation
    return batch


BATCH_COUNTS = ("num_corrupt", "num_shard_reads", "num_skipped_shards")
"""The int64 scalars every batch carries: what its producing worker skipped or read since its last batch."""


def zero_counts() -> dict[str, torch.Tensor]:
    """`BATCH_COUNTS`, all 0: for a batch no shard made (a benchmark's or a test's batch fed to the loop)."""
    return {name: torch.tensor(0, dtype=torch.int64) for name in BATCH_COUNTS}


def _seed_global_rngs(seed: int) -> None:
    """Seeds the global torch (CPU), python and numpy RNGs that transforms draw from."""
    torch.default_generator.manual_seed(seed)  # not torch.manual_seed, which would also reseed CUDA
    random.seed(seed)
    np.random.seed(seed % 2**32)


def _restore_global_rngs(batches: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Yields `batches`, restoring the global torch (CPU), python and numpy RNG state after each one.

    `_decode` reseeds these RNGs for every sample; saving and restoring once per batch (not per sample)
    keeps that invisible to the caller at a fraction of the cost.
    """
    while True:
        states = torch.get_rng_state(), random.getstate(), np.random.get_state()
        try:
            batch = next(batches)
        except StopIteration:
            return
        finally:
            torch.set_rng_state(states[0])
            random.setstate(states[1])
            np.random.set_state(states[2])
        yield batch


def _make_loader(stream: _ShardStream, num_workers: int, timeout_s: float) -> DataLoader:
    """Wraps a stream in a DataLoader that leaves the caller's global RNG untouched, with workers started from the
    fork server and a timeout (data/workers.py)."""
    # DataLoader draws a base seed for its workers at every iter(); a private generator keeps that draw off
    # the global torch RNG (our streams seed themselves and do not use it).
    generator = torch.Generator().manual_seed(_mix_seed(stream.seed, _SEED_LOADER, stream.rank))
    return worker_loader(
        stream, num_workers=num_workers, timeout_s=timeout_s, rank=stream.rank, batch_size=None,
        pin_memory=torch.cuda.is_available(), generator=generator,
    )  # fmt: skip


def _check_loader_args(
    shards: list[str], batch_size: int, seed: int, rank: int, world_size: int, num_workers: int
) -> None:
    """Raises ValueError for loader arguments that cannot work."""
    if not shards:
        raise ValueError("shard list is empty")
    if batch_size < 1 or seed < 0 or num_workers < 0:
        raise ValueError(f"need batch_size >= 1, seed >= 0, num_workers >= 0; got {batch_size}, {seed}, {num_workers}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, world_size={world_size})")


def _check_source(source: WeightedShards, name: str, *, resampled: bool, world_size: int, num_workers: int) -> None:
    """Raises ValueError for a training source that cannot be streamed; `name` prefixes the message."""
    if not source.shards:
        raise ValueError(f"{name}shard list is empty")
    if not (source.weight > 0 and math.isfinite(source.weight)):
        raise ValueError(f"{name}shard spec {describe_shards(source.shards)}: weight must be > 0, got {source.weight}")
    num_streams = world_size * max(num_workers, 1)
    if not resampled and len(source.shards) < num_streams:
        raise ValueError(
            f"{name}shard spec {describe_shards(source.shards)}: {len(source.shards)} shards cannot be split over "
            f"{num_streams} streams (world_size {world_size} x {max(num_workers, 1)} workers); write more shards or "
            "use fewer workers"
        )


def _default_shuffle_buffer(shards: list[str], num_open_shards: int) -> int:
    """The samples the open shards hold together, so that the buffer mixes them whole, within a memory budget.

    Their count comes from index.json (mean samples per shard); their size from the shard files, tar headers
    included, so the buffer's memory stays below `_SHUFFLE_BUFFER_BYTES`. Without an index: a fixed count.
    """
    num_samples = dataset_size(shards)
    if num_samples is None:
        return _SHUFFLE_BUFFER_FALLBACK
    open_samples = min(num_open_shards, len(shards)) * num_samples / len(shards)
    bytes_per_sample = sum(os.path.getsize(s) for s in shards) / max(num_samples, 1)
    return max(1, min(round(open_samples), int(_SHUFFLE_BUFFER_BYTES / max(bytes_per_sample, 1))))


def _order_rng(seed: int) -> Callable[..., random.Random]:
    """The seeded generators of the sample order (data/order.py `SeededRng`)."""
    return lambda *parts: random.Random(_mix_seed(seed, _SEED_ORDER, *parts))


def _worker_position() -> tuple[int, int]:
    """(worker id, number of workers) inside a DataLoader worker, (0, 1) in the main process."""
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def _mix_seed(*parts: int) -> int:
    """A 64-bit seed mixed from non-negative integers (numpy's SeedSequence hashing)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1, np.uint64)[0])


_MASK64 = 2**64 - 1


def _sample_seed(stream_seed: int, index: int) -> int:
    """The 64-bit seed of sample `index` of a stream: splitmix64's output of the stream's seed stepped `index + 1`
    times. A SeedSequence per sample (`_mix_seed`) costs ~10 us, this well under 1 us; both decorrelate neighbours."""
    z = (stream_seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
