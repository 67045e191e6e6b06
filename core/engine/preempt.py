"""Stopping cleanly on SIGTERM: SLURM preemption (`scancel --signal=TERM`), or torchrun forwarding its own SIGTERM.

The handler only records the request. The loop reads it once per optimizer step and the ranks agree on it inside the
all-reduce they already do for the non-finite check, so every rank stops after the same step, saves a checkpoint of
it and exits with `EXIT_PREEMPTED`. Launching the same command again resumes from that checkpoint.

DataLoader workers live in their rank's process group, and torchrun (`killpg`) and SLURM (every process of the step)
signal them too. A worker killed by that SIGTERM would fail its rank before the checkpoint, so a process forked while
the handler is installed blocks SIGTERM and leaves it to one thread, which exits only on its parent's SIGTERM
(multiprocessing's `terminate()`, as DataLoader's own worker handler does) and ignores everyone else's.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

EXIT_PREEMPTED = 4
"""Process exit code of a rank that stopped on SIGTERM after saving a checkpoint."""


class _Watch:
    """Process-wide state: signal handlers belong to the process, not to any object."""

    installed = False
    requested = False
    previous: Callable | int | None = None
    fork_hook = False


def install() -> None:
    """Record SIGTERM instead of dying, until `restore()`. Idempotent; call it from the main thread."""
    if _Watch.installed:
        return
    if not _Watch.fork_hook:  # os.register_at_fork has no way back: the hook checks `installed` at each fork
        os.register_at_fork(after_in_child=_guard_forked_child)
        _Watch.fork_hook = True
    _Watch.requested = False
    _Watch.previous = signal.signal(signal.SIGTERM, _on_sigterm)
    _Watch.installed = True


def restore() -> None:
    """Put back the SIGTERM handler that `install()` replaced."""
    if _Watch.installed:
        signal.signal(signal.SIGTERM, _Watch.previous)
        _Watch.installed = False


def stop_requested() -> bool:
    """Whether this process received SIGTERM since `install()` (the ranks still have to agree on it)."""
    return _Watch.requested


def _on_sigterm(signum: int, frame) -> None:
    if not _Watch.requested:
        rank = os.environ.get("RANK", "0")
        # os.write, not print: the handler may interrupt a print to the same stream (a reentrant-call error).
        os.write(2, f"[mimpipe] rank {rank}: SIGTERM received; stopping after the current step\n".encode())
    _Watch.requested = True


def _guard_forked_child() -> None:
    # A signal mask survives DataLoader's own SIGTERM action in its workers; the action is set after this hook runs.
    if _Watch.installed:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Thread(target=_exit_on_parents_sigterm, name="mimpipe-sigterm", daemon=True).start()


def _exit_on_parents_sigterm() -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == os.getppid():
            os._exit(0)
