"""torchrun (`torch.distributed.run`, the same arguments) whose report of a failed run is one line.

torchrun ends a run in which a worker failed by raising `ChildFailedError` out of its main: a traceback of torchrun
itself and a table per rank, after the ranks' own output (SIGTERM: a `SignalException` traceback). The ranks already
said what went wrong (core/engine/failure.py), so here the failed ranks are listed on one line, each with its exit
code or the signal that ended it. The exit code stays torchrun's: 1.

    python -m core.launch.torchrun [torchrun options] -m MODULE [args ...]
"""

from __future__ import annotations

import gc
import sys

from core.launch.imports import imports_without_collection

EXIT_FAILED = 1
"""torchrun's exit code when a worker failed or torchrun itself was signalled."""


def main(argv: list[str] | None = None) -> int:
    with imports_without_collection():  # inside: torch's import, without the collector's passes over it (0.3 s)
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main as torchrun_main
    try:
        torchrun_main(argv)
    except ChildFailedError as err:
        print(failure_line(err), file=sys.stderr, flush=True)
        return EXIT_FAILED
    except SignalException as err:
        print(f"[mimpipe] torchrun: received {err.sigval.name}, the ranks were stopped", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        gc.freeze()  # spares the interpreter's exit a collection over torch's objects (0.35 s)
    return 0


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
