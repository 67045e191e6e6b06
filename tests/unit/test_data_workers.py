"""DataLoader workers (data/workers.py, data/worker_process.py): started by the fork server with SIGTERM blocked,
deaf to a SIGTERM that is not their rank's and to Ctrl-C, gone when their rank dies (kill -9 included), and a stuck
one is a one-line error naming it.

Loaders are `make_eval_loader`s over small synthetic shards; the transforms below are module-level classes, so that
they pickle to the workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from data.pipeline import make_eval_loader
from data.transforms import eval_transform
from data.workers import DataWorkerTimeout
from tests.launching import MARKER, REPO, marked_processes, wait_gone, write_synthetic

MEAN = STD = (0.5, 0.5, 0.5)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    """4 shards of 16 samples, 16 px."""
    out = write_synthetic(tmp_path_factory.mktemp("workers") / "val", "val", 64, 16, seed=0)
    return sorted(str(p) for p in out.glob("*.tar"))


class WhereAmI:
    """The eval transform, plus the worker's pid, its parent's pid and whether SIGTERM is blocked in it."""

    def __init__(self):
        self.view = eval_transform(16, MEAN, STD, crop_pct=1.0)

    def __call__(self, image):
        blocked = signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, set())
        return {
            "image": self.view(image),
            "pid": torch.tensor(os.getpid()),
            "ppid": torch.tensor(os.getppid()),
            "blocked": torch.tensor(blocked),
        }


class Stall:
    """The eval transform, which hangs at sample `after` + 1 (a stuck shard read or transform); a batch of B is made
    once sample B + 1 has come, so `after` = 2B gives one batch, then stalls."""

    def __init__(self, after: int):
        self.view, self.after, self.seen = eval_transform(16, MEAN, STD, crop_pct=1.0), after, 0

    def __call__(self, image):
        self.seen += 1
        if self.seen > self.after:
            time.sleep(3600)
        return self.view(image)


def _loader(shards, transform, num_workers: int = 2, **kwargs):
    return make_eval_loader(
        shards, transform=transform, batch_size=4, rank=0, world_size=1, num_workers=num_workers, **kwargs
    )


def test_workers_come_from_the_fork_server_with_sigterm_blocked_and_give_every_sample(shards):
    batches = list(_loader(shards, WhereAmI()))
    assert sum(len(b["key"]) for b in batches) == 64
    assert len({key for b in batches for key in b["key"]}) == 64
    pids = {int(p) for b in batches for p in b["pid"]}
    parents = {int(p) for b in batches for p in b["ppid"]}
    assert len(pids) == 2 and os.getpid() not in pids
    assert len(parents) == 1 and os.getpid() not in parents  # not forked from this (threaded) process
    assert all(bool(b) for batch in batches for b in batch["blocked"])
    assert wait_gone(pids) == set()  # a finished pass stops its workers


def test_a_foreign_sigterm_leaves_the_worker_running(shards):
    batches = iter(_loader(shards, WhereAmI(), num_workers=1))
    first = next(batches)
    worker = int(first["pid"][0])
    subprocess.run(["kill", "-TERM", str(worker)], check=True)  # from another process, as killpg or SLURM would
    rest = list(batches)
    assert sum(len(b["key"]) for b in [first, *rest]) == 64  # the worker went on to the end
    assert {int(p) for b in rest for p in b["pid"]} == {worker}


def test_ctrl_c_leaves_the_worker_running(shards):
    """A terminal's Ctrl-C reaches every process of its foreground group, torchrun's every process of a rank's group:
    the rank decides (it saves first, core/engine/preempt.py), its worker serves on."""
    batches = iter(_loader(shards, WhereAmI(), num_workers=1))
    first = next(batches)
    worker = int(first["pid"][0])
    subprocess.run(["kill", "-INT", str(worker)], check=True)
    rest = list(batches)
    assert sum(len(b["key"]) for b in [first, *rest]) == 64
    assert {int(p) for b in rest for p in b["pid"]} == {worker}


def test_a_stuck_worker_is_one_line_naming_it_and_is_stopped(shards):
    batches = iter(_loader(shards, Stall(after=0), num_workers=1, timeout_s=2))
    start = time.monotonic()
    with pytest.raises(DataWorkerTimeout) as raised:
        next(batches)
    waited = time.monotonic() - start
    message = str(raised.value)
    assert message.startswith("data worker 0 of rank 0 gave no batch for 2 s (pid ")
    assert "data.loader_timeout_s=2" in message and "\n" not in message
    assert 2 <= waited < 600  # the timeout ended the wait, not the stalled sample (an hour)
    worker = int(message.split("(pid ")[1].split(",")[0])
    del batches, raised
    assert wait_gone([worker]) == set()  # the loader's shutdown stopped it (our SIGTERM is its rank's)


RANK_SCRIPT = """
import multiprocessing.forkserver, os, sys, time
from data.pipeline import make_eval_loader
from data.worker_process import start_fork_server
from tests.launching import MARKER, marked_processes
from tests.unit.test_data_workers import Stall
forked, *shards = sys.argv[1:]
start_fork_server(forked=forked == "forked")
server = multiprocessing.forkserver._forkserver._forkserver_pid
with open(f"/proc/{server}/cmdline", "rb") as f, open("/proc/self/cmdline", "rb") as own:
    print("forked" if f.read() == own.read() else "exec'd", flush=True)  # a fork runs this command line
batches = iter(make_eval_loader(shards, transform=Stall(after=8), batch_size=4, rank=0, world_size=1, num_workers=2))
first = next(batches)
print(" ".join(str(pid) for pid in marked_processes(os.environ[MARKER]) - {os.getpid()}), flush=True)
time.sleep(3600)
"""


@pytest.mark.parametrize("server", ["forked", "exec'd"])
def test_workers_and_fork_server_die_with_a_killed_rank(shards, tmp_path, server):
    """A process holding a loader with stuck workers is killed with SIGKILL: its workers and its fork server go,
    whether the server is a fork of the rank (as a stage starts it, core/entry/stage.py) or a fresh interpreter."""
    marker = f"test_data_workers-{os.getpid()}-{time.monotonic_ns()}"  # inherited by all the process starts
    env = {**os.environ, MARKER: marker, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    rank = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(RANK_SCRIPT), server, *shards], cwd=REPO, env=env,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert rank.stdout.readline().strip() == server
        others = {int(pid) for pid in rank.stdout.readline().split()}
        assert len(others) >= 3, others  # the fork server and 2 workers (and multiprocessing's resource tracker)
        rank.kill()
        rank.wait(timeout=10)
        assert wait_gone(others) == set()
        assert marked_processes(marker) == set()
    finally:
        rank.kill()


QUIET_AFTER_RANK = """
import subprocess, sys
from data.worker_process import quiet_after_rank
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
quiet_after_rank(rank.pid)
if sys.argv[1] == "gone":
    rank.kill()
    rank.wait()
try:
    raise ConnectionResetError(104, "Connection reset by peer")
except ConnectionResetError:
    sys.excepthook(*sys.exc_info())  # as multiprocessing's resource sharer thread reports it
print("reported and went on", flush=True)
rank.kill()
"""


@pytest.mark.parametrize("rank", ["gone", "alive"])
def test_a_reset_connection_after_the_rank_ended_ends_the_worker_quietly(rank):
    """A rank stopped at once can leave a worker's resource sharer with a reset connection: with the rank gone the
    worker ends without a traceback (exit 0); while the rank lives the error is reported as before."""
    done = subprocess.run(
        [sys.executable, "-c", QUIET_AFTER_RANK, rank], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    if rank == "gone":
        assert (done.stdout, done.stderr) == ("", "")
    else:
        assert "ConnectionResetError: [Errno 104] Connection reset by peer" in done.stderr
        assert done.stdout == "reported and went on\n"
