"""The files of `run_dir/checkpoints/`: tag folders `step_NNNNNNNN`, the completeness marker in each, the `latest`
pointer, and which checkpoint a run may resume from.

A tag folder is a checkpoint only once it holds its marker, `complete`: a JSON list of every file the ranks wrote
into it with its size, written by rank 0 after every rank has fsynced its own files (see core/engine/checkpoint.py
`save_checkpoint`). A folder without the marker, or one whose files no longer have the recorded sizes (a torn or
truncated file), is incomplete: never resumed, and removed by `prune`. A complete one whose files do not read back
whole (bit rot: `why_damaged`) is damaged: a resume passes over it to the newest one that reads back
(core/engine/checkpoint.py `find_resume`). The resume choice (`choose_resume`) is also what a relaunch is judged by
(core/launch/rundir.py: finished or not, and whose config), so that the check and the resume never disagree.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from collections.abc import Mapping
from pathlib import Path

LATEST = "latest"
COMPLETE = "complete"
"""The marker file of a complete checkpoint (see the module's doc)."""
_TAG = re.compile(r"step_(\d+)")


def tag_of(step: int) -> str:
    return f"step_{step:08d}"


def step_of(tag: str) -> int | None:
    """The step a tag folder's name gives, or None for a name that is not a tag (e.g. `step_1.old`)."""
    match = _TAG.fullmatch(tag)
    return int(match.group(1)) if match else None


def fsync_path(path: Path) -> None:
    """Make a file's contents durable, or for a directory the names created, replaced or removed in it (which a
    file's own fsync does not)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, text: str) -> None:
    """Write `path` through a temporary file, fsynced, then renamed over it and the rename fsynced: a reader sees
    the old content or the new one, never a part. The temporary file is removed when the write fails (a full disk)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def tag_folders(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Every tag folder in `ckpt_dir` as (step, path), by step number (`step_10` after `step_9` whatever the
    padding); names that do not parse are not tags and are left alone."""
    found = [(step_of(p.name), p) for p in ckpt_dir.glob("step_*") if p.is_dir()] if ckpt_dir.is_dir() else []
    return sorted((step, p) for step, p in found if step is not None)


def write_marker(tag_dir: Path, files: dict[str, int]) -> None:
    """Mark `tag_dir` complete, listing `files` ({name: bytes}); the folder itself is fsynced first, so that every
    name the marker lists is durable before the marker is."""
    fsync_path(tag_dir)
    atomic_write(tag_dir / COMPLETE, json.dumps({"files": files}, sort_keys=True))


def marked_files(tag_dir: Path) -> dict[str, int] | None:
    """{name: bytes} of a complete checkpoint's marker; None without a readable marker."""
    try:
        return dict(json.loads((tag_dir / COMPLETE).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def why_incomplete(tag_dir: Path) -> str | None:
    """None for a complete checkpoint whose files all have the sizes its marker lists; else what is wrong."""
    files = marked_files(tag_dir)
    if files is None:
        return "no completeness marker (a save that did not finish)"
    for name, size in sorted(files.items()):
        try:
            actual = (tag_dir / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, {size} were written"
    return None


def checkpoint_files(tag_dir: Path) -> list[str]:
    """The names of a checkpoint's files, sorted: those its marker lists, or every file of a folder written before
    markers existed."""
    files = marked_files(tag_dir)
    return sorted(files) if files is not None else sorted(p.name for p in tag_dir.iterdir() if p.is_file())


def why_damaged(tag_dir: Path, names: list[str]) -> str | None:
    """None when each of `names` in `tag_dir` reads back whole, else what is wrong with the first that does not.

    A DeepSpeed or torch file (`.pt`, a zip archive) must match the CRC-32 recorded for each of its records, a JSON
    file must parse. This reads the files in full; `torch.load` itself checks no CRC, so a flipped bit in a tensor
    would load without a word.
    """
    for name in names:
        path = tag_dir / name
        try:
            if name.endswith(".json"):
                json.loads(path.read_text())
            elif name.endswith(".pt"):
                with zipfile.ZipFile(path) as archive:
                    record = archive.testzip()
                if record is not None:
                    return f"{name} is damaged: its record {record} fails its CRC-32 check"
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            return f"{name} is damaged: {err}"
    return None


def checkpoint_bytes(tag_dir: Path) -> int | None:
    """What a complete checkpoint holds on disk, from its marker (no walk over the files)."""
    files = marked_files(tag_dir)
    return None if files is None else sum(files.values())


def read_latest(ckpt_dir: Path) -> str | None:
    """The tag `latest` names; None when there is no `latest` or it holds no whole tag name as `tag_of` writes it
    (empty, torn, or cut short: `step_000` is a truncated `step_00000006`, not step 0)."""
    try:
        tag = (ckpt_dir / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    step = step_of(tag)
    return tag if step is not None and tag == tag_of(step) else None


def choose_resume(ckpt_dir: Path, damaged: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """The checkpoint a run resumes from: the one `latest` names when it is complete, else the newest complete one.
    `damaged` ({tag: what is wrong}) names checkpoints found not to read back (`why_damaged`): never chosen.

    Returns:
        (tag or None for a fresh run, a console line when it fell back from `latest`, else None).
    """
    damaged = damaged or {}

    def why_not(tag_dir: Path) -> str | None:
        return damaged.get(tag_dir.name) or why_incomplete(tag_dir)

    latest = read_latest(ckpt_dir)
    if latest is not None and why_not(ckpt_dir / latest) is None:
        return latest, None
    folders = tag_folders(ckpt_dir)
    legacy = not any((p / COMPLETE).exists() for _, p in folders)  # written before markers existed
    if latest is not None and latest not in damaged and (ckpt_dir / latest).is_dir() and legacy:
        return latest, None  # `latest` was only ever moved to a finished save
    if latest is not None:
        problem = f"{ckpt_dir / LATEST} names {latest}, which cannot be loaded: {why_not(ckpt_dir / latest)}"
    elif (ckpt_dir / LATEST).exists():
        problem = f"{ckpt_dir / LATEST} is unreadable or names no checkpoint"
    else:
        problem = f"{ckpt_dir / LATEST} is missing"
    complete = [p for _, p in reversed(folders) if p.name != latest and why_not(p) is None]
    if not complete:
        if latest is None and not (ckpt_dir / LATEST).exists():
            return None, None  # a fresh run
        return None, f"[mimpipe] warning: {problem}, and no other checkpoint is complete; starting from scratch"
    return complete[0].name, f"[mimpipe] warning: {problem}; resuming from {complete[0]}, the newest complete one"


def prune(ckpt_dir: Path, keep_last: int, keep: set[str]) -> list[str]:
    """Remove the complete checkpoints older than the `keep_last` newest (by step) and every incomplete folder, but
    never a tag in `keep` (the one just written, the one `latest` names). Rank 0, after every rank has finished
    the save (no folder is being written). Returns the names removed."""
    folders = tag_folders(ckpt_dir)
    complete = [p for _, p in folders if why_incomplete(p) is None]
    old = {p.name for p in complete[:-keep_last]}
    stale = {p.name for _, p in folders if p not in complete}
    removed = sorted((old | stale) - keep)
    for name in removed:
        shutil.rmtree(ckpt_dir / name, ignore_errors=True)
    return removed
