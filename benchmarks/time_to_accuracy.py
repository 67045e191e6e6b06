"""Time to accuracy (issue 50, part of `make bench-quality`): each objective's encoder measured at several points of
its pretraining, against the CPU-seconds the pretraining had spent to get there, all on one machine in one run.

    .venv/bin/python -m benchmarks.time_to_accuracy                         # MAE and data2vec 2.0, recipes/bench/
    .venv/bin/python -m benchmarks.time_to_accuracy --scale 0.25            # a quarter of every pretraining

Per objective O (recipes/bench/O.yaml): `./launch.sh` pretrains it with the monitors off and a checkpoint every
1/`--points` of its steps, while a sampler reads the CPU time of the launch's whole process tree (launcher, rank,
data workers) every `SAMPLE_S`; a checkpoint's CPU-seconds are the tree's at the time metrics.jsonl logged its step.
Each checkpoint is exported (`python -m pretrain export --step`), then one `mimpipe evaluate` measures every export
of every objective side by side: kNN top-1 and the L-BFGS linear probe on the class token and on the mean of the
patch tokens. CPU-seconds, unlike wall time, barely move with what else the machine runs; the rows still compare
only within one run. Everything is kept under ROOT (default runs/time_to_accuracy): a rerun skips a finished
pretraining and an export already written.

Writes benchmarks/results/time_to_accuracy.md (the table, the goals checked) and .png (both measures against
CPU-seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from benchmarks.bench_quality import BENCH, FINETUNE, launched_arm, run_arm, scale_overrides, write_label_subsets
from benchmarks.quality_report import RESULT_FILE
from benchmarks.workers import write_result
from core.recipe.config import load_config

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "time_to_accuracy.md"
SAMPLE_S = 1.0
NAMES = {"mae": "MAE", "data2vec2": "data2vec 2.0", "ijepa": "I-JEPA"}
GOALS = (
    "data2vec 2.0 reaches MAE's end-of-pretraining kNN and linear probe in at most a third of MAE's pretraining "
    "CPU-seconds, and at MAE's pretraining CPU-seconds its linear probe is at least 2 points above MAE's and its 1% "
    "fine-tuning at least MAE's (issue 50); at MAE's pretraining CPU-seconds I-JEPA's linear probe is at least MAE's "
    "(issue 51)"
)


class TreeCPU:
    """Samples (wall time, CPU-seconds of a process and all its descendants) until stopped. A descendant that ends
    between two samples keeps its last reading, so a finished process's time is not lost."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        self.seen: dict[int, float] = {}
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> None:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            try:
                cpu = proc.cpu_times()
                self.seen[proc.pid] = cpu.user + cpu.system
            except psutil.NoSuchProcess:
                continue
        self.samples.append((time.time(), sum(self.seen.values())))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._read()
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> TreeCPU:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, when: float) -> float:
        """CPU-seconds at wall time `when`, interpolated between the samples around it."""
        before = [s for s in self.samples if s[0] <= when] or self.samples[:1]
        after = [s for s in self.samples if s[0] >= when] or self.samples[-1:]
        (t0, c0), (t1, c1) = before[-1], after[0]
        return c0 if t1 == t0 else c0 + (c1 - c0) * (when - t0) / (t1 - t0)


def pretrain(objective: str, root: Path, args: argparse.Namespace) -> dict:
    """Pretrain `objective` with checkpoints at `args.points` points; returns {step: CPU-seconds} (kept in
    ROOT/O/cpu.json, so a finished pretraining is not run again)."""
    run_dir = root / objective
    done = run_dir / "cpu.json"
    if done.is_file():
        return {int(k): v for k, v in json.loads(done.read_text()).items()}
    recipe = BENCH / f"{objective}.yaml"
    scaled = dict(o.split("=", 1) for o in scale_overrides(recipe, args.scale))
    steps = int(scaled.get("schedule.steps", load_config(recipe).schedule.steps))
    every = max(1, steps // args.points)
    overrides = [
        *(f"{k}={v}" for k, v in scaled.items() if k.startswith("schedule.")),
        f"run_dir={run_dir}",
        f"seed={args.seed}",
        f"data.train={args.shards / 'train'}",
        "eval.knn.enabled=false",
        "eval.features.enabled=false",
        f"checkpoint.every_steps={every}",
        f"checkpoint.keep_last={args.points + 1}",
        f"logging.every_steps={every}",
    ]
    if objective in ("data2vec2", "ijepa"):
        overrides.append(f"objective.ema.steps={steps}")  # the decay schedule spans the (scaled) run
    env = {**os.environ, "NPROC_PER_NODE": "1", "HF_HUB_OFFLINE": "1", "PYTHON": sys.executable}
    print(f"[time-to-accuracy] {objective}: ./launch.sh {recipe.relative_to(REPO)} {' '.join(overrides)}", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir.parent / f"{objective}.log", "w") as log:
        proc = subprocess.Popen([str(REPO / "launch.sh"), str(recipe), *overrides], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT)  # fmt: skip
        with TreeCPU(proc.pid) as sampler:
            code = proc.wait()
    if code != 0:
        raise RuntimeError(f"{objective}'s pretraining failed (exit {code}): {run_dir.parent / f'{objective}.log'}")
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    cpu = {r["step"]: sampler.at(r["time"]) for r in logged if "train/loss" in r and r["step"] % every == 0}
    done.write_text(json.dumps(cpu))
    return cpu


def export_points(objective: str, root: Path, steps: list[int]) -> list[Path]:
    """Each checkpoint's encoder as an export (`python -m pretrain export --step`), written once."""
    outs = []
    for step in steps:
        out = root / "exports" / f"{objective}_step{step:06d}"
        if not (out / "model.safetensors").is_file():
            command = [sys.executable, "-m", "pretrain", "export", str(root / objective), "--step", str(step)]
            subprocess.run([*command, "--out", str(out)], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        outs.append(out)
    return outs


def evaluate(exports: list[Path], root: Path, args: argparse.Namespace) -> dict[str, dict]:
    """One `mimpipe evaluate` of every export: {export folder name: its metrics}."""
    done = {}  # a rerun (another objective added, the fine-tuning arms) measures only what it has not measured
    for report in sorted(root.glob("evaluate*/report.json")):
        done |= {Path(row["checkpoint"]).name: row["metrics"] for row in json.loads(report.read_text())["rows"]}
    missing = [e for e in exports if e.name not in done]
    if missing:  # the same images in the same order and the same settings as every earlier call
        out = root / f"evaluate_{len(list(root.glob('evaluate*')))}"
        command = [str(Path(sys.executable).parent / "mimpipe"), "evaluate", *map(str, missing)]
        command += ["--train", str(args.shards / "train"), "--val", str(args.shards / "test"), "--suite", "knn,linear"]
        command += ["--max-train", str(args.max_train), "--max-val", str(args.max_val), "--num-workers", "0"]
        subprocess.run([*command, "--out", str(out)], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        done |= {
            Path(row["checkpoint"]).name: row["metrics"]
            for row in json.loads((out / "report.json").read_text())["rows"]
        }
    return {e.name: done[e.name] for e in exports}


def curves(cpu: dict[str, dict[int, float]], metrics: dict[str, dict]) -> dict[str, list[dict]]:
    """Per objective, its points in step order: step, CPU-seconds, kNN top-1, probe (cls, mean, the better)."""
    out = {}
    for objective, points in cpu.items():
        rows = []
        for step, seconds in sorted(points.items()):
            m = metrics[f"{objective}_step{step:06d}"]
            cls, mean = m.get("linear/top1_cls"), m["linear/top1_mean"]  # no cls probe without a class token
            rows.append({"step": step, "cpu_s": seconds, "knn": m["knn/top1"], "cls": cls, "mean": mean,
                         "probe": max(v for v in (cls, mean) if v is not None)})  # fmt: skip
        out[objective] = rows
    return out


def value_at(rows: list[dict], key: str, cpu_s: float) -> float | None:
    """`key` interpolated at `cpu_s` along the points, None outside them."""
    for a, b in zip(rows, rows[1:], strict=False):
        if a["cpu_s"] <= cpu_s <= b["cpu_s"]:
            return a[key] + (b[key] - a[key]) * (cpu_s - a["cpu_s"]) / (b["cpu_s"] - a["cpu_s"])
    return rows[-1][key] if rows and abs(rows[-1]["cpu_s"] - cpu_s) < 1e-9 else None


def time_to(rows: list[dict], key: str, level: float) -> float | None:
    """The CPU-seconds of the first point at or above `level` of `key`, None if none reaches it."""
    return next((r["cpu_s"] for r in rows if r[key] >= level), None)


def goal_lines(found: dict[str, list[dict]]) -> list[str]:
    """The issue's goals, checked on the measured curves (MAE's end is its last point)."""
    mae, d2v = found.get("mae"), found.get("data2vec2")
    if not (mae and d2v):
        return ["- goals need both MAE and data2vec 2.0 rows"]
    end = mae[-1]
    lines = []
    for key, what in (("knn", "kNN top-1"), ("probe", "linear probe (better pooling)")):
        reached = time_to(d2v, key, end[key])
        share = "never, within its run" if reached is None else f"{reached:.0f} CPU-s = {reached / end['cpu_s']:.2f}x"
        verdict = "met" if reached is not None and reached <= end["cpu_s"] / 3 else "not met"
        lines.append(f"- data2vec 2.0 reaches MAE's end {what} ({end[key]:.4f} at {end['cpu_s']:.0f} CPU-s): {share} "
                     f"of MAE's time (goal <= 0.33x: {verdict})")  # fmt: skip
    for objective, points in (("data2vec2", 2.0), ("ijepa", 0.0)):  # issue 50's goal, issue 51's
        if objective not in found:
            continue
        name, probe = NAMES[objective], value_at(found[objective], "probe", end["cpu_s"])
        if probe is None:
            lines.append(f"- at MAE's pretraining CPU-seconds: {name}'s run does not reach that far")
            continue
        gain = 100 * (probe - end["probe"])
        verdict = "met" if gain >= points else "not met"
        lines.append(f"- at MAE's pretraining CPU-seconds: {name}'s linear probe {probe:.4f} against MAE's "
                     f"{end['probe']:.4f} ({gain:+.1f} points; goal >= {points:+g}: {verdict})")  # fmt: skip
    return lines


def finetune_encoders(found: dict[str, list[dict]], root: Path) -> dict[str, Path]:
    """The encoders fine-tuned on 1%, 10% and all labels: each objective's last export, and each other objective's at
    MAE's pretraining CPU-seconds (its last point at or before them), the issues' comparison at equal time."""
    chosen = {o: root / "exports" / f"{o}_step{rows[-1]['step']:06d}" for o, rows in found.items()}
    if "mae" in found:
        budget = found["mae"][-1]["cpu_s"]
        for objective in [o for o in found if o != "mae"]:
            within = [r for r in found[objective] if r["cpu_s"] <= budget]
            if within and within[-1] is not found[objective][-1]:
                chosen[f"{objective}@mae_time"] = root / "exports" / f"{objective}_step{within[-1]['step']:06d}"
    return chosen


def finetune(encoders: dict[str, Path], root: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """recipes/bench/finetune_{1pct,10pct,full}.yaml from each encoder (bench_quality's arms, same subsets and
    steps): {encoder: {arm: test top-1}}; an arm already run is read back."""
    write_label_subsets(args.shards, args.subsets)
    data = {"train": args.shards / "train", "test": args.shards / "test"}
    out: dict[str, dict[str, float]] = {}
    for label, export in encoders.items():
        for name, (recipe, per_class) in FINETUNE.items():
            if name not in args.finetune_arms:
                continue
            train = args.subsets / f"train_{per_class}_per_class" if per_class else data["train"]
            run_dir = root / "finetune" / label.replace("@", "_at_") / name
            arm = launched_arm("finetune", run_dir, recipe, args.seed, {**data, "train": train}, args.finetune_scale)
            arm = type(arm)(arm.kind, arm.run_dir, arm.recipe, (*arm.overrides, f"model.init={export}"), export)
            if run_arm(arm, timeout=6 * 3600) in ("done", "ran"):
                result = json.loads((run_dir / RESULT_FILE).read_text())
                out.setdefault(label, {})[name] = result["metrics"]["top1"]
    return out


def finetune_lines(tuned: dict[str, dict[str, float]], found: dict[str, list[dict]]) -> list[str]:
    """The fine-tuning table, and the goal at equal pretraining time."""
    lines = ["| encoder | 1% (60/class) | 10% (600/class) | full (60k) |", "|---|---:|---:|---:|"]
    for label, arms in tuned.items():
        cells = " | ".join(f"{arms[a]:.4f}" if a in arms else "-" for a in FINETUNE)
        lines.append(f"| {label} | {cells} |")
    at_time = tuned.get("data2vec2@mae_time")
    if at_time is None and found.get("data2vec2") and found.get("mae"):  # its whole run within MAE's time
        within = found["data2vec2"][-1]["cpu_s"] <= found["mae"][-1]["cpu_s"]
        at_time = tuned.get("data2vec2") if within else None
    if "mae" in tuned and at_time and "ft_1pct" in tuned["mae"] and "ft_1pct" in at_time:
        gain = 100 * (at_time["ft_1pct"] - tuned["mae"]["ft_1pct"])
        verdict = "met" if gain >= 0 else "not met"
        lines += ["", f"- 1% fine-tuning at MAE's pretraining CPU-seconds: data2vec 2.0 {gain:+.1f} points against MAE "
                  f"(goal >= 0: {verdict})"]  # fmt: skip
    return lines


def level_lines(found: dict[str, list[dict]]) -> list[str]:
    """Each objective's CPU-seconds to first reach MAE's value at each of MAE's points (its ratio to MAE's): where
    along the run one method leads, which the end-of-run goals alone do not show."""
    mae = found.get("mae")
    others = [o for o in found if o != "mae"]
    if not mae or not others:
        return []
    names = " | ".join(f"{NAMES.get(o, o)} CPU-s (x MAE)" for o in others)
    lines = [f"| measure | MAE's value | MAE CPU-s | {names} |", "|---|---:|---:|" + "---:|" * len(others)]
    for key, what in (("knn", "kNN top-1"), ("probe", "probe (better pooling)")):
        levels = sorted({max(r[key] for r in mae if r["cpu_s"] <= p["cpu_s"]) for p in mae})  # MAE's best so far
        for level in levels:
            reach = time_to(mae, key, level)
            cells = []
            for objective in others:
                t = time_to(found[objective], key, level)
                cells.append("not reached" if t is None else f"{t:.0f} ({t / reach:.2f}x)")
            lines.append(f"| {what} | {level:.4f} | {reach:.0f} | " + " | ".join(cells) + " |")
    return lines


def render(found: dict[str, list[dict]], args: argparse.Namespace, picture: str, tuned: dict) -> str:
    lines = [
        f"# Time to accuracy: {', '.join(NAMES.get(o, o) for o in found)} on one machine, one run",
        "",
        f"- command: `python -m benchmarks.time_to_accuracy {' '.join(args.argv)}`",
        f"- machine: {os.cpu_count()} cores; CPU-seconds of the pretraining's whole process tree (launcher, rank, data "
        "workers), start-up included; monitors off during pretraining",
        f"- measured: `mimpipe evaluate --suite knn,linear`, {args.max_train} training / {args.max_val} test images, "
        "every export side by side",
        f"- goals: {GOALS}",
        "",
        "| objective | step | pretraining CPU-s | kNN top-1 | probe cls | probe mean |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for objective, rows in found.items():
        for r in rows:
            cls = "-" if r["cls"] is None else f"{r['cls']:.4f}"
            lines.append(f"| {NAMES.get(objective, objective)} | {r['step']} | {r['cpu_s']:.0f} | {r['knn']:.4f} | "
                         f"{cls} | {r['mean']:.4f} |")  # fmt: skip
    tuning = ["", "## Fine-tuning (recipes/bench/finetune_*.yaml, test top-1 at the last step)", "", *finetune_lines(
        tuned, found)] if tuned else []  # fmt: skip
    levels = level_lines(found)
    reach = ["", "## Time to reach MAE's accuracy at each of its points", "", *levels] if levels else []
    return "\n".join([*lines, "", *goal_lines(found), *reach, *tuning, "", picture, ""])


def plot(found: dict[str, list[dict]], path: Path) -> str:
    """kNN top-1 and the linear probe against pretraining CPU-seconds, one line per objective; the markdown line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in zip(
        axes, ("knn", "probe"), ("kNN top-1", "linear probe top-1 (better pooling)"), strict=True
    ):
        for objective, rows in found.items():
            ax.plot([r["cpu_s"] for r in rows], [r[key] for r in rows], marker="o", label=NAMES.get(objective))
        ax.set_xlabel("pretraining CPU-seconds")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"![kNN and linear probe against pretraining CPU-seconds]({path.name})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objectives", default="mae,data2vec2,ijepa", help="recipes/bench/ names (default: %(default)s)")
    p.add_argument("--points", type=int, default=5, help="checkpoints measured per pretraining (default 5)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every pretraining's steps (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-train", type=int, default=10000, help="training images of kNN and probe (default 10000)")
    p.add_argument("--max-val", type=int, default=2000, help="test images scored (default 2000)")
    p.add_argument("--shards", type=Path, default=REPO / "shards" / "quickstart", help="holds train/ and test/")
    p.add_argument("--root", type=Path, default=REPO / "runs" / "time_to_accuracy")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--subsets", type=Path, default=REPO / "shards" / "bench", help="label subsets written here")
    p.add_argument("--finetune-scale", type=float, default=1.0, help="multiply the fine-tuning arms' steps")
    p.add_argument("--no-finetune", action="store_true", help="measure the pretraining points only")
    p.add_argument("--pretrain-only", action="store_true", help="pretrain and export; measure nothing yet")
    p.add_argument("--finetune-arms", default=",".join(FINETUNE), help="of %(default)s")
    args = p.parse_args(argv)
    args.argv = argv
    args.finetune_arms = [a for a in args.finetune_arms.split(",") if a]
    if unknown := sorted(set(args.finetune_arms) - set(FINETUNE)):
        p.error(f"--finetune-arms: unknown {unknown}; known: {', '.join(FINETUNE)}")
    if not 0 < args.scale <= 1 or args.points < 2:
        p.error("--scale must be in (0, 1] and --points at least 2")
    objectives = [o for o in args.objectives.split(",") if o]
    cpu = {o: pretrain(o, args.root, args) for o in objectives}
    exports = [e for o in objectives for e in export_points(o, args.root, sorted(cpu[o]))]
    if args.pretrain_only:
        return 0
    found = curves(cpu, evaluate(exports, args.root, args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    picture = plot(found, args.out.with_suffix(".png"))
    write_result(render(found, args, picture, {}), args.out, "time-to-accuracy")  # before the fine-tuning's hours
    if not args.no_finetune:
        tuned = finetune(finetune_encoders(found, args.root), args.root, args)
        write_result(render(found, args, picture, tuned), args.out, "time-to-accuracy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
