"""Start-up: from `./launch.sh recipes/quickstart.yaml` starting to its first training step starting, in phases.

    .venv/bin/python -m benchmarks.bench_startup                  # 3 rounds of this tree (make bench-startup)
    .venv/bin/python -m benchmarks.bench_startup --before HEAD~3  # + the tree of a git revision, interleaved

Each launch is the quickstart recipe as a user runs it (its shards, `make quickstart-data`; its data workers, kNN
monitor and pre-flight), cut to 2 steps into a fresh run_dir. The phases are read off the time each line of the
launch's output arrives:

    check    launch.sh's own work and its pre-launch check (recipe, topology, pre-flight), up to the plan it prints
    engine   torchrun (several processes), the rank's imports, its process group, the model and the DeepSpeed
             engine, up to the `[mimpipe] stage ...` line printed once the engine is built
    loop     from there to the first training step starting: the first batch from the data workers (before issue 28's
             start-up work, also the FLOP count and peak for perf/mfu) ("first step: X s" arrives when the step
             ends; it started X s before)

Rounds interleave the trees (in reverse order on odd rounds), so both see the same machine load. Writes
benchmarks/results/startup.md. The goal (issue 28): at most 6 s in all on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_engine import publish
from benchmarks.workers import REPO, extract_tree, machine_lines

RESULTS = REPO / "benchmarks" / "results" / "startup.md"
SHARDS = REPO / "shards" / "quickstart"
PHASES = ("check", "engine", "loop")
FIRST_STEP = re.compile(r"\[mimpipe\] first step: ([0-9.]+) s")


def launch(tree: Path, run_dir: Path, log: Path) -> dict[str, float]:
    """One launch of the quickstart recipe from `tree`; the seconds of each phase and their total."""
    overrides = [
        f"run_dir={run_dir}", f"data.train={SHARDS / 'train'}", f"eval.knn.query.shards={SHARDS / 'test'}",
        "schedule.steps=2", "schedule.warmup_steps=1", "checkpoint.every_steps=1000", "checkpoint.export_at_end=false",
    ]  # fmt: skip
    env = {**os.environ, "PYTHON": sys.executable}
    start = time.perf_counter()
    with subprocess.Popen(
        ["./launch.sh", "recipes/quickstart.yaml", *overrides], cwd=tree, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1,
    ) as proc:  # fmt: skip
        timed = [(time.perf_counter() - start, line) for line in proc.stdout]
    log.write_text("".join(f"{now:7.2f} {line}" for now, line in timed))
    phases = read_phases(timed)
    if proc.returncode != 0 or phases is None:
        raise RuntimeError(f"launch from {tree} (exit {proc.returncode}) lacks a phase's line; see {log}")
    return phases


def read_phases(timed: list[tuple[float, str]]) -> dict[str, float] | None:
    """The seconds of each phase and their total ("total") from a launch's output lines and the seconds after the
    start at which each arrived; None when a phase's line is missing."""
    marks: dict[str, float] = {}
    for now, line in timed:
        if "[mimpipe] pre-flight:" in line:
            marks["check"] = now
        elif line.startswith("[mimpipe] stage ") and "check" in marks and "engine" not in marks:
            marks["engine"] = now
        elif match := FIRST_STEP.search(line):
            marks["loop"] = now - float(match[1])
    if set(marks) != set(PHASES):
        return None
    ends = [marks[p] for p in PHASES]
    begins = [0.0, *ends[:-1]]
    return {"total": ends[-1], **{p: end - begin for p, begin, end in zip(PHASES, begins, ends, strict=True)}}


def render(trees: dict[str, list[dict]]) -> list[str]:
    head = ["| tree | launches | " + " | ".join(f"{p}, s" for p in PHASES) + " | to the first step, s (min-max) |"]
    head.append("|---|---:|" + "---:|" * len(PHASES) + "---:|")
    rows = []
    for name, runs in trees.items():
        med = {k: statistics.median(r[k] for r in runs) for k in (*PHASES, "total")}
        totals = [r["total"] for r in runs]
        rows.append(
            f"| {name} | {len(runs)} | " + " | ".join(f"{med[p]:.2f}" for p in PHASES)
            + f" | **{med['total']:.2f}** ({min(totals):.2f}-{max(totals):.2f}) |"
        )  # fmt: skip
    return head + rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", default=None, help="a git revision to launch side by side with this tree")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (SHARDS / "train" / "index.json").is_file():
        raise SystemExit(f"bench_startup: no quickstart shards in {SHARDS}; run `make quickstart-data` first")
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as scratch:
        scratch = Path(scratch)
        trees = {"this tree": REPO}
        if args.before:
            rev = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=REPO, check=True, text=True,
                                 stdout=subprocess.PIPE).stdout.strip()  # fmt: skip
            trees[f"`{rev}` ({args.before})"] = extract_tree(args.before, scratch)
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for r in range(args.rounds):
            for name in list(trees)[:: -1 if r % 2 else 1]:
                run_dir = Path(tempfile.mkdtemp(dir=scratch))
                runs[name].append(launch(trees[name], run_dir / "run", run_dir / "launch.log"))
                print(f"[bench] round {r + 1} {name}: {runs[name][-1]['total']:.2f} s", flush=True)
    lines = [
        "# Start-up: `./launch.sh recipes/quickstart.yaml` to its first training step (benchmarks/bench_startup.py)",
        "",
        *machine_lines(os.cpu_count() or 1),
        f"- command: `python -m benchmarks.bench_startup{''.join(' ' + a for a in sys.argv[1:])}`; OMP_NUM_THREADS as "
        "launch.sh sets it (cores / processes)",
        "",
        *render(runs),
        "",
        "Medians over the launches. Phases (module docstring): check = launch.sh and its pre-launch check up to the "
        "plan; engine = torchrun (several processes), the rank's imports, model and DeepSpeed engine up to the "
        "`[mimpipe] stage` line; loop = from there to the first step starting (the first step's line gives its time to "
        "0.1 s, so this phase is known to +-0.05 s). Goal (issue 28): at most 6 s to the first step on an idle 2-core "
        "machine.",
        "",
    ]
    publish("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
