"""A command whose output is piped into a reader that closes early (`mimpipe status RUN_DIR | head -1`) ends quietly.

Python ignores SIGPIPE, so its next write to the closed pipe raises BrokenPipeError: a traceback, or, when the write
is the interpreter's last flush, "Exception ignored ... BrokenPipeError" and exit code 120. `quiet_on_closed_pipe` does
what the Python docs advise (library/signal.html, "Note on SIGPIPE"): stdout is pointed at /dev/null, so that nothing
fails again at exit, and the process exits with `EXIT_CLOSED_PIPE`, as if SIGPIPE had ended it. SIGPIPE's default
action is not restored instead: `mimpipe` runs the training stages in its own process, and their ranks, data workers
and fork servers keep Python's handling (core/engine/preempt.py installs theirs).

Only the pipe's own error is quiet: a BrokenPipeError while stdout's reader is still there (a worker's pipe, a
subprocess's) stays an error.

Imports nothing of ours, so the entry points of every layer use it (`python -m data`, `mimpipe`).
"""

from __future__ import annotations

import os
import select
import sys
from collections.abc import Callable

EXIT_CLOSED_PIPE = 141
"""128 + SIGPIPE: what a shell reports for a command the closed pipe ended (`yes | head -1`; bash's PIPESTATUS,
`set -o pipefail`), and the status `pipe:` shard reads ignore (core/compat/webdataset.py)."""


def quiet_on_closed_pipe(main: Callable[[], int | str | None]) -> int | str | None:
    """Run a command-line `main` and flush stdout; returns its exit status (what `sys.exit` takes, a SystemExit's
    code included), or `EXIT_CLOSED_PIPE`, without a traceback, when stdout's reader closed the pipe."""
    try:
        try:
            code = main()
        except SystemExit as stop:  # argparse's --help and errors, sys.exit() inside: flushed below as well
            code = stop.code
        sys.stdout.flush()  # inside the try: output left in the buffer fails here, not at the interpreter's exit
    except BrokenPipeError:
        if not stdout_reader_gone():
            raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter flushes stdout again at exit: into nothing
        os.close(devnull)
        return EXIT_CLOSED_PIPE
    return code


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reading end is closed: poll reports an error on it (Linux: POLLERR
    on a pipe without readers). True where poll is not available, as the Python docs' recipe assumes."""
    if not hasattr(select, "poll"):
        return True
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)  # no events asked: POLLERR and POLLHUP are always reported
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError):  # stdout closed or not a file
        return False
