"""The encoder table of docs/encoders.md on the Fashion-MNIST quickstart budget (`make encoders-table`): each
encoder fine-tuned from scratch, and the hybrid and T2T-ViT also after SimMIM pretraining, test top-1 side by side
with the plain ViT.

    .venv/bin/python -m benchmarks.encoders_table                        # every row (~40 min on 2 cores)
    .venv/bin/python -m benchmarks.encoders_table --rows vit,t2t         # some rows (names: ROWS below)
    .venv/bin/python -m benchmarks.encoders_table --dry-run              # print the ./launch.sh commands only
    .venv/bin/python -m benchmarks.encoders_table --assemble-only        # the table from the runs already there

Each row runs its recipes through `./launch.sh` as a user does, on shards/quickstart (`make quickstart-data`),
overriding only the run folder and, after SimMIM, `model.init` (the SimMIM export). The fine-tuning recipes share
quickstart_finetune.yaml's budget (1000 steps of 128; 28 px for the ViT, 32 px for the hybrid and VT, 64 px for
T2T-ViT), the SimMIM runs quickstart.yaml's (700 steps of 256). The table (`results/encoders.md`) is assembled from
the runs' metrics.jsonl: the test top-1 of the last evaluation (the number to compare), the best evaluation with its
step, and the minutes each stage took.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.workers import machine_lines, quickstart_vit

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "benchmarks" / "results" / "encoders.md"
HYBRID_SIMMIM = (
    "model.arch=vit_hybrid",
    "model.hybrid_backbone=resnet_stem",
    "model.img_size=32",
    "model.patch_size=2",
    "objective.mask_patch_size=1",
)
T2T_SIMMIM = (
    "model.arch=t2t_vit",
    "model.t2t_variant=t_14",
    "model.img_size=64",
    "model.embed_dim=128",
    "model.depth=6",
    "objective.mask_patch_size=1",
)
"""quickstart_simmim.yaml overrides that pretrain the encoder quickstart_hybrid.yaml / quickstart_t2t.yaml fine-tune
(the commands in those recipes' comments)."""


@dataclass(frozen=True)
class Row:
    """One line of the table: a fine-tuning run, after an optional SimMIM run whose export it starts from."""

    name: str
    """Run folder under the runs directory, and the `--rows` key."""
    encoder: str
    finetune: tuple[str, ...]
    """Recipe stem in recipes/, then its overrides."""
    pretrain: tuple[str, ...] = ()
    """SimMIM recipe stem and overrides; empty: from scratch."""


SCRATCH_VIT = quickstart_vit()  # quickstart_finetune.yaml reads it from the export it starts from
HYBRID = "hybrid: ResNet stem + ViT (128 wide, 4 blocks, 32 px)"
T2T = "T2T-ViT_t (128 wide, 6 blocks, 64 px)"
ROWS: tuple[Row, ...] = (
    Row("vit", "ViT (128 wide, 4 blocks, patch 4, 28 px)", ("quickstart_finetune", "model.init=null", *SCRATCH_VIT)),
    Row("hybrid", HYBRID, ("quickstart_hybrid",)),
    Row("t2t", T2T, ("quickstart_t2t",)),
    Row("vt", "VT-ResNet-18 (16 tokens 256 wide, 32 px)", ("quickstart_vt",)),
    Row(
        "vt_cluster",
        "VT-ResNet-18, clustering tokenizer (16 k-means centres, 32 px)",
        ("quickstart_vt", "model.vt_tokenizer=cluster"),
    ),
    Row("hybrid_simmim", HYBRID, ("quickstart_hybrid",), ("quickstart_simmim", *HYBRID_SIMMIM)),
    Row("t2t_simmim", T2T, ("quickstart_t2t",), ("quickstart_simmim", *T2T_SIMMIM)),
)


def plan(row: Row, runs: Path) -> list[list[str]]:
    """The `./launch.sh` commands of a row, in order: its SimMIM pretraining if any, then its fine-tuning."""
    commands, finetune = [], [f"run_dir={runs / row.name}"]
    if row.pretrain:
        recipe, *overrides = row.pretrain
        pretrain_dir = runs / f"{row.name}_pretrain"
        commands.append(["./launch.sh", f"recipes/{recipe}.yaml", *overrides, f"run_dir={pretrain_dir}"])
        finetune.append(f"model.init={pretrain_dir / 'export'}")
    recipe, *overrides = row.finetune
    commands.append(["./launch.sh", f"recipes/{recipe}.yaml", *overrides, *finetune])
    return commands


@dataclass
class RowResult:
    """What a row's runs left in their metrics.jsonl; None where a run is missing or never evaluated."""

    row: Row
    top1: float | None = None
    """val/top1 at the last evaluation of the fine-tuning run (the Fashion-MNIST test set)."""
    step: int | None = None
    best_top1: float | None = None
    best_step: int | None = None
    finetune_minutes: float | None = None
    pretrain_minutes: float | None = None


def read_run(run_dir: Path) -> tuple[list[dict], float | None]:
    """(metrics lines, minutes from the first to the last line) of a run folder; ([], None) without metrics."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return [], None
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    minutes = (lines[-1]["time"] - lines[0]["time"]) / 60 if lines else None
    return lines, minutes


def collect(row: Row, runs: Path) -> RowResult:
    """A row's numbers from its run folders (a missing folder leaves its fields None)."""
    lines, minutes = read_run(runs / row.name)
    result = RowResult(row, finetune_minutes=minutes)
    if row.pretrain:
        result.pretrain_minutes = read_run(runs / f"{row.name}_pretrain")[1]
    evals = [(m["step"], m["val/top1"]) for m in lines if "val/top1" in m]
    if evals:
        result.step, result.top1 = evals[-1]
        result.best_step, result.best_top1 = max(evals, key=lambda e: (e[1], -e[0]))  # the earliest of equal bests
    return result


def render_row(r: RowResult) -> str:
    pretraining = "SimMIM (quickstart budget)" if r.row.pretrain else "none (from scratch)"
    if r.top1 is None:
        return f"| {r.row.encoder} | {pretraining} | not run | - | - | `{r.row.name}` |"
    minutes = f"{r.finetune_minutes:.1f}"
    if r.row.pretrain:
        pre = "?" if r.pretrain_minutes is None else f"{r.pretrain_minutes:.1f}"
        minutes = f"{pre} + {minutes}"
    best = f"{r.best_top1:.4f} (step {r.best_step})"
    return f"| {r.row.encoder} | {pretraining} | {r.top1:.4f} (step {r.step}) | {best} | {minutes} | `{r.row.name}` |"


def render(results: list[RowResult], argv: list[str], machine: list[str]) -> str:
    return "\n".join(
        [
            "# Encoders on the Fashion-MNIST quickstart budget",
            "",
            *machine,
            f"- command: `{' '.join(['python', '-m', 'benchmarks.encoders_table', *argv])}`",
            "- fine-tuning: quickstart_finetune.yaml's budget (1000 steps of 128, base lr 5e-3, label smoothing 0.1, "
            "random erasing 0.1), each encoder's quickstart recipe; SimMIM: quickstart.yaml's budget (700 steps of "
            "256, 60% masked) on the same encoder, then the same fine-tuning from its export",
            "- test top-1: val/top1 on the 10k Fashion-MNIST test images at the last evaluation; best: the highest "
            "evaluation and its step (chosen on the test set, so not the number to compare); one run each, whose "
            "standard error is about 0.0035 at this accuracy",
            "- minutes: from the first to the last logged line of each run (SimMIM + fine-tuning)",
            "",
            "| encoder | pretraining | test top-1 | best | minutes | run |",
            "|---|---|---:|---:|---:|---|",
            *(render_row(r) for r in results),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(r.name for r in ROWS), help="comma-separated row names (default: all)")
    p.add_argument("--runs-dir", type=Path, default=Path("runs/encoders"), help="run folders (default: %(default)s)")
    p.add_argument("--out", type=Path, default=RESULTS, help="markdown result file (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing, write nothing")
    p.add_argument("--assemble-only", action="store_true", help="write the table from the runs already there")
    args = p.parse_args(argv)
    by_name = {r.name: r for r in ROWS}
    names = [n for n in args.rows.split(",") if n]
    unknown = sorted(set(names) - set(by_name))
    if unknown:
        p.error(f"unknown rows {unknown}; known: {', '.join(by_name)}")
    rows = [by_name[n] for n in names]
    runs = args.runs_dir if args.runs_dir.is_absolute() else REPO / args.runs_dir
    failed = []
    for row in rows if not args.assemble_only else ():
        if not args.dry_run:  # a run folder left from before would be resumed, not started afresh
            for folder in (runs / row.name, runs / f"{row.name}_pretrain"):
                shutil.rmtree(folder, ignore_errors=True)
        for command in plan(row, runs):
            print("[encoders] " + " ".join(command), flush=True)
            if not args.dry_run and subprocess.run(command, cwd=REPO).returncode != 0:
                failed.append(row.name)
                break
    if args.dry_run:
        return 0
    threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count())  # what launch.sh gives its one CPU process
    text = render([collect(row, runs) for row in rows], argv, machine_lines(threads))
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"[encoders] written to {args.out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
