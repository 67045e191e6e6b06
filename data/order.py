"""The order in which raw training samples reach one stream (one DataLoader worker of one rank), and its cursor.

    each source: `num_open` of its shards read at once, each next sample from one of them drawn uniformly
    -> the stream: each next sample from a source drawn by weight (one source: no draw) -> shuffle buffer

Why several shards at once: a shuffle buffer over one shard at a time cannot undo an order that spans shards.
Shards written class by class (by another tool, from a folder tree) hold a few classes each, so batches drawn
from one shard's buffer hold those few classes. Drawing every next sample from one of `num_open` open shards
mixes the classes of all of them, and a buffer that holds what they hold together (data/pipeline.py's default,
within its memory budget) mixes them whole. A stream cannot mix more than it holds: many class-ordered shards
should be rewritten (`python -m data write` shuffles).

The buffer gives its first sample once it holds `FIRST_FILL` samples (or all it may hold, if fewer), then grows by
one with every sample it gives until it holds `shuffle_buffer`: filling 40,000 samples before the first batch took
the quickstart's worker 4-6 s, 1,000 take ~0.1 s. So the first samples of a run come from a smaller buffer (still
drawn from every open shard), as webdataset's own `shuffle(bufsize, initial)` does. A resumed stream's buffer
grows on from what it held.

An open shard holds no samples: its tar stream is read one sample at a time. What it costs is a file handle, or a
connection (a `curl` process for http shards). Samples wait, still encoded, only in the shuffle buffer.

Shard assignment per source:
    resampled: pass p of stream (rank, worker) reads the source's shards in its own random order; passes follow
        each other without epochs (an open shard stays open across passes); streams are independent of each other
        and may read the same shards.
    not resampled: epoch e reads shards[g::G] of the epoch's shard permutation, which every rank computes from
        (seed, source, e) alone, so the G streams never overlap and together read every shard once per epoch.

Cursor: `TrainOrder.state()` is where the stream stands, as small JSON-safe values, and `TrainOrder(..., state=...)`
continues from it, reading only the shards that were open (up to where they were) and those of the samples the
shuffle buffer held, never the epochs before. Shards are named by their number in the sources' shard lists, one
list after another; a sample by a reference, its shard's number << 32 | its index in the shard. Per source:
    {"epoch": epoch (pass), "next": shards of the epoch's list opened so far, "open": [[shard, samples read], ...],
     "leftover": [[shard, samples to skip], ...] to open before the epoch's list (an elastic resume, data/cursor.py),
     "rng": the state of the generator that picks the open shard of every next sample (None: seed it afresh)}
and for the stream: {"num_shards": per source, "generation": elastic resumes so far (seeds mix and buffer), "sources",
"mix": the mix generator's state, "buffer": {"rng": its generator's state, "refs": its samples' references,
base64 of little-endian int64s, in buffer order}}.

Randomness comes only from the `rng(*parts)` generators the caller seeds, so the raw stream is a function of the
seeds, the rank, the worker and the cursor it starts from: a stream restarted from the cursor it gave after N samples
yields what the uninterrupted stream yields after N.
"""

import array
import base64
import itertools
import logging
import random
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

from data.specs import WeightedShards, describe_shards

log = logging.getLogger(__name__)

Sample = dict[str, Any]
ReadShard = Callable[[str], Iterator[Sample]]
SeededRng = Callable[..., random.Random]
"""`rng(*parts)`: a generator seeded from the run's seed and the non-negative ints `parts`."""

FIRST_FILL = 1000
"""Samples the shuffle buffer holds before it gives its first (see the module docstring)."""

# Purpose tags, the first part of every seed drawn here, so the generators are independent of each other.
_SHARD_ORDER, _SHARD_PASS, _INTERLEAVE, _MIX, _SHUFFLE = range(5)
_INDEX_BITS = 32  # a sample reference: shard number << _INDEX_BITS | index of the sample in its shard


class TrainOrder:
    """The endless raw sample stream of one stream: sources interleaved shard-wise, mixed by weight, buffered.

    Args:
        sources: The sources with their weights; one source is read without any draw between sources.
        read: Opens one shard (by URL) and yields its raw samples; a shard that ends early is simply exhausted.
        rng: Seeded generators (see `SeededRng`).
        rank: This process's rank.
        worker: This stream's worker index within the rank.
        stream_id: The stream's global id g = rank * W + worker.
        num_streams: G = world_size * W.
        resampled: See the module docstring.
        num_open: Shards each source reads at once.
        shuffle_buffer: Samples held by the shuffle buffer after the mix; 0 turns it off.
        state: A cursor from `state()` to continue from (see the module docstring); None starts afresh.
        reopen: Opens again a shard the cursor had open or holds buffered samples of (what the interrupted stream had
            begun reading already); None: `read`.

    Raises:
        ValueError: If `state` was saved for other sources than `sources`.
    """

    def __init__(
        self,
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
        state: dict | None = None,
        reopen: ReadShard | None = None,
    ) -> None:
        state = state or initial_state([len(s.shards) for s in sources])
        reopen = reopen or read
        if state["num_shards"] != [len(s.shards) for s in sources]:
            raise ValueError(
                f"the saved data position is for sources of {state['num_shards']} shards, data.train has "
                f"{[len(s.shards) for s in sources]}: the stream cannot continue where it stopped"
            )
        self.shards = [url for s in sources for url in s.shards]
        offsets = list(itertools.accumulate([0, *(len(s.shards) for s in sources)]))[:-1]
        layout = (rank, worker, stream_id, num_streams)
        self.sources = [
            _Source(
                self.shards, offset, len(s.shards), i, (read, reopen), rng, layout, resampled, num_open, source_state
            )
            for i, (s, offset, source_state) in enumerate(zip(sources, offsets, state["sources"], strict=True))
        ]
        self.generation = state["generation"]
        self.cum_weights = list(itertools.accumulate(s.weight for s in sources))
        self.mix_rng = _restored(state["mix"], lambda: rng(_MIX, self.generation, rank, worker))
        buffered = state["buffer"]
        self.buffer_size = shuffle_buffer
        self.shuffle_rng = _restored(buffered["rng"], lambda: rng(_SHUFFLE, self.generation, rank, worker))
        self.buffer_refs = decode_refs(buffered["refs"])
        self.buffer = _read_refs(self.buffer_refs, self.shards, reopen)

    def __iter__(self) -> Iterator[Sample]:
        return self

    def __next__(self) -> Sample:
        if self.buffer_size == 0 and not self.buffer:
            return self._draw()[1]
        # Up to FIRST_FILL at once, then one more for every sample given (2 in, 1 out), up to buffer_size
        target = min(self.buffer_size, max(FIRST_FILL, len(self.buffer) + 2))
        while len(self.buffer) < target:
            ref, sample = self._draw()
            self.buffer_refs.append(ref)
            self.buffer.append(sample)
        i = self.shuffle_rng.randrange(len(self.buffer))
        sample = self.buffer[i]
        self.buffer_refs[i], self.buffer[i] = self.buffer_refs[-1], self.buffer[-1]  # the last takes its place
        self.buffer_refs.pop()
        self.buffer.pop()
        return sample

    def state(self) -> dict:
        """The cursor: a fresh `TrainOrder` given it yields what this one yields next (JSON-safe values)."""
        return {
            "num_shards": [source.num_shards for source in self.sources],
            "generation": self.generation,
            "sources": [source.state() for source in self.sources],
            "mix": _rng_state(self.mix_rng) if len(self.sources) > 1 else None,
            "buffer": {"rng": _rng_state(self.shuffle_rng), "refs": encode_refs(self.buffer_refs)},
        }

    def _draw(self) -> tuple[int, Sample]:
        """The next raw sample after the mix, with its reference."""
        if len(self.sources) == 1:
            return next(self.sources[0])
        (source,) = self.mix_rng.choices(self.sources, cum_weights=self.cum_weights)
        return next(source)


def initial_state(num_shards: list[int]) -> dict:
    """The cursor of a stream that has not started, for sources of `num_shards` shards each."""
    fresh = {"epoch": 0, "next": 0, "open": [], "leftover": [], "rng": None}
    return {
        "num_shards": list(num_shards),
        "generation": 0,
        "sources": [dict(fresh) for _ in num_shards],
        "mix": None,
        "buffer": {"rng": None, "refs": encode_refs(array.array("q"))},
    }


def epoch_shards(num_shards: int, source: int, epoch: int, rng: SeededRng, stream_id: int, num_streams: int) -> list:
    """Not resampled: the shard numbers (within the source) that stream `stream_id` of `num_streams` reads in
    `epoch`, in order: its share of the epoch's permutation, the same on every rank and worker."""
    order = list(range(num_shards))
    rng(_SHARD_ORDER, source, epoch).shuffle(order)
    return order[stream_id::num_streams]


class _Source:
    """One source's endless raw samples for one stream, each with its reference (see the module docstring)."""

    def __init__(
        self,
        shards: list[str],
        offset: int,
        num_shards: int,
        source: int,
        reads: tuple[ReadShard, ReadShard],
        rng: SeededRng,
        layout: tuple[int, int, int, int],
        resampled: bool,
        num_open: int,
        state: dict,
    ) -> None:
        """`shards`: every source's, one list after another; this source's are `shards[offset:offset + num_shards]`.
        `reads`: (read, reopen), see `TrainOrder`. `layout`: (rank, worker, stream_id, num_streams). `state`: the
        source's part of the cursor."""
        self.shards, self.offset, self.num_shards, self.source = shards, offset, num_shards, source
        (self.read, self.reopen), self.rng_of, self.resampled = reads, rng, resampled
        self.rank, self.worker, self.stream_id, self.num_streams = layout
        names = shards[offset : offset + num_shards]
        self.num_distinct = len(set(names))
        self.num_open = min(num_open, self.num_distinct) if resampled else num_open
        self.epoch, self.next, self.leftover = state["epoch"], state["next"], [tuple(e) for e in state["leftover"]]
        self.epoch_list = self._epoch_list()
        self.rng = _restored(state["rng"], self._seeded_rng)
        # A shard opened but not yet drawn from (skip 0) was never begun: it is read as any other next shard is.
        self.open = [self._open(number, skip, self.reopen if skip else self.read) for number, skip in state["open"]]
        self.epoch_empty = self.next == 0 and not self.open  # nothing read yet in this epoch
        self.found_empty: set[str] = set()  # resampled: shards that held no sample, since the last sample

    def __next__(self) -> tuple[int, Sample]:
        while True:
            while len(self.open) < self.num_open and (entry := self._next_entry()) is not None:
                self.open.append(self._open(*entry, self.read))
            if not self.open:  # not resampled: the epoch's shards are read
                if self.epoch_empty:  # would otherwise loop forever without yielding
                    urls = [self.shards[self.offset + i] for i in self.epoch_list]
                    raise ValueError(f"shards {describe_shards(urls)} of stream {self.stream_id} hold no samples")
                self.epoch, self.next, self.epoch_empty = self.epoch + 1, 0, True
                self.epoch_list, self.rng = self._epoch_list(), self._seeded_rng()
                continue
            i = self.rng.randrange(len(self.open))
            shard = self.open[i]
            sample = next(shard.samples, None)
            if sample is not None:
                shard.num_read += 1
                self.found_empty.clear()
                self.epoch_empty = False
                return shard.number << _INDEX_BITS | (shard.num_read - 1), sample
            self.open.pop(i)
            if shard.num_read == shard.first and self.resampled:
                self.found_empty.add(self.shards[shard.number])
                if len(self.found_empty) >= self.num_distinct:
                    raise ValueError(
                        f"none of the {self.num_distinct} shards {describe_shards(sorted(self.found_empty))} holds a "
                        "sample"
                    )

    def state(self) -> dict:
        return {
            "epoch": self.epoch,
            "next": self.next,
            "open": [[shard.number, shard.num_read] for shard in self.open],
            "leftover": [list(entry) for entry in self.leftover],
            "rng": _rng_state(self.rng),
        }

    def _epoch_list(self) -> list[int]:
        """The shard numbers (within the source) of the current epoch (pass), in the order they are opened."""
        if not self.resampled:
            return epoch_shards(self.num_shards, self.source, self.epoch, self.rng_of, self.stream_id, self.num_streams)
        order = list(range(self.num_shards))
        self.rng_of(_SHARD_PASS, self.source, self.epoch, self.rank, self.worker).shuffle(order)
        return order

    def _seeded_rng(self) -> random.Random:
        """The open-shard generator of the current epoch (resampled: of the stream, seeded at the pass it starts)."""
        return self.rng_of(_INTERLEAVE, self.source, self.epoch, self.rank, self.worker)

    def _next_entry(self) -> tuple[int, int] | None:
        """(global shard number, samples to skip) of the next shard to open; None when the epoch has no more.

        Resampled: passes follow each other, and a shard already open is passed over (the same shard read twice at
        once would repeat its samples close together); `num_open` <= the distinct shards leaves one to find.
        """
        if self.leftover:
            return self.leftover.pop(0)
        reading = {self.shards[shard.number] for shard in self.open}
        while True:
            if self.next == len(self.epoch_list):
                if not self.resampled:
                    return None
                self.epoch, self.next = self.epoch + 1, 0
                self.epoch_list = self._epoch_list()
            number = self.offset + self.epoch_list[self.next]
            self.next += 1
            if not self.resampled or self.shards[number] not in reading:
                return number, 0

    def _open(self, number: int, skip: int, read: ReadShard) -> "_OpenShard":
        """Shard `number`, read by `read`, its first `skip` samples read past (a resumed shard)."""
        return _OpenShard(number, itertools.islice(read(self.shards[number]), skip, None), skip)


class _OpenShard:
    """A shard being read: its number, its remaining samples, how many it has given (from its start) and how many
    it had given when it was opened."""

    def __init__(self, number: int, samples: Iterator[Sample], num_read: int) -> None:
        self.number, self.samples, self.num_read, self.first = number, samples, num_read, num_read


def encode_refs(refs: array.array) -> str:
    """Sample references as base64 of little-endian int64s: a few bytes per buffered sample, JSON-safe."""
    if sys.byteorder == "big":
        refs = array.array("q", refs)
        refs.byteswap()
    return base64.b64encode(refs.tobytes()).decode("ascii")


def decode_refs(text: str) -> array.array:
    refs = array.array("q", base64.b64decode(text))
    if sys.byteorder == "big":
        refs.byteswap()
    return refs


def _read_refs(refs: array.array, shards: list[str], read: ReadShard) -> list[Sample]:
    """The samples `refs` name, reading each of their shards once, up to the last one needed; a sample its shard no
    longer gives (a shard that now ends early) is dropped from `refs`, with a warning."""
    wanted: dict[int, set[int]] = defaultdict(set)
    for ref in refs:
        wanted[ref >> _INDEX_BITS].add(ref & (2**_INDEX_BITS - 1))
    found: dict[int, Sample] = {}
    for number, indices in sorted(wanted.items()):
        for index, sample in enumerate(itertools.islice(read(shards[number]), max(indices) + 1)):
            if index in indices:
                found[number << _INDEX_BITS | index] = sample
    missing = [ref for ref in refs if ref not in found]
    if missing:
        log.warning("%d buffered samples could not be read again (their shards end early); dropped", len(missing))
        refs[:] = array.array("q", (ref for ref in refs if ref in found))
    return [found[ref] for ref in refs]


def _rng_state(rng: random.Random) -> list:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _restored(state: list | None, seeded: Callable[[], random.Random]) -> random.Random:
    """The generator in `state`, or `seeded()` when there is none (a fresh stream, or a new epoch)."""
    if state is None:
        return seeded()
    rng = random.Random()
    rng.setstate((state[0], tuple(state[1]), state[2]))
    return rng
