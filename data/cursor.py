"""Where a rank's training streams stand (its data position, saved in every checkpoint), and how an elastic resume
hands what the old streams left unread to the new ones.

Each batch carries the cursor of the stream (DataLoader worker) that made it, as of right after the batch
(`StreamCursor`, "cursor" in the batch). The training process keeps, per rank, the cursor of the last batch it
consumed from each worker: the position
    {"next_worker": the worker whose batch comes next, "streams": per worker, {"index": the stream's next sample
     index (augmentation seeds come from it), "order": the `TrainOrder` cursor (data/order.py), "reads": its shard
     reads begun and skipped and the skipped shards still resting (`data.shard_read.ShardCounts.state`)}, or None:
     none consumed yet}
Workers prefetch ahead of training; what they prefetched is not in the position, so a resumed stream makes it again.

Elastic resume (another world size or worker count): the old streams cannot continue, since each stream's share of an
epoch depends on the number of streams. What they left unread is dealt out over the new streams, which read it
first (`redistribute`): the samples in their shuffle buffers, the rest of their open shards and, not resampled, the
shards of their epoch they had not opened yet (and of any later epoch another old stream had already begun). Then
every new stream starts the epoch after the latest one an old stream had reached. So every sample of the epochs the
old streams were in is seen exactly once in all (at most once, none skipped); resampled streams (no epochs) lose
none of the samples drawn into the buffers or the open shards and continue with passes of their own that no old
stream used.
"""

import array
import itertools
from dataclasses import dataclass

from data.order import SeededRng, decode_refs, encode_refs, epoch_shards, initial_state
from data.specs import WeightedShards


@dataclass(frozen=True)
class StreamCursor:
    """A batch's "cursor": where its stream stands right after it.

    Not a Mapping or a Sequence, so that the DataLoader (its conversion and pin-memory thread) passes it through
    as it is instead of walking its thousands of values.
    """

    worker: int
    num_workers: int
    state: dict
    """{"index": the stream's next sample index, "order": its `TrainOrder.state()`, "reads": its
    `ShardCounts.state()`}."""


def advance(position: dict | None, cursor: StreamCursor) -> dict:
    """The rank's data position once the batch that carried `cursor` is consumed (a new dict: the loader may still
    hold the one it started from)."""
    same_layout = position is not None and len(position["streams"]) == cursor.num_workers
    streams = list(position["streams"]) if same_layout else [None] * cursor.num_workers
    streams[cursor.worker] = cursor.state
    return {"next_worker": (cursor.worker + 1) % cursor.num_workers, "streams": streams}


def start_position(
    positions: list[dict | None],
    *,
    rank: int,
    world_size: int,
    num_workers: int,
    sources: list[WeightedShards],
    resampled: bool,
    rng: SeededRng,
) -> dict:
    """The position this rank's streams start from.

    Args:
        positions: The data position each rank of the resumed run saved, by rank. With the same world size and
            worker count only this rank's is read (the others may be None); with another every one is (elastic).
        rank: This process's rank.
        world_size: The number of ranks now.
        num_workers: DataLoader workers per rank now (0: one stream in the process).
        sources: The training sources.
        resampled: Whether the sources are resampled.
        rng: The stream's seeded generators (data/order.py `SeededRng`).

    Raises:
        ValueError: If a position needed is missing (a checkpoint from before data positions were saved).
    """
    num_workers = max(num_workers, 1)
    own = positions[rank] if len(positions) == world_size else None
    if own is not None and len(own["streams"]) == num_workers:
        return own
    missing = [r for r, position in enumerate(positions) if position is None]
    if missing:
        raise ValueError(
            f"the checkpoint holds no data position for rank {missing[0]} (written before mimpipe saved one): "
            "its streams cannot be continued; start afresh with another run_dir"
        )
    streams = redistribute(positions, world_size * num_workers, sources=sources, resampled=resampled, rng=rng)
    return {"next_worker": 0, "streams": streams[rank * num_workers : (rank + 1) * num_workers]}


def redistribute(
    positions: list[dict], num_streams: int, *, sources: list[WeightedShards], resampled: bool, rng: SeededRng
) -> list[dict]:
    """The starting cursors of `num_streams` new streams (by global id) that read what the old ones left unread
    (see the module docstring), every new stream computing the same deal from the same positions."""
    num_shards = [len(s.shards) for s in sources]
    old = [stream for position in positions for stream in position["streams"]]  # by old stream id
    orders = [initial_state(num_shards) if stream is None else stream["order"] for stream in old]
    if any(order["num_shards"] != num_shards for order in orders):
        raise ValueError(
            f"the saved data position is for sources of {orders[0]['num_shards']} shards, data.train has "
            f"{num_shards}: the streams cannot continue where they stopped"
        )
    offsets = list(itertools.accumulate([0, *num_shards]))
    leftovers, next_epochs = [], []
    for i, n in enumerate(num_shards):
        states = [order["sources"][i] for order in orders]
        last = max(state["epoch"] for state in states)
        entries = []
        for stream_id, state in enumerate(states):
            entries += state["leftover"] + state["open"]
            for epoch in range(state["epoch"], last + 1) if not resampled else ():
                share = epoch_shards(n, i, epoch, rng, stream_id, len(orders))
                start = state["next"] if epoch == state["epoch"] else 0
                entries += [[offsets[i] + k, 0] for k in share[start:]]
        leftovers.append(entries)
        next_epochs.append(last + 1)
    refs = array.array("q", itertools.chain.from_iterable(decode_refs(o["buffer"]["refs"]) for o in orders))
    index = max((stream["index"] for stream in old if stream is not None), default=0)
    generation = max(order["generation"] for order in orders) + 1
    return [
        {
            "index": index,  # past every index an old stream used: no augmentation seed of the run repeats
            "order": {
                "num_shards": num_shards,
                "generation": generation,
                "sources": [
                    {"epoch": epoch, "next": 0, "open": [], "leftover": entries[g::num_streams], "rng": None}
                    for entries, epoch in zip(leftovers, next_epochs, strict=True)
                ],
                "mix": None,
                "buffer": {"rng": None, "refs": encode_refs(refs[g::num_streams])},
            },
        }
        for g in range(num_streams)
    ]
