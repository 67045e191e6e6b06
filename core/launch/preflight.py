"""Pre-flight: what launch.sh checks (through core/launch/check.py) before any process starts, so that bad input stops
with one line naming the recipe key and the file instead of a traceback from every rank minutes later.

Checked here for every stage: `engine.device` can run here (no silent CPU fallback on a node whose GPUs torch
cannot use); `engine.precision` suits the machine (`auto` made concrete, bf16 refused on a GPU without it);
`run_dir` can be created and written, and no live launch holds its lease (core/launch/lease.py); every data split
the stage reads resolves to shards, and the first sample of its first local shard has an image field (and, for
fine-tuning, a label `data.decode.read_label` can read); a schedule in epochs has a sample count; an evaluation
split has a shard for every rank (each rank reads its own, `make_eval_loader`); a relaunch into a run_dir whose
checkpoint (the one its resume would load) another config wrote is refused, and one into a finished run is found
(core/launch/rundir.py).
Each stage adds its own checks (pretrain/preflight.py, finetune/preflight.py), handed in by
core/entry/launch_check.py as `StageChecks`: `check(cfg, findings, world_size)`
(`model.init`, `distill.teacher` and the labels' range for fine-tuning, the tokenizer target and the kNN sets for
pretraining) and `resolve(cfg)` (what the entry point completes before comparing configs).

It imports only what it checks: torch, timm or webdataset only where a stage's check needs them (a fine-tuning's
`model.init`, a brace pattern's expansion), so that a pretraining launch's check takes well under a second. Room for
the checkpoints is checked by rank 0 before its engine (core/launch/disk.py), where the objective is at hand.

Only the first sample of one shard per split is read. Remote shards (`http(s)://`, `s3://`, `pipe:`) are not
opened: that would mean a download or running a command at launch; they fail inside the ranks, naming the shard.
"""

from __future__ import annotations

import os
import shlex
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from core.launch.gpus import cuda_unusable
from core.launch.lease import in_use_by
from core.launch.precision import PrecisionChoice, choose_precision, launch_machine
from core.launch.rundir import Relaunch, relaunch, resumed_checkpoint
from core.recipe.config import Config, ConfigError
from data.decode import IMAGE_FIELDS, LabelError, image_field, read_label
from data.index import shard_samples
from data.specs import dataset_size, describe_shards, is_mixture, resolve_shards

_LABEL_FIELDS = frozenset({"cls", "json"})


@dataclass(frozen=True)
class Problem:
    """One failed check: the recipe key, and what is wrong with the file it names."""

    key: str
    message: str

    def line(self) -> str:
        """`key: message` on one line (a multi-line message is joined)."""
        return f"{self.key}: {' '.join(self.message.split())}"


@dataclass
class Findings:
    """What the checks found: problems (launch refused) and what passed (printed with the plan)."""

    problems: list[Problem] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """What runs, but not as well as it could (printed with the plan)."""
    notes: list[str] = field(default_factory=list)
    """What the launch takes that the recipe does not say, e.g. `model.init`'s architecture (a line each, with the
    plan)."""
    precision: PrecisionChoice | None = None
    """The precision the launch trains in and why (`check_precision`)."""
    relaunch: Relaunch = field(default_factory=Relaunch)
    """What launching into run_dir does: a fresh run, a resume (with the settings it changes), or nothing (finished)."""

    def fail(self, key: str, message: str, file: str | Path | None = None) -> None:
        """Record a problem with `key`; `file` is put in front of the message unless the message names it."""
        if file is not None and str(file) not in message:
            message = f"{file}: {message}"
        self.problems.append(Problem(key, message))

    def ok(self, note: str) -> None:
        self.passed.append(note)

    def note(self, line: str) -> None:
        self.notes.append(line)


@dataclass(frozen=True)
class StageChecks:
    """A stage's own launch-time checks (see the module docstring)."""

    check: Callable[[Config, Findings, int], None]
    resolve: Callable[[Config], None]


def preflight(
    cfg: Config,
    stage: StageChecks,
    *,
    world_size: int = 1,
    allow_change: bool = False,
    take_over: bool = False,
    owner_check: bool = True,
) -> Findings:
    """Run every check for `cfg`.

    Args:
        cfg: The launch's config.
        stage: The checks of the stage the recipe runs.
        world_size: Processes the launch will have.
        allow_change: `--allow-config-change` was passed (see core/launch/rundir.py).
        take_over: `--take-over-run-dir` was passed (see core/launch/lease.py).
        owner_check: Check run_dir's lease: false on a node other than node 0 (see `check_lease`).
    """
    findings = Findings()
    check_device(cfg.engine.device, findings)
    check_precision(cfg, findings)
    check_run_dir(cfg.run_dir, findings)
    if owner_check:
        check_lease(cfg.run_dir, findings, take_over=take_over)
    labels = cfg.stage == "finetune" and cfg.objective.kind == "classification"  # others read images (and masks)
    resolved = {
        key: check_split(key, spec, cfg.data.label_field, labels, findings, num_ranks=world_size if is_eval else 1)
        for key, spec, is_eval in shard_specs(cfg)
    }
    if all(ok for key, ok in resolved.items() if key.startswith("data.train")):
        check_epochs(cfg, findings)
    stage.check(cfg, findings, world_size)
    findings.relaunch = check_relaunch(cfg, stage.resolve, findings, allow_change=allow_change)
    return findings


def shard_specs(cfg: Config) -> list[tuple[str, str | list[str], bool]]:
    """(recipe key, shard spec, whether every rank evaluates on its own shards of it) of every data split the stage
    reads: `data.train`, and `data.val` for fine-tuning (the only stage that evaluates on it; the kNN monitor's sets
    are pretrain/preflight.py's). The one place that knows where splits live in the recipe."""
    if cfg.data.is_mixture:
        specs = [(f"data.train[{i}].shards", source.shards, False) for i, source in enumerate(cfg.data.train)]
    else:
        specs = [("data.train", cfg.data.train, False)]
    if cfg.stage == "finetune" and cfg.data.val:
        specs.append(("data.val", cfg.data.val, True))
    return specs


def check_split(
    key: str,
    spec: str | list[str],
    label_field: str | None,
    needs_label: bool,
    findings: Findings,
    *,
    num_ranks: int = 1,
) -> bool:
    """The split resolves to shards, at least `num_ranks` of them (an evaluation split: every rank reads its own), and
    the first sample of its first local shard holding one has an image field and, when `needs_label`, a readable
    label. Returns whether the shards resolved."""
    if not spec:
        findings.fail(key, "not set: give a shard directory, a brace pattern, a glob or a list of shards")
        return False
    try:
        shards = resolve_shards(spec)
    except (ValueError, OSError) as err:  # a missing shard or index, an unreadable index.json
        findings.fail(key, str(err), file=describe_spec(spec))
        return False
    if len(shards) < num_ranks:
        findings.fail(
            key,
            f"{len(shards)} shards for {num_ranks} ranks: evaluation gives every rank shards of its own (at least 1 "
            "each); write the split in smaller shards (python -m data write --shard-size) or launch fewer processes",
            file=describe_spec(spec),
        )
        return True
    local = [shard for shard in shards if os.path.isfile(shard)]  # resolve_shards checked that every local one exists
    if not local:
        findings.ok(f"{key}: {len(shards)} remote shards, not opened")
        return True
    for shard in local:
        try:
            sample = first_sample(shard)
        except ValueError as err:  # shard_samples: 'cannot read shard ...: why'
            findings.fail(key, f"not a readable tar file ({err})", file=shard)
            return True
        if sample is not None:
            break
    else:
        findings.fail(key, f"its {len(local)} local shards hold no samples", file=describe_spec(spec))
        return True
    check_sample(key, sample, label_field, needs_label, findings)
    return True


def first_sample(shard: str) -> dict | None:
    """The first sample of a local tar shard (its fields, `__key__`, `__url__`; only a label's bytes are read), or
    None when it is empty."""
    samples = shard_samples(shard, _LABEL_FIELDS)
    try:
        return next(samples, None)
    finally:
        samples.close()


def check_sample(key: str, sample: dict, label_field: str | None, needs_label: bool, findings: Findings) -> None:
    """The sample has an image field and, when `needs_label`, a label in `.cls` or `label_field` of its `.json`."""
    shard, name = sample["__url__"], sample["__key__"]
    fields = sorted(k for k in sample if not k.startswith("__"))
    found = image_field(sample)
    if found is None:
        wanted = f"{', '.join(IMAGE_FIELDS)}, any case"
        findings.fail(key, f"first sample {name} has no image field ({wanted}); it has {', '.join(fields)}", file=shard)
        return
    if needs_label:
        try:
            read_label(sample, label_field)
        except LabelError as err:
            findings.fail(key, str(err), file=shard)
            return
    label = " and a label" if needs_label else ""
    findings.ok(f"{key}: first sample of {os.path.basename(shard)} has .{found}{label}")


def check_epochs(cfg: Config, findings: Findings) -> None:
    """A schedule in epochs needs the samples in an epoch: `data.samples_per_epoch`, or index.json counts."""
    s = cfg.schedule
    key = "schedule.epochs" if s.epochs is not None else "schedule.warmup_epochs"
    if (s.epochs is None and s.warmup_epochs is None) or cfg.data.samples_per_epoch:
        return
    try:
        cfg.steps(dataset_size(cfg.data.train))
    except ConfigError as err:
        spec = cfg.data.train if isinstance(cfg.data.train, str) else "SPEC"
        hint = "" if "python -m data index" in str(err) else f"; `python -m data index {shlex.quote(spec)}` writes one"
        findings.fail(key, f"{describe_spec(cfg.data.train)}: {err}{hint}")


def check_device(device: str, findings: Findings) -> None:
    """`engine.device` can run here: `cuda` has a GPU, and `auto` does not fall back to the CPU on a node whose GPUs
    torch cannot use (core/launch/gpus.py)."""
    problem = cuda_unusable(device)
    if problem is not None:
        findings.fail("engine.device", problem)


def check_precision(cfg: Config, findings: Findings) -> None:
    """`engine.precision` suits the machine the launch trains on (core/launch/precision.py): `auto` is made concrete in
    `cfg` (the plan says which and why, and a relaunch compares the choice with its checkpoint's), bf16 on a GPU
    without it is refused, bf16 on a CPU without native bf16 warned about."""
    choice = choose_precision(cfg.engine.precision, launch_machine(cfg.engine.device))
    if choice.problem is not None:
        findings.fail("engine.precision", choice.problem)
        return
    if choice.warning is not None:
        findings.warnings.append(choice.warning)
    cfg.engine.precision = choice.precision
    findings.precision = choice


def check_run_dir(run_dir: str, findings: Findings) -> None:
    """`run_dir` exists as a writable folder, or its nearest existing parent is one (nothing is created)."""
    path = existing = Path(run_dir)
    try:
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir():
            findings.fail("run_dir", f"cannot be created: {existing} is a file", file=path)
            return
        with tempfile.TemporaryFile(dir=existing):  # a real write: catches read-only mounts, also as root
            pass
    except OSError as err:
        findings.fail("run_dir", f"not writable: cannot write in {existing} ({err.strerror or err})", file=path)
        return
    findings.ok("run_dir writable")


def check_lease(run_dir: str, findings: Findings, *, take_over: bool) -> None:
    """No live launch holds `run_dir` (core/launch/lease.py). A stale or gone lease passes: the stage takes it over
    with a warning. Only the launch's one pre-flight, or node 0's, checks: another node cannot see a process of node 0
    gone, so it could refuse a relaunch that node 0 lets through, which would then wait for it at the rendezvous; rank
    0 decides for every node at the stage's start anyway. Every node's pre-flight ends before torchrun starts a rank,
    so none sees its own launch's lease."""
    try:
        refusal = in_use_by(run_dir, take_over=take_over)
    except OSError:  # run_dir unreadable: check_run_dir says so
        return
    if refusal is not None:
        findings.fail("run_dir", refusal)


def describe_spec(spec: str | list[str]) -> str:
    """A shard spec as it appears in a message: the string, the first and last of a list, or a mixture's sources."""
    if isinstance(spec, str):
        return spec
    if is_mixture(spec):
        return "; ".join(describe_spec(source.shards) for source in spec)
    return describe_shards(spec)


def check_relaunch(cfg: Config, resolve, findings: Findings, *, allow_change: bool) -> Relaunch:
    """A launch into a run_dir that holds a checkpoint (core/launch/rundir.py): refused when another config wrote it
    (unless `allow_change`); found finished when it reached this schedule's end. `resolve` completes the config as the
    entry point will before comparing it."""
    if resumed_checkpoint(cfg.run_dir) is None:
        return Relaunch()
    resolved = cfg.model_copy(deep=True)
    try:
        resolve(resolved)
    except ValueError:  # model.init unreadable: its own check says so
        return Relaunch()
    try:
        total_steps, _ = resolved.steps(resolved.data.samples_per_epoch or dataset_size(resolved.data.train))
    except (ConfigError, ValueError, OSError):  # the data checks say why; without a length the run is not finished
        total_steps = None
    verdict = relaunch(resolved, total_steps, allow_change=allow_change)
    refusal = verdict.refusal(cfg.run_dir)
    if refusal is not None:
        findings.fail("run_dir", refusal)
    return verdict
