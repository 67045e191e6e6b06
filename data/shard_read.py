"""Reading one shard with a timeout and retries; in training, a shard that keeps failing is skipped and counted.

    read_shard(url) -> the shard's raw samples, in order
        a reader thread opens the shard (a file, `pipe:` command, curl for http(s), fsspec for object stores) and
        hands its samples over a small queue; each wait for the next sample lasts at most `timeout_s`
        an error (truncated tar, OSError, a failing command, no sample within `timeout_s`) -> wait (backoff), reopen,
        drop the samples already given, go on: a retry that succeeds neither repeats nor loses a sample
        after `retries` retries: training (`counts` given) logs one warning line naming the shard and the error,
        counts the shard as skipped and ends it there; evaluation raises, naming the shard (a skipped validation
        shard would change the metric without a word)
        a shard the stream skipped rests (gives nothing, counts nothing) until the stream has begun reads of all the
        other shards (`ShardCounts`)

Why a thread: a read that hangs (a stalled connection, a hung network file system, a command that never writes)
blocks in C; the reader waits on the queue instead, in a DataLoader worker or in the training process alike. A
stopped reader's `pipe:` or curl process is killed with its children, which ends the thread's blocked read; a hung
read of a file or an fsspec object cannot be interrupted from Python, so its thread (a daemon) is left to end when
the read returns.

Which samples come out depends only on what each attempt reads, never on the retry timing (the jittered backoff).

The skipped-shard budget: a run stops once more than `max_skipped_fraction` x max(shard reads begun, distinct
shards) shard reads were skipped. The distinct shards keep one early failure from looking like a large fraction; the
reads keep a shard that fails on every pass (each pass reads it again) at its share. The training loop checks the
counts summed over all ranks at logging steps; each stream checks its own at every skip, so that a stream that
cannot read anything stops the run instead of never making a batch.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil

from core.compat import webdataset as wds_compat

log = logging.getLogger(__name__)

Sample = dict[str, Any]

_READ_AHEAD = 4
"""Samples a reader thread holds ready: enough to overlap reading with decoding, few enough to stay small."""
_PUT_POLL_S = 0.1
"""How often a reader thread blocked on a full queue looks whether it was stopped."""
_JITTER = random.SystemRandom()  # not seeded: DataLoader workers forked from one process retry at different times


class ShardReadError(RuntimeError):
    """A shard that could not be read within the retries where skipping it is not allowed (evaluation), or that no
    retry can help (a missing fsspec package)."""


class TooManySkippedShardsError(RuntimeError):
    """More shard reads were skipped than `data.max_skipped_shard_fraction` allows."""


@dataclass(frozen=True)
class ShardReadPolicy:
    """How shards are read (the `data.read_*` keys and `data.max_skipped_shard_fraction`)."""

    timeout_s: float = 120.0
    """Longest wait for a shard's next sample, opening it included, before the attempt counts as failed."""
    retries: int = 3
    """Attempts after the first before the shard is given up."""
    backoff_s: float = 5.0
    """Wait before the first retry, doubled for each next one, each drawn within +-50% (jitter)."""
    max_skipped_fraction: float = 0.05
    """See the module docstring: 0 stops at the first skipped shard, 1 never stops."""

    def check_skipped(self, num_skipped: int, num_reads: int, num_shards: int, where: str, last: str = "") -> None:
        """Raises `TooManySkippedShardsError` when `num_skipped` of `num_reads` shard reads exceed the budget.

        Args:
            num_skipped: Shard reads given up.
            num_reads: Shard reads begun.
            num_shards: Distinct shards of the training sources.
            where: Whose counts these are, for the message (e.g. "over all ranks").
            last: The last shard skipped and why, for the message; empty when unknown.
        """
        allowed = self.max_skipped_fraction * max(num_reads, num_shards)
        if num_skipped <= allowed:
            return
        last = f"; the last: {last}" if last else ""
        raise TooManySkippedShardsError(
            f"{num_skipped} of {num_reads} shard reads failed and were skipped {where}, more than "
            f"data.max_skipped_shard_fraction={self.max_skipped_fraction} allows ({self.max_skipped_fraction} x "
            f"max({num_reads} reads, {num_shards} shards) = {allowed:g}){last}. Check the storage (each skipped shard "
            "is named in the log), or raise data.max_skipped_shard_fraction"
        )


class ShardCounts:
    """The shard reads one stream began and skipped: in all (checked against the budget) and since the last `take`
    (what the stream's next batch reports).

    A shard the stream skipped rests until the stream has begun reads of `num_shards - 1` others (about one pass of
    resampled shards): while it rests, reading it gives no sample and counts nothing. Without the rest, a stream that
    holds every shard open at once (no more shards than `data.num_open_shards`) would reopen a skipped shard at once,
    its retries and timeouts again and again.
    """

    def __init__(self, policy: ShardReadPolicy, num_shards: int, where: str) -> None:
        self.policy, self.num_shards, self.where = policy, num_shards, where
        self.num_reads = self.num_skipped = 0
        self._taken = (0, 0)
        self._skipped_at: dict[str, int] = {}  # url -> num_reads when it was skipped

    def begin(self, url: str) -> bool:
        """Counts a read of `url` begun; False, counting nothing, while `url` rests after a skip."""
        skipped_at = self._skipped_at.get(url)
        if skipped_at is not None and self.num_reads - skipped_at < self.num_shards - 1:
            return False
        self._skipped_at.pop(url, None)
        self.num_reads += 1
        return True

    def skip(self, url: str, why: str) -> None:
        """Counts a skipped shard; raises `TooManySkippedShardsError` past the budget."""
        self.num_skipped += 1
        self._skipped_at[url] = self.num_reads
        self.policy.check_skipped(self.num_skipped, self.num_reads, self.num_shards, self.where, f"{url}: {why}")

    def state(self) -> dict:
        """What a resumed stream needs to go on counting (JSON-safe; part of the stream's cursor): its totals and the
        shards resting after a skip."""
        return {"reads": self.num_reads, "skipped": self.num_skipped, "skipped_at": dict(self._skipped_at)}

    def load(self, state: dict) -> None:
        """Go on from `state()` of the interrupted stream; what it reported in its batches counts as taken."""
        self.num_reads, self.num_skipped = state["reads"], state["skipped"]
        self._skipped_at = dict(state["skipped_at"])
        self._taken = (self.num_reads, self.num_skipped)

    def take(self) -> tuple[int, int]:
        """(reads begun, reads skipped) since the last call."""
        now = (self.num_reads, self.num_skipped)
        since = (now[0] - self._taken[0], now[1] - self._taken[1])
        self._taken = now
        return since


def read_shard(
    url: str,
    policy: ShardReadPolicy,
    counts: ShardCounts | None = None,
    *,
    reopened: bool = False,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[Sample]:
    """The raw samples (fields of bytes, `__key__`, `__url__`) of the shard at `url`, retried as `policy` says.

    Args:
        url: A shard path or URL (`data/specs.py` `resolve_shards`).
        policy: Timeout, retries and backoff.
        counts: The stream's counts: a shard that fails every try is logged, counted there and ended early, and
            gives nothing while it rests (see `ShardCounts`). None (evaluation): it raises instead.
        reopened: A read a resumed stream begins again (a shard its cursor had open, or one its shuffle buffer holds
            samples of): the interrupted run counted it already, so it is not counted again nor kept from resting.
        sleep: Waits the backoff (tests record it).

    Raises:
        ShardReadError: A shard that fails every try, without `counts`; or a missing fsspec package.
        TooManySkippedShardsError: From `counts.skip`.
    """
    if counts is not None and not reopened and not counts.begin(url):
        return
    num_given, num_tries, why = 0, policy.retries + 1, ""
    for attempt in range(num_tries):
        if attempt:
            delay = policy.backoff_s * 2 ** (attempt - 1) * _JITTER.uniform(0.5, 1.5)
            log.info("shard %s: %s; try %d of %d in %.1f s", url, why, attempt + 1, num_tries, delay)
            sleep(delay)
        reader = _Reader(url)
        try:
            for index, item in enumerate(reader.items(policy.timeout_s)):
                if isinstance(item, _Failed):
                    if item.final:
                        raise ShardReadError(f"cannot read shard {url}: {item.why}")
                    why = item.why
                    break
                if index >= num_given:  # a retry reads the shard from its start: drop what was given already
                    num_given += 1
                    yield item
            else:
                return
        finally:
            reader.stop()
    if counts is None:
        raise ShardReadError(f"cannot read shard {url}: {why} ({num_tries} tries)")
    log.warning("skipping the rest of shard %s after %d tries (%d samples read): %s", url, num_tries, num_given, why)
    counts.skip(url, why)


@dataclass(frozen=True)
class _Failed:
    """The end of an attempt that failed: why, in one line; `final` when no retry can help."""

    why: str
    final: bool = False


_END = object()


class _Reader:
    """One attempt at reading a shard: a daemon thread opens it and puts its samples on a queue, then `_END` or a
    `_Failed`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.queue: queue.Queue = queue.Queue(maxsize=_READ_AHEAD)
        self.stopped = threading.Event()
        self.stream: Any = None
        self.thread = threading.Thread(target=self._run, name=f"mimpipe shard reader {url}", daemon=True)
        self.thread.start()

    def items(self, timeout_s: float) -> Iterator[Sample | _Failed]:
        """The samples in order, then a `_Failed` if the attempt failed; the waits last at most `timeout_s` each."""
        while True:
            try:
                item = self.queue.get(timeout=timeout_s)
            except queue.Empty:
                item = _Failed(f"no sample within {timeout_s:g} s (data.read_timeout_s)")
            if item is _END:
                return
            yield item
            if isinstance(item, _Failed):
                return

    def stop(self) -> None:
        """Ends the thread: it stops putting, and a `pipe:`/curl process it reads is killed (see the module doc)."""
        self.stopped.set()
        _kill_process_tree(self.stream)  # the thread does the same if it opens the stream only now

    def _run(self) -> None:
        try:
            self.stream = wds_compat.open_shard(self.url)
            if self.stopped.is_set():  # stopped while opening: `stop` may have missed the stream
                _kill_process_tree(self.stream)
                return
            for sample in wds_compat.tar_samples(self.url, self.stream):
                if not self._put(sample):
                    return
            self._put(_END)
        except wds_compat.MissingFilesystemError as exn:
            self._put(_Failed(str(exn), final=True))
        except Exception as exn:  # noqa: BLE001 - every read error is the attempt's outcome, retried or reported
            if not self.stopped.is_set():
                self._put(_Failed(" ".join(wds_compat.why_unreadable(exn).split())))
        finally:
            self._close()

    def _put(self, item: Any) -> bool:
        """Puts `item`, waiting while the queue is full; False once the reader was stopped."""
        while not self.stopped.is_set():
            try:
                self.queue.put(item, timeout=_PUT_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _close(self) -> None:
        """Closes the stream (a `Pipe` waits for its process); a failing close after the samples changes nothing."""
        if self.stream is not None:
            with contextlib.suppress(Exception):  # e.g. curl exiting on the closed pipe once the tar's end was read
                self.stream.close()


def _kill_process_tree(stream: Any) -> None:
    """Kills the process (and its children: a `pipe:` shell's command) behind a webdataset `Pipe`; other streams
    have none."""
    proc = getattr(stream, "proc", None)
    if proc is None or proc.poll() is not None:
        return
    try:
        tree = [psutil.Process(proc.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for process in tree:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
