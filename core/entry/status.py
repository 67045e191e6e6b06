"""`mimpipe status RUN_DIR [--json] [--verify]` (`python -m core.entry.status`): one screen for a run that cannot be
watched directly (on a cluster, in another terminal). Who owns it and whether it is alive (`lease.json`), its stage
and config, the step reached of the schedule's total, images/s and ETA, the last monitor values, its checkpoints with
what a relaunch would resume from and why, the export and `finished.json`. `--json`: the same as one JSON object.

It only reads: nothing is written into the run_dir and nothing waits on a running run. Of a metrics.jsonl being
appended to, the complete lines count; a checkpoint folder without its completion marker is being written (by a live
run) or partial. The resume choice is the resume code's own (core/launch/ckpt_files.py `choose_resume`, with its
line when it falls back from `latest`); `--verify` also reads every file of the chosen checkpoint back in full, as a
resume does before it loads one, passing over a damaged one (core/engine/checkpoint.py `resumable_tag`: torch,
seconds per GB). The files read: docs/run_dir.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import yaml
from pydantic import ValidationError

from core.compat.closed_pipe import quiet_on_closed_pipe
from core.entry.status_screen import render
from core.export.manifest import MANIFEST_NAME
from core.launch.ckpt_files import choose_resume, read_latest, tag_folders, why_incomplete
from core.launch.lease import LEASE_FILE, LIVE, Lease, here, judge, read_raw
from core.launch.rundir import FINISHED, relaunch, saved_step
from core.recipe.config import Config, ConfigError
from data.specs import dataset_size

RATE_WINDOWS = 5
"""The logged windows of `perf/images_per_sec` the shown rate and ETA average over."""
MONITORS = ("train/loss", "knn/top1", "fewshot/top1_", "features/effective_rank", "val/top1")
"""The scalars shown with their last value and step, those the config runs (`monitors_of`); one ending in `_`
stands for every key it starts."""
TAIL_BYTES = 32 * 2**20
"""How far from its end metrics.jsonl is read at most: once the last rate windows and every monitor the config runs
are found, reading stops; a monitor logged last before that is not shown. A status costs the same however long the
run."""
EXIT_NOT_A_RUN = 2
"""Exit code for a path that does not exist or is not a run_dir."""


def read_status(run_dir: Path, *, verify: bool = False, now: float | None = None) -> dict:
    """Everything `mimpipe status` shows of `run_dir`, as JSON-safe values (see docs/run_dir.md for each key).

    Raises:
        ValueError: `run_dir` does not exist or is not a run_dir.
    """
    now = time.time() if now is None else now
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: no such folder" if not run_dir.exists() else f"{run_dir}: not a folder")
    marks = ("config.yaml", "checkpoints", "metrics.jsonl", LEASE_FILE)
    if not any((run_dir / name).exists() for name in marks):
        raise ValueError(f"{run_dir}: not a run_dir (none of {', '.join(marks)})")
    lease = read_lease(run_dir / LEASE_FILE, now)
    status = {"run_dir": str(run_dir), "alive": lease["alive"], "lease": lease}
    cfg, facts = launch_config(run_dir)
    status |= facts
    batch = None if cfg is None else cfg.data.global_batch_size
    status |= progress(run_dir / "metrics.jsonl", status["total_steps"], batch, monitors_of(cfg), now)
    status |= checkpoints(run_dir / "checkpoints", alive=lease["alive"])
    status["resume"] = resume_choice(run_dir / "checkpoints", verify=verify)
    status["finished"] = _read_json(run_dir / FINISHED)
    if status["finished"] is not None:  # what launching this config again does: the relaunch check's own verdict
        status["finished"]["relaunch_does_nothing"] = _relaunch_does_nothing(cfg, run_dir, status["total_steps"])
    status["export"] = export_info(run_dir / "export")
    return status


def _relaunch_does_nothing(cfg: Config | None, run_dir: Path, total_steps: int | None) -> bool:
    """Whether launching `cfg` again finds its run finished: the relaunch check's own verdict (core/launch/rundir.py
    `relaunch`), with run_dir this folder (a copied or moved run is the same run)."""
    if cfg is None or total_steps is None:
        return False
    try:
        return relaunch(cfg.model_copy(update={"run_dir": str(run_dir)}), total_steps).finished
    except (OSError, ValueError):  # a `latest` that does not read as text
        return False


def read_lease(path: Path, now: float) -> dict:
    """The lease's fields and what the lease code makes of it (core/launch/lease.py `judge`): `state` is "none",
    "unreadable" (a file that holds no lease), "live", "stale" (no heartbeat within its `stale_after_s`) or "gone"
    (written on this host by a process that no longer runs); `alive` is "live"."""
    try:
        raw = read_raw(path)
    except OSError:
        raw = b""
    if raw is None:
        return {"state": "none", "alive": False}
    lease = Lease.decode(raw)
    try:
        state = judge(lease, now, here())
        ages = {"heartbeat_age_s": now - lease.heartbeat, "started_age_s": now - lease.started}
    except (AttributeError, TypeError):  # no lease, or fields of the wrong types
        return {"state": "unreadable", "alive": False}
    return {**asdict(lease), "who": lease.who(), "state": state, "alive": state == LIVE, **ages}


def launch_config(run_dir: Path) -> tuple[Config | None, dict]:
    """The latest launch's config (`configs/launch_NNNN.yaml`, else `config.yaml`; None when there is none or it is
    not valid today) and what it says: stage, objective, model, and the schedule's total steps as the stage computes
    it (`Config.steps` over `data.samples_per_epoch` or the shards' index.json); `total_steps` None with
    `total_unknown` saying why."""
    launches = sorted((run_dir / "configs").glob("launch_*.yaml"))
    path = launches[-1] if launches else run_dir / "config.yaml"
    out = {"config": str(path.relative_to(run_dir)), "stage": None, "objective": None, "model": None}
    out |= {"total_steps": None, "total_unknown": None}
    tree = None
    try:
        tree = yaml.safe_load(path.read_text()) or {}
        cfg = Config.model_validate(tree)
    except OSError:
        return None, out | {"config": None, "total_unknown": "no config.yaml"}
    except (yaml.YAMLError, ValidationError) as err:
        stage = tree.get("stage") if isinstance(tree, dict) else None
        first = str(err).splitlines()[0]
        return None, out | {"stage": stage, "total_unknown": f"{out['config']} is not valid today: {first}"}
    out |= {"stage": cfg.stage, "objective": cfg.objective.kind}
    out["model"] = f"{cfg.model.arch} {cfg.model.size} at {cfg.model.img_size} px, patch {cfg.model.patch_size}"
    try:
        out["total_steps"] = cfg.steps(None)[0]
    except ConfigError:  # a schedule in epochs: the stage converts it with the shards' sample count
        try:
            samples = cfg.data.samples_per_epoch or dataset_size(cfg.data.train)
        except (OSError, ValueError) as err:
            samples, reason = None, str(err)
        else:
            reason = "no index.json lists every shard" if samples is None else None
        if samples is None:
            out["total_unknown"] = f"schedule in epochs, and the shards' size is not known here ({reason})"
        else:
            out["total_steps"] = cfg.steps(samples)[0]
    return cfg, out


def monitors_of(cfg: Config | None) -> tuple[str, ...]:
    """The `MONITORS` the config runs (all of them without a config)."""
    if cfg is None:
        return MONITORS
    knn, pretrain = cfg.eval.knn, cfg.stage == "pretrain"
    runs = {
        "train/loss": True,
        "knn/top1": pretrain and knn.enabled,
        "fewshot/top1_": pretrain and knn.enabled and bool(knn.fewshot),
        "features/effective_rank": pretrain and cfg.eval.features.enabled,
        "val/top1": cfg.stage == "finetune",
    }
    return tuple(name for name in MONITORS if runs[name])


def progress(
    metrics: Path, total_steps: int | None, global_batch: int | None, monitors: tuple[str, ...], now: float
) -> dict:
    """The step reached (metrics.jsonl's last complete line), when it was logged, images/s (the harmonic mean over
    the last `RATE_WINDOWS` windows: the rate of all their images together) with the ETA it gives, and the last value
    of each of `monitors` with its step."""
    out = {"step": None, "logged_age_s": None, "images_per_sec": None, "rate_windows": 0, "eta_s": None}
    rates: list[float] = []
    found: dict[str, dict] = {}  # by name in `monitors`: {key: {"value", "step"}}
    for line in complete_lines_backwards(metrics, TAIL_BYTES):
        need_rate = len(rates) < RATE_WINDOWS
        missing = [name for name in monitors if name not in found]
        if out["step"] is not None and not need_rate and not any(f'"{name}'.encode() in line for name in missing):
            continue  # most lines once the rates are in: not parsed
        try:
            values = json.loads(line)
            step = int(values["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if out["step"] is None:
            out["step"], out["logged_age_s"] = step, now - float(values.get("time", now))
        if need_rate and isinstance(values.get("perf/images_per_sec"), int | float):
            rates.append(values["perf/images_per_sec"])
        for name in missing:
            prefix = name.endswith("_")
            logged = {k: v for k, v in values.items() if (k.startswith(name) if prefix else k == name)}
            if logged:
                found[name] = {k: {"value": v, "step": step} for k, v in sorted(logged.items())}
        if len(rates) == RATE_WINDOWS and len(found) == len(monitors):
            break
    out["monitors"] = {k: v for name in monitors for k, v in found.get(name, {}).items()}
    if rates and min(rates) > 0:
        out["images_per_sec"], out["rate_windows"] = len(rates) / sum(1 / r for r in rates), len(rates)
        if total_steps is not None and global_batch is not None and out["step"] is not None:
            out["eta_s"] = max(0, total_steps - out["step"]) * global_batch / out["images_per_sec"]
    return out


def complete_lines_backwards(path: Path, max_bytes: int, chunk: int = 2**20) -> Iterator[bytes]:
    """The complete lines (ended by a newline) of `path`, last first, from at most its last `max_bytes`: a line being
    appended (no newline yet) is left out, as is a line cut by the `max_bytes` limit. Nothing for a missing file."""
    try:
        f = open(path, "rb")  # noqa: SIM115  (closed below; a generator keeps it open between lines)
    except OSError:
        return
    with f:
        pos = f.seek(0, os.SEEK_END)
        start = max(0, pos - max_bytes)
        buf, tail_cut = b"", False
        while pos > start:
            size = min(chunk, pos - start)
            pos -= size
            f.seek(pos)
            buf = f.read(size) + buf
            if not tail_cut:  # what follows the file's last newline is a line still being written
                if (cut := buf.rfind(b"\n")) < 0:
                    continue
                buf, tail_cut = buf[:cut], True
            lines = buf.split(b"\n")
            buf = lines.pop(0) if pos > 0 else b""  # the first may begin before `pos`
            yield from (line for line in reversed(lines) if line)
        if pos == 0 and buf:
            yield buf


def checkpoints(ckpt_dir: Path, *, alive: bool) -> dict:
    """Each tag folder (step, state, bytes on disk), what `latest` says, and the bytes of everything under
    checkpoints/. A folder without its completion marker is "being written" while the run lives (the newest one),
    else "partial"; one whose files disagree with its marker is "incomplete"."""
    folders = tag_folders(ckpt_dir)
    listed = []
    for number, (step, folder) in enumerate(folders):
        problem = why_incomplete(folder)
        if problem is not None and not folder.is_dir():  # pruned meanwhile
            continue
        if problem is None:
            state = "complete"
        elif problem.startswith("no completeness marker"):
            state = "being written" if alive and number == len(folders) - 1 else "partial"
        else:
            state = "incomplete"
        listed.append({"tag": folder.name, "step": step, "state": state, "why": problem, "bytes": _bytes(folder)})
    latest = None
    with contextlib.suppress(OSError, UnicodeDecodeError):
        latest = (ckpt_dir / "latest").read_text().strip()
    named = read_latest(ckpt_dir)
    return {
        "checkpoints": listed,
        "checkpoint_bytes": _bytes(ckpt_dir),
        "latest": named,
        "latest_torn": latest is not None and named is None,
    }


def resume_choice(ckpt_dir: Path, *, verify: bool) -> dict:
    """The checkpoint a relaunch resumes from, with what the resume prints when it does not take `latest` (`note`:
    its lines, as it prints them). Without `verify`: `choose_resume`, the choice itself (markers and file sizes, no
    file read). With it: the resume's `resumable_tag`, which also reads each candidate's files back in full and
    passes over a damaged one."""
    if verify:
        from core.engine.checkpoint import resumable_tag  # torch: only for --verify, keeping a status quick

        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            tag = resumable_tag(ckpt_dir)
        note = printed.getvalue().strip() or None
    else:
        tag, note = choose_resume(ckpt_dir)
    step = None if tag is None else saved_step(ckpt_dir / tag)
    return {"tag": tag, "step": step, "note": note, "verified": verify}


def export_info(export_dir: Path) -> dict | None:
    """The export's manifest (its step, method, size, when written; fine-tuning's metrics) and its files."""
    manifest = _read_json(export_dir / MANIFEST_NAME)
    if manifest is None:
        return None
    keys = ("step", "method", "kind", "mode", "num_params", "num_tensors", "created", "metrics", "source")
    out = {key: manifest[key] for key in keys if key in manifest}
    out["not_exported"] = len(manifest.get("not_exported", []))
    with contextlib.suppress(OSError):
        out["files"] = {p.name: p.stat().st_size for p in sorted(export_dir.iterdir()) if p.is_file()}
    return out


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _bytes(path: Path) -> int:
    """Bytes of the files under `path`; a file removed meanwhile (a prune) counts nothing."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(folder, name)).st_size
    return total


def main(argv: list[str] | None = None) -> int:
    """Print the status of RUN_DIR. Returns 0, or `EXIT_NOT_A_RUN` (one line on stderr) for a path that is not one."""
    parser = argparse.ArgumentParser(prog="mimpipe status", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the screen")
    parser.add_argument("--verify", action="store_true", help="read the resume checkpoint's files back in full")
    args = parser.parse_args(argv)
    try:
        status = read_status(args.run_dir, verify=args.verify)
    except ValueError as err:
        print(f"mimpipe status: {err}", file=sys.stderr)
        if args.json:
            print(json.dumps({"run_dir": str(args.run_dir), "error": str(err)}))
        return EXIT_NOT_A_RUN
    print(json.dumps(status, indent=2) if args.json else render(status), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(quiet_on_closed_pipe(main))  # `| head -1`: no traceback, exit code 141 (core/compat/closed_pipe.py)
