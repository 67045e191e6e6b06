"""Pre-flight: what launch.sh checks (through core/launch.py) before any process starts, so that bad input stops
with one line naming the recipe key and the file instead of a traceback from every rank minutes later.

Checked here for every stage: `engine.device` can run here (no silent CPU fallback on a node whose GPUs torch
cannot use); `run_dir` can be created and written; every data split the stage reads resolves to shards, and the
first sample of its first local shard has an image field (and, for fine-tuning, a label `data.decode.read_label` can
read); a schedule in epochs has a sample count. Each stage package adds its own checks in
`<stage module>/preflight.py` (`check(cfg, findings)`): `model.init` and `distill.teacher` for fine-tuning, the
tokenizer target for BEiT-style pretraining.

Only the first sample of one shard per split is read. Remote shards (`http(s)://`, `s3://`, `pipe:`) are not
opened: that would mean a download or running a command at launch; they fail inside the ranks, naming the shard.
"""

from __future__ import annotations

import importlib
import os
import shlex
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import webdataset as wds

from core.config import Config, ConfigError
from core.gpus import cuda_unusable
from data.decode import IMAGE_FIELDS, LabelError, image_field, read_label
from data.specs import dataset_size, describe_shards, is_mixture, resolve_shards


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

    def fail(self, key: str, message: str, file: str | Path | None = None) -> None:
        """Record a problem with `key`; `file` is put in front of the message unless the message names it."""
        if file is not None and str(file) not in message:
            message = f"{file}: {message}"
        self.problems.append(Problem(key, message))

    def ok(self, note: str) -> None:
        self.passed.append(note)


def preflight(cfg: Config, stage_module: str) -> Findings:
    """Run every check for `cfg`; `stage_module` is the package launch.sh starts (pretrain or finetune), whose
    `preflight.check` adds the stage's own checks."""
    findings = Findings()
    check_device(cfg.engine.device, findings)
    check_run_dir(cfg.run_dir, findings)
    labels = cfg.stage == "finetune"  # pretraining reads images only
    resolved = {key: check_split(key, spec, cfg.data.label_field, labels, findings) for key, spec in shard_specs(cfg)}
    if all(ok for key, ok in resolved.items() if key.startswith("data.train")):
        check_epochs(cfg, findings)
    importlib.import_module(f"{stage_module}.preflight").check(cfg, findings)
    return findings


def shard_specs(cfg: Config) -> list[tuple[str, str | list[str]]]:
    """(recipe key, shard spec) of every data split the stage reads: `data.train`, and `data.val` for fine-tuning
    (the only stage that evaluates). The one place that knows where splits live in the recipe."""
    if cfg.data.is_mixture:
        specs = [(f"data.train[{i}].shards", source.shards) for i, source in enumerate(cfg.data.train)]
    else:
        specs = [("data.train", cfg.data.train)]
    if cfg.stage == "finetune" and cfg.data.val:
        specs.append(("data.val", cfg.data.val))
    return specs


def check_split(
    key: str, spec: str | list[str], label_field: str | None, needs_label: bool, findings: Findings
) -> bool:
    """The split resolves to shards, and the first sample of its first local shard holding one has an image field
    and, when `needs_label`, a readable label. Returns whether the shards resolved."""
    if not spec:
        findings.fail(key, "not set: give a shard directory, a brace pattern, a glob or a list of shards")
        return False
    try:
        shards = resolve_shards(spec)
    except (ValueError, OSError) as err:  # a missing shard or index, an unreadable index.json
        findings.fail(key, str(err), file=describe_spec(spec))
        return False
    local = [shard for shard in shards if os.path.isfile(shard)]  # resolve_shards checked that every local one exists
    if not local:
        findings.ok(f"{key}: {len(shards)} remote shards, not opened")
        return True
    for shard in local:
        try:
            sample = first_sample(shard)
        except (tarfile.TarError, OSError, ValueError) as err:
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
    """The first sample of a local tar shard (fields of bytes, `__key__`, `__url__`), or None when it is empty."""
    samples = wds.tarfile_samples([{"url": shard}])
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
    torch cannot use (core/gpus.py)."""
    problem = cuda_unusable(device)
    if problem is not None:
        findings.fail("engine.device", problem)


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


def describe_spec(spec: str | list[str]) -> str:
    """A shard spec as it appears in a message: the string, the first and last of a list, or a mixture's sources."""
    if isinstance(spec, str):
        return spec
    if is_mixture(spec):
        return "; ".join(describe_spec(source.shards) for source in spec)
    return describe_shards(spec)
