"""Resume start-up: time from building the training loader to its first batch, resumed after 1x, 10x and 100x the
steps, from the saved data cursor (data/cursor.py) and by replay, side by side.

- `cursor`: `make_train_loader(positions=...)` restarts the stream where the checkpoint left it, reading only the
  shards that were open and those of the buffered samples;
- `replay`: what main did before the cursor (data/pipeline.py `_skip_image_samples`): the stream is read from its
  start and every sample before the position is skipped undecoded, then the first batch is made.

Both use the same loader (one rank, in-process, the default shuffle buffer: what the 8 open shards hold) over
generated shards of 64 px JPEGs. Also the cost the cursor adds to every batch: the stream's `state()` and pickling
the batch's cursor (as a DataLoader worker does), next to the time one batch takes to make.

    .venv/bin/python -m benchmarks.bench_resume            # 100 / 1,000 / 10,000 steps of 32, 3 rounds (~3 minutes)
    .venv/bin/python -m benchmarks.bench_resume --quick    # 1 / 10 / 100 steps, 1 round: checks that it runs
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import pickle
import platform
import statistics
import tempfile
import time
from pathlib import Path

from data import pipeline, sources
from data.cursor import StreamCursor
from data.order import TrainOrder
from data.specs import WeightedShards, resolve_shards
from data.transforms import IMAGENET_MEAN, IMAGENET_STD, pretrain_transform
from data.write import write_shards

REPO = Path(__file__).resolve().parents[1]

SEED, BATCH, SIZE = 0, 32, 64
NUM_SHARDS, SHARD_SIZE = 32, 64


def loader(shards: list[str], positions: list[dict] | None):
    transform = pretrain_transform(SIZE, IMAGENET_MEAN, IMAGENET_STD)
    return pipeline.make_train_loader(
        shards, transform=transform, batch_size=BATCH, seed=SEED, rank=0, world_size=1, num_workers=0,
        resampled=False, positions=positions,
    )  # fmt: skip


def raw_order(shards: list[str], buffer: int, state: dict | None = None) -> TrainOrder:
    """The loader's raw order (the same seeds and reader as `_ShardStream` uses for stream 0 of 1)."""
    return TrainOrder(
        [WeightedShards(shards, 1.0)], lambda url: pipeline._read_shards([url]), pipeline._order_rng(SEED), rank=0,
        worker=0, stream_id=0, num_streams=1, resampled=False, num_open=8, shuffle_buffer=buffer, state=state,
    )  # fmt: skip


def replay(shards: list[str], buffer: int, steps: int) -> tuple[float, dict]:
    """Main's resume before the cursor: the stream read from its start, `steps` batches of samples skipped undecoded,
    then the first batch decoded. Returns its seconds and the data position a checkpoint after `steps` holds (every
    generated sample has an image)."""
    transform = pretrain_transform(SIZE, IMAGENET_MEAN, IMAGENET_STD)
    start = time.perf_counter()
    order = raw_order(shards, buffer)
    for _ in itertools.islice(order, steps * BATCH):
        pass
    position = {"next_worker": 0, "streams": [{"index": steps * BATCH, "order": order.state()}]}
    seed_prefix = (SEED, pipeline._SEED_AUGMENT, 0, 0)  # rank 0, worker 0
    decoded = pipeline._decode(order, transform, pipeline._no_label, seed_prefix, steps * BATCH)
    pipeline._collate(list(itertools.islice(decoded, BATCH)), transform.normalisation)
    return time.perf_counter() - start, position


def from_cursor(shards: list[str], position: dict) -> float:
    """Seconds from building the loader at `position` (through JSON, as a checkpoint holds it) to its first batch."""
    start = time.perf_counter()
    next(iter(loader(shards, [json.loads(json.dumps(position))])))
    return time.perf_counter() - start


def per_batch_cost(shards: list[str], buffer: int, position: dict, repeats: int = 200) -> dict:
    """Microseconds of `state()` + pickling the cursor (worker) + unpickling (trainer), its size, and the time to
    make one batch."""
    order = raw_order(shards, buffer, position["streams"][0]["order"])
    start = time.perf_counter()
    for _ in range(repeats):
        payload = pickle.dumps(StreamCursor(0, 1, {"index": 0, "order": order.state()}))
        pickle.loads(payload)
    cursor_us = (time.perf_counter() - start) / repeats * 1e6
    batches = iter(loader(shards, None))
    next(batches)
    start = time.perf_counter()
    for _ in range(10):
        next(batches)
    batch_ms = (time.perf_counter() - start) / 10 * 1e3
    return {"cursor_us": cursor_us, "bytes": len(payload), "batch_ms": batch_ms, "json": len(json.dumps(position))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 / 10 / 100 steps, 1 round")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "resume.md"))
    args = parser.parse_args()
    base, rounds = (1, 1) if args.quick else (100, 3)
    read = pipeline._read_shards
    num_read = [0]

    def counting(urls):
        for sample in read(urls):
            num_read[0] += 1
            yield sample

    pipeline._read_shards = counting  # every shard the loader opens is read through it
    with tempfile.TemporaryDirectory() as tmp:
        source = sources.synthetic(NUM_SHARDS * SHARD_SIZE, SIZE, 10, seed=0, split="train")
        write_shards(source.samples(), tmp, shard_size=SHARD_SIZE, split="train", classes=source.classes, source="b")
        shards = resolve_shards(tmp)
        buffer = loader(shards, None).dataset.shuffle_buffer
        rows = []
        for steps in (base, 10 * base, 100 * base):
            num_read[0] = 0
            replay_s, position = replay(shards, buffer, steps)
            replay_read, num_read[0] = num_read[0], 0
            cursor_s = statistics.median(from_cursor(shards, position) for _ in range(rounds))
            rows.append((steps, replay_read, replay_s, num_read[0] // rounds, cursor_s))
        cost = per_batch_cost(shards, buffer, position)
    write_table(args.out, rows, cost, buffer, rounds)


def write_table(out: str, rows: list[tuple], cost: dict, buffer: int, rounds: int) -> None:
    lines = [
        "# Resume start-up: data cursor vs replay",
        "",
        f"`make bench-resume` ({datetime.date.today()}, {platform.processor() or platform.machine()}): time from "
        f"building the training loader to its first batch when resuming after N steps of {BATCH} samples, and the "
        f"raw samples read from shards on the way (one rank, in-process; {NUM_SHARDS} generated shards of "
        f"{SHARD_SIZE} JPEGs of {SIZE} px, {NUM_SHARDS * SHARD_SIZE:,} samples an epoch, 8 open, the default shuffle "
        f"buffer: {buffer}). Replay is what main did before the cursor: read the stream from its start and skip "
        f"every sample before the position, undecoded (timed once); the cursor is the median of {rounds}.",
        "",
        "| steps | samples before | replay: read | replay (s) | cursor: read | cursor (s) | replay / cursor |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for steps, replay_read, replay_s, cursor_read, cursor_s in rows:
        lines.append(
            f"| {steps} | {steps * BATCH:,} | {replay_read:,} | {replay_s:.2f} | {cursor_read:,} | {cursor_s:.2f} | "
            f"{replay_s / cursor_s:.1f}x |"
        )
    lines += [
        "",
        "The cursor reads the shards that were open, up to where they were, and those of the buffered samples, up to "
        "the last one buffered: a buffered sample can wait there for a few buffer lengths of draws, so once the "
        "buffer has turned over a few times that amount stays the same however far the run got.",
        "",
        f"Per batch, the cursor costs {cost['cursor_us']:.0f} us (the stream's `state()`, pickled in the worker and "
        f"unpickled in the trainer: {cost['bytes']:,} bytes with {buffer} buffered samples), next to "
        f"{cost['batch_ms']:.0f} ms to make the batch of {BATCH} {SIZE} px images. A saved position: "
        f"{cost['json']:,} bytes of JSON per worker.",
        "",
    ]
    Path(out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
