"""A run_dir is one run: what a relaunch into it may do (docs/run_dir.md).

A relaunch is judged by the checkpoint its resume would load (core/launch/ckpt_files.py `choose_resume`: the one
`latest` names when it is complete, else the newest complete one, as for a torn or truncated `latest`), which holds
the config that wrote it (`checkpoints/<tag>/config.yaml`). A relaunch whose resolved config differs from it only in
`MAY_CHANGE` keys resumes with the new values (listed on one line); any other difference is refused, before any
process starts (launch.sh's pre-flight, core/launch/check.py) and again by the stage entry point (rank 0 decides, see
core/engine/run.py), unless the launch passes `--allow-config-change`. A run that reached the end of its schedule and
exported leaves `finished.json`: relaunching it with the same schedule does nothing (exit 0) when that checkpoint is
the finished step's; a longer one continues it. The first launch's config is `config.yaml`, each later launch's goes
to `configs/launch_NNNN.yaml`, so that none is overwritten.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from core.launch.ckpt_files import choose_resume
from core.recipe.config import Config
from core.recipe.tree import flatten

ALLOW_FLAG = "--allow-config-change"
"""The launch.sh / entry point flag that resumes a run_dir whatever its checkpoint's config says."""

FINISHED = "finished.json"
"""Written by rank 0 after a stage's last step and its export: {"step": N, "tag": "step_0000000N"}."""

MAY_CHANGE = {
    "schedule.steps": "schedule length",
    "schedule.epochs": "schedule length",
    "logging.every_steps": "logging cadence",
    "logging.image_every_steps": "logging cadence",
    "logging.tensorboard": "logging",
    "logging.wandb.enabled": "logging",
    "logging.wandb.mode": "logging",
    "logging.wandb.project": "logging",
    "logging.wandb.entity": "logging",
    "logging.wandb.name": "logging",
    "logging.wandb.dir": "logging",
    "checkpoint.every_steps": "checkpoint cadence",
    "checkpoint.keep_last": "checkpoints kept",
    "checkpoint.export_at_end": "export",
    "checkpoint.lease_timeout_s": "how long a silent launch keeps run_dir",
    "eval.every_steps": "evaluation cadence",
    "eval.knn.every_steps": "evaluation cadence",
    "data.num_workers": "data workers",
    "engine.grad_accum_steps": "keeps the global batch at another world size",
    "engine.sync_every_steps": "host reads only; the updates are the same",
    "engine.max_consecutive_nonfinite": "when to stop; the updates are the same",
    "engine.peak_tflops": "perf/mfu's denominator only",
    "engine.spike_factor": "when to roll back; the updates are the same",
    "engine.spike_window": "when to roll back; the updates are the same",
    "engine.max_rollbacks": "when to stop; the updates are the same",
    "data.read_timeout_s": "how long a shard read may wait (storage)",
    "data.read_retries": "how often a shard read is tried (storage)",
    "data.read_backoff_s": "the wait between tries of a shard read (storage)",
    "data.max_skipped_shard_fraction": "when to stop on failing storage",
    "data.loader_timeout_s": "how long a rank waits for a batch",
}
"""Keys a resumed run may change (the value says why it is safe): they change how long the run is, how often it
logs, saves and evaluates, and how it is fed, never what a step computes from its batch. Everything else (the model,
the objective, the optimizer and its learning rate, the data and its order, precision, ZeRO stage, seed, warmup)
needs `--allow-config-change`. `run_dir` itself is not compared: a copied or moved run is the same run."""

NOT_COMPARED = ("run_dir",)


@dataclass(frozen=True)
class Change:
    """One key whose value differs between the checkpoint's config and this launch's."""

    key: str
    old: Any
    new: Any

    def describe(self) -> str:
        return f"{self.key}: {_show(self.old)} -> {_show(self.new)}"


@dataclass(frozen=True)
class Checkpointed:
    """What the checkpoint a resume would load says: its tag, the step it holds, and the config that wrote it (None
    when it has no config.yaml: a torn save in a run_dir from before completeness markers, resumed as `latest`)."""

    tag: str
    step: int
    config_yaml: str | None


@dataclass
class Relaunch:
    """What launching `cfg` into its run_dir does.

    Attributes:
        checkpoint: The checkpoint a resume would load there (`resumed_checkpoint`), or None (a fresh run).
        applied: Differences in `MAY_CHANGE` keys: resumed with the new values.
        refused: Other differences: the launch is refused unless `allowed`.
        allowed: `--allow-config-change` was passed.
        finished: The run reached the end of this schedule and exported: nothing to do.
    """

    checkpoint: Checkpointed | None = None
    applied: list[Change] = field(default_factory=list)
    refused: list[Change] = field(default_factory=list)
    allowed: bool = False
    finished: bool = False

    def refusal(self, run_dir: str | Path) -> str | None:
        """The one line refusing the launch (without a prefix), or None when it may go on."""
        if not self.refused or self.allowed:
            return None
        tag = self.checkpoint.tag
        return (
            f"{run_dir} holds a run of another config (checkpoints/{tag}; {_list(self.refused)}); pass "
            f"run_dir=NEW_DIR to start a new run, or {ALLOW_FLAG} to continue this one with the new config"
        )

    def notes(self, run_dir: str | Path) -> list[str]:
        """One line for each thing the resume changes or finds (none for a fresh run or an unchanged resume)."""
        notes = []
        if self.applied:
            notes.append(f"resuming {run_dir} with changed settings: {_list(self.applied)}")
        if self.refused and self.allowed:
            notes.append(f"resuming {run_dir} with another config ({ALLOW_FLAG}): {_list(self.refused)}")
        if self.finished:
            ckpt = self.checkpoint
            notes.append(
                f"{run_dir} holds a finished run (step {ckpt.step}, checkpoints/{ckpt.tag}, exported): nothing to do; "
                "lengthen the schedule (schedule.steps / schedule.epochs) to continue it, or pass run_dir=NEW_DIR to "
                "start a new run"
            )
        return notes


def resumed_checkpoint(run_dir: str | Path) -> Checkpointed | None:
    """The checkpoint a resume would load (`choose_resume`: `latest` when it names a complete one, else the newest
    complete one, as for a torn `latest`), or None when the resume would start from scratch. The resume reads its
    files back in full first (core/engine/checkpoint.py `resumable_tag`); this reads its marker and file sizes only."""
    ckpt_dir = Path(run_dir) / "checkpoints"
    if not ckpt_dir.is_dir():  # also when run_dir is not a folder (pre-flight reports that)
        return None
    tag, _ = choose_resume(ckpt_dir)  # the resume prints the line saying why it is not `latest`'s
    if tag is None:
        return None
    config = ckpt_dir / tag / "config.yaml"
    return Checkpointed(tag, saved_step(ckpt_dir / tag), config.read_text() if config.is_file() else None)


def saved_step(tag_dir: Path) -> int:
    """The step a checkpoint holds: rank 0's train state, else the number in its tag (`step_00000006`)."""
    try:
        saved = json.loads((tag_dir / "rank_00000.json").read_text())
        return int((saved.get("train") or saved)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return int(tag_dir.name.rpartition("_")[2]) if tag_dir.name.rpartition("_")[2].isdigit() else 0


def config_changes(saved_yaml: str, cfg: Config) -> list[Change]:
    """The keys in which the config a checkpoint saved differs from `cfg`, in the order of `cfg`'s keys.

    The saved config is read through today's schema first, so a key added since it was written counts at its
    default (no difference when `cfg` keeps the default). A saved config the schema no longer accepts is one change,
    `(checkpoint config)`, whose old value is the schema's error.
    """
    new = flatten(cfg.model_dump(mode="json"))
    try:
        old = flatten(Config.model_validate(yaml.safe_load(saved_yaml) or {}).model_dump(mode="json"))
    except (ValidationError, yaml.YAMLError) as err:
        first = str(err).splitlines()[0:3]
        return [Change("(checkpoint config)", f"not valid today: {' '.join(first)}", "this launch's config")]
    keys = list(new) + [key for key in old if key not in new]
    missing = "(unset)"
    return [
        Change(key, old.get(key, missing), new.get(key, missing))
        for key in keys
        if key not in NOT_COMPARED and old.get(key, missing) != new.get(key, missing)
    ]


def relaunch(cfg: Config, total_steps: int | None, *, allow_change: bool = False) -> Relaunch:
    """What launching `cfg` into `cfg.run_dir` does (see `Relaunch`).

    Args:
        cfg: The resolved config of this launch.
        total_steps: Its schedule length in steps; None when unknown (then it is never `finished`).
        allow_change: `--allow-config-change` was passed.
    """
    checkpoint = resumed_checkpoint(cfg.run_dir)
    if checkpoint is None:
        return Relaunch()
    changes = [] if checkpoint.config_yaml is None else config_changes(checkpoint.config_yaml, cfg)
    done = finished_step(cfg.run_dir)
    return Relaunch(
        checkpoint=checkpoint,
        applied=[c for c in changes if c.key in MAY_CHANGE],
        refused=[c for c in changes if c.key not in MAY_CHANGE],
        allowed=allow_change,
        finished=total_steps is not None and done == checkpoint.step and total_steps <= checkpoint.step,
    )


def finished_step(run_dir: str | Path) -> int | None:
    """The step at which the run last finished (its `finished.json`), or None."""
    try:
        return int(json.loads((Path(run_dir) / FINISHED).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def mark_finished(run_dir: str | Path, step: int, tag: str) -> None:
    """Record that the run finished at `step` (its last checkpoint `tag`) and exported (rank 0, after the export)."""
    _write_atomic(Path(run_dir) / FINISHED, json.dumps({"step": step, "tag": tag}) + "\n")


def keep_launch_config(run_dir: str | Path, config_yaml: str) -> Path:
    """Write this launch's config: `config.yaml` for the first launch, else the next `configs/launch_NNNN.yaml` (the
    second launch is 0002). Nothing is overwritten. Returns the file written."""
    run_dir = Path(run_dir)
    first = run_dir / "config.yaml"
    if not first.exists():
        _write_atomic(first, config_yaml)
        return first
    folder = run_dir / "configs"
    folder.mkdir(exist_ok=True)
    number = 2 + len(list(folder.glob("launch_*.yaml")))
    while True:
        path = folder / f"launch_{number:04d}.yaml"
        try:
            with open(path, "x") as f:  # exclusive: a launch never takes another's number
                f.write(config_yaml)
            return path
        except FileExistsError:
            number += 1


def _show(value: Any, limit: int = 60) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _list(changes: list[Change]) -> str:
    return ", ".join(change.describe() for change in changes)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
