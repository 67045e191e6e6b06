"""A rank never outlives its launcher: the kernel kills it when torchrun's agent (or DeepSpeed's launcher) dies.

torchrun starts each rank in a session of its own (`start_new_session`), so killing the launcher's process group
(a batch system, a test's timeout, ^C in a terminal) does not reach the ranks, and a launcher killed with SIGKILL
cannot stop them itself: they would run on as orphans, holding GPUs and waiting forever in a collective. Linux's
parent-death signal (`prctl(PR_SET_PDEATHSIG)`) closes that gap. A rank's data workers follow their rank
(data/worker_process.py), and the fork server follows them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_launcher() -> None:
    """SIGKILL this process when its parent ends, if a launcher started it (`LOCAL_RANK` set: torchrun, DeepSpeed's
    launcher); a process started from a shell (`python -m pretrain ...`) is left alone, so that it may outlive the
    shell (nohup). Linux only; elsewhere nothing happens.

    SIGKILL, not SIGTERM: a rank whose launcher is gone cannot count on its peers for the agreed stop and checkpoint
    a SIGTERM starts (core/engine/preempt.py), and could wait in a collective forever.

    Called before the process group is joined: a launcher that dies in the moments before the call leaves the rank to
    fail at the rendezvous, whose store the launcher hosts or serves.
    """
    if "LOCAL_RANK" not in os.environ or sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
