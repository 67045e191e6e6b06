"""How a rank ends on an error: one `[mimpipe] error: ...` line on the console, the traceback in a log file.

`run_guarded(main)` wraps a stage entry point. On an exception the full traceback is appended to
`RUN_DIR/logs/rank{RANK}.log` (`MIMPIPE_DEBUG=1` prints it on the console too; before the run directory is known
it goes to the console), the console gets one line naming the error and the log file, and the process exits with
`EXIT_ERROR`.

A `ConfigError` (the recipe or an override does not fit the schema: the user's input, not a fault) is what launch.sh's
check says of the same recipe, without a traceback: `[mimpipe] refused: ` and the error's own message (the key, with
its close-match hint), from rank 0, and `EXIT_REFUSED`. So `python -m pretrain RECIPE` and `mimpipe pretrain RECIPE`
end on a bad recipe as `./launch.sh RECIPE` does (core/launch/check.py).

Every rank that fails on its own says so in its own line (the rank that read a bad shard may not be rank 0). A rank
whose collective failed because another rank died first prints a quieter `[mimpipe] rank N stopped: ...` line
instead, so that the one `[mimpipe] error:` line is the cause. That is gloo's "Connection closed by peer", any
`DistBackendError` / `DistNetworkError`, and NCCL's ways of saying it: a remote error (`ncclRemoteError`), a
communicator its watchdog aborted after a peer's error or a collective timeout (init_distributed has NCCL abort the
communicators and raise in the rank rather than end the process from its watchdog thread), and `PeerLostError`, which
our own waits outside collectives raise.

Ctrl-C (core/engine/preempt.py handles it inside the training loop): outside the loop, a KeyboardInterrupt is one line
from rank 0 and `EXIT_INTERRUPTED`; after a Ctrl-C, a peer lost is the peer that stopped at once on the second one,
and ends this rank quietly with the same code.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from core.engine.preempt import EXIT_INTERRUPTED, ctrl_c_received
from core.recipe.errors import ConfigError

EXIT_ERROR = 1
"""Exit code of a rank that stopped on an exception (Python's own code for an uncaught one)."""
EXIT_REFUSED = 2
"""Exit code of a launch refused before training: a recipe that does not load, another live launch holding the
run_dir, or a run_dir holding a run of another config (as launch.sh's pre-flight exits)."""

# What a collective raises when a peer's connection drops (gloo, NCCL's TCP bootstrap) or NCCL gives up on a peer
# (a remote error, a communicator aborted by the watchdog, a collective timeout); the peer's error is the cause.
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote worker crash",
    "ncclRemoteError",
    "NCCL communicator was aborted",
    "Watchdog caught collective operation timeout",
)
# torch's DataLoader re-raises a worker's exception as "Caught X in DataLoader worker process N.\nOriginal Traceback
# (most recent call last): ..." with the original traceback text in the message; the original message ends it.
_WORKER_TRACEBACK = "Original Traceback (most recent call last):"
_DIST_ERRORS = ("DistNetworkError", "DistBackendError")

_log_dir: Path | None = None


class StageExit(Exception):  # noqa: N818  (an exit, not an error)
    """A stage that ends on purpose before it trains (a relaunch refused, or a run already finished): the process
    exits with `code` after printing `line` (None on the ranks that stay quiet)."""

    def __init__(self, code: int, line: str | None):
        super().__init__(line or f"exit code {code}")
        self.code, self.line = code, line


class PeerLostError(RuntimeError):
    """Another rank went away while this one waited for it outside a collective (e.g. for rank 0's checkpoint
    conversion): reported as a stopped rank, since the other rank's own line is the cause."""


def log_tracebacks_to(run_dir: str | Path) -> None:
    """Write tracebacks to `run_dir/logs/` from now on (called as soon as the run directory is known)."""
    global _log_dir
    _log_dir = Path(run_dir) / "logs"


def run_guarded(main: Callable[[], int]) -> int:
    """Run a stage entry point; an exception becomes one console line, a logged traceback and `EXIT_ERROR`
    (`StageExit`: its own line and code; `ConfigError`: `refused_recipe`; Ctrl-C: `stopped_by_ctrl_c`)."""
    try:
        return main()
    except StageExit as stop:
        if stop.line is not None:
            print(stop.line, file=sys.stdout if stop.code == 0 else sys.stderr, flush=True)
        return stop.code
    except ConfigError as err:
        return refused_recipe(err)
    except KeyboardInterrupt:
        return stopped_by_ctrl_c()
    except Exception as err:  # every error ends here, reported once
        if ctrl_c_received() and (isinstance(err, PeerLostError) or peer_lost(err)):
            return EXIT_INTERRUPTED  # a peer stopped at once on a second Ctrl-C (before this rank saw it): it says so
        return report(err)


def stopped_by_ctrl_c() -> int:
    """A Ctrl-C outside the training loop (before it, or after its last step; inside it the loop saves first,
    core/engine/preempt.py): one line from rank 0, no traceback, and `EXIT_INTERRUPTED`."""
    if os.environ.get("RANK", "0") == "0":
        line = (
            "[mimpipe] stopped by Ctrl-C outside the training loop, nothing saved; launch the same command again to "
            f"resume from the last complete checkpoint, the one checkpoints/latest names (exit code {EXIT_INTERRUPTED})"
        )
        print(line, file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def refused_recipe(err: ConfigError) -> int:
    """A recipe or override that does not fit the schema: its message from rank 0 (every rank loads the same recipe),
    as launch.sh's check prints it, no traceback (`MIMPIPE_DEBUG=1`: on the console too), and `EXIT_REFUSED`."""
    if os.environ.get("MIMPIPE_DEBUG") == "1":
        print("".join(traceback.format_exception(err)), file=sys.stderr, end="", flush=True)
    if os.environ.get("RANK", "0") == "0":
        print(f"[mimpipe] refused: {err}", file=sys.stderr, flush=True)
    return EXIT_REFUSED


def report(err: BaseException) -> int:
    """Log `err`'s traceback, print its one line, and return `EXIT_ERROR`."""
    rank = int(os.environ.get("RANK", "0"))
    text = "".join(traceback.format_exception(err))
    log_file = _write_log(rank, text)
    if log_file is None or os.environ.get("MIMPIPE_DEBUG") == "1":
        print(text, file=sys.stderr, end="", flush=True)
    where = f"rank {rank}" + (f"; traceback in {log_file}" if log_file else "")
    if isinstance(err, PeerLostError):
        line = f"[mimpipe] rank {rank} stopped: {first_line(err)} ({where})"
    elif peer_lost(err):
        cause = f"{type(err).__name__}: " + next((s for s in _PEER_LOST if s in str(err)), "collective failed")
        line = f"[mimpipe] rank {rank} stopped: another rank failed first ({cause}; {where})"
    else:
        line = f"[mimpipe] error: {first_line(err)} ({where})"
    print(line, file=sys.stderr, flush=True)
    return EXIT_ERROR


def peer_lost(err: BaseException) -> bool:
    """Whether `err` is a collective failing because another rank went away (its own error is the cause)."""
    # By name: this module is imported before torch (core/entry/stage.py); `torch.distributed`'s error classes.
    broken = any(cls.__name__ in _DIST_ERRORS for cls in type(err).__mro__)
    return broken or (isinstance(err, RuntimeError) and any(s in str(err) for s in _PEER_LOST))


def first_line(err: BaseException) -> str:
    """The error's own message on one line: unwrapped from a DataLoader worker's re-raise, long messages cut to their
    first line (the rest is in the log)."""
    message = str(err)
    if _WORKER_TRACEBACK in message:
        # The original traceback's last line(s): "[module.]ErrorName: message".
        found = list(re.finditer(rf"^(?:[\w.]+\.)?{re.escape(type(err).__name__)}: ", message, flags=re.MULTILINE))
        message = message[found[-1].end() :] if found else message
    lines = message.strip().splitlines() or [type(err).__name__]
    more = f" (+{len(lines) - 1} lines)" if len(lines) > 1 else ""
    return lines[0] + more


def _write_log(rank: int, text: str) -> Path | None:
    """Append the traceback to this rank's log file; None when there is no run directory (yet) or it is unwritable."""
    if _log_dir is None:
        return None
    path = _log_dir / f"rank{rank}.log"
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(f"--- {stamp} rank {rank} on {socket.gethostname()} (pid {os.getpid()}) stopped:\n{text}\n")
    except OSError:
        return None
    return path
