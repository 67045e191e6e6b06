"""A run_dir has one owner (core/launch/lease.py): when a lease is live, stale or gone (fake clock, real processes for
pid checks), the lines that refuse a launch or warn of a takeover, that `lease.json` holds exactly the fields
`mimpipe status` reads and is only ever replaced whole, that a lease is released only while it is ours, that an owner
whose lease was taken over stops, and that of processes racing for one lease (fresh, stale, or after a claimer died)
exactly one gets it."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from core.engine.failure import StageExit
from core.entry import stage
from core.launch import lease as lease_module
from core.launch.lease import (
    CLAIM_PREFIX,
    GONE,
    LEASE_FILE,
    LIVE,
    STALE,
    Lease,
    Place,
    acquire,
    heartbeat_period,
    here,
    in_use_by,
    judge,
)
from tests.launching import REPO

T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC
FIELDS = {"host", "pid", "slurm_job_id", "started", "heartbeat", "stale_after_s", "stage", "recipe", "owner"}
"""What `mimpipe status` reads; `pid_started` and `pid_namespace` tell a reused pid apart."""
ELSEWHERE = Place("node-b", "boot:1")


class Clock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def other_lease(**fields) -> Lease:
    """A lease of another launch on host node-a, started and last renewed at T0, timeout 300 s."""
    values = dict(
        host="node-a", pid=4242, slurm_job_id="777", started=T0, heartbeat=T0, stale_after_s=300.0,
        stage="pretrain", recipe="/r/mae.yaml", owner="a" * 32, pid_started=T0 - 5, pid_namespace="boot:0",
    )  # fmt: skip
    return Lease(**(values | fields))


def when(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("MIMPIPE_LEASE_HOST", raising=False)


def take(run_dir: Path, clock: Clock, place: Place = ELSEWHERE, **kwargs):
    return acquire(
        run_dir, stage="pretrain", recipe="/r/mae.yaml", stale_after_s=300, clock=clock, place=place, **kwargs
    )


def test_a_lease_is_live_until_its_heartbeat_is_older_than_its_own_timeout():
    lease = other_lease(stale_after_s=60.0)
    assert judge(lease, T0 + 60, ELSEWHERE) == LIVE
    assert judge(lease, T0 + 60.5, ELSEWHERE) == STALE
    assert heartbeat_period(300) == 10.0 and heartbeat_period(5) == 1.0


def test_on_its_own_host_a_lease_whose_process_ended_or_whose_pid_was_reused_is_gone():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = here()
        started = psutil.Process(sleeper.pid).create_time()
        lease = other_lease(host=mine.host, pid=sleeper.pid, pid_started=started, pid_namespace=mine.namespace)
        assert judge(lease, T0, mine) == LIVE
        assert judge(other_lease(**{**lease.__dict__, "pid_started": started - 30}), T0, mine) == GONE  # reused pid
        assert judge(lease, T0, Place(mine.host, "another-container")) == LIVE  # its pids are not ours to check
        sleeper.kill()
        sleeper.wait()
        assert judge(lease, T0, mine) == GONE
        assert judge(lease, T0, Place("node-b", mine.namespace)) == LIVE  # another host: only its heartbeat counts
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_launch_into_a_live_lease_is_refused_with_one_line_saying_what_to_do(tmp_path):
    (tmp_path / LEASE_FILE).write_bytes(other_lease().encode())
    got = take(tmp_path, Clock(T0 + 42.4))
    line = (
        f"{tmp_path} is in use by host node-a pid 4242 (SLURM job 777) since {when(T0)}, last heartbeat 42 s ago; "
        "wait for it to end (a launch silent for 300 s is taken over), pass run_dir=NEW_DIR to start a new run, or "
        "--take-over-run-dir if you know it is gone"
    )
    assert got.held is None and got.refusal == line
    assert (tmp_path / LEASE_FILE).read_bytes() == other_lease().encode()  # untouched
    # The pre-flight's verdict is the same line (judged at the real time: a heartbeat of now)
    (tmp_path / LEASE_FILE).write_bytes(other_lease(started=time.time(), heartbeat=time.time()).encode())
    assert "is in use by host node-a pid 4242 (SLURM job 777)" in in_use_by(tmp_path, place=ELSEWHERE)
    assert in_use_by(tmp_path, place=ELSEWHERE, take_over=True) is None
    assert in_use_by(tmp_path / "nothing_there") is None


@pytest.mark.parametrize(
    "state, clock, place, why",
    [
        (STALE, T0 + 301, ELSEWHERE, "its last heartbeat was 301 s ago, past its 300 s timeout"),
        (GONE, T0 + 1, Place("node-a", "boot:0"), "that process is gone"),
    ],
)
def test_a_stale_or_gone_lease_is_taken_over_with_one_warning_naming_the_old_owner(tmp_path, state, clock, place, why):
    (tmp_path / LEASE_FILE).write_bytes(other_lease().encode())
    got = take(tmp_path, Clock(clock), place, alive=lambda pid, started: False)
    try:
        assert got.refusal is None
        assert (
            got.note == f"taking over {tmp_path} from host node-a pid 4242 (SLURM job 777), started {when(T0)}: {why}"
        )
        held = json.loads((tmp_path / LEASE_FILE).read_text())
        assert held["owner"] == got.held.lease.owner != "a" * 32 and held["host"] == place.host
        assert sorted(p.name for p in tmp_path.iterdir()) == [LEASE_FILE]  # no claim or temporary file left
    finally:
        got.held.release()


def test_take_over_flag_takes_a_live_lease_and_the_old_owner_stops_at_its_next_heartbeat(tmp_path):
    clock, lost = Clock(), []
    first = take(tmp_path, clock, Place("node-a", "boot:0"), on_lost=lost.append).held
    clock.now += 5
    second = take(tmp_path, clock, take_over=True)
    assert second.note == (
        f"taking over {tmp_path} from host node-a pid {os.getpid()}, started {when(T0)}: its last heartbeat was 5 s "
        "ago (--take-over-run-dir; if it still runs, it stops)"
    )
    assert first.renew() is False and lost == [
        f"{tmp_path} was taken over by host node-b pid {os.getpid()} at {when(T0 + 5)}"
    ]
    assert json.loads((tmp_path / LEASE_FILE).read_text())["owner"] == second.held.lease.owner  # not written back
    first.release()  # not ours any more: left alone
    assert json.loads((tmp_path / LEASE_FILE).read_text())["owner"] == second.held.lease.owner
    second.held.release()
    assert not (tmp_path / LEASE_FILE).exists()


def test_lease_json_holds_the_documented_fields_and_is_renewed_by_whole_replacement(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "31337")
    clock = Clock()
    held = take(tmp_path, clock).held
    try:
        first = json.loads((tmp_path / LEASE_FILE).read_text())
        assert set(first) == FIELDS | {"pid_started", "pid_namespace"}
        assert first | {"owner": "x"} == {
            "host": "node-b", "pid": os.getpid(), "slurm_job_id": "31337", "started": T0, "heartbeat": T0,
            "stale_after_s": 300.0, "stage": "pretrain", "recipe": "/r/mae.yaml", "owner": "x",
            "pid_started": psutil.Process().create_time(), "pid_namespace": "boot:1",
        }  # fmt: skip
        clock.now += 10
        inode = (tmp_path / LEASE_FILE).stat().st_ino
        assert held.renew()
        assert json.loads((tmp_path / LEASE_FILE).read_text()) == first | {"heartbeat": T0 + 10}
        assert (tmp_path / LEASE_FILE).stat().st_ino != inode  # a new file put in place, never rewritten in place

        def no_replace(src, dst):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(lease_module.os, "replace", no_replace)
        clock.now += 10
        assert held.renew()  # a failed renewal leaves the lease as it was, and no temporary file
        assert json.loads((tmp_path / LEASE_FILE).read_text())["heartbeat"] == T0 + 10
        assert sorted(p.name for p in tmp_path.iterdir()) == [LEASE_FILE]
    finally:
        monkeypatch.undo()
        held.release()


def test_the_heartbeat_thread_renews_until_released(tmp_path):
    got = acquire(tmp_path, stage="pretrain", recipe="r.yaml", stale_after_s=0.5)  # a beat every 0.1 s
    first = json.loads((tmp_path / LEASE_FILE).read_text())["heartbeat"]
    time.sleep(0.5)
    assert json.loads((tmp_path / LEASE_FILE).read_text())["heartbeat"] > first
    got.held.release()
    assert not (tmp_path / LEASE_FILE).exists()
    assert not any(t.name == "mimpipe-lease" and t.is_alive() for t in threading.enumerate())


def test_a_live_claimer_refuses_and_a_dead_one_is_passed_over(tmp_path):
    stale = other_lease().encode()
    (tmp_path / LEASE_FILE).write_bytes(stale)
    claim = tmp_path / (CLAIM_PREFIX + lease_module._digest(stale))
    claim.write_bytes(other_lease(host="node-c", pid=99, owner="c" * 32, started=T0 + 300, heartbeat=T0 + 300).encode())
    got = take(tmp_path, Clock(T0 + 301))
    assert got.held is None and got.refusal.startswith(f"{tmp_path} is in use by host node-c pid 99 (SLURM job 777)")
    got = take(tmp_path, Clock(T0 + 601))  # that claimer went silent too: its claim is passed over
    try:
        assert got.held is not None and "from host node-a pid 4242" in got.note
        assert sorted(p.name for p in tmp_path.iterdir()) == [LEASE_FILE]
    finally:
        got.held.release()


def test_an_owner_whose_lease_was_taken_over_prints_one_line_and_exits_2(tmp_path):
    script = (
        "import sys, time; from core.launch.lease import acquire\n"
        "acquire(sys.argv[1], stage='pretrain', recipe='r.yaml', stale_after_s=0.5)\n"
        "print('held', flush=True); time.sleep(30)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline() == "held\n"
    (tmp_path / "taken").write_bytes(other_lease(started=T0).encode())
    os.replace(tmp_path / "taken", tmp_path / LEASE_FILE)  # as a takeover leaves it: replaced whole
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 2
    assert err == (
        f"[mimpipe] error: run_dir: {tmp_path} was taken over by host node-a pid 4242 (SLURM job 777) at {when(T0)} "
        "(exit code 2)\n"
    )


def _contend(run_dir: str, start, done, results) -> None:
    """One launch's rank 0 racing the others for the lease; holds what it got until every one has tried."""
    start.wait()
    got = acquire(run_dir, stage="pretrain", recipe="r.yaml", stale_after_s=300)
    results.put((os.getpid(), got.held is not None, got.refusal, got.note))
    done.wait()
    if got.held is not None:
        got.held.release()


@pytest.mark.parametrize("before", ["none", "stale", "stale, and a dead claimer"])
def test_of_processes_racing_for_one_lease_exactly_one_gets_it(tmp_path, before):
    context = multiprocessing.get_context("fork")
    num, rounds = 6, 4
    for number in range(rounds):
        run_dir = tmp_path / str(number)
        run_dir.mkdir()
        if before != "none":
            stale = other_lease(heartbeat=time.time() - 400).encode()
            (run_dir / LEASE_FILE).write_bytes(stale)
        if before == "stale, and a dead claimer":
            dead = other_lease(host=here().host, pid=99999999, owner="d" * 32, heartbeat=time.time(),
                               pid_namespace=here().namespace)  # fmt: skip
            (run_dir / (CLAIM_PREFIX + lease_module._digest(stale))).write_bytes(dead.encode())
        start, done, results = context.Barrier(num), context.Barrier(num), context.Queue()
        procs = [context.Process(target=_contend, args=(str(run_dir), start, done, results)) for _ in range(num)]
        for proc in procs:
            proc.start()
        outcomes = [results.get(timeout=60) for _ in procs]
        for proc in procs:
            proc.join(timeout=60)
            assert proc.exitcode == 0
        winners = [pid for pid, won, _, _ in outcomes if won]
        assert len(winners) == 1, outcomes
        refusals = [refusal for _, won, refusal, _ in outcomes if not won]
        assert all(f"is in use by host {here().host} pid {winners[0]} " in line for line in refusals), outcomes
        note = next(note for _, won, _, note in outcomes if won)
        assert (note is None) == (before == "none") and (note is None or "from host node-a pid 4242" in note)
        assert sorted(p.name for p in run_dir.iterdir()) == []  # released; no claim or temporary file left


@pytest.mark.parametrize(
    "end, code",
    [("finished", 0), ("non-finite", 3), ("preempted", 4), ("error", 1), ("refused", 2), ("ctrl-c", 130)],
)
def test_a_stage_gives_its_lease_back_however_it_ends(tmp_path, monkeypatch, end, code):
    """core/entry/stage.py's `finally` around the stage: exit codes 0, 3 and 4 are returned by the stage, an error and
    a refusal raised, Ctrl-C a KeyboardInterrupt (the training loop's own Ctrl-C path returns 130 like SIGTERM's 4)."""

    def main(argv: list[str]) -> int:
        acquire(tmp_path, stage="pretrain", recipe="r.yaml", stale_after_s=300)
        assert (tmp_path / LEASE_FILE).exists()
        if end == "error":
            raise ValueError("a shard that cannot be read")
        if end == "refused":
            raise StageExit(2, "[mimpipe] refused: run_dir: ...")
        if end == "ctrl-c":
            raise KeyboardInterrupt
        return code

    monkeypatch.setitem(stage.STAGES, "fake", lambda: main)
    assert stage.run("fake", []) == code
    assert sorted(p.name for p in tmp_path.iterdir()) == []
