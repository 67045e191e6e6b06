"""Resume from a data cursor (data/order.py, data/cursor.py): a resumed stream equals the uninterrupted one on simulated
ranks, reads a bounded amount however far the run got, and an elastic resume sees every sample of the interrupted
epochs once."""

import collections
import itertools
import json
import logging
import random
from types import SimpleNamespace

import pytest
import torch

from core.engine import stream
from core.engine.stream import train_stream
from core.engine.train_state import TrainState
from data import pipeline, sources
from data.cursor import redistribute
from data.order import TrainOrder, decode_refs
from data.pipeline import make_train_loader
from data.specs import WeightedShards, resolve_shards
from data.transforms import eval_transform
from data.write import write_shards
from tests.launching import position_after

NUM_SHARDS, SHARD_SIZE, SIZE = 16, 12, 4
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    """16 shards of 12 synthetic 4x4 images, keys train_00000000 ... train_00000191."""
    out = str(tmp_path_factory.mktemp("shards"))
    source = sources.synthetic(NUM_SHARDS * SHARD_SIZE, SIZE, 4, seed=0, split="train")
    write_shards(source.samples(), out, shard_size=SHARD_SIZE, split="train", classes=source.classes, source="syn")
    return resolve_shards(out)


def _loader(shards, **overrides) -> torch.utils.data.DataLoader:
    args = dict(
        transform=eval_transform(SIZE, MEAN, STD, crop_pct=1.0), batch_size=4, seed=1, rank=0, world_size=1,
        num_workers=0, shuffle_buffer=10, resampled=False, num_open_shards=2,
    )  # fmt: skip
    return make_train_loader(shards, **(args | overrides))


def _take(loader, num_batches: int) -> list[dict]:
    return list(itertools.islice(iter(loader), num_batches))


def _keys(batches: list[dict]) -> list[str]:
    return [k for b in batches for k in b["key"]]


@pytest.mark.parametrize("resampled", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_two_ranks_with_a_mixture_resume_exactly_from_their_saved_positions(shards, resampled, num_workers):
    mixture = [WeightedShards(shards[:8], 1.0), WeightedShards(shards[8:], 0.5)]
    for rank in range(2):
        args = dict(rank=rank, world_size=2, num_workers=num_workers, resampled=resampled)
        fresh = _take(_loader(mixture, **args), 30)  # 120 samples of this rank: into its second epoch
        positions = [None, None]
        positions[rank] = json.loads(json.dumps(position_after(fresh, 17)))  # through a checkpoint's JSON
        resumed = _take(_loader(mixture, **args, positions=positions), 13)
        assert _keys(resumed) == _keys(fresh[17:])
        assert all(torch.equal(a["image"], b["image"]) for a, b in zip(resumed, fresh[17:], strict=True))


@pytest.mark.parametrize("resampled", [False, True])
def test_resuming_reads_the_same_bounded_data_after_1x_10x_and_100x_the_batches(shards, resampled, monkeypatch):
    """The reader counts the samples each shard gives; a replay would read 4 per batch before the position."""
    fresh = _take(_loader(shards, resampled=resampled), 600)  # 2,400 samples: 12.5 epochs
    read = pipeline._read_shards
    counts: collections.Counter = collections.Counter()

    def counting(urls):
        for sample in read(urls):
            counts[sample["__url__"]] += 1
            yield sample

    monkeypatch.setattr(pipeline, "_read_shards", counting)
    num_read = []
    for position in (6, 60, 600 - 6):
        counts.clear()
        resumed = _take(_loader(shards, resampled=resampled, positions=[position_after(fresh, position)]), 1)
        assert _keys(resumed) == _keys(fresh[position : position + 1])
        num_read.append(sum(counts.values()))
        assert len(counts) <= 6  # the 2 open shards, those of the 10 buffered samples, a new one for the batch
    assert max(num_read) <= 6 * SHARD_SIZE, num_read  # ~0.3 epoch at most, and not growing: replay read 2,400


def _epoch_order(shards: list[str], *, stream_id: int, num_streams: int, state=None, shuffle_buffer=0) -> TrainOrder:
    """The raw order of one stream over fake shards `shards`, whose samples are (shard, index) pairs."""
    rank, worker = divmod(stream_id, 2)

    def read(url: str):
        return ({"__key__": f"{url}/{i}", "__url__": url} for i in range(int(url.split("-")[1])))

    return TrainOrder(
        [WeightedShards(shards, 1.0)], read, lambda *parts: random.Random(str(parts)), rank=rank, worker=worker,
        stream_id=stream_id, num_streams=num_streams, resampled=False, num_open=2, shuffle_buffer=shuffle_buffer,
        state=state,
    )  # fmt: skip


def test_elastic_resume_sees_every_sample_of_the_interrupted_epochs_once():
    """4 old streams stop at different places, two of them already in epoch 1; 3 new streams read what was left,
    then epoch 2: old and new samples together hold every sample exactly three times (epochs 0, 1, 2)."""
    shards = [f"s{j}-{3 + j % 5}" for j in range(24)]  # 3 to 7 samples each
    num_samples = sum(int(s.split("-")[1]) for s in shards)
    seen: list[str] = []
    positions = []
    for rank, stops in enumerate([(30, 12), (50, 5)]):  # rank 0's 2 workers stop after 30 and 12 samples, ...
        streams = []
        for worker, stop in enumerate(stops):
            order = _epoch_order(shards, stream_id=2 * rank + worker, num_streams=4)
            seen += [s["__key__"] for s in itertools.islice(order, stop)]
            streams.append({"index": stop, "order": json.loads(json.dumps(order.state()))})
        positions.append({"next_worker": 0, "streams": streams})
    assert max(s["order"]["sources"][0]["epoch"] for p in positions for s in p["streams"]) == 1
    rng = lambda *parts: random.Random(str(parts))  # noqa: E731
    new = redistribute(positions, 3, sources=[WeightedShards(shards, 1.0)], resampled=False, rng=rng)
    for stream_id, start in enumerate(new):
        assert start["index"] == 50
        order = _epoch_order(shards, stream_id=stream_id, num_streams=3, state=start["order"])
        while True:
            sample = next(order)
            if order.state()["sources"][0]["epoch"] == 3:  # the first sample of epoch 3 (after leftover + epoch 2)
                break
            seen.append(sample["__key__"])
    counts = collections.Counter(seen)
    assert len(counts) == num_samples and set(counts.values()) == {3}  # epochs 0 and 1, then 2 by the new streams


def test_elastic_resume_deals_out_the_buffered_samples_once():
    shards = [f"s{j}-{4 + j % 3}" for j in range(12)]
    positions, buffered = [], []
    for stream_id, stop in enumerate([9, 17]):
        order = _epoch_order(shards, stream_id=stream_id, num_streams=2, shuffle_buffer=6)
        list(itertools.islice(order, stop))
        buffered += [s["__key__"] for s in order.buffer]
        positions.append({"next_worker": 0, "streams": [{"index": stop, "order": order.state()}]})
    rng = lambda *parts: random.Random(str(parts))  # noqa: E731
    new = redistribute(positions, 3, sources=[WeightedShards(shards, 1.0)], resampled=False, rng=rng)
    assert [len(decode_refs(s["order"]["buffer"]["refs"])) for s in new] == [4, 3, 3]  # 2 x 5 dealt out
    restored = []
    for stream_id, start in enumerate(new):
        order = _epoch_order(shards, stream_id=stream_id, num_streams=3, state=start["order"], shuffle_buffer=6)
        restored += [s["__key__"] for s in order.buffer]
    assert sorted(restored) == sorted(buffered)


def test_elastic_loader_from_two_ranks_to_one_reads_the_rest_of_the_epoch_first(shards):
    """2 ranks x 2 workers stop inside epoch 0; 1 rank with 1 worker (one shard open at a time, no buffer) first
    yields exactly the samples they had not consumed."""
    args = dict(num_open_shards=1, shuffle_buffer=0)
    positions, consumed = [], []
    for rank in range(2):
        fresh = _take(_loader(shards, rank=rank, world_size=2, num_workers=2, **args), 5 + 2 * rank)
        consumed += _keys(fresh)
        positions.append(json.loads(json.dumps(position_after(fresh, len(fresh)))))
    remaining = NUM_SHARDS * SHARD_SIZE - len(consumed)
    resumed = _keys(_take(_loader(shards, positions=positions, **args), remaining // 4 + 1))
    everything = sorted(f"train_{i:08d}" for i in range(NUM_SHARDS * SHARD_SIZE))
    assert sorted(consumed + resumed[:remaining]) == everything
    assert resumed[remaining:] != []  # then epoch 1 goes on


def test_a_checkpoint_without_a_data_position_stops_naming_it(tmp_path):
    state = TrainState(step=6, batches_consumed=12)  # as a checkpoint of an older mimpipe resumes it
    run = SimpleNamespace(cfg=None, dist=None, run_dir=tmp_path, resume={"tag": "step_00000006"}, state=state)
    with pytest.raises(ValueError, match=rf"checkpoint {tmp_path}/checkpoints/step_00000006 holds no data position"):
        train_stream(run, None, labels=False)


def test_a_position_for_other_shards_is_refused(shards):
    position = position_after(_take(_loader(shards), 3), 3)
    with pytest.raises(ValueError, match=r"saved data position is for sources of \[16\] shards, data.train has \[15\]"):
        _take(_loader(shards[:15], positions=[position]), 1)


def test_a_buffered_sample_its_shard_no_longer_gives_is_dropped_with_a_warning(caplog):
    shards = [f"s{j}-6" for j in range(4)]
    order = _epoch_order(shards, stream_id=0, num_streams=1, shuffle_buffer=8)
    list(itertools.islice(order, 5))
    state = order.state()
    short = {shards[0]: 2}  # shard 0 now ends after 2 samples (a read that failed after its retries)

    def read(url: str):
        return ({"__key__": f"{url}/{i}", "__url__": url} for i in range(short.get(url, 6)))

    with caplog.at_level(logging.WARNING, logger="data.order"):
        restored = TrainOrder(
            [WeightedShards(shards, 1.0)], read, lambda *parts: random.Random(str(parts)), rank=0, worker=0,
            stream_id=0, num_streams=1, resampled=False, num_open=2, shuffle_buffer=8, state=state,
        )  # fmt: skip
    kept = [s["__key__"] for s in order.buffer if not s["__key__"].startswith("s0-6/") or int(s["__key__"][-1]) < 2]
    assert [s["__key__"] for s in restored.buffer] == kept and len(kept) < len(order.buffer)
    assert "could not be read again" in caplog.text


def test_a_resume_reads_its_own_position_or_with_another_layout_every_old_ranks(tmp_path):
    tag_dir = tmp_path / "checkpoints" / "step_00000003"
    tag_dir.mkdir(parents=True)
    saved = [{"next_worker": rank, "streams": [None, None]} for rank in range(2)]  # 2 workers each
    for rank, position in enumerate(saved):
        state = {"step": 3, "batches_consumed": 3, "data_position": position}
        (tag_dir / f"rank_{rank:05d}.json").write_text(json.dumps({"world_size": 2, "train": state}))

    def run(world_size: int, num_workers: int, **resume) -> SimpleNamespace:
        cfg = SimpleNamespace(data=SimpleNamespace(num_workers=num_workers))
        dist = SimpleNamespace(rank=1, world_size=world_size)
        state = TrainState(3, 3, data_position=saved[1])
        resume = {"tag": tag_dir.name, **resume}
        return SimpleNamespace(cfg=cfg, dist=dist, run_dir=tmp_path, resume=resume, state=state)

    assert stream._resume_positions(run(2, 2)) == [None, saved[1]]  # its own: no other rank file is read
    assert stream._resume_positions(run(2, 1)) == saved  # another worker count
    assert stream._resume_positions(run(3, 2, from_world_size=2)) == saved  # another world size
