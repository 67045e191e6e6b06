"""Progress lines for long commands (`python -m data write`, `python -m data index`), for a terminal and a log alike.

    data write: 12,800/1,281,167 images (1%) in 41s, 312 images/s, ~1h08m left

A line is printed, whole and ending in a newline (never a carriage return that a log file would keep as one long
line), at most every `every_s` seconds, and once more by `finish` when any was printed: a short command prints none.
"""

import sys
import time
from collections.abc import Callable
from typing import TextIO

PROGRESS_EVERY_S = 5.0
"""Seconds between two progress lines: often enough to see a job move, few enough lines for a log of hours."""


class Progress:
    """Counts work done and reports it, throttled.

    Args:
        total: Units of work in all; None when unknown (no percentage and no time left then).
        unit: What a unit is, plural: "images", "shards".
        label: What is progressing, the line's prefix: "data write".
        every_s: Least number of seconds between two lines.
        stream: Where lines go; default: sys.stderr at the time of printing (so that pytest's capture sees it).
        clock: Seconds from an arbitrary start (time.monotonic; a test passes a fake one).
    """

    def __init__(
        self,
        total: int | None,
        unit: str,
        *,
        label: str,
        every_s: float = PROGRESS_EVERY_S,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total, self.unit, self.label, self.every_s = total, unit, label, every_s
        self.stream, self.clock = stream, clock
        self.done = 0
        self.start = clock()
        self.last_printed: float | None = None  # when the last line was printed; None: no line yet

    def advance(self, count: int = 1) -> None:
        """Adds `count` units done; prints a line when `every_s` seconds passed since the last one (or the start)."""
        self.done += count
        now = self.clock()
        if now - (self.start if self.last_printed is None else self.last_printed) >= self.every_s:
            self._print(now)

    def finish(self) -> None:
        """Prints the final line, if any line was printed before: a log that showed progress ends with 100%."""
        if self.last_printed is not None:
            self._print(self.clock())

    def line(self, now: float) -> str:
        """`label: done/total unit (pct) in elapsed, rate unit/s, ~left` at time `now`."""
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        counted = f"{self.done:,}" if self.total is None else f"{self.done:,}/{self.total:,}"
        text = f"{self.label}: {counted} {self.unit}"
        if self.total:
            text += f" ({100 * self.done // self.total}%)"
        text += f" in {format_duration(elapsed)}, {format_rate(rate)} {self.unit}/s"
        if self.total is not None and self.done < self.total:
            text += f", ~{format_duration((self.total - self.done) / rate)} left" if rate > 0 else ", time left unknown"
        return text

    def _print(self, now: float) -> None:
        print(self.line(now), file=self.stream or sys.stderr, flush=True)
        self.last_printed = now


def format_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m` (rounded down to the unit shown)."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def format_rate(rate: float) -> str:
    """Three significant figures or more: `3,210`, `41.5`, `0.52`."""
    if rate >= 100:
        return f"{rate:,.0f}"
    return f"{rate:.1f}" if rate >= 10 else f"{rate:.2f}"
