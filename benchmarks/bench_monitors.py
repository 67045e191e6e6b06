"""The label-free and few-shot monitors against kNN top-1 (issue 30, `make bench-monitors`), and what they cost.

    .venv/bin/python -m benchmarks.bench_monitors                          # the protocol: ~70 minutes on 2 CPU cores
    .venv/bin/python -m benchmarks.bench_monitors --scale 0.05 --overhead-repeats 0          # a smoke run

Part 1, how the monitors move with kNN top-1: the bench-quality pretraining of each objective (recipes/bench/O.yaml,
MAE and SimMIM by default) rerun with the label-free monitor (`eval.features`, on the kNN bank's images, so it reuses
their features) and few-shot linear evaluation (`eval.knn.fewshot` 1/5/10/25) at the kNN monitor's cadence. The
result lists every evaluated step and, per objective, the Spearman rank correlation of each monitor with kNN top-1
over the steps.

Part 2, what they cost: recipes/quickstart.yaml as `make quickstart` runs it (its kNN monitor on in both arms) with
and without the new monitors, `--overhead-repeats` times each, alternating; the ratio of the runs' wall times (median
over repeats) and the monitors' own seconds as logged (`features/seconds`, `fewshot/seconds`) over the run's.

Each run goes through `./launch.sh` in `ROOT/...` and leaves a bench_result.json (benchmarks/bench_quality.py
`run_arm`): a finished run is skipped, so a stopped benchmark goes on where it was. benchmarks/results/monitors.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from benchmarks.bench_quality import BENCH, Arm, run_arm, scale_overrides
from benchmarks.quality_report import name_of, objective_of
from benchmarks.smoke_measure import read_metrics
from benchmarks.workers import arms_header, write_result
from core.recipe.config import load_config

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "monitors.md"
OBJECTIVES = ("mae", "simmim")
SHOTS = (1, 5, 10, 25)
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
WITHOUT_NEW_MONITORS = ("eval.features.enabled=false", "eval.knn.fewshot=[]")
"""The quickstart recipe as it was before the new monitors: its kNN monitor only."""
COLUMNS = ("knn/top1", *(f"fewshot/top1_{n}shot" for n in SHOTS), "features/effective_rank", "features/std")
LABELS = ("kNN top-1", *(f"{n}-shot" for n in SHOTS), "effective rank", "std x sqrt(D)")


def monitor_overrides(recipe: Path, scaled: list[str]) -> list[str]:
    """The new monitors on `recipe` (after its `scaled` step counts): the label-free one on the kNN bank's images at
    the kNN cadence (so it reuses the bank's features), few-shot at 1/5/10/25 images per class."""
    knn = load_config(recipe, scaled).eval.knn
    return [
        "eval.features.enabled=true",
        f"eval.features.every_steps={knn.every_steps}",
        f"eval.features.max_samples={knn.bank.max_samples}",
        f"eval.knn.fewshot=[{','.join(map(str, SHOTS))}]",
    ]


def quality_arms(root: Path, objectives: list[str], shards: Path, scale: float) -> list[Arm]:
    """Part 1: each objective's bench pretraining with the new monitors, seed 0."""
    arms = []
    for objective in objectives:
        recipe = BENCH / f"{objective}.yaml"
        scaled = scale_overrides(recipe, scale)
        run_dir = root / "quality" / objective
        data = [f"data.train={shards / 'train'}", f"eval.knn.query.shards={shards / 'test'}"]
        overrides = (f"run_dir={run_dir}", "seed=0", *data, *scaled, *monitor_overrides(recipe, scaled))
        arms.append(Arm("pretrain", run_dir, recipe, overrides))
    return arms


def overhead_arms(root: Path, repeats: int, shards: Path, scale: float) -> list[Arm]:
    """Part 2: the quickstart's pretraining without ("off") and with ("on") the new monitors, alternating."""
    scaled = scale_overrides(QUICKSTART, scale)
    data = [f"data.train={shards / 'train'}", f"eval.knn.query.shards={shards / 'test'}"]
    arms = []
    for i in range(repeats):
        for name, extra in (("off", WITHOUT_NEW_MONITORS), ("on", ())):
            run_dir = root / "overhead" / f"{name}{i}"
            arms.append(Arm("pretrain", run_dir, QUICKSTART, (f"run_dir={run_dir}", *data, *scaled, *extra)))
    return arms


def evaluated_steps(records: list[dict]) -> list[dict]:
    """Per step where a monitor ran, its figures (a step's records merged), in step order."""
    steps: dict[int, dict] = {}
    for record in records:
        if any(key in record for key in COLUMNS):
            steps.setdefault(record["step"], {"step": record["step"]}).update(record)
    return [steps[s] for s in sorted(steps)]


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None for fewer than 3 pairs or a constant side."""
    if len(xs) < 3:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    if len(set(rx)) == 1 or len(set(ry)) == 1:
        return None
    return statistics.correlation(rx, ry)


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def quality_section(root: Path, objectives: list[str]) -> list[str]:
    """Part 1's tables: every evaluated step per objective, then the rank correlations with kNN top-1."""
    lines = ["## 1. How the monitors move with kNN top-1", ""]
    correlations, last = [], []
    for objective in objectives:
        steps = evaluated_steps(read_metrics(root / "quality" / objective))
        if not steps:
            continue
        last.append(f"| {name_of(objective)} | " + " | ".join(_cell(steps[-1].get(key), key) for key in COLUMNS) + " |")
        lines += [f"### {name_of(objective)}", ""]
        lines += ["| step | " + " | ".join(LABELS) + " |", "|---" * (len(LABELS) + 1) + "|"]
        for row in steps:
            cells = [_cell(row.get(key), key) for key in COLUMNS]
            lines.append(f"| {row['step']} | " + " | ".join(cells) + " |")
        lines.append("")
        knn = [row.get("knn/top1") for row in steps]
        rhos = []
        for key in COLUMNS[1:]:
            pairs = [(k, row[key]) for k, row in zip(knn, steps, strict=True) if k is not None and key in row]
            rho = spearman([p[0] for p in pairs], [p[1] for p in pairs])
            rhos.append("-" if rho is None else f"{rho:+.2f}")
        correlations.append(f"| {name_of(objective)} | {len(steps)} | " + " | ".join(rhos))
    lines += [
        "### Spearman rank correlation with kNN top-1 over the evaluated steps",
        "",
        "| objective | steps | " + " | ".join(LABELS[1:]) + " |",
        "|---" * (len(LABELS) + 1) + "|",
        *[row + " |" for row in correlations],
        "",
        "### Across objectives, at the last step",
        "",
        "| objective | " + " | ".join(LABELS) + " |",
        "|---" * (len(LABELS) + 1) + "|",
        *last,
    ]
    return lines


def overhead_section(root: Path, repeats: int) -> list[str]:
    """Part 2's table: each quickstart run's wall time and monitor seconds, then the medians' ratio."""
    if repeats == 0:
        return []
    lines = [
        "## 2. What the new monitors cost the quickstart's pretraining",
        "",
        "| run | wall s | kNN s | label-free s | few-shot s | new monitors' share of the wall time |",
        "|---|---|---|---|---|---|",
    ]
    walls: dict[str, list[float]] = {"off": [], "on": []}
    for i in range(repeats):
        for name in ("off", "on"):
            run_dir = root / "overhead" / f"{name}{i}"
            result = run_dir / "bench_result.json"
            if not result.is_file():
                continue
            wall = json.loads(result.read_text())["wall_seconds"]
            walls[name].append(wall)
            spent = {key: sum(r.get(key, 0.0) for r in read_metrics(run_dir)) for key in _SECONDS}
            new = spent["features/seconds"] + spent["fewshot/seconds"]
            cells = " | ".join(f"{spent[key]:.1f}" for key in _SECONDS)
            lines.append(f"| {name}{i} | {wall:.1f} | {cells} | {new / wall:.2%} |")
    if walls["off"] and walls["on"]:
        ratio = statistics.median(walls["on"]) / statistics.median(walls["off"])
        runs = f"{len(walls['on'])} run{'s' if len(walls['on']) > 1 else ''} each"
        lines += ["", f"Median wall time with / without the new monitors: **{ratio:.3f}** ({runs})."]
    return lines


_SECONDS = ("knn/seconds", "features/seconds", "fewshot/seconds")


def _cell(value: float | None, key: str) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if key == "features/effective_rank" else f"{value:.4f}" if "top1" in key else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objectives", default=",".join(OBJECTIVES), help="comma-separated (default: %(default)s)")
    p.add_argument("--overhead-repeats", type=int, default=2, help="quickstart runs per arm (default: %(default)s)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every step count (smoke runs; default 1)")
    p.add_argument("--root", type=Path, default=REPO / "runs" / "bench_monitors", help="runs (default: %(default)s)")
    p.add_argument("--shards", type=Path, default=REPO / "shards" / "quickstart", help="holds train/ and test/")
    p.add_argument("--timeout", type=float, default=4 * 3600, help="seconds before a run is killed")
    p.add_argument("--out", type=Path, default=RESULTS, help="markdown result file (default: %(default)s)")
    args = p.parse_args(argv)
    objectives = [o for o in args.objectives.split(",") if o]
    if unknown := [o for o in objectives if not (BENCH / f"{o}.yaml").is_file() or objective_of(o) == "beit"]:
        p.error(f"no recipes/bench pretraining without a tokenizer named {unknown}")
    if not 0 < args.scale <= 1:
        p.error(f"--scale must be in (0, 1], got {args.scale}")

    arms = overhead_arms(args.root, args.overhead_repeats, args.shards, args.scale)
    arms += quality_arms(args.root, objectives, args.shards, args.scale)
    outcome = {arm.name: run_arm(arm, timeout=args.timeout) for arm in arms}

    threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count())
    command = " ".join(["python", "-m", "benchmarks.bench_monitors", *argv])
    header = arms_header(command, threads, args.scale, outcome)
    body = quality_section(args.root, objectives) + [""] + overhead_section(args.root, args.overhead_repeats)
    title = "# The label-free and few-shot monitors against kNN top-1 (`make bench-monitors`)"
    write_result("\n".join([title, "", *header, "", *body, ""]), args.out, "bench-monitors")
    return 1 if any(what in ("failed", "blocked") for what in outcome.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
