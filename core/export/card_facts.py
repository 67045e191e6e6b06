"""What a model card says that only the run knows (core/export/card.py renders the card): the shards it read, as
their index.json describes them (shards, samples, source, Hub dataset), the schedule's length, what `model.init` was
(the method and step of the export it started from), and the monitors' last values in metrics.jsonl at the exported
step, read backwards from the file's end so that the cost does not grow with the run."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from core.export.hub import is_hub_spec
from core.export.manifest import MANIFEST_NAME
from core.recipe.config import Config, ConfigError
from data.specs import dataset_size, describe_shards, resolve_shards, split_index

MONITORS = ("train/loss", "knn/top1", "fewshot/top1_", "features/effective_rank", "val/top1", "val/miou")
"""metrics.jsonl keys whose last values the card lists; one ending in `_` stands for every key it starts."""
TAIL_BYTES = 32 * 2**20
"""How far from its end metrics.jsonl is read at most: reading stops once every monitor the recipe runs is found, so
the card costs the same however long the run."""
KNOWN_DATASETS = {
    "fashion-mnist": "zalando-datasets/fashion_mnist",
    "fashion-mnist-scenes": "zalando-datasets/fashion_mnist",  # scenes composed of its garments
}
"""index.json `source` (python -m data write --source) -> the Hub dataset it was made from. An index.json may also
name its Hub dataset itself in a `dataset` field."""


@dataclass
class DataSource:
    """One split or mixture source a run read, as its index.json describes it (None: not known here)."""

    role: str
    """"train", "train (weight 0.5)", "val"."""
    spec: str
    num_shards: int | None = None
    num_samples: int | None = None
    source: str | None = None
    """index.json's `source` and `split`, e.g. "fashion-mnist, split train"."""
    dataset: str | None = None
    """The Hub dataset id, when known (KNOWN_DATASETS, or index.json's `dataset`)."""


@dataclass
class InitFacts:
    """What `model.init` was: as the run's hand-off recorded it (run_dir/load_report.json), else as the init export's
    mimpipe.json says (a local folder; a Hub repo is not fetched for a card)."""

    spec: str
    """`model.init` as the recipe gives it."""
    checkpoint_format: str | None = None
    """core/export/read.py's format ("mimpipe-export", "mae-pretrain", "timm", ...), when known."""
    manifest: dict = field(default_factory=dict)
    """The init export's mimpipe.json without its recipe (method, step, mode, checkpoint_format, ...); {} for a file
    that is not an export of ours."""


@dataclass
class RunFacts:
    """What the card says that only the run's shards, hand-off record and metrics.jsonl know."""

    data: list[DataSource] = field(default_factory=list)
    total_steps: int | None = None
    monitors: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Key -> (step, value): the last logged at or before the exported step."""
    init: InitFacts | None = None
    """What `model.init` was (None: the recipe names none)."""


def run_facts(cfg: Config, *, run_dir: Path | None, step: int | None) -> RunFacts:
    """The data sources, schedule length, `model.init` and monitors' last values of a run (each left out when
    unreadable here)."""
    train = cfg.data.train
    sources = [(f"train (weight {s.weight:g})", s.shards) for s in train] if cfg.data.is_mixture else [("train", train)]
    if cfg.data.val:
        sources.append(("val", cfg.data.val))
    try:
        total_steps = cfg.steps(cfg.data.samples_per_epoch or dataset_size(train))[0]
    except (ConfigError, ValueError, OSError):  # epochs without a known size, shards not here
        total_steps = None
    monitors = {}
    if run_dir is not None:
        monitors = last_values(run_dir / "metrics.jsonl", expected_monitors(cfg), upto=step)
    init = init_facts(cfg.model.init, run_dir) if cfg.model.init else None
    return RunFacts([describe_source(role, spec) for role, spec in sources], total_steps, monitors, init)


def init_facts(spec: str, run_dir: Path | None) -> InitFacts:
    """What `spec` (a `model.init`) was: the run's hand-off record first (what was loaded, even when the init has been
    replaced since, and what a Hub repo or official file was), else the init export's mimpipe.json."""
    report = _read_json(run_dir / "load_report.json") if run_dir is not None else {}
    if report.get("checkpoint_format"):
        return InitFacts(spec, report["checkpoint_format"], _without_recipe(report.get("manifest") or {}))
    if not is_hub_spec(spec):
        manifest = _read_json(Path(spec) / MANIFEST_NAME)
        if manifest:
            return InitFacts(spec, "mimpipe-export", _without_recipe(manifest))
    return InitFacts(spec)


def _without_recipe(manifest: dict) -> dict:
    """A manifest less its recipe, and a converted export's run manifest reduced to its method."""
    slim = {k: v for k, v in manifest.items() if k not in ("config", "source_manifest")}
    run = manifest.get("source_manifest")
    if isinstance(run, dict) and run.get("method"):
        slim["source_manifest"] = {"method": run["method"]}
    return slim


def _read_json(path: Path) -> dict:
    """The JSON object in `path`; {} when it is missing, unreadable or not an object (a card never fails on it)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def describe_source(role: str, spec: str | list[str]) -> DataSource:
    """What index.json says about a split: shards, samples, source and Hub dataset (whatever is readable here)."""
    source = DataSource(role, spec if isinstance(spec, str) else describe_shards([str(s) for s in spec]))
    try:
        source.num_shards = len(resolve_shards(spec))
        source.num_samples = dataset_size(spec)
        index = split_index(spec)[1]
    except (ValueError, OSError, KeyError):  # remote or missing shards, an unreadable index
        return source
    name, split = index.get("source"), index.get("split")
    if name and name != "index":  # "index": written by `python -m data index`, which does not know the source
        source.source = f"written from {name}" + (f" (split {split})" if split else "")
    source.dataset = index.get("dataset") or KNOWN_DATASETS.get(name)
    return source


def expected_monitors(cfg: Config) -> tuple[str, ...]:
    """The monitors the recipe logs (reading metrics.jsonl stops once all are found)."""
    if cfg.stage != "pretrain":
        val = ("val/miou" if cfg.objective.kind == "segmentation" else "val/top1",) if cfg.data.val else ()
        return ("train/loss", *val)
    knn, features = cfg.eval.knn, cfg.eval.features
    return (
        "train/loss",
        *(("knn/top1",) if knn.enabled else ()),
        *(("fewshot/top1_",) if knn.enabled and knn.fewshot else ()),
        *(("features/effective_rank",) if features.enabled else ()),
    )


def last_values(path: Path, expected: tuple[str, ...], *, upto: int | None) -> dict[str, tuple[int, float]]:
    """The last (step, value) of each of `MONITORS` in metrics.jsonl at or before step `upto`, read backwards from
    its end until every `expected` one is found (at most `TAIL_BYTES`); a line cut short by a kill is skipped."""
    found: dict[str, tuple[int, float]] = {}
    seen = set()  # monitors found (a prefix monitor counts once, with every key of its last line)
    for line in _lines_backwards(path, TAIL_BYTES):
        if all(m in seen for m in expected):
            break
        wanted = [m for m in MONITORS if m not in seen and m.encode() in line]
        if not wanted:
            continue  # the common case, decided without parsing: a line of monitors already found
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if upto is not None and step > upto:
            continue
        for monitor in wanted:
            keys = [k for k in record if k.startswith(monitor)] if monitor.endswith("_") else [monitor]
            values = {k: record[k] for k in keys if isinstance(record.get(k), int | float)}
            if values:
                found |= {k: (step, float(v)) for k, v in values.items()}
                seen.add(monitor)
    return found


def _lines_backwards(path: Path, max_bytes: int, block: int = 2**20) -> Iterator[bytes]:
    """The non-empty lines of a file from its last, read in blocks from the end, at most `max_bytes` in all (a line
    cut by that limit is left out)."""
    try:
        f = open(path, "rb")  # noqa: SIM115  (closed in `finally`: the caller may stop early)
    except OSError:
        return
    try:
        pos = f.seek(0, os.SEEK_END)
        floor, tail = max(0, pos - max_bytes), b""
        while pos > floor:
            start = max(floor, pos - block)
            f.seek(start)
            lines = (f.read(pos - start) + tail).split(b"\n")
            pos = start
            tail = lines.pop(0) if pos > 0 else b""  # the end of a line that begins before this block
            yield from (line for line in reversed(lines) if line.strip())
    finally:
        f.close()
