"""A run_dir has one owner: rank 0 of the launch that trains in it holds `RUN_DIR/lease.json` (docs/run_dir.md).

Two launches into one run_dir would both train: metrics.jsonl would get every step twice, both would write the same
checkpoint folders and replace `latest` in turn. Comparing configs (core/launch/rundir.py) cannot tell a live
duplicate from a relaunch, so the launch that trains holds a lease whose heartbeat it renews, and another launch stops
while that lease is live: in launch.sh's pre-flight (`in_use_by`), and at its stage's start, where rank 0 takes the
lease (`acquire`) and two launches that passed the pre-flight together find which one got it.

No kernel lock (flock and fcntl locks are unreliable on NFS and Lustre): every change of owner is an exclusive create
that the file server decides, which NFSv3 and later, Lustre and local file systems make atomic:
- a lease where there is none is a complete file hard-linked to `lease.json`; `link` fails when the name exists, so
  of two launches one links and the other then finds its lease live;
- a stale or gone lease goes to the launch that first links a claim named by a hash of the lease's bytes
  (`.lease-claim-HASH`): each lease read can be claimed once. The claimer reads `lease.json` again and replaces it
  (`os.replace`) only if its bytes are still those it judged, so a launch that claimed an older lease finds them
  changed. A claimer that died before replacing leaves its claim, judged as a lease is; once it is stale or gone, a
  claim whose name adds that claim's hash takes its place;
- NFS may answer a link it made with EEXIST (a retransmitted request): the temporary file's link count says whether
  it was made (open(2) on O_EXCL).
A heartbeat replaces the file atomically (temp file + os.replace) once it has read that the lease is still its own. An
owner that finds another's lease there (it was taken over: stale after a pause longer than its timeout, or by
`--take-over-run-dir`) stops its process at once, without saving, so that one launch writes in run_dir.

A lease is live until its heartbeat is older than its own timeout (`stale_after_s`: `checkpoint.lease_timeout_s` of
the launch that wrote it) or, on the same host and pid namespace, until its process is gone (no process with its pid,
or one started at another time: the pid was reused). A kill -9 leaves the file; these rules free it. Hosts must agree
on the time to well within the timeout (NTP does). `MIMPIPE_LEASE_HOST` replaces the host name a lease records and
compares: for tests, and for containers whose host name says nothing about the machine.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import psutil

LEASE_FILE = "lease.json"
CLAIM_PREFIX = ".lease-claim-"
TAKE_OVER_FLAG = "--take-over-run-dir"
"""The launch.sh / entry point flag that takes run_dir over from whichever launch holds it, live or not."""
HOST_ENV = "MIMPIPE_LEASE_HOST"
"""Replaces the host name a lease records and compares (tests; containers)."""
HEARTBEAT_MAX_S = 10.0
"""The heartbeat's period is a fifth of the timeout, at most this."""
EXIT_TAKEN_OVER = 2
"""Exit code of an owner whose lease another launch took over (as a refused launch's)."""
LIVE, STALE, GONE = "live", "stale", "gone"
_MAX_TRIES = 8  # the lease changed under this launch that often (or so many claimers died): give up
_PID_START_TOLERANCE_S = 1.0  # psutil's create_time is exact to a clock tick; a reused pid started later


@dataclass(frozen=True)
class Lease:
    """The contents of `lease.json` (`mimpipe status` reads them). `pid_started` and `pid_namespace` tell a reused
    pid and another container's process apart from the owner."""

    host: str
    pid: int
    slurm_job_id: str | None
    started: float
    heartbeat: float
    stale_after_s: float
    stage: str
    recipe: str
    owner: str
    """A unique id of the launch (uuid4 hex)."""
    pid_started: float | None = None
    pid_namespace: str | None = None

    def encode(self) -> bytes:
        return (json.dumps(asdict(self)) + "\n").encode()

    @classmethod
    def decode(cls, raw: bytes) -> Lease | None:
        """The lease `raw` holds, or None when it holds none (a file edited or cut by hand)."""
        try:
            found = json.loads(raw)
            return cls(**{f.name: found[f.name] for f in fields(cls) if f.name in found})
        except (ValueError, TypeError):
            return None

    def who(self) -> str:
        job = f" (SLURM job {self.slurm_job_id})" if self.slurm_job_id else ""
        return f"host {self.host} pid {self.pid}{job}"


@dataclass(frozen=True)
class Place:
    """Where a process runs, as far as a pid means anything: the host name, and the boot and pid namespace there."""

    host: str
    namespace: str


def here() -> Place:
    host = os.environ.get(HOST_ENV) or socket.gethostname()
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # not Linux
        namespace = ""
    return Place(host, namespace)


def process_alive(pid: int, started: float | None) -> bool:
    """Whether process `pid` runs and is the one started at `started` (unix time; None: any)."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(process.create_time() - started) < _PID_START_TOLERANCE_S
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # another user's: it runs
        return True


def judge(lease: Lease, now: float, place: Place, alive: Callable = process_alive) -> str:
    """LIVE, STALE (no heartbeat for its timeout) or GONE (its process ended, seen from its own host)."""
    if now - lease.heartbeat > lease.stale_after_s:
        return STALE
    if (lease.host, lease.pid_namespace) == (place.host, place.namespace) and not alive(lease.pid, lease.pid_started):
        return GONE
    return LIVE


def heartbeat_period(stale_after_s: float) -> float:
    return min(HEARTBEAT_MAX_S, stale_after_s / 5)


def in_use(run_dir: str | Path, lease: Lease, now: float) -> str:
    """The line refusing a launch into `run_dir` while `lease` is live (without a prefix)."""
    return (
        f"{run_dir} is in use by {lease.who()} since {_when(lease.started)}, last heartbeat "
        f"{_ago(lease, now)} s ago; wait for it to end (a launch silent for {lease.stale_after_s:g} s is taken "
        f"over), pass run_dir=NEW_DIR to start a new run, or {TAKE_OVER_FLAG} if you know it is gone"
    )


def takeover_note(run_dir: str | Path, lease: Lease | None, state: str, now: float) -> str:
    """The warning line of a launch that takes `run_dir` over from `lease` (None: a file that holds no lease)."""
    if lease is None:
        return f"taking over {run_dir}: its {LEASE_FILE} holds no lease"
    why = {
        STALE: f"its last heartbeat was {_ago(lease, now)} s ago, past its {lease.stale_after_s:g} s timeout",
        GONE: "that process is gone",
        LIVE: f"its last heartbeat was {_ago(lease, now)} s ago ({TAKE_OVER_FLAG}; if it still runs, it stops)",
    }[state]
    return f"taking over {run_dir} from {lease.who()}, started {_when(lease.started)}: {why}"


def in_use_by(run_dir: str | Path, *, take_over: bool = False, place: Place | None = None) -> str | None:
    """The pre-flight's verdict: the `in_use` line when a live launch holds `run_dir`, else None (no lease, a stale
    or gone one, which the stage takes over, or `take_over`)."""
    raw = read_raw(Path(run_dir) / LEASE_FILE)
    lease = None if raw is None else Lease.decode(raw)
    now = time.time()
    if lease is None or take_over or judge(lease, now, place or here()) != LIVE:
        return None
    return in_use(run_dir, lease, now)


@dataclass
class Acquired:
    """What `acquire` got: the lease (`held`), or the line refusing the launch; `note` warns of a takeover."""

    held: HeldLease | None = None
    refusal: str | None = None
    note: str | None = None


def acquire(
    run_dir: str | Path,
    *,
    stage: str,
    recipe: str,
    stale_after_s: float,
    take_over: bool = False,
    clock: Callable[[], float] = time.time,
    place: Place | None = None,
    alive: Callable = process_alive,
    on_lost: Callable[[str], None] | None = None,
) -> Acquired:
    """Take `run_dir`'s lease for this process and start its heartbeat, unless a live launch holds it (or is taking
    it over right now); see the module docstring for why two launches cannot both get it. `clock`, `place` and
    `alive` are for tests; `on_lost` is what the heartbeat does when another launch took the lease over (default:
    print its line and end the process)."""
    path = Path(run_dir) / LEASE_FILE
    place = place or here()
    mine = new_lease(stage, recipe, stale_after_s, clock(), place)
    for _ in range(_MAX_TRIES):  # each pass: the lease changed while this launch looked
        raw = read_raw(path)
        mine = replace(mine, heartbeat=clock())
        if raw is None:
            if _create(path, mine):
                return Acquired(HeldLease(path, mine, clock=clock, on_lost=on_lost).start())
            continue
        current = Lease.decode(raw)
        now = clock()
        state = STALE if current is None else judge(current, now, place, alive)
        if state == LIVE and not take_over:
            return Acquired(refusal=in_use(run_dir, current, now))
        taken = _take(path, raw, mine, now, place, alive)
        if isinstance(taken, Lease):  # another launch is taking it over right now
            return Acquired(refusal=in_use(run_dir, taken, now))
        if taken:
            held = HeldLease(path, mine, clock=clock, on_lost=on_lost).start()
            return Acquired(held, note=takeover_note(run_dir, current, state, now))
    return Acquired(
        refusal=f"{path} kept changing while this launch tried to take it, or {CLAIM_PREFIX}* files of launches that "
        "died taking it over block it (remove them if no launch runs there)"
    )


def new_lease(stage: str, recipe: str, stale_after_s: float, now: float, place: Place) -> Lease:
    return Lease(
        host=place.host,
        pid=os.getpid(),
        slurm_job_id=os.environ.get("SLURM_JOB_ID") or None,
        started=now,
        heartbeat=now,
        stale_after_s=float(stale_after_s),
        stage=stage,
        recipe=recipe,
        owner=uuid.uuid4().hex,
        pid_started=psutil.Process().create_time(),
        pid_namespace=place.namespace,
    )


def _create(path: Path, lease: Lease) -> bool:
    """Make `lease` the lease at `path` if there is none there; whether it was made."""
    tmp = _write_tmp(path, lease)
    try:
        made = _link(tmp, path)
    finally:
        tmp.unlink()
    if made:
        _remove_claims(path)  # left by launches that died taking over an earlier lease
    return made


def _take(path: Path, raw: bytes, lease: Lease, now: float, place: Place, alive: Callable) -> bool | Lease:
    """Replace the lease whose bytes are `raw` with `lease` if this launch is the first to claim it. Returns True when
    replaced, the claimer's lease when a live launch claimed it first, False when it changed meanwhile."""
    tmp = _write_tmp(path, lease)
    try:
        name = CLAIM_PREFIX + _digest(raw)
        for _ in range(_MAX_TRIES):
            claim = path.with_name(name)
            if _link(tmp, claim):
                break
            claim_raw = read_raw(claim)
            if claim_raw is None:  # removed meanwhile: the lease changed
                return False
            claimer = Lease.decode(claim_raw)
            if claimer is not None and judge(claimer, now, place, alive) == LIVE:
                return claimer
            name += "-" + _digest(claim_raw)[:8]  # that claimer died: claim after it
        else:
            return False
        if read_raw(path) != raw:  # another launch claimed first and replaced it: this claim is of an old lease
            claim.unlink(missing_ok=True)
            return False
        os.replace(tmp, path)
        _remove_claims(path)  # every claim now names an old lease, this launch's too
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _link(tmp: Path, target: Path) -> bool:
    try:
        os.link(tmp, target)
        return True
    except FileExistsError:
        return os.stat(tmp).st_nlink > 1  # NFS: a retransmitted link that was made answers EEXIST


def _remove_claims(path: Path) -> None:
    """Remove every claim: called once `path` holds a lease no one has claimed yet, so each names an older one (a
    launch still holding one finds the lease changed when it reads it again)."""
    for claim in path.parent.glob(f"{CLAIM_PREFIX}*"):
        claim.unlink(missing_ok=True)


def _write_tmp(path: Path, lease: Lease) -> Path:
    tmp = path.with_name(f".{path.name}.{lease.owner}.{threading.get_ident()}.tmp")
    tmp.write_bytes(lease.encode())
    return tmp


def _write_atomic(path: Path, lease: Lease) -> None:
    tmp = _write_tmp(path, lease)
    try:
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:16]


def read_raw(path: Path) -> bytes | None:
    """The file's bytes, read by a fresh open (NFS revalidates on open), or None when there is no such file."""
    try:
        return path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _when(stamp: float) -> str:
    return datetime.datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M:%S")


def _ago(lease: Lease, now: float) -> str:
    return f"{max(0.0, now - lease.heartbeat):.0f}"


def stop_process(line: str) -> None:
    """The heartbeat's answer to a lease taken over: the line, then the process ends at once (no checkpoint, no
    export: the new owner writes in run_dir now; the other ranks stop as their collectives fail)."""
    os.write(2, f"[mimpipe] error: run_dir: {line} (exit code {EXIT_TAKEN_OVER})\n".encode())
    os._exit(EXIT_TAKEN_OVER)


class HeldLease:
    """Rank 0's lease while its stage runs. A daemon thread renews the heartbeat every `heartbeat_period`: file I/O
    only, it never waits for or touches the training step. `release` gives the lease back (only while it is ours)."""

    def __init__(self, path: Path, lease: Lease, *, clock: Callable[[], float] = time.time, on_lost=None):
        self.path, self.lease, self.clock = path, lease, clock
        self.on_lost = on_lost or stop_process
        self.period = heartbeat_period(lease.stale_after_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()  # a forked child holds a copy of this object, not the lease
        self._failing = False

    def start(self) -> HeldLease:
        _HELD.add(self)
        self._thread = threading.Thread(target=self._beat, name="mimpipe-lease", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.period):
            self.renew()

    def renew(self) -> bool:
        """Renew the heartbeat; False (after `on_lost`) when another launch holds the lease now."""
        try:
            raw = read_raw(self.path)
            current = None if raw is None else Lease.decode(raw)
            if current is not None and current.owner != self.lease.owner:
                self._stop.set()
                _HELD.discard(self)
                self.on_lost(f"{self.path.parent} was taken over by {current.who()} at {_when(current.started)}")
                return False
            self.lease = replace(self.lease, heartbeat=self.clock())
            if raw is None:  # removed by hand: made again, exclusively, as a new lease is
                _create(self.path, self.lease)
            else:
                _write_atomic(self.path, self.lease)
            self._failing = False
        except OSError as err:  # a file server's hiccup: the next beat tries again
            if not self._failing:
                print(f"[mimpipe] warning: run_dir: cannot renew {self.path} ({err})", file=sys.stderr, flush=True)
            self._failing = True
        return True

    def release(self) -> None:
        """Stop the heartbeat and remove `lease.json` if it is still this launch's."""
        if os.getpid() != self._pid:
            return
        self._stop.set()
        _HELD.discard(self)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.period + 5)
        with contextlib.suppress(OSError):  # left behind, it is seen gone by the next launch on this host
            raw = read_raw(self.path)
            current = None if raw is None else Lease.decode(raw)
            if current is not None and current.owner == self.lease.owner:
                self.path.unlink(missing_ok=True)


_HELD: set[HeldLease] = set()


def release_held() -> None:
    """Give back every lease this process holds: a stage's `finally`, and at exit for a stage run by other code."""
    for held in list(_HELD):
        held.release()


atexit.register(release_held)
