"""Stopping cleanly on SIGTERM (SLURM preemption, `scancel --signal=TERM`, or torchrun forwarding its own SIGTERM) and
on Ctrl-C (SIGINT: from the terminal, or forwarded by torchrun's agent, core/launch/torchrun.py).

The handler only records the request. The loop reads it once per optimizer step and the ranks agree on it inside the
all-reduce they already do for the non-finite check, so every rank stops after the same step, saves a checkpoint of
it and exits with `EXIT_PREEMPTED` (SIGTERM) or `EXIT_INTERRUPTED` (Ctrl-C, when any rank received one). Launching the
same command again resumes from that checkpoint.

An evaluation pass (fine-tuning's, the kNN monitor's) is cut short instead of finished: its ranks already agree once
per batch whether anyone still has data, and they agree on the stop in the same all-reduce (`StopAgreed`). A rank
waiting for its next evaluation batch stops waiting at once (`next_unless_stopping`). A checkpoint being saved when
the signal arrives is finished, and the loop then stops with it.

A second Ctrl-C stops the process at once, without saving: one line (rank 0's) and `EXIT_INTERRUPTED`, whatever the
process was doing, until it ends (the handler stays after `restore()` once a Ctrl-C came). A SIGTERM after a Ctrl-C
(torchrun's agent stopping the other ranks once one has exited) only confirms the stop already under way.

DataLoader workers and their fork server ignore SIGINT, and a SIGTERM that does not come from their rank
(data/worker_process.py): torchrun (`killpg`), SLURM (every process of the step) and a terminal (its foreground process
group) signal them too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

EXIT_PREEMPTED = 4
"""Process exit code of a rank that stopped on SIGTERM after saving a checkpoint."""
EXIT_INTERRUPTED = 130
"""Process exit code of a rank stopped by Ctrl-C, with a checkpoint or (a second Ctrl-C) at once: 128 + SIGINT, what a
shell reports for a process that SIGINT ended."""


class StopAgreed(Exception):
    """Raised on every rank at once by a collective pass (an evaluation) that stopped early because some rank
    received SIGTERM or Ctrl-C; the loop then saves the step and exits."""


class _Interrupted(BaseException):
    """Raised by the handler inside `_interruptible()`; a BaseException so that no `except Exception` swallows it."""


class _Watch:
    """Process-wide state: signal handlers belong to the process, not to any object."""

    installed = False
    requested = False
    ctrl_c = False
    """A Ctrl-C came (since `install()`): the stop is Ctrl-C's, and the next one stops the process at once."""
    interruptible = False
    previous: dict[int, Callable | int | None] = {}


def install() -> None:
    """Record SIGTERM and Ctrl-C instead of dying, until `restore()`. Idempotent; call it from the main thread."""
    if _Watch.installed:
        return
    _Watch.requested = _Watch.ctrl_c = False
    for signum, handler in ((signal.SIGTERM, _on_sigterm), (signal.SIGINT, _on_sigint)):
        replaced = signal.signal(signum, handler)
        if replaced is not handler:  # ours already: SIGINT's, kept by `restore()` after a Ctrl-C
            _Watch.previous[signum] = replaced
    _Watch.installed = True


def restore() -> None:
    """Put back the handlers that `install()` replaced; a request recorded meanwhile is forgotten (what runs next in
    this process, e.g. another stage's loop in tests, starts unrequested). After a Ctrl-C, SIGINT keeps its handler:
    the process is on its way out, and a second Ctrl-C still stops it at once, with one line instead of a
    KeyboardInterrupt traceback from wherever it lands."""
    if _Watch.installed:
        for signum, handler in _Watch.previous.items():
            if signum != signal.SIGINT or not _Watch.ctrl_c:
                signal.signal(signum, handler)
        _Watch.installed = False
        _Watch.requested = False


def stop_requested() -> bool:
    """Whether this process received SIGTERM or Ctrl-C since `install()` (the ranks still have to agree on it)."""
    return _Watch.requested


def ctrl_c_received() -> bool:
    """Whether the stop requested is (also) a Ctrl-C's: the run then exits with `EXIT_INTERRUPTED`."""
    return _Watch.ctrl_c


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
        _say(f"rank {os.environ.get('RANK', '0')}: SIGTERM received; stopping after the current step")
    _request()


def _on_sigint(signum: int, frame) -> None:
    if _Watch.ctrl_c:
        _stop_at_once()
    _Watch.ctrl_c = True
    if os.environ.get("LOCAL_RANK", "0") == "0":  # every rank of a node gets it at once: one line per node
        _say(
            f"rank {os.environ.get('RANK', '0')}: Ctrl-C received; stopping after the current step with a checkpoint "
            "(Ctrl-C again: stop at once, without saving)"
        )
    _request()


def _request() -> None:
    _Watch.requested = True
    if _Watch.interruptible:
        _Watch.interruptible = False
        raise _Interrupted


def _stop_at_once() -> None:
    """The second Ctrl-C: end this process now, the save (if under way) left unfinished; `latest` is written last,
    so it still names a complete checkpoint (core/engine/checkpoint.py). Its data workers and fork server follow it
    (data/worker_process.py)."""
    for stream in (sys.stdout, sys.stderr):  # what the run printed so far, complete
        with contextlib.suppress(Exception):  # RuntimeError: the handler interrupted a write to that very stream
            stream.flush()
    if os.environ.get("RANK", "0") == "0":
        _say(
            "stopped by a second Ctrl-C, at once and without saving; launch the same command again to resume from "
            f"the last complete checkpoint, the one checkpoints/latest names (exit code {EXIT_INTERRUPTED})"
        )
    os._exit(EXIT_INTERRUPTED)


def _say(line: str) -> None:
    # os.write, not print: the handler may interrupt a print to the same stream (a reentrant-call error).
    os.write(2, f"[mimpipe] {line}\n".encode())
