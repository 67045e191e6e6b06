"""Checkpoints under `run_dir/checkpoints/`: one DeepSpeed tag per save (model and optimizer, partitioned the way
ZeRO holds them) plus, per rank, a JSON file with every other `Stateful` the run names (the loop's: "train", the
step, counters and data-stream position of `TrainState`, and "rng", every RNG state); the resolved config sits
beside them as YAML.

Write order (`save_checkpoint`): every rank writes and fsyncs its own files (DeepSpeed's shards, its state JSON) ->
they exchange what they wrote (a barrier) -> rank 0 fsyncs the folder, writes the completeness marker `complete`
(core/launch/ckpt_files.py) and replaces `latest` atomically -> old and incomplete tags are pruned. A crash, or a full
disk, at any point leaves `latest` naming a complete checkpoint.
Resume order (see `find_resume`): the run_dir's own `latest`, or the newest complete checkpoint that reads back
whole when that one is incomplete or damaged, else training starts from scratch (an `init` checkpoint, if any, is
applied by the stage before this).
"""

from __future__ import annotations

import base64
import json
import math
import os
import random
import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from subprocess import PIPE
from typing import Protocol

import numpy as np
import torch

from core.compat import deepspeed as ds_compat
from core.engine.distributed import DistInfo, barrier
from core.engine.failure import PeerLostError
from core.engine.fp16 import MASTER_NAMES, zero0_master_names
from core.launch.ckpt_files import (
    COMPLETE,
    LATEST,
    atomic_write,
    checkpoint_bytes,
    checkpoint_files,
    choose_resume,
    prune,
    read_latest,
    tag_of,
    why_damaged,
    write_marker,
)

FREE_SPACE_MARGIN = 1.1
"""A save goes ahead only with this many times the previous checkpoint's size free (the new one is written before
the oldest is pruned)."""
BYTES_PER_PARAM = 16
"""The size of a first checkpoint, per parameter: fp32 weights, and AdamW's fp32 master copy and two moments."""
CONVERSION_HEARTBEAT_S = 10.0
"""How often rank 0 shows the other ranks that it is still converting a checkpoint to the universal format."""
CONVERSION_STALE_S = 300.0
"""How long the other ranks wait on a conversion that shows no sign of life: well above a heartbeat and the attribute
caching of a shared filesystem (NFS: up to 60 s)."""
PER_RANK_STATES = ("rng",)
"""States that belong to the ranks that wrote them and do not carry over to another world size."""


class Stateful(Protocol):
    """What a checkpoint saves and restores besides the DeepSpeed engine (torchtitan's `Stateful`): JSON-safe values."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class RNGState:
    """The global Python, NumPy and torch RNGs as a `Stateful` of JSON-safe values: the CPU's, and the CUDA generator
    of the GPU this rank uses (its current device), not those of every GPU the process can see: a run resumed with
    the same world size on nodes that expose another number of GPUs each must load.
    """

    def state_dict(self) -> dict:
        b64 = lambda t: base64.b64encode(t.numpy().tobytes()).decode()  # noqa: E731
        np_state = np.random.get_state()
        state = {
            "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "torch": b64(torch.get_rng_state()),
        }
        if torch.cuda.is_available():
            state["cuda"] = b64(torch.cuda.get_rng_state())
        return state

    def load_state_dict(self, state: dict) -> None:
        unb64 = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)  # noqa: E731
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        name, keys, *rest = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
        torch.set_rng_state(unb64(state["torch"]))
        if "cuda" in state and torch.cuda.is_available():
            cuda = state["cuda"]
            if isinstance(cuda, list):  # checkpoints before this held every visible GPU's: take this rank's
                device = torch.cuda.current_device()
                cuda = cuda[device] if device < len(cuda) else None
            if cuda is not None:
                torch.cuda.set_rng_state(unb64(cuda))


@dataclass(frozen=True)
class SaveOutcome:
    """What became of one save, the same on every rank."""

    tag_dir: Path | None
    """The complete checkpoint written; None when the save was skipped or failed (`latest` names the one before)."""
    note: str | None = None
    """The console line of a skipped or failed save."""


def save_checkpoint(
    engine,
    *,
    run_dir: Path,
    step: int,
    dist: DistInfo,
    states: Mapping[str, Stateful],
    config_yaml: str,
    keep_last: int,
) -> SaveOutcome:
    """Save model and optimizer (DeepSpeed) and each of `states` under its name, complete or not at all.

    Skipped (the run goes on, `latest` unchanged) when some rank's filesystem has less free space than the previous
    checkpoint took (`FREE_SPACE_MARGIN`); a write that fails on any rank (a full disk) removes the partial folder
    and leaves `latest` where it was. Collective: every rank calls it at the same step.
    """
    ckpt_dir = run_dir / "checkpoints"
    tag_dir = ckpt_dir / tag_of(step)
    latest = read_latest(ckpt_dir)
    if dist.is_main:  # left by an earlier attempt at this step (killed mid-save, or a run that fell back before it)
        shutil.rmtree(tag_dir, ignore_errors=True)
    # the gather is also the barrier that keeps the other ranks from writing before the folder is gone
    short = next(filter(None, _all_gather(_space_short(engine, ckpt_dir, latest))), None)
    if short is not None:
        return SaveOutcome(None, f"[mimpipe] warning: checkpoint of step {step} skipped: {short}; {_still(latest)}")
    written, errors = _write_tag(engine, tag_dir, step, dist, states, config_yaml)
    reports = _all_gather((written, [f"rank {dist.rank}: {err}" for err in errors]))  # every rank fsynced its files
    failed = [error for _, rank_errors in reports for error in rank_errors]
    outcome = SaveOutcome(tag_dir)
    if failed:
        outcome = SaveOutcome(None, f"[mimpipe] warning: checkpoint of step {step} failed ({failed[0]}); ")
    elif dist.is_main:
        outcome = _commit(ckpt_dir, tag_dir, {name: n for files, _ in reports for name, n in files.items()}, keep_last)
    if outcome.tag_dir is None:
        if dist.is_main:
            shutil.rmtree(tag_dir, ignore_errors=True)
        outcome = SaveOutcome(None, outcome.note + f"partial folder removed, {_still(latest)}")
    return _broadcast(outcome)


def _still(latest: str | None) -> str:
    return f"checkpoints/latest still names {latest}" if latest else "no checkpoint to resume from yet"


def _write_tag(engine, tag_dir: Path, step: int, dist: DistInfo, states, config_yaml: str):
    """This rank's files of the tag, each fsynced: DeepSpeed's, then its states (and on rank 0 the config).

    Returns:
        ({file name: bytes} written, the OSErrors of the writes that failed).
    """
    client_state = {"step": step}
    if engine.fp16_enabled() and engine.zero_optimization_stage() == 0:
        client_state[MASTER_NAMES] = zero0_master_names(engine)  # lets an offline export name the fp32 weights
    written: dict[str, int] = {}
    errors: list[OSError] = []
    with ds_compat.recorded_writes(engine, written, errors):
        try:
            engine.save_checkpoint(str(tag_dir.parent), tag=tag_dir.name, client_state=client_state, save_latest=False)
        except OSError as err:  # rank 0 copying DeepSpeed's recovery scripts, after its files, before its last barrier
            errors.append(err)
            barrier()  # the barrier DeepSpeed's save skipped, which the other ranks are waiting in
    saved = {"world_size": dist.world_size, **{name: stateful.state_dict() for name, stateful in states.items()}}
    own = {f"rank_{dist.rank:05d}.json": json.dumps(saved), **({"config.yaml": config_yaml} if dist.is_main else {})}
    for name, text in own.items():
        try:
            atomic_write(tag_dir / name, text)
            written[name] = (tag_dir / name).stat().st_size
        except OSError as err:
            errors.append(err)
    return written, errors


def _commit(ckpt_dir: Path, tag_dir: Path, files: dict[str, int], keep_last: int) -> SaveOutcome:
    """Rank 0, once every rank has written and fsynced its files: the marker, then `latest`, then the pruning."""
    try:
        write_marker(tag_dir, files)
        atomic_write(ckpt_dir / LATEST, tag_dir.name)
    except OSError as err:
        (tag_dir / COMPLETE).unlink(missing_ok=True)
        return SaveOutcome(None, f"[mimpipe] warning: checkpoint {tag_dir.name} could not be marked complete ({err}); ")
    prune(ckpt_dir, keep_last, keep={tag_dir.name})
    return SaveOutcome(tag_dir)


def _space_short(engine, ckpt_dir: Path, latest: str | None) -> str | None:
    """Why this rank's filesystem cannot take the next checkpoint, or None. Its size is the previous checkpoint's
    (from its marker), else `BYTES_PER_PARAM` per parameter; every rank checks for the whole checkpoint, as on the
    shared filesystem a run_dir normally sits on."""
    need = checkpoint_bytes(ckpt_dir / latest) if latest is not None else None
    if need is None:
        need = BYTES_PER_PARAM * sum(math.prod(ds_compat.full_shape(p)) for p in engine.module.parameters())
    free = shutil.disk_usage(next(p for p in (ckpt_dir, *ckpt_dir.parents) if p.exists())).free  # before a first save
    if free >= need * FREE_SPACE_MARGIN:
        return None
    return f"{free / 2**30:.2f} GiB free in {ckpt_dir}, a checkpoint takes about {need / 2**30:.2f} GiB"


def _all_gather(value) -> list:
    """Every rank's `value` (picklable), in rank order; [value] without a process group."""
    if not torch.distributed.is_initialized():
        return [value]
    values = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def _shared() -> bool:
    """Whether this process is one of several ranks (a group of one, e.g. a test's, decides alone)."""
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def _broadcast(value):
    """Rank 0's `value` on every rank."""
    if not _shared():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def best_checkpoint(run_dir: Path, dist: DistInfo) -> str | None:
    """The checkpoint a resume would load now (`latest`, or the newest complete one), decided by rank 0 for all."""
    tag, _ = _broadcast(choose_resume(run_dir / "checkpoints") if dist.is_main else None)
    return tag


def find_resume(run_dir: Path, rank: int, world_size: int, step: int | None = None) -> dict | None:
    """Where to resume from: the checkpoint `latest` names, or the newest complete one when that one cannot be
    loaded: incomplete (a save that did not finish) or damaged (a file that does not read back whole; every
    candidate is read in full first, see `resumable_tag`). Rank 0 decides for every rank and prints one line naming
    both; or the given step. None for a fresh run.

    Returns:
        "tag", "load_tag" (what `load_checkpoint` gives DeepSpeed), "universal", and "states": this rank's saved
        states by name, for `load_states`. A checkpoint written by another world size is resumed through DeepSpeed's
        universal checkpoint (see `_elastic_resume`) and also gives "from_world_size".

    Raises:
        ValueError: The checkpoint lacks this rank's state, or was written by another world size and cannot be
            converted.
    """
    ckpt_dir = run_dir / "checkpoints"
    tag = tag_of(step) if step is not None else resumable_tag(ckpt_dir, rank, world_size)
    if tag is None:
        return None
    first = ckpt_dir / tag / f"rank_{0:05d}.json"
    saved_world = json.loads(first.read_text()).get("world_size", world_size) if first.is_file() else world_size
    if saved_world != world_size:
        return _elastic_resume(ckpt_dir, tag, saved_world, world_size, rank)
    state_file = ckpt_dir / tag / f"rank_{rank:05d}.json"
    if not state_file.is_file():
        raise ValueError(f"checkpoint {ckpt_dir / tag} has no state for rank {rank} ({state_file} missing)")
    return {"tag": tag, "load_tag": tag, "universal": False, "states": _read_states(state_file)}


def resumable_tag(ckpt_dir: Path, rank: int = 0, world_size: int = 1) -> str | None:
    """The tag to resume from (see `find_resume`), read back in full before anything loads it: the ranks share its
    files out, each checks its share (`why_damaged`), and a checkpoint any rank finds damaged is passed over for the
    next newest complete one. Rank 0 chooses, for every rank, and prints what it passed over."""
    damaged: dict[str, str] = {}
    while True:
        tag, note = _broadcast(choose_resume(ckpt_dir, damaged) if rank == 0 or not _shared() else None)
        if tag is None:
            break
        share = checkpoint_files(ckpt_dir / tag)[rank::world_size]
        problem = next(filter(None, _all_gather(why_damaged(ckpt_dir / tag, share))), None)
        if problem is None:
            break
        damaged[tag] = problem
    if rank == 0:
        latest = read_latest(ckpt_dir)  # its damage is in `note`
        passed_over = [f"{ckpt_dir / t} ({why})" for t, why in damaged.items() if t != latest]
        if passed_over:
            print(f"[mimpipe] warning: passed over damaged {', '.join(passed_over)}", flush=True)
        if note is not None:
            print(note, flush=True)
    return tag


def _read_states(state_file: Path) -> dict[str, dict]:
    """The states saved in one rank's JSON, by name (checkpoints from before named states held "rng" and the train
    state's fields side by side)."""
    saved = json.loads(state_file.read_text())
    saved.pop("world_size", None)
    if "train" not in saved:
        rng = saved.pop("rng", None)
        saved = {"train": saved, **({"rng": rng} if rng is not None else {})}
    return saved


def saved_states(run_dir: Path, tag: str, name: str) -> list[dict]:
    """The state `name` as every rank that wrote checkpoint `tag` saved it, by rank (an elastic resume of the data
    streams needs every old rank's position)."""
    tag_dir = run_dir / "checkpoints" / tag
    world_size = json.loads((tag_dir / "rank_00000.json").read_text()).get("world_size", 1)
    return [_read_states(tag_dir / f"rank_{rank:05d}.json")[name] for rank in range(world_size)]


def load_states(resume: dict | None, states: Mapping[str, Stateful]) -> None:
    """Loads each of `states` from the resume point; one it does not carry (a fresh run, or "rng" after a world-size
    change) keeps its current value."""
    for name, stateful in states.items():
        if resume is not None and name in resume["states"]:
            stateful.load_state_dict(resume["states"][name])


def _elastic_resume(ckpt_dir: Path, tag: str, saved_world: int, world_size: int, rank: int) -> dict:
    """Resume state for a world size other than the one that wrote `tag`.

    Model and optimizer state come back exactly: the ZeRO partitions are converted once (by rank 0) into DeepSpeed's
    universal checkpoint, `tag/universal`, which any world size loads. The step and counters come from rank 0's state.
    Every saved state but `PER_RANK_STATES` comes from rank 0's, whole: the step, counters and best evaluation of the
    train state are the same on every rank; the data streams deal out what every old rank's left unread (core/engine/
    stream.py reads their positions with `saved_states`, data/cursor.py); the RNGs are not restored (each rank keeps
    its seed + rank). Refused where DeepSpeed's conversion fails, naming the checkpoint.
    """
    states = _read_states(ckpt_dir / tag / "rank_00000.json")
    carried = {name: state for name, state in states.items() if name not in PER_RANK_STATES}
    keep = {"tag": tag, "from_world_size": saved_world, "states": carried}
    ds_compat.check("checkpoint_files")  # before `parallelize` checks it with the others: the names matter here
    if not ds_compat.has_zero_shards(ckpt_dir / tag):  # ZeRO-0: nothing partitioned, any world size loads it
        return {**keep, "load_tag": tag, "universal": False}
    if not (ckpt_dir / tag / "universal").is_dir():
        why = f"was written by {saved_world} processes, this run has {world_size}"
        _convert_once(ckpt_dir / tag, rank, why)
    return {**keep, "load_tag": f"{tag}/universal", "universal": True}


def _convert_once(tag_dir: Path, rank: int, why: str) -> None:
    """Rank 0 converts `tag_dir` into `tag_dir/universal`; the other ranks wait for it outside any collective.

    A conversion reads every ZeRO shard and can take far longer than the collective timeout (init_distributed's
    `timeout_s`), so the others watch the shared run_dir instead of a barrier: rank 0 rewrites a heartbeat file every
    `CONVERSION_HEARTBEAT_S` while DeepSpeed's converter runs, and writes a failure file when it fails. A waiting rank
    goes on when `universal` appears, and stops (`PeerLostError`) at the failure file or a heartbeat that stood still
    for `CONVERSION_STALE_S` (rank 0 ended without a word, e.g. its node was lost).
    """
    files = ConversionFiles(tag_dir)
    if rank == 0:
        files.heartbeat.unlink(missing_ok=True)
        files.failed.unlink(missing_ok=True)
    barrier()  # every rank comes here straight from start-up: from now on the files are this attempt's
    if rank != 0:
        files.wait()
        return
    tmp = tag_dir / f".universal.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    returncode, output = _run_with_heartbeat(ds_compat.universal_command(tag_dir, tmp), files.heartbeat)
    if returncode != 0:
        message = f"checkpoint {tag_dir} {why}, and converting it to a universal checkpoint failed:\n{output}"
        atomic_write(files.failed, message)
        raise ValueError(message)
    os.replace(tmp, files.universal)


def _run_with_heartbeat(command: list[str], heartbeat: Path) -> tuple[int, str]:
    """Run `command`, rewriting `heartbeat` with a new count every `CONVERSION_HEARTBEAT_S` until it ends; returns
    its exit code and the end of its stdout and stderr."""
    proc = subprocess.Popen(command, stdout=PIPE, stderr=PIPE, text=True)
    beat = 0
    while True:
        atomic_write(heartbeat, str(beat))
        try:
            stdout, stderr = proc.communicate(timeout=CONVERSION_HEARTBEAT_S)  # retrying it loses no output
        except subprocess.TimeoutExpired:
            beat += 1
            continue
        return proc.returncode, f"{stdout[-2000:]}{stderr[-2000:]}"


@dataclass(frozen=True)
class ConversionFiles:
    """What rank 0's conversion of one checkpoint shows the waiting ranks, in the checkpoint's directory."""

    tag_dir: Path

    @property
    def universal(self) -> Path:
        return self.tag_dir / "universal"

    @property
    def heartbeat(self) -> Path:
        return self.tag_dir / ".universal.heartbeat"

    @property
    def failed(self) -> Path:
        return self.tag_dir / ".universal.failed"

    def wait(self, stale_s: float = CONVERSION_STALE_S, poll_s: float = 1.0) -> None:
        """Return once `universal` exists; raise `PeerLostError` at the failure file or a heartbeat that stood still
        for `stale_s` (a heartbeat not yet written counts as standing still)."""
        last_beat, last_change = None, time.monotonic()
        while not self.universal.is_dir():
            if self.failed.is_file():
                raise PeerLostError(f"rank 0 could not convert {self.tag_dir} to a universal checkpoint")
            try:
                beat = self.heartbeat.read_text()
            except OSError:  # not written yet, or replaced under us (a shared filesystem)
                beat = last_beat
            now = time.monotonic()
            if beat != last_beat:
                last_beat, last_change = beat, now
            elif now - last_change > stale_s:
                raise PeerLostError(f"rank 0 showed no sign of converting {self.tag_dir} for {stale_s:.0f} s")
            time.sleep(poll_s)


def load_checkpoint(engine, *, run_dir: Path, resume: dict, states: Mapping[str, Stateful]) -> None:
    """Load DeepSpeed model/optimizer state of `resume["load_tag"]`, then each of `states` the resume carries."""
    ckpt_dir = run_dir / "checkpoints"
    path, _ = engine.load_checkpoint(
        str(ckpt_dir), tag=resume["load_tag"], load_optimizer_states=True, load_lr_scheduler_states=False
    )
    if path is None:
        raise ValueError(f"could not load checkpoint {ckpt_dir / resume['load_tag']}")
    load_states(resume, states)
