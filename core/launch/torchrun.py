"""torchrun (`torch.distributed.run`, the same arguments) whose report of a failed run is one line.

torchrun ends a run in which a worker failed by raising `ChildFailedError` out of its main: a traceback of torchrun
itself and a table per rank, after the ranks' own output (SIGTERM: a `SignalException` traceback). The ranks already
said what went wrong (core/engine/failure.py), so here the failed ranks are listed on one line, each with its exit
code or the signal that ended it. The exit code stays torchrun's, 1, but for a launch refused before training: every
rank exited `EXIT_REFUSED` (2; a rank still ending when the first had exited may show as killed by the SIGTERM
torchrun then sends), and the agent exits 2 too, as one process or launch.sh's pre-flight does, adding no line to the
refusal's own (`exit_code`).

Ctrl-C (SIGINT; the ranks, in sessions of their own, get it from here only): the first is torchrun's own shutdown, as
for SIGTERM: SIGINT to each rank's process group, then up to `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` seconds for the ranks to
save (core/engine/preempt.py) before SIGKILL; the agent's warnings about it are silenced, and the exit code is
`EXIT_INTERRUPTED` (130). A second Ctrl-C is passed on to the ranks, which stop at once without saving; a rank still
there `KILL_AFTER_S` later is killed with its process group. (torchrun's own handler would raise again: its shutdown
then sends SIGTERM, which ranks already stopping take as a confirmation, and waits the full timeout.)

    python -m core.launch.torchrun [torchrun options] -m MODULE [args ...]
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

import psutil

from core.launch.imports import imports_without_collection

EXIT_FAILED = 1
"""torchrun's exit code when a worker failed or torchrun itself was signalled."""
EXIT_REFUSED = 2
"""The exit code of a launch refused before training (another live launch holds run_dir, a run of another config
there, no room for its checkpoints...): every rank's own, as core/engine/failure.py's, and launch.sh's pre-flight's."""
EXIT_INTERRUPTED = 130
"""The exit code after Ctrl-C (128 + SIGINT), as the ranks' own (core/engine/preempt.py)."""
KILL_AFTER_S = 5.0
"""After a second Ctrl-C, the seconds a rank has to end before it is killed with its process group (it ends within
milliseconds unless its main thread is stuck in native code, e.g. a collective whose peer is gone)."""


def main(argv: list[str] | None = None) -> int:
    try:
        with imports_without_collection():  # inside: torch's import, without the collector's passes over it (0.3 s)
            from torch.distributed.elastic.multiprocessing import api
            from torch.distributed.elastic.multiprocessing.api import SignalException
            from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
            from torch.distributed.run import main as torchrun_main
    except KeyboardInterrupt:  # Ctrl-C before any rank started
        return EXIT_INTERRUPTED
    # torchrun installs this module global for its signals as it starts the ranks (read then): ours passes a second
    # Ctrl-C on instead; SIGINT's handler until then too
    api._terminate_process_handler = _CtrlC(api._terminate_process_handler).handle
    signal.signal(signal.SIGINT, api._terminate_process_handler)
    try:
        torchrun_main(argv)
    except ChildFailedError as err:
        code = exit_code(err)
        if code == EXIT_FAILED:
            print(failure_line(err), file=sys.stderr, flush=True)
        return code  # a Ctrl-C (here, or on another node) or a refusal: the ranks said so
    except SignalException as err:
        if err.sigval == signal.SIGINT:
            return EXIT_INTERRUPTED  # the ranks said what they saved
        print(f"[mimpipe] torchrun: received {err.sigval.name}, the ranks were stopped", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        gc.freeze()  # spares the interpreter's exit a collection over torch's objects (0.35 s)
    return 0


class _CtrlC:
    """torchrun's signal handler, but for a second Ctrl-C (see the module's doc)."""

    def __init__(self, torchrun_handler: Callable[[int, object], None]):
        self.torchrun_handler = torchrun_handler  # raises SignalException, which starts torchrun's shutdown
        self.count = 0

    def handle(self, signum: int, frame) -> None:
        if signum != signal.SIGINT:
            self.torchrun_handler(signum, frame)
            return
        self.count += 1
        if self.count == 1:
            _quiet_torchrun()
            self.torchrun_handler(signum, frame)
        _signal_ranks(signal.SIGINT)
        killer = threading.Timer(KILL_AFTER_S, _signal_ranks, (signal.SIGKILL,))
        killer.daemon = True  # the agent's exit does not wait for it
        killer.start()


def _signal_ranks(signum: int) -> None:
    """`signum` to each child of this process (the ranks) and its process group (its data workers, fork server)."""
    for child in psutil.Process().children():
        with contextlib.suppress(OSError):  # gone meanwhile
            if os.getpgid(child.pid) == child.pid:
                os.killpg(child.pid, signum)
            else:
                os.kill(child.pid, signum)


def _quiet_torchrun() -> None:
    """torchrun's loggers from now on say errors only: its shutdown is expected, the ranks say how they stopped."""
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.ERROR)


def exit_code(err) -> int:
    """The agent's exit code for torchrun's `ChildFailedError` `err`: `EXIT_INTERRUPTED` when every failed rank exited
    with it (a Ctrl-C); `EXIT_REFUSED` when the ranks were refused before training, which they decide together (rank 0
    tells the others, core/engine/run.py): every failed rank exited with it, but those torchrun stopped with SIGTERM
    once the first had exited (killed by it as they ended); else `EXIT_FAILED`."""
    codes = [failure.exitcode for failure in err.failures.values()]
    if codes and all(code == EXIT_INTERRUPTED for code in codes):
        return EXIT_INTERRUPTED
    if EXIT_REFUSED in codes and all(code in (EXIT_REFUSED, -signal.SIGTERM) for code in codes):
        return EXIT_REFUSED
    return EXIT_FAILED


def failure_line(err) -> str:
    """'[mimpipe] torchrun: finetune failed: rank 1 (exit code 1) first, then rank 0 (killed by SIGTERM); ...' for
    torchrun's `ChildFailedError` `err` (imported with torch, in `main`)."""
    ranks = sorted(err.failures, key=lambda rank: err.failures[rank].timestamp)
    parts = []
    for rank in ranks:
        failure = err.failures[rank]
        how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        parts.append(f"rank {rank} ({how})")
    listed = parts[0] + (" first, then " + ", ".join(parts[1:]) if len(parts) > 1 else "")
    return f"[mimpipe] torchrun: {err.name} failed: {listed}; their own lines are above, tracebacks in run_dir/logs"


if __name__ == "__main__":
    sys.exit(main())
