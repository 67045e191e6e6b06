"""Representation quality (issue 14, `make bench-quality`): every pretraining objective of recipes/bench/ on the same
ViT and budget, then the same label-efficiency arms for each encoder and for the ViT from scratch.

    .venv/bin/python -m benchmarks.bench_quality                       # the full protocol: hours on 2 CPU cores
    .venv/bin/python -m benchmarks.bench_quality --objectives mae --scale 0.02      # a smoke run of minutes
    .venv/bin/python -m benchmarks.bench_quality --seeds 0,1 --objectives mae       # a second seed of one row

Per seed S and objective O: the VQ-VAE tokenizer (BEiT-style only), pretraining (recipes/bench/O.yaml, kNN monitor
on), then for O's export and for scratch: fine-tuning on 1% of the labels (60 per class, 300 steps x 64), 10% (600 per
class, 250 x 128) and all of them (400 x 128), and the L-BFGS linear probe (finetune/lbfgs_probe.py) on frozen cls
and mean-pooled features; test top-1 on the 10k test images. Each arm runs through `./launch.sh RECIPE overrides` as
a user runs it (the probe through `python -m finetune.lbfgs_probe`), in `ROOT/seed{S}/{encoder}/{arm}`, and leaves a
`bench_result.json` there (benchmarks/quality_report.py): an arm that has one is skipped, so a stopped run goes on
where it was (a pretraining stopped mid-way resumes from its last checkpoint). The label subsets are written once
(data/subset.py: the first N of each class in the training shards' order). `--scale` multiplies every step count
(and the kNN sets and the probe's training set) for a smoke run; the default 1 is the protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks.quality_report import (
    ENCODERS,
    RESULT_FILE,
    collect,
    encoders_in,
    objective_of,
    plot,
    render,
    summarise_run,
)
from benchmarks.smoke_measure import launch
from benchmarks.workers import arms_header, write_result
from core.recipe.config import load_config
from core.recipe.tree import flatten
from data.subset import write_per_class_subset

REPO = Path(__file__).resolve().parents[1]

BENCH = REPO / "recipes" / "bench"
RESULTS = REPO / "benchmarks" / "results" / "quality.md"
OBJECTIVES = tuple(e for e in ENCODERS if e != "scratch")
FINETUNE = {"ft_1pct": ("finetune_1pct", 60), "ft_10pct": ("finetune_10pct", 600), "ft_full": ("finetune_full", None)}
"""Fine-tuning arm -> (recipe in recipes/bench/, training images per class; None: all)."""
PROBE_TRAIN_SAMPLES = 60000
"""The probe fits on every training image (at `--scale` s: s x this, at least 2,000)."""


@dataclass(frozen=True)
class Arm:
    """One run of the protocol: a launched recipe, or the probe."""

    kind: str
    """"tokenizer", "pretrain", "finetune" or "probe" (see quality_report.summarise_run)."""
    run_dir: Path
    """ROOT/seed{S}/{encoder}/{arm}; its bench_result.json says it is done."""
    recipe: Path
    overrides: tuple[str, ...]
    requires: Path | None = None
    """An export an earlier arm writes; without it the arm is not run (that arm failed)."""

    @property
    def name(self) -> str:
        return "/".join(self.run_dir.parts[-3:])


def scale_overrides(recipe: Path, scale: float) -> list[str]:
    """Overrides that shrink a recipe's step counts (schedule, warmup, checkpoints, logging, the monitors) by `scale`,
    and the monitors' sets with them; none at scale 1."""
    if scale == 1:
        return []
    cfg = load_config(recipe)
    steps = max(2, round(cfg.schedule.steps * scale))

    def every(n: int) -> int:
        return max(1, min(steps, round(n * scale)))

    out = [
        f"schedule.steps={steps}",
        f"schedule.warmup_steps={min(steps - 1, round((cfg.schedule.warmup_steps or 0) * scale))}",
        f"checkpoint.every_steps={every(cfg.checkpoint.every_steps)}",
        f"logging.every_steps={every(cfg.logging.every_steps)}",
    ]
    knn = cfg.eval.knn
    if knn.enabled:
        out += [
            f"eval.knn.every_steps={every(knn.every_steps)}",
            f"eval.knn.bank.max_samples={max(knn.k, 1000, round(knn.bank.max_samples * scale))}",
            f"eval.knn.query.max_samples={max(500, round(knn.query.max_samples * scale))}",
        ]
    features = cfg.eval.features
    if features.enabled:  # as the kNN bank, so that a label-free monitor on the bank's images stays on them
        out += [
            f"eval.features.every_steps={every(features.every_steps)}",
            f"eval.features.max_samples={max(1000, round(features.max_samples * scale))}",
        ]
    return out


def write_label_subsets(shards: Path, subsets: Path) -> None:
    """The fine-tuning arms' label subsets (the first N of each class of the training shards), written once."""
    for _, per_class in (v for v in FINETUNE.values() if v[1]):
        out = subsets / f"train_{per_class}_per_class"
        if not (out / "index.json").is_file():
            write_per_class_subset(str(shards / "train"), str(out), per_class)


def plan(
    root: Path, *, objectives: list[str], seeds: list[int], shards: Path, subsets: Path, scale: float
) -> list[Arm]:
    """Every arm, in the order they run: per seed, scratch first, then each objective's pretraining and its arms."""
    data = {"train": shards / "train", "test": shards / "test"}
    arms = []
    for seed in seeds:
        base = root / f"seed{seed}"
        for encoder in ["scratch", *objectives]:
            export = base / encoder / "pretrain" / "export" if encoder != "scratch" else None
            if objective_of(encoder) == "beit":
                arms.append(launched_arm("tokenizer", base / encoder / "tokenizer", "tokenizer", seed, data, scale))
            if export is not None:
                arm = launched_arm("pretrain", export.parent, encoder, seed, data, scale)
                if objective_of(encoder) == "beit":
                    target = base / encoder / "tokenizer" / "export"
                    arm = Arm(
                        arm.kind, arm.run_dir, arm.recipe, (*arm.overrides, f"objective.target.path={target}"), target
                    )
                arms.append(arm)
            init = (f"model.init={export}",) if export else ()
            for name, (recipe, per_class) in FINETUNE.items():
                train = subsets / f"train_{per_class}_per_class" if per_class else data["train"]
                arm = launched_arm("finetune", base / encoder / name, recipe, seed, {**data, "train": train}, scale)
                arms.append(Arm(arm.kind, arm.run_dir, arm.recipe, (*arm.overrides, *init), export))
            max_train = max(2000, round(PROBE_TRAIN_SAMPLES * scale)) if scale < 1 else None
            probe_args = (*_data_overrides("finetune", data), f"seed={seed}", *init)
            probe_args += (f"--max-train={max_train}",) if max_train else ()
            arms.append(Arm("probe", base / encoder / "probe", BENCH / "finetune_full.yaml", probe_args, export))
    return arms


def variant_lines(encoders: list[str]) -> list[str]:
    """What each variant among `encoders` changes: its recipe's own keys (the rest comes from its `base`)."""
    lines = []
    for encoder in encoders:
        if encoder in ENCODERS:
            continue
        own = yaml.safe_load((BENCH / f"{encoder}.yaml").read_text())
        changes = ", ".join(f"{k}={v}" for k, v in flatten(own).items() if k not in ("base", "run_dir"))
        lines.append(f"- `{encoder}`: recipes/bench/{encoder}.yaml, {own.get('base')} with {changes}")
    return lines


def launched_arm(kind: str, run_dir: Path, recipe: str, seed: int, data: dict[str, Path], scale: float) -> Arm:
    """The arm that runs recipes/bench/`recipe` into `run_dir` on `data` ("train", "test"), scaled by `scale`."""
    path = BENCH / f"{recipe}.yaml"
    overrides = (f"run_dir={run_dir}", f"seed={seed}", *_data_overrides(kind, data), *scale_overrides(path, scale))
    return Arm(kind, run_dir, path, overrides)


def _data_overrides(kind: str, data: dict[str, Path]) -> list[str]:
    """Where an arm's recipe reads its shards: the training set, and the test set it is scored on."""
    out = [f"data.train={data['train']}"]
    if kind == "pretrain":
        out.append(f"eval.knn.query.shards={data['test']}")
    elif kind == "finetune":
        out.append(f"data.val={data['test']}")
    return out


def run_arm(arm: Arm, *, timeout: float) -> str:
    """Runs an arm unless it is done or blocked; writes its bench_result.json. Returns what happened, one word."""
    if (arm.run_dir / RESULT_FILE).is_file():
        return "done"
    if arm.requires is not None and not arm.requires.is_dir():
        return "blocked"
    arm.run_dir.mkdir(parents=True, exist_ok=True)
    print(f"[bench-quality] {arm.name}: running ({arm.kind})", flush=True)
    if arm.kind == "probe":
        measured = _run_probe(arm, timeout=timeout)
    else:
        measured = launch(arm.recipe, list(arm.overrides), arm.run_dir / "launch.log", timeout=timeout)
    if measured["exit_code"] != 0:
        log = arm.run_dir / "launch.log"
        tail = log.read_text()[-3000:] if log.is_file() else ""
        print(f"[bench-quality] {arm.name}: FAILED (exit {measured['exit_code']}), {log}:\n{tail}", flush=True)
        return "failed"
    metrics = summarise_run(arm.kind, arm.run_dir)
    result = {"arm": arm.name, "wall_seconds": measured["wall_seconds"], "others_load": measured.get("others_load")}
    (arm.run_dir / RESULT_FILE).write_text(json.dumps(result | {"metrics": metrics}, indent=1))
    print(f"[bench-quality] {arm.name}: {measured['wall_seconds'] / 60:.1f} min, {metrics}", flush=True)
    return "ran"


def _run_probe(arm: Arm, *, timeout: float) -> dict:
    """`python -m finetune.lbfgs_probe` for an arm (overrides and --max-train in `arm.overrides`)."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "finetune.lbfgs_probe", str(arm.recipe), *arm.overrides]
    command += ["--out", str(arm.run_dir / "probe.json")]
    start = time.monotonic()
    with open(arm.run_dir / "launch.log", "w") as log:
        try:
            code = subprocess.run(
                command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            code = -9
    return {"exit_code": code, "wall_seconds": time.monotonic() - start}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objectives", default=",".join(OBJECTIVES), help="comma-separated (default: %(default)s)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default: %(default)s)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every step count (smoke runs; default 1)")
    p.add_argument("--root", type=Path, default=REPO / "runs" / "bench_quality", help="runs (default: %(default)s)")
    p.add_argument("--shards", type=Path, default=REPO / "shards" / "quickstart", help="holds train/ and test/")
    p.add_argument("--subsets", type=Path, default=REPO / "shards" / "bench", help="label subsets written here")
    p.add_argument("--timeout", type=float, default=6 * 3600, help="seconds before an arm is killed")
    p.add_argument("--out", type=Path, default=RESULTS, help="markdown result file (default: %(default)s)")
    args = p.parse_args(argv)
    objectives = [o for o in args.objectives.split(",") if o]
    variants = sorted(f.stem for f in BENCH.glob("*_*.yaml") if objective_of(f.stem) in OBJECTIVES)
    if unknown := sorted(set(objectives) - {*OBJECTIVES, *variants}):
        p.error(f"unknown objectives {unknown}; known: {', '.join(OBJECTIVES)}; variants: {', '.join(variants)}")
    if not 0 < args.scale <= 1:
        p.error(f"--scale must be in (0, 1], got {args.scale}")
    seeds = [int(s) for s in args.seeds.split(",") if s]

    write_label_subsets(args.shards, args.subsets)
    arms = plan(
        args.root, objectives=objectives, seeds=seeds, shards=args.shards, subsets=args.subsets, scale=args.scale
    )
    outcome = {arm.name: run_arm(arm, timeout=args.timeout) for arm in arms}

    results = collect(args.root)
    threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count())
    command = " ".join(["python", "-m", "benchmarks.bench_quality", *argv])
    tried = variant_lines(encoders_in(results))
    extra = ["", "Variants (settings tried; each row names its recipe):", "", *tried] if tried else []
    note = f" (scale {args.scale:g}, seeds {args.seeds})"
    header = arms_header(command, threads, args.scale, outcome, note=note, extra=extra)
    text = render(results, header=header, plot_note=plot(results, args.out.with_suffix(".png")))
    write_result(text, args.out, "bench-quality")
    return 1 if any(what in ("failed", "blocked") for what in outcome.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
