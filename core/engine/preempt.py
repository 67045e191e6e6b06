"""Stopping cleanly on SIGTERM: SLURM preemption (`scancel --signal=TERM`), or torchrun forwarding its own SIGTERM.

The handler only records the request. The loop reads it once per optimizer step and the ranks agree on it inside the
all-reduce they already do for the non-finite check, so every rank stops after the same step, saves a checkpoint of
it and exits with `EXIT_PREEMPTED`. Launching the same command again resumes from that checkpoint.

An evaluation pass (fine-tuning's, the kNN monitor's) is cut short instead of finished: its ranks already agree once
per batch whether anyone still has data, and they agree on the stop in the same all-reduce (`StopAgreed`). A rank
waiting for its next evaluation batch stops waiting at once (`next_unless_stopping`). A checkpoint being saved when
the signal arrives is finished, and the loop then stops with it.

DataLoader workers and their fork server ignore a SIGTERM that does not come from their rank (data/worker_process.py):
torchrun (`killpg`) and SLURM (every process of the step) signal them too.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

EXIT_PREEMPTED = 4
"""Process exit code of a rank that stopped on SIGTERM after saving a checkpoint."""


class StopAgreed(Exception):
    """Raised on every rank at once by a collective pass (an evaluation) that stopped early because some rank
    received SIGTERM; the loop then saves the step and exits with `EXIT_PREEMPTED`."""


class _Interrupted(BaseException):
    """Raised by the handler inside `_interruptible()`; a BaseException so that no `except Exception` swallows it."""


class _Watch:
    """Process-wide state: signal handlers belong to the process, not to any object."""

    installed = False
    requested = False
    interruptible = False
    previous: Callable | int | None = None


def install() -> None:
    """Record SIGTERM instead of dying, until `restore()`. Idempotent; call it from the main thread."""
    if _Watch.installed:
        return
    _Watch.requested = False
    _Watch.previous = signal.signal(signal.SIGTERM, _on_sigterm)
    _Watch.installed = True


def restore() -> None:
    """Put back the SIGTERM handler that `install()` replaced; a request recorded meanwhile is forgotten (what runs
    next in this process, e.g. another stage's loop in tests, starts unrequested)."""
    if _Watch.installed:
        signal.signal(signal.SIGTERM, _Watch.previous)
        _Watch.installed = False
        _Watch.requested = False


def stop_requested() -> bool:
    """Whether this process received SIGTERM since `install()` (the ranks still have to agree on it)."""
    return _Watch.requested


def next_unless_stopping(iterator: Iterator[T]) -> T | None:
    """`next(iterator, None)`, but None at once if SIGTERM arrives (or has arrived) meanwhile: a rank that waits for
    a slow or stuck evaluation batch stops waiting and tells the others (`stop_requested()`). The iterator is
    unusable after such a stop."""
    if _Watch.requested:
        return None
    try:
        with _interruptible():
            return next(iterator, None)
    except _Interrupted:
        return None


@contextlib.contextmanager
def _interruptible():
    _Watch.interruptible = True
    try:
        yield
    finally:
        _Watch.interruptible = False


def _on_sigterm(signum: int, frame) -> None:
    if not _Watch.requested:
        rank = os.environ.get("RANK", "0")
        # os.write, not print: the handler may interrupt a print to the same stream (a reentrant-call error).
        os.write(2, f"[mimpipe] rank {rank}: SIGTERM received; stopping after the current step\n".encode())
    _Watch.requested = True
    if _Watch.interruptible:
        _Watch.interruptible = False
        raise _Interrupted
