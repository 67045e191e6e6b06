"""Streams WebDataset shards into batches for training (endless, resumable) and evaluation (one pass).

Each stream runs inside one DataLoader worker (or in-process when num_workers=0):
    shard urls -> tar samples -> shuffle buffer -> skip (resume) -> decode + transform -> batch
Batches are built in the worker and passed through by DataLoader(batch_size=None).

Distributed layout: a stream's global id is g = rank * W + worker with W = max(num_workers, 1), and there
are G = world_size * W streams. Without resampling, stream g reads shards[g::G] of the epoch's shard
permutation, which every rank computes from (seed, epoch) alone, so the streams never overlap.

Determinism: every random choice comes from a generator seeded with a purpose tag plus (seed, rank,
worker, ...), and each sample's augmentation runs under RNGs seeded from its position in its stream.
The caller's global torch/python/numpy RNG state is restored after every batch, so an in-process
loader never disturbs the trainer's randomness (e.g. MAE mask noise).

Resume: `skip_batches=N` drops each worker's share of the first N batches as raw samples, before
decoding. It reproduces the uninterrupted run exactly unless the skipped range held corrupt images
(each one, never decoded, shifts the resumed stream by one sample).

Shapes: B batch size, H/W image height/width after the transform.
"""

import contextlib
import glob
import itertools
import logging
import os
import random
import re
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from webdataset.gopen import gopen_schemes

from data.decode import decode_rgb
from data.write import INDEX_FILE, read_index

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "webp")
_PER_SAMPLE_FIELDS = ("label", "key", "num_corrupt")
_CORRUPT_IMAGE_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)
# Purpose tags mixed into seeds so the RNGs drawn from one user seed are independent of each other.
_SEED_SHARD_ORDER, _SEED_SHARD_DRAW, _SEED_SHUFFLE, _SEED_AUGMENT, _SEED_LOADER = range(5)


def resolve_shards(spec: str | list[str]) -> list[str]:
    """Turns a shard spec into the list of shard paths or URLs.

    Args:
        spec: A directory with an `index.json`; a brace pattern such as `dir/train-{000000..000127}.tar`;
            a glob such as `dir/train-*.tar`; a single path; or a list of paths/URLs.

    Returns:
        The shards, in index / brace / sorted-glob / list order.

    Raises:
        ValueError: If a local shard does not exist or a pattern matches nothing.
    """
    if isinstance(spec, list | tuple):
        shards = [str(s) for s in spec]
    elif os.path.isdir(spec):
        shards = [os.path.join(spec, s["name"]) for s in read_index(spec)["shards"]]
    elif any(c in spec for c in "*?["):
        shards = sorted(glob.glob(spec))
    else:
        shards = wds.shardlists.expand_urls(spec)
    missing = [s for s in shards if not _is_url(s) and not os.path.isfile(s)]
    if not shards or (missing and len(missing) == len(shards) and shards != [spec]):
        raise ValueError(f"shard spec {spec} matches no files")
    if missing:
        raise ValueError(f"shard {missing[0]} (from shard spec {spec}) does not exist")
    return shards


def dataset_size(spec: str | list[str]) -> int | None:
    """Total number of samples in the shards of `spec`, from the `index.json` beside them.

    Returns:
        The sum of the shards' `num_samples`, or None when some shard is not listed in an index.
    """
    counts: dict[str, int] = {}
    shards = resolve_shards(spec)
    for directory in {os.path.dirname(s) for s in shards}:
        if os.path.isfile(os.path.join(directory, INDEX_FILE)):
            for entry in read_index(directory)["shards"]:
                counts[os.path.join(directory, entry["name"])] = entry["num_samples"]
    if not all(s in counts for s in shards):
        return None
    return sum(counts[s] for s in shards)


def dataset_classes(spec: str | list[str]) -> list[str]:
    """Class names from the `index.json` beside the first shard of `spec` ([] when there is none)."""
    directory = os.path.dirname(resolve_shards(spec)[0])
    if not os.path.isfile(os.path.join(directory, INDEX_FILE)):
        return []
    return list(read_index(directory).get("classes") or [])


def make_train_loader(
    shards: list[str],
    *,
    transform: Callable[[Image.Image], Any],
    batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    num_workers: int,
    shuffle_buffer: int,
    resampled: bool = True,
    skip_batches: int = 0,
) -> DataLoader:
    """An endless, deterministic stream of training batches for one rank.

    Args:
        shards: Shard paths or URLs (see `resolve_shards`).
        transform: Maps an RGB PIL image to a (3, H, W) tensor, or to a dict of tensors that includes
            "image" (extra entries, e.g. per-sample masks, are stacked into the batch as well).
        batch_size: Samples per batch (per device).
        seed: Seed (>= 0) for shard order, shuffling and augmentation.
        rank: This process's rank.
        world_size: Number of ranks.
        num_workers: DataLoader workers; 0 runs the stream in this process.
        shuffle_buffer: Samples (still encoded) held by each worker's shuffle buffer; 0 disables shuffling.
        resampled: Draw shards with replacement per (rank, worker) instead of splitting each epoch's
            shard permutation over all streams.
        skip_batches: Number of leading batches to skip without decoding them (exact resume).

    Returns:
        A DataLoader of batch dicts: "image" (B, 3, H, W) float32, "label" (B,) int64, "key" list of B
        str, "num_corrupt" int64 scalar (corrupt samples the producing worker skipped since its last batch).
    """
    _check_loader_args(shards, batch_size, seed, rank, world_size, num_workers)
    num_streams = world_size * max(num_workers, 1)
    if not resampled and len(shards) < num_streams:
        raise ValueError(
            f"shard spec {_describe(shards)}: {len(shards)} shards cannot be split over {num_streams} streams "
            f"(world_size {world_size} x {max(num_workers, 1)} workers); write more shards or use fewer workers"
        )
    if shuffle_buffer < 0 or skip_batches < 0:
        raise ValueError(f"shuffle_buffer and skip_batches must be >= 0, got {shuffle_buffer} and {skip_batches}")
    stream = _ShardStream(
        shards,
        transform=transform,
        batch_size=batch_size,
        seed=seed,
        rank=rank,
        world_size=world_size,
        train=True,
        shuffle_buffer=shuffle_buffer,
        resampled=resampled,
        skip_batches=skip_batches,
    )
    return _make_loader(stream, num_workers)


def make_eval_loader(
    shards: list[str],
    *,
    transform: Callable[[Image.Image], Any],
    batch_size: int,
    rank: int,
    world_size: int,
    num_workers: int,
) -> DataLoader:
    """One pass over the shards in order; across all ranks and workers every sample appears once.

    Uses fewer workers when there are fewer than `world_size * num_workers` shards. Each worker's last
    batch may be partial. Batches are as in `make_train_loader`.
    """
    _check_loader_args(shards, batch_size, 0, rank, world_size, num_workers)
    if len(shards) < world_size:
        raise ValueError(f"shard spec {_describe(shards)}: {len(shards)} shards for {world_size} ranks; need >= 1 each")
    stream = _ShardStream(
        shards, transform=transform, batch_size=batch_size, seed=0, rank=rank, world_size=world_size, train=False
    )
    return _make_loader(stream, min(num_workers, len(shards) // world_size))


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
        skip_batches: int = 0,
    ) -> None:
        super().__init__()
        self.shards, self.transform, self.batch_size = list(shards), transform, batch_size
        self.seed, self.rank, self.world_size, self.train = seed, rank, world_size, train
        self.shuffle_buffer, self.resampled, self.skip_batches = shuffle_buffer, resampled, skip_batches

    def __iter__(self) -> Iterator[dict[str, Any]]:
        loader_worker, num_workers = _worker_position()
        # DataLoader takes batches round-robin from its workers, starting at worker 0: batch i of a fresh run
        # comes from worker i % W. A run resumed after N batches must start with the worker that made batch N,
        # so DataLoader worker w plays the role of worker (w + N) % W, which skips its own batches among the N.
        worker = (loader_worker + self.skip_batches) % num_workers
        stream_id, num_streams = self.rank * num_workers + worker, self.world_size * num_workers
        if self.train:
            samples = self._train_samples(worker, stream_id, num_streams)
        else:
            samples = _read_shards(self.shards[stream_id::num_streams])
        own_skipped = self.skip_batches // num_workers + int(worker < self.skip_batches % num_workers)
        num_skipped = own_skipped * self.batch_size
        samples = itertools.islice(samples, num_skipped, None)  # raw samples: nothing decoded
        decoded = _decode(samples, self.transform, (self.seed, _SEED_AUGMENT, self.rank, worker), num_skipped)
        batches = wds.batched(self.batch_size, collation_fn=_collate, partial=not self.train)(decoded)
        return _restore_global_rngs(batches)

    def _train_samples(self, worker: int, stream_id: int, num_streams: int) -> Iterator[dict[str, Any]]:
        """Raw samples of this stream, epoch after epoch (a resampled stream stays in epoch 0 forever)."""
        for epoch in itertools.count():
            if self.resampled:
                draw = random.Random(_mix_seed(self.seed, _SEED_SHARD_DRAW, self.rank, worker))
                urls = (draw.choice(self.shards) for _ in itertools.count())
            else:
                urls = list(self.shards)
                random.Random(_mix_seed(self.seed, _SEED_SHARD_ORDER, epoch)).shuffle(urls)  # same on all ranks
                urls = urls[stream_id::num_streams]
            samples = _read_shards(urls)
            if self.shuffle_buffer > 0:
                rng = random.Random(_mix_seed(self.seed, _SEED_SHUFFLE, epoch, self.rank, worker))
                samples = wds.shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, rng=rng)(samples)
            empty = True
            for sample in samples:
                empty = False
                yield sample
            if empty:  # would otherwise loop forever without yielding
                raise ValueError(f"shards {_describe(urls)} of stream {stream_id} hold no samples")


def _gopen_fsspec(url: str, mode: str = "rb", bufsize: int = 8192):
    """Opens a shard URL with fsspec, for the object stores webdataset's gopen has no handler for."""
    import fsspec

    try:
        return fsspec.open(url, mode).open()
    except ImportError as exn:  # fsspec knows the protocol, its implementation (e.g. s3fs) is not installed
        raise RuntimeError(f"cannot open shard {url}: {exn} (for s3://: pip install 'mimpipe[s3]')") from exn


# Object stores reached through fsspec (s3fs, adlfs, gcsfs installed separately); `memory://` serves tests.
for _scheme in ("s3", "s3a", "az", "abfs", "gcs", "memory"):
    gopen_schemes.setdefault(_scheme, _gopen_fsspec)


# What curl's exit status means when webdataset's gopen fetches an http(s) shard with `curl -f`.
_CURL_EXITS = {
    6: "the host name does not resolve",
    7: "nothing accepts connections at that host and port",
    22: "the server answered with an HTTP error (404: no such shard there; 403: no access)",
    28: "the transfer timed out",
    35: "the TLS handshake failed",
    56: "the connection broke while receiving",
}


def _read_shards(urls: Iterator[str] | list[str]) -> Iterator[dict[str, Any]]:
    """Raw samples (dicts of bytes keyed by extension, plus `__key__` and `__url__`) of each shard in turn."""
    for url in urls:
        try:
            yield from wds.tarfile_samples([{"url": url}])
        except Exception as exn:
            raise RuntimeError(f"cannot read shard {url}: {_why_unreadable(exn)}") from exn


def _why_unreadable(exn: Exception) -> str:
    """Why a shard could not be read: in words when curl fetched it and failed, else the error itself.

    webdataset reports a failed curl either with its exit status or, when it read the empty stream before curl
    exited, as an 'empty file' that carries the still-running pipe: then the status is waited for.
    """
    pipe = next((a for a in exn.args if hasattr(a, "proc") and "curl" in str(getattr(a, "args", ""))), None)
    status = None
    if pipe is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            status = pipe.proc.wait(timeout=60)
    elif found := re.search(r"\['curl'.*exit (\d+)", str(exn)):
        status = int(found[1])
    if not status:
        return str(exn)
    return f"{_CURL_EXITS.get(status, 'curl failed')} (curl exit {status})"


def _decode(
    samples: Iterator[dict[str, Any]],
    transform: Callable[[Image.Image], Any],
    seed_prefix: tuple[int, ...],
    first_index: int,
) -> Iterator[dict[str, Any]]:
    """Decodes images to RGB and transforms them; corrupt images are skipped, logged and counted.

    Sample `first_index + i` of the stream is transformed under RNGs seeded from (*seed_prefix, index).
    Each output carries "num_corrupt": the corrupt samples skipped right before it.
    """
    num_corrupt = 0
    for index, sample in enumerate(samples, start=first_index):
        key, url = sample["__key__"], sample["__url__"]
        ext = next((e for e in IMAGE_EXTENSIONS if e in sample), None)
        if ext is None or "cls" not in sample:
            raise ValueError(f"sample {key} in shard {url} needs an image and a .cls entry, has {sorted(sample)}")
        try:
            image = getattr(transform, "decode", decode_rgb)(sample[ext])  # a transform may decode its own input
        except _CORRUPT_IMAGE_ERRORS as exn:
            log.warning("skipping corrupt image of sample %s in shard %s: %s", key, url, exn)
            num_corrupt += 1
            continue
        _seed_global_rngs(_mix_seed(*seed_prefix, index))  # restored by _restore_global_rngs
        out = transform(image)
        fields = out if isinstance(out, dict) else {"image": out}
        yield {**fields, "label": int(sample["cls"]), "key": key, "num_corrupt": num_corrupt}
        num_corrupt = 0


def _collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stacks the transform outputs into (B, ...) tensors; labels (B,), keys list, num_corrupt summed."""
    batch = {name: torch.stack([s[name] for s in samples]) for name in samples[0] if name not in _PER_SAMPLE_FIELDS}
    batch["label"] = torch.tensor([s["label"] for s in samples], dtype=torch.int64)  # (B,)
    batch["key"] = [s["key"] for s in samples]
    batch["num_corrupt"] = torch.tensor(sum(s["num_corrupt"] for s in samples), dtype=torch.int64)
    return batch


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


def _make_loader(stream: _ShardStream, num_workers: int) -> DataLoader:
    """Wraps a stream in a DataLoader that leaves the caller's global RNG untouched."""
    # DataLoader draws a base seed for its workers at every iter(); a private generator keeps that draw off
    # the global torch RNG (our streams seed themselves and do not use it).
    generator = torch.Generator().manual_seed(_mix_seed(stream.seed, _SEED_LOADER, stream.rank))
    return DataLoader(
        stream, batch_size=None, num_workers=num_workers, pin_memory=torch.cuda.is_available(), generator=generator
    )


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


def _worker_position() -> tuple[int, int]:
    """(worker id, number of workers) inside a DataLoader worker, (0, 1) in the main process."""
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


def _mix_seed(*parts: int) -> int:
    """A 64-bit seed mixed from non-negative integers (numpy's SeedSequence hashing)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1, np.uint64)[0])


def _describe(shards: list[str]) -> str:
    """A short description of a shard list for error messages."""
    return ", ".join(shards) if len(shards) <= 2 else f"[{shards[0]} ... {shards[-1]}] ({len(shards)} shards)"


def _is_url(shard: str) -> bool:
    """Whether a shard is a URL (`pipe:`, `http://`, `s3://`, ...) rather than a local path."""
    return shard.startswith("pipe:") or "://" in shard
