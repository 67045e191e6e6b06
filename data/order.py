"""The order in which raw training samples reach one stream (one DataLoader worker of one rank).

    each source: `num_open` of its shards read at once, each next sample from one of them drawn uniformly
    -> the stream: each next sample from a source drawn by weight (one source: no draw) -> shuffle buffer

Why several shards at once: a shuffle buffer over one shard at a time cannot undo an order that spans shards.
Shards written class by class (by another tool, from a folder tree) hold a few classes each, so batches drawn
from one shard's buffer hold those few classes. Drawing every next sample from one of `num_open` open shards
mixes the classes of all of them, and a buffer that holds what they hold together (data/pipeline.py's default,
within its memory budget) mixes them whole. A stream cannot mix more than it holds: many class-ordered shards
should be rewritten (`python -m data write` shuffles).

An open shard holds no samples: its tar stream is read one sample at a time. What it costs is a file handle, or a
connection (a `curl` process for http shards). Samples wait, still encoded, only in the shuffle buffer.

Shard assignment per source:
    resampled: the stream walks through the source's shards in its own random order, pass after pass, without
        epochs; streams are independent of each other and may read the same shards.
    not resampled: epoch e reads shards[g::G] of the epoch's shard permutation, which every rank computes from
        (seed, source, e) alone, so the G streams never overlap and together read every shard once per epoch.

Randomness comes only from the `rng(*parts)` generators the caller seeds, so the raw stream is a function of the
seeds, the rank and the worker: skipping its first N samples reproduces a resumed run exactly.
"""

import itertools
import random
from collections.abc import Callable, Iterator
from typing import Any

import webdataset as wds

from data.specs import WeightedShards, describe_shards

Sample = dict[str, Any]
ReadShard = Callable[[str], Iterator[Sample]]
SeededRng = Callable[..., random.Random]
"""`rng(*parts)`: a generator seeded from the run's seed and the non-negative ints `parts`."""

# Purpose tags, the first part of every seed drawn here, so the generators are independent of each other.
_SHARD_ORDER, _SHARD_PASS, _INTERLEAVE, _MIX, _SHUFFLE = range(5)


def train_order(
    sources: list[WeightedShards],
    read: ReadShard,
    rng: SeededRng,
    *,
    rank: int,
    worker: int,
    stream_id: int,
    num_streams: int,
    resampled: bool,
    num_open: int,
    shuffle_buffer: int,
) -> Iterator[Sample]:
    """The endless raw sample stream of one stream: sources interleaved shard-wise, mixed by weight, buffered.

    Args:
        sources: The sources with their weights; one source is read without any draw between sources.
        read: Opens one shard and yields its raw samples.
        rng: Seeded generators (see `SeededRng`).
        rank: This process's rank.
        worker: This stream's worker index within the rank.
        stream_id: The stream's global id g = rank * W + worker.
        num_streams: G = world_size * W.
        resampled: See the module docstring.
        num_open: Shards each source reads at once.
        shuffle_buffer: Samples held by the shuffle buffer after the mix; 0 turns it off.
    """
    streams = [
        _source_stream(s.shards, i, read, rng, rank, worker, stream_id, num_streams, resampled, num_open)
        for i, s in enumerate(sources)
    ]
    samples = streams[0] if len(streams) == 1 else _mix(streams, [s.weight for s in sources], rng(_MIX, rank, worker))
    if shuffle_buffer > 0:
        samples = wds.shuffle(shuffle_buffer, initial=shuffle_buffer, rng=rng(_SHUFFLE, rank, worker))(samples)
    return samples


def interleave_shards(
    urls: Iterator[str], read: ReadShard, *, num_open: int, rng: random.Random, num_distinct: int | None = None
) -> Iterator[Sample]:
    """Reads up to `num_open` shards at once; each next sample comes from one of them, drawn uniformly.

    An exhausted shard is replaced by the next of `urls` that is not open already (an endless `urls` repeats
    shards, and the same shard read twice at once would repeat its samples close together); the stream ends
    when `urls` and every open shard are.

    Args:
        urls: The shards, in the order they are opened.
        read: Opens one shard and yields its raw samples.
        num_open: How many shards are read at once.
        rng: Draws the shard of every next sample.
        num_distinct: How many different shards an endless `urls` repeats (at most that many are open at once;
            once all of them have been found empty with no sample in between, raise instead of looping forever);
            None for a finite `urls`.
    """
    num_open = num_open if num_distinct is None else min(num_open, num_distinct)
    open_shards: list[_OpenShard] = []
    found_empty: set[str] = set()  # shards that held no sample, since the last sample
    exhausted = False
    while True:
        while not exhausted and len(open_shards) < num_open:
            reading = {shard.url for shard in open_shards}
            url = next((u for u in urls if u not in reading), None)
            if url is None:
                exhausted = True
            else:
                open_shards.append(_OpenShard(url, read(url)))
        if not open_shards:
            return
        i = rng.randrange(len(open_shards))
        shard = open_shards[i]
        sample = next(shard.samples, None)
        if sample is not None:
            shard.num_read += 1
            found_empty.clear()
            yield sample
            continue
        open_shards.pop(i)
        if shard.num_read == 0:
            found_empty.add(shard.url)
            if num_distinct is not None and len(found_empty) >= num_distinct:
                raise ValueError(
                    f"none of the {num_distinct} shards {describe_shards(sorted(found_empty))} holds a sample"
                )


class _OpenShard:
    """A shard being read: its url, its remaining samples and how many it has given."""

    def __init__(self, url: str, samples: Iterator[Sample]) -> None:
        self.url, self.samples, self.num_read = url, samples, 0


def _source_stream(
    shards: list[str],
    source: int,
    read: ReadShard,
    rng: SeededRng,
    rank: int,
    worker: int,
    stream_id: int,
    num_streams: int,
    resampled: bool,
    num_open: int,
) -> Iterator[Sample]:
    """One source's endless raw samples for one stream (see the module docstring for the shard assignment)."""
    if resampled:
        passes = rng(_SHARD_PASS, source, rank, worker)
        urls = (url for _ in itertools.count() for url in passes.sample(shards, len(shards)))
        interleave_rng = rng(_INTERLEAVE, source, rank, worker)
        yield from interleave_shards(urls, read, num_open=num_open, rng=interleave_rng, num_distinct=len(set(shards)))
        return
    for epoch in itertools.count():
        urls = list(shards)
        rng(_SHARD_ORDER, source, epoch).shuffle(urls)  # the same permutation on every rank and worker
        urls = urls[stream_id::num_streams]
        interleave_rng = rng(_INTERLEAVE, source, epoch, rank, worker)
        empty = True
        for sample in interleave_shards(iter(urls), read, num_open=num_open, rng=interleave_rng):
            empty = False
            yield sample
        if empty:  # would otherwise loop forever without yielding
            raise ValueError(f"shards {describe_shards(urls)} of stream {stream_id} hold no samples")


def _mix(streams: list[Iterator[Sample]], weights: list[float], rng: random.Random) -> Iterator[Sample]:
    """Each next sample from source i with probability weights[i] / sum(weights); every stream is endless."""
    indices = range(len(streams))
    cum_weights = list(itertools.accumulate(weights))
    while True:
        (i,) = rng.choices(indices, cum_weights=cum_weights)
        yield next(streams[i])
