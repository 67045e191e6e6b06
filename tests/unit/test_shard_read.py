"""data/shard_read.py: a shard read with a timeout and retries. A retry that succeeds neither repeats nor loses a
sample; a hung read times out and its `pipe:` process tree is killed; a shard that fails every try is skipped,
logged in one line and counted in training, and stops an evaluation; too many skipped shards stop the stream.
Failures are real: truncated tars, commands that fail or sleep, run as `pipe:` shards."""

from __future__ import annotations

import itertools
import logging
import re
import tarfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from core.compat.webdataset import open_shard, tar_samples
from data import sources
from data.pipeline import make_eval_loader, make_train_loader
from data.shard_read import ShardCounts, ShardReadError, ShardReadPolicy, TooManySkippedShardsError, read_shard
from data.specs import resolve_shards
from data.transforms import eval_transform, pretrain_transform
from data.write import write_shards

NUM_SHARDS, SHARD_SIZE, SIZE = 4, 12, 8
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
FAST = ShardReadPolicy(timeout_s=5.0, retries=2, backoff_s=0.0, max_skipped_fraction=1.0)
HANG_S = 600  # a hung command sleeps this long: a read that waited for it would outlast the test's own timeout


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    """4 shards of 12 synthetic 8x8 images."""
    out = tmp_path_factory.mktemp("shards")
    source = sources.synthetic(NUM_SHARDS * SHARD_SIZE, SIZE, 4, seed=0, split="train")
    write_shards(source.samples(), str(out), shard_size=SHARD_SIZE, split="train", classes=source.classes, source="s")
    return out


def _keys(samples) -> list[str]:
    return [sample["__key__"] for sample in samples]


def _cut_at(shard: Path, sample: int) -> int:
    """A byte offset inside the image data of sample number `sample` of `shard`. (A tar cut inside a header, or
    between members, reads as a shorter tar: only a cut inside a member's data is an error tarfile can see.)"""
    with tarfile.open(shard) as tar:
        member = [m for m in tar.getmembers() if m.name.endswith(".png")][sample]
        return member.offset_data + member.size // 2


def _truncated(shard: Path, out: Path, sample: int) -> Path:
    """A copy of `shard` cut inside sample number `sample`: `sample` samples read before the error."""
    out.write_bytes(shard.read_bytes()[: _cut_at(shard, sample)])
    return out


def _descendants_running(marker: str) -> list[psutil.Process]:
    """This process's descendants whose command line holds `marker`."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if marker in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def _wait_for_readers_to_end(timeout_s: float = 10.0) -> list[str]:
    """The names of reader threads still running after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("mimpipe shard reader")]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def test_a_read_that_fails_mid_shard_is_retried_without_repeating_or_losing_samples(shard_dir, tmp_path):
    """Try 1 reads 7 samples, try 2 only 3 (fewer than were given), try 3 all of them."""
    shard = shard_dir / "train-000000.tar"
    cuts = _cut_at(shard, 7), _cut_at(shard, 3)
    script = tmp_path / "flaky.sh"
    script.write_text(
        f"n=$(cat {tmp_path}/tries 2>/dev/null || echo 0); echo $((n + 1)) > {tmp_path}/tries\n"
        f"case $n in 0) head -c {cuts[0]} {shard};; 1) head -c {cuts[1]} {shard};; *) cat {shard};; esac\n"
    )
    delays = []
    counts = ShardCounts(FAST, num_shards=1, where="here")
    samples = list(read_shard(f"pipe:sh {script}", FAST, counts, sleep=delays.append))
    assert (tmp_path / "tries").read_text().strip() == "3"
    assert _keys(samples) == _keys(tar_samples(str(shard), open_shard(str(shard)))) and len(samples) == SHARD_SIZE
    assert len(delays) == 2 and counts.take() == (1, 0)  # one read begun, none skipped


def test_retries_back_off_exponentially_with_jitter_then_training_skips_with_one_line(tmp_path, caplog):
    policy = ShardReadPolicy(timeout_s=5.0, retries=3, backoff_s=1.0, max_skipped_fraction=1.0)
    delays = []
    counts = ShardCounts(policy, num_shards=4, where="here")
    with caplog.at_level(logging.INFO, logger="data.shard_read"):
        assert list(read_shard("pipe:exit 3", policy, counts, sleep=delays.append)) == []
    assert len(delays) == 3
    for attempt, delay in enumerate(delays):  # 1 s, 2 s, 4 s, each within +-50%
        assert 0.5 * 2**attempt <= delay <= 1.5 * 2**attempt, delays
    assert counts.take() == (1, 1) and counts.take() == (0, 0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "skipping the rest of shard pipe:exit 3 after 4 tries (0 samples read): the command exited with status 3"
    ]
    assert len([r for r in caplog.records if r.levelno == logging.INFO]) == 3  # each retry, below the console's level


def test_evaluation_raises_naming_the_shard_after_the_last_try():
    delays = []
    expected = "cannot read shard pipe:exit 3: the command exited with status 3 (3 tries)"
    with pytest.raises(ShardReadError, match=re.escape(expected)):
        list(read_shard("pipe:exit 3", FAST, None, sleep=delays.append))
    assert len(delays) == 2


def test_a_hung_read_times_out_keeps_what_it_read_and_kills_the_command(shard_dir, caplog):
    """The command writes 4 samples and part of the next, then hangs in a child of its shell: every try times out,
    the samples read before the hang come once, and nothing of the command is left running. (The tar is read in
    10 KiB records: the samples before the last whole record come, here 3.)"""
    marker = f"sleep {HANG_S}"
    url = f"pipe:head -c {_cut_at(shard_dir / 'train-000001.tar', 4)} {shard_dir}/train-000001.tar; {marker}"
    policy = ShardReadPolicy(timeout_s=0.5, retries=1, backoff_s=0.0, max_skipped_fraction=1.0)
    counts = ShardCounts(policy, num_shards=4, where="here")
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="data.shard_read"):
        samples = list(read_shard(url, policy, counts))
    assert time.monotonic() - start < HANG_S / 10  # two timed-out tries, not the command's hang
    whole = _keys(tar_samples("x", open_shard(str(shard_dir / "train-000001.tar"))))
    assert 0 < len(samples) <= 4 and _keys(samples) == whole[: len(samples)]
    assert counts.take() == (1, 1)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert url in warning and "after 2 tries" in warning and "no sample within 0.5 s (data.read_timeout_s)" in warning
    assert _wait_for_readers_to_end() == []
    assert _descendants_running(marker) == []


def test_a_read_left_unfinished_stops_its_command(shard_dir):
    """An evaluation quota stops reading a shard early: its command (and the reader thread) end with it."""
    marker = f"sleep {HANG_S + 1}"
    samples = read_shard(f"pipe:cat {shard_dir}/train-000002.tar; {marker}", FAST)
    assert len(list(itertools.islice(samples, 3))) == 3
    assert _descendants_running(marker)  # still running: the reader has not finished the shard
    samples.close()
    deadline = time.monotonic() + 10
    while _descendants_running(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _descendants_running(marker) == [] and _wait_for_readers_to_end() == []


def test_the_skipped_shard_budget():
    policy = ShardReadPolicy(max_skipped_fraction=0.25)
    policy.check_skipped(2, 5, 8, "here")  # 2 <= 0.25 x max(5, 8)
    policy.check_skipped(3, 12, 8, "here")  # 3 <= 0.25 x 12: a shard read again on later passes counts again
    with pytest.raises(TooManySkippedShardsError) as caught:
        policy.check_skipped(3, 5, 8, "over all ranks", "s/x.tar: ReadError: unexpected end of data")
    message = str(caught.value)
    assert message.startswith("3 of 5 shard reads failed and were skipped over all ranks, more than ")
    assert "data.max_skipped_shard_fraction=0.25" in message and "max(5 reads, 8 shards) = 2" in message
    assert "the last: s/x.tar: ReadError: unexpected end of data" in message
    with pytest.raises(TooManySkippedShardsError):  # 0: the first skipped shard stops
        ShardReadPolicy(max_skipped_fraction=0.0).check_skipped(1, 1000, 1000, "here")
    ShardReadPolicy(max_skipped_fraction=1.0).check_skipped(1000, 1000, 1, "here")  # 1: never


@pytest.mark.parametrize("num_workers", [0, 1])
def test_training_skips_an_unreadable_shard_and_counts_it_in_the_batches(shard_dir, tmp_path, num_workers):
    """One epoch (resampled=False, no shuffle buffer) over 3 good shards and one cut inside its first sample: the
    epoch's 6 batches hold every good sample once, and count the 4 shard reads and the 1 skipped shard."""
    good = resolve_shards(str(shard_dir))[1:]
    bad = str(_truncated(shard_dir / "train-000000.tar", tmp_path / "train-cut.tar", 0))
    loader = make_train_loader(
        [*good, bad], transform=pretrain_transform(SIZE, MEAN, STD), batch_size=6, seed=3, rank=0, world_size=1,
        num_workers=num_workers, shuffle_buffer=0, resampled=False, read_policy=FAST,
    )  # fmt: skip
    batches = list(itertools.islice(iter(loader), 3 * SHARD_SIZE // 6))  # epoch 0
    keys = [k for b in batches for k in b["key"]]
    assert sorted(keys) == sorted(k for url in good for k in _keys(tar_samples(url, open_shard(url))))
    # A batch is made once the sample after it is read: the last one counts the start of epoch 1 as well.
    assert sum(int(b["num_shard_reads"]) for b in batches[:-1]) == NUM_SHARDS
    assert sum(int(b["num_skipped_shards"]) for b in batches[:-1]) == 1


def test_a_skipped_shard_rests_instead_of_being_reopened_at_once(shard_dir, tmp_path):
    """Resampled, every shard open at once: without a rest, a skipped shard would be reopened at once (it is the only
    one not open), again and again. With it, it is tried once per 3 reads of the good shards: once at the start, then
    at most once after each 3 of the 9 good-shard reads that 3 passes over the 36 good samples take (3 or 4 skips,
    depending on where the seeded pass order puts it)."""
    bad = str(_truncated(shard_dir / "train-000000.tar", tmp_path / "train-cut.tar", 0))
    policy = ShardReadPolicy(timeout_s=5.0, retries=0, backoff_s=0.0, max_skipped_fraction=1.0)
    loader = make_train_loader(
        [*resolve_shards(str(shard_dir))[1:], bad], transform=pretrain_transform(SIZE, MEAN, STD), batch_size=6,
        seed=3, rank=0, world_size=1, num_workers=0, shuffle_buffer=0, resampled=True, read_policy=policy,
    )  # fmt: skip
    batches = list(itertools.islice(iter(loader), 3 * 3 * SHARD_SIZE // 6))  # 3 passes over the 36 good samples
    assert sum(int(b["num_skipped_shards"]) for b in batches) in (3, 4)
    counts = ShardCounts(policy, num_shards=3, where="here")
    assert counts.begin("a") and counts.begin("b")
    counts.skip("a", "broken")
    assert not counts.begin("a")  # resting: nothing counted
    assert counts.begin("b") and not counts.begin("a") and counts.begin("c") and counts.begin("a")  # 2 others began
    assert counts.take() == (5, 1)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_training_stream_that_skips_too_many_shards_stops_naming_the_key(shard_dir, tmp_path, num_workers):
    """Every shard is cut: the second skip is more than 0.25 x max(reads begun, 4 shards), before the stream could
    find that none of its shards holds a sample."""
    bad = [str(_truncated(shard_dir / f"train-00000{i}.tar", tmp_path / f"cut-{i}.tar", 0)) for i in range(4)]
    policy = ShardReadPolicy(timeout_s=5.0, retries=0, backoff_s=0.0, max_skipped_fraction=0.25)
    loader = make_train_loader(
        bad, transform=pretrain_transform(SIZE, MEAN, STD), batch_size=6, seed=3, rank=0, world_size=1,
        num_workers=num_workers, shuffle_buffer=10, resampled=True, read_policy=policy,
    )  # fmt: skip
    with pytest.raises(TooManySkippedShardsError) as caught:
        next(iter(loader))
    message = str(caught.value).splitlines()[-1] if num_workers else str(caught.value)  # a worker's: its traceback
    assert re.search(r"2 of [2-7] shard reads failed and were skipped by rank 0 data worker 0, more than", message)
    assert "data.max_skipped_shard_fraction=0.25" in message and "ReadError: unexpected end of data" in message


def test_an_evaluation_pass_stops_at_a_shard_that_fails_every_try(shard_dir, tmp_path):
    bad = str(_truncated(shard_dir / "train-000003.tar", tmp_path / "cut.tar", 6))
    loader = make_eval_loader(
        [*resolve_shards(str(shard_dir))[:3], bad], transform=eval_transform(SIZE, MEAN, STD), batch_size=6,
        rank=0, world_size=1, num_workers=0, read_policy=FAST,
    )  # fmt: skip
    expected = f"cannot read shard {bad}: ReadError: unexpected end of data (3 tries)"
    with pytest.raises(ShardReadError, match=re.escape(expected)):
        list(loader)
