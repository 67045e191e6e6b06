"""Does pretraining help dense prediction? (issue 29, `make bench-seg`): on the Fashion-MNIST scenes, mIoU of UperNet
and of the linear probe from an MAE encoder against the same ViT from scratch at an equal budget, and VT-FPN against
panoptic FPN on the same ResNet; then both FPNs' parameters and GMACs (benchmarks/seg_costs.py).

    .venv/bin/python -m benchmarks.bench_seg                    # the protocol: about 1.5 hours on 2 CPU cores
    .venv/bin/python -m benchmarks.bench_seg --scale 0.05       # a smoke run of minutes

Every arm is `./launch.sh RECIPE overrides` as a user runs it, in `ROOT/{arm}`, one process; an arm whose
bench_result.json exists is skipped, so a stopped run goes on where it was. The ViT is 192 wide, 6 blocks, 3 heads,
at 64 px with 8 px patches (an 8x8 grid), for every arm that has one:
    mae                 MAE on the 4,000 training scenes' images (their masks unused), recipes/quickstart.yaml with
                        the ViT above, 1,000 steps of 256, raw-pixel targets (norm_pix_loss off: standardising each
                        patch turns the canvas's noise into targets nothing can predict, and the loss stalls near 1)
    upernet_{mae,scratch}        recipes/quickstart_seg.yaml with the ViT above, from the MAE export or from scratch
    upernet_frozen_{mae,random}  the same with the encoder frozen (a random one for `random`): what the head does alone
    linear_{mae,random}          the same with the linear head on the frozen encoder (a random one for `random`)
    {fpn,vt_fpn}_r18             panoptic FPN and VT-FPN on a ResNet-18 from scratch, same data, steps and optimizer
Each fine-tuning arm runs 600 steps of 32 (~5 epochs) and is scored by its best mIoU on the 500 validation scenes
(evaluated at steps 300 and 600) and its last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.seg_costs import render as render_costs
from benchmarks.smoke_measure import launch, read_metrics
from benchmarks.workers import arms_header, write_result

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "segmentation.md"
RESULT_FILE = "bench_result.json"
VIT = ["model.embed_dim=192", "model.depth=6", "model.num_heads=3", "model.img_size=64", "model.patch_size=8"]
PRETRAIN = [
    *VIT, "objective.decoder_embed_dim=128", "objective.decoder_num_heads=4", "objective.norm_pix_loss=false",
    "schedule.steps=1000", "schedule.warmup_steps=50", "checkpoint.every_steps=500", "eval.knn.enabled=false",
    "eval.features.enabled=false", "logging.image_every_steps=0",
]  # fmt: skip
FINETUNE_STEPS = 600
RESNET = ["model.arch=resnet", "model.resnet_variant=18", "model.img_size=64", "optim.layer_decay=1.0"]
LINEAR = ["objective.head=linear", "objective.freeze_encoder=true", "objective.aux_weight=0"]


@dataclass(frozen=True)
class Arm:
    name: str
    recipe: str
    overrides: tuple[str, ...]
    needs_export: bool = False
    """Starts from the `mae` arm's export (not run when it is missing)."""


ARMS = (
    Arm("mae", "quickstart.yaml", tuple(PRETRAIN)),
    Arm("upernet_mae", "quickstart_seg.yaml", tuple(VIT), needs_export=True),
    Arm("upernet_scratch", "quickstart_seg.yaml", (*VIT, "model.init=null")),
    Arm("upernet_frozen_mae", "quickstart_seg.yaml", (*VIT, "objective.freeze_encoder=true"), needs_export=True),
    Arm("upernet_frozen_random", "quickstart_seg.yaml", (*VIT, "objective.freeze_encoder=true", "model.init=null")),
    Arm("linear_mae", "quickstart_seg.yaml", (*VIT, *LINEAR), needs_export=True),
    Arm("linear_random", "quickstart_seg.yaml", (*VIT, *LINEAR, "model.init=null")),
    Arm("fpn_r18", "quickstart_seg.yaml", (*RESNET, "objective.head=fpn", "model.init=null")),
    Arm("vt_fpn_r18", "quickstart_seg.yaml", (*RESNET, "objective.head=vt_fpn", "model.init=null")),
)
ROWS = (
    ("UperNet, fine-tuned", "upernet_mae", "upernet_scratch"),
    ("UperNet, encoder frozen", "upernet_frozen_mae", "upernet_frozen_random"),
    ("linear head, encoder frozen", "linear_mae", "linear_random"),
)


def arm_overrides(arm: Arm, root: Path, scenes: Path, scale: float) -> list[str]:
    """The arm's overrides with its run_dir, data and (at `scale` < 1) shortened schedule."""
    out = [f"run_dir={root / arm.name}", *arm.overrides]
    if arm.name == "mae":
        out.append(f"data.train={scenes / 'train'}")
        steps = max(2, round(1000 * scale))
        return out + ([f"schedule.steps={steps}", f"schedule.warmup_steps={steps // 20}"] if scale < 1 else [])
    out += [f"data.train={scenes / 'train'}", f"data.val={scenes / 'val'}"]
    if arm.needs_export:
        out.append(f"model.init={root / 'mae' / 'export'}")
    steps = max(2, round(FINETUNE_STEPS * scale))
    every = max(1, steps // 2)
    return out + [
        f"schedule.steps={steps}", f"schedule.warmup_steps={max(1, steps // 12)}", f"eval.every_steps={every}",
        f"checkpoint.every_steps={every}", f"logging.every_steps={max(1, steps // 12)}",
    ]  # fmt: skip


def summarise(arm: Arm, run_dir: Path) -> dict:
    """What the tables read: the pretraining's last loss, or a fine-tuning's best and last mIoU."""
    records = read_metrics(run_dir)
    if arm.name == "mae":
        losses = [r["train/loss"] for r in records if "train/loss" in r]
        return {"loss": losses[-1] if losses else None}
    evals = [r for r in records if "val/miou" in r]
    if not evals:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no val/miou")
    best = max(evals, key=lambda r: r["val/miou"])
    return {"best_miou": best["val/miou"], "best_step": best["step"], "last_miou": evals[-1]["val/miou"],
            "last_pixel_acc": evals[-1]["val/pixel_acc"]}  # fmt: skip


def run_arm(arm: Arm, root: Path, scenes: Path, scale: float, timeout: float) -> str:
    """Runs an arm unless it is done or its export is missing; returns what happened, one word."""
    run_dir = root / arm.name
    if (run_dir / RESULT_FILE).is_file():
        return "done"
    if arm.needs_export and not (root / "mae" / "export").is_dir():
        return "blocked"
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"[bench-seg] {arm.name}: running", flush=True)
    recipe = REPO / "recipes" / arm.recipe
    measured = launch(recipe, arm_overrides(arm, root, scenes, scale), run_dir / "launch.log", timeout=timeout)
    if measured["exit_code"] != 0:
        tail = (run_dir / "launch.log").read_text()[-3000:]
        print(f"[bench-seg] {arm.name}: FAILED (exit {measured['exit_code']}):\n{tail}", flush=True)
        return "failed"
    result = {"arm": arm.name, "wall_seconds": measured["wall_seconds"], "metrics": summarise(arm, run_dir)}
    (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=1))
    print(f"[bench-seg] {arm.name}: {measured['wall_seconds'] / 60:.1f} min, {result['metrics']}", flush=True)
    return "ran"


def render(results: dict[str, dict], header: list[str]) -> str:
    """benchmarks/results/segmentation.md from the finished arms' results."""

    def cell(name: str, key: str = "best_miou") -> str:
        metrics = results.get(name, {}).get("metrics")
        return f"{metrics[key]:.4f}" if metrics else "-"

    def gap(a: str, b: str) -> str:
        if a not in results or b not in results:
            return "-"
        return f"{100 * (results[a]['metrics']['best_miou'] - results[b]['metrics']['best_miou']):+.1f}"

    lines = ["# Segmentation: does pretraining help, and VT-FPN against panoptic FPN (`make bench-seg`)", "", *header]
    lines += ["", "## mIoU on the 500 validation scenes (best of steps 300 and 600; last in brackets)", ""]
    lines += [
        "| arm | MAE encoder | same ViT, scratch / random | pretrained - scratch (points) |",
        "|---|---:|---:|---:|",
    ]
    for label, pretrained, scratch in ROWS:
        lines.append(
            f"| {label} | {cell(pretrained)} ({cell(pretrained, 'last_miou')}) | {cell(scratch)} "
            f"({cell(scratch, 'last_miou')}) | {gap(pretrained, scratch)} |"
        )
    lines += ["", "| ResNet-18 from scratch | panoptic FPN | VT-FPN | VT-FPN - FPN (points) |", "|---|---:|---:|---:|"]
    lines.append(
        f"| mIoU | {cell('fpn_r18')} ({cell('fpn_r18', 'last_miou')}) | {cell('vt_fpn_r18')} "
        f"({cell('vt_fpn_r18', 'last_miou')}) | {gap('vt_fpn_r18', 'fpn_r18')} |"
    )
    if "mae" in results:
        lines += ["", f"MAE pretraining's last loss: {results['mae']['metrics']['loss']:.4f}."]
    walls = ", ".join(f"{name} {r['wall_seconds'] / 60:.1f}" for name, r in results.items())
    lines += ["", f"Wall minutes per arm (one process, 2 cores): {walls}."]
    lines += ["", "## Parameters and GMACs (as the VT paper compares them)", "", *render_costs(50, 512, 150), ""]
    lines += [*render_costs(18, 64, 11), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenes", type=Path, default=REPO / "shards" / "scenes", help="holds train/ and val/")
    p.add_argument("--root", type=Path, default=REPO / "runs" / "bench_seg", help="runs (default: %(default)s)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every step count (smoke runs; default 1)")
    p.add_argument("--timeout", type=float, default=3 * 3600, help="seconds before an arm is killed")
    p.add_argument("--out", type=Path, default=RESULTS, help="markdown result file (default: %(default)s)")
    args = p.parse_args(argv)
    if not 0 < args.scale <= 1:
        p.error(f"--scale must be in (0, 1], got {args.scale}")
    outcome = {arm.name: run_arm(arm, args.root, args.scenes, args.scale, args.timeout) for arm in ARMS}
    results = {
        arm.name: json.loads((args.root / arm.name / RESULT_FILE).read_text())
        for arm in ARMS
        if (args.root / arm.name / RESULT_FILE).is_file()
    }
    threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count())
    command = " ".join(["python -m benchmarks.bench_seg", *argv])
    header = arms_header(command, threads, args.scale, outcome)
    write_result(render(results, header), args.out, "bench-seg")
    return 1 if any(what in ("failed", "blocked") for what in outcome.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
