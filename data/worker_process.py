"""A data worker's process, torch-free: how it starts, what stops it. data/workers.py builds the loaders on it.

Start: by the time a loader starts its workers the rank runs threads (gloo's, OpenMP's, the pin-memory thread, the
queue feeders of its other loaders). `fork()` copies only the calling thread, so a lock another thread held at that
moment stays locked in the child for good: a kNN query loader's worker once deadlocked right after its fork. Workers
are therefore started by multiprocessing's fork server: one single-threaded server per rank that forks each worker
from itself and hands it the pickled stream (which must pickle, transform included). A worker starts in
milliseconds instead of `spawn`'s seconds of imports (benchmarks/results/eval_workers.md), so evaluation loaders are
made afresh at every evaluation.

The server is the rank itself, forked while it still runs one thread (`start_fork_server(forked=True)`, which a stage
calls right after importing torch, timm and the data modules: core/entry/stage.py): it holds those modules without
importing them again (~3 s of CPU per rank, and their memory shared with the rank). Started later, or from a process
that already runs threads, it is multiprocessing's own: a fresh interpreter (fork + exec) that imports `PRELOAD`.

SIGTERM and SIGINT: torchrun signals a rank's whole process group, SLURM every process of the step and a terminal's
Ctrl-C its whole foreground process group, server and workers included. A worker that died of it would fail its rank
before the checkpoint the rank saves on either signal (core/engine/preempt.py), so workers start with both blocked
(the server is started with them blocked and its children inherit the mask). SIGINT stays ignored: the rank decides
(a second Ctrl-C ends the rank, and its workers follow it). A thread in each worker exits it on its own rank's SIGTERM
only (DataLoader's `terminate()` of a worker that does not stop when told).

Death: a thread in each worker waits on its rank's pidfd and exits the worker the moment the rank is gone, however
it went (kill -9 included); the server exits once the rank and all workers have. A worker that exits this way (or on
its rank's SIGTERM) kills the processes it started first (a `pipe:` shard's command).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import select
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

START_METHOD = "forkserver"
PRELOAD = ["__main__", "core.compat.timm_import", "data.pipeline", "data.transforms", "data.masking"]
"""Imported once by the fork server, so each worker has them at its fork. `__main__` is a script's own module (a
`python -m` entry point has none to preload); a transform from a module not listed is imported by each worker.
`core.compat.timm_import` comes before the modules that import timm: it imports timm without timm's own wandb import."""

LOADER_TIMEOUT_S = 1800.0
"""The longest a rank waits for one batch from its workers (`data.loader_timeout_s`), the first one included: that
fills a shuffle buffer (up to 256 MiB of encoded samples per worker) and may retry shard reads first; at 1800 s a
first batch still arrives from storage that gives each worker ~150 KB/s."""


def start_fork_server(*, forked: bool = False) -> None:
    """Start this process's fork server now rather than at the first loader's first iter().

    Args:
        forked: Make the server a fork of this process, which holds what this process imported. For a process
            that has only imported modules so far: its one Python thread is checked (a thread another one started
            would be missing in the fork, see the module docstring), while the native threads an import starts are
            taken to survive a fork (numpy's OpenBLAS pool stops itself around one; OpenMP starts none before its
            first parallel region). Otherwise, and with False, the server is a fresh interpreter importing `PRELOAD`.
    """
    context()
    if START_METHOD != "forkserver":
        return
    with stop_signals_blocked():  # see data/workers.py _WorkerLoader.__iter__
        if forked and threading.active_count() == 1:
            with _server_forked():
                multiprocessing.forkserver.ensure_running()
        else:
            multiprocessing.forkserver.ensure_running()


@contextlib.contextmanager
def _server_forked():
    """While multiprocessing starts its fork server, the interpreter it would exec runs in a fork of this process.

    multiprocessing starts the server by running `python -c "from multiprocessing.forkserver import main; main(...)"`
    through `util.spawnv_passfds` (fork, close every descriptor but those passed, exec). Here the child skips the exec
    and runs that same code itself, after closing what the exec would have closed (among them the write end of the
    pipe whose closing tells the server its rank is gone) and releasing the lock the forking thread held. Any other
    process multiprocessing spawns meanwhile (its resource tracker) is spawned as before.
    """
    spawn = multiprocessing.util.spawnv_passfds

    def fork_instead(path: str, args: list[str], passfds: list[int]) -> int:
        code = args[-1]
        if not code.startswith("from multiprocessing.forkserver import main"):
            return spawn(path, args, passfds)
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice, by a worker
            stream.flush()
        pid = os.fork()
        if pid:
            return pid
        status = 0
        try:
            _close_fds_except({0, 1, 2, *passfds})
            multiprocessing.forkserver._forkserver._lock = threading.Lock()  # held by the parent's ensure_running
            exec(code, {"__name__": "__mp_forkserver__"})  # returns once the rank and all workers have gone
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else 0
        except BaseException:  # noqa: BLE001 - reported, then the child ends as a failed exec'd server would
            traceback.print_exc()
            status = 1
        finally:
            os._exit(status)

    multiprocessing.util.spawnv_passfds = fork_instead
    try:
        yield
    finally:
        multiprocessing.util.spawnv_passfds = spawn


def _close_fds_except(keep: set[int]) -> None:
    low = 0
    for fd in sorted(keep):
        if low < fd:  # os.closerange(n, n) would close every descriptor from n on (close_range(n, n - 1))
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context workers start from (`START_METHOD`), the fork server's preload set."""
    ctx = multiprocessing.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts
    return ctx


STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
"""Blocked in the fork server and the workers from their start: they are their rank's to act on."""


@contextlib.contextmanager
def stop_signals_blocked():
    """`STOP_SIGNALS` blocked in this thread inside: a process started meanwhile inherits the mask; a signal for this
    process waits, then reaches its handler. The resource tracker is started first: its start unblocks both in the
    calling thread (multiprocessing's own protection of its start), and a fork server started after that inside would
    run without the mask."""
    start_resource_tracker()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker now (if not running), without its warning about the semaphores it
    cleans up: a rank stopped at once (a second Ctrl-C, core/engine/preempt.py) leaves its loaders' to it on purpose.
    The tracker ignores SIGINT and SIGTERM itself and ends when the last process holding its pipe has."""
    quiet = "ignore:resource_tracker:UserWarning"  # "resource_tracker: There appear to be N leaked semaphore objects"
    previous = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = f"{previous},{quiet}" if previous else quiet  # read by the tracker's interpreter
    try:
        multiprocessing.resource_tracker.ensure_running()
    finally:
        if previous is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = previous


def init_worker(rank_pid: int, worker_id: int) -> None:
    """DataLoader's `worker_init_fn`: in each worker, before its first sample."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # already blocked from the start (see __iter__)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # for good, and a Ctrl-C pending since the start is dropped
    threading.Thread(target=_exit_on_sigterm_from, args=(rank_pid,), name="mimpipe-sigterm", daemon=True).start()
    threading.Thread(target=_exit_with, args=(rank_pid,), name="mimpipe-rank-watch", daemon=True).start()
    quiet_after_rank(rank_pid)


RANK_GONE_WAIT_S = 1.0
"""How long a worker whose connection failed waits to see whether its rank has ended (then it follows it quietly)."""


def quiet_after_rank(rank_pid: int) -> None:
    """A connection error reported in this worker once its rank has ended ends the worker without a traceback.

    A rank stopped at once (a second Ctrl-C) may end while it fetches a batch's shared memory from a worker:
    multiprocessing's resource sharer thread in the worker then meets a reset connection and prints its traceback
    (through `sys.excepthook`) before the rank watch above has exited the worker. Such an error, with the rank gone
    within `RANK_GONE_WAIT_S`, ends the worker as the watch would; any other is reported as before."""
    previous = sys.excepthook

    def hook(kind, error, trace) -> None:
        if issubclass(kind, (ConnectionError, EOFError)) and _ends_within(rank_pid, RANK_GONE_WAIT_S):
            _exit_worker()
        previous(kind, error, trace)

    sys.excepthook = hook


def _ends_within(pid: int, seconds: float | None) -> bool:
    """Whether process `pid` has ended, or ends within `seconds` (None: waits until it has)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError:  # no pidfd (Linux < 5.3): poll
        deadline = None if seconds is None else time.monotonic() + seconds
        while _alive(pid) and (deadline is None or time.monotonic() < deadline):
            time.sleep(1.0 if deadline is None else 0.05)
        return not _alive(pid)
    try:
        return bool(select.select([pidfd], [], [], seconds)[0])  # readable once the process has ended
    finally:
        os.close(pidfd)


def _exit_on_sigterm_from(rank_pid: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid in (rank_pid, os.getppid()):
            _exit_worker()


def _exit_with(pid: int) -> None:
    """Exits this worker as soon as process `pid` has ended."""
    _ends_within(pid, None)
    _exit_worker()


def _exit_worker() -> None:
    """Ends this worker at once, and every process it started: a `pipe:` shard's command (a shell, the curl or
    reader under it) would otherwise outlive it, holding the run's output open."""
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    os._exit(0)


def _descendants(pid: int) -> list[int]:
    """The processes below `pid`: its children, theirs, and so on (one scan of /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
