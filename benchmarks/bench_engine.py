"""Engine overhead: seconds per MAE training step through `parallelize` + `train` at each ZeRO stage, against a plain
torch loop on the same model, batch, param groups and AdamW (bf16 autocast over fp32 weights, world size 1).

    .venv/bin/python -m benchmarks.bench_engine            # ViT-B MAE, batch 8 at 224 px, glibc and tcmalloc
    .venv/bin/python -m benchmarks.bench_engine --quick    # ViT-Ti at 64 px, one round: checks that it runs
    .venv/bin/python -m benchmarks.bench_engine --matrix   # + plain/ZeRO-1 x AdamW kernel x malloc
    .venv/bin/python -m benchmarks.bench_engine --stages 1,2 --ds zero_optimization.compute_grad_norm=false
    .venv/bin/python -m benchmarks.bench_engine --official-mae ~/mae  # + the official MAE step and the ceiling
    .venv/bin/python -m benchmarks.bench_engine --compile-stages 2     # + ZeRO-2 with engine.compile: true

Every configuration runs in a fresh subprocess (clean DeepSpeed and allocator state, its own environment); the
configurations are interleaved over --rounds, in reverse order on odd rounds, so that load from other processes falls
on all of them alike. Step times are taken between consecutive batch draws, and the stream ends before `train`'s last
step (which would write a checkpoint). benchmarks/README.md explains the columns.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.engine_step import OFFICIAL_RUNNERS, OPTIMIZERS
from benchmarks.workers import machine_lines, run_worker, worker_env

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "benchmarks" / "results" / "engine.md"
PRELOADS = {"jemalloc": "libjemalloc.so.2", "tcmalloc": "libtcmalloc_minimal.so.4"}  # Debian: libjemalloc2, ...
# "glibc-keep": big blocks come from the heap instead of fresh mmap()s and freed memory is not trimmed, so a
# 400 MiB buffer freed in one step is reused in the next instead of being page-faulted in again.
MALLOC_KEEP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}
MALLOC_NAMES = ("glibc", "glibc-keep", *PRELOADS)


def allocator_env(name: str) -> dict[str, str] | None:
    """Environment for the malloc variant `name`; None when its library is not installed."""
    if name in ("glibc", "glibc-keep"):
        return {} if name == "glibc" else dict(MALLOC_KEEP)
    if name not in PRELOADS:
        raise ValueError(f"unknown allocator {name!r}; choose from glibc, glibc-keep, {', '.join(PRELOADS)}")
    hits = sorted(glob.glob(f"/usr/lib/*-linux-gnu/{PRELOADS[name]}") + glob.glob(f"/usr/lib*/{PRELOADS[name]}"))
    return {"LD_PRELOAD": hits[0]} if hits else None


@dataclass(frozen=True)
class Case:
    """One configuration: a plain torch loop (zero_stage None) or the engine at a ZeRO stage."""

    zero_stage: int | None
    optimizer: str
    allocator: str
    ds: tuple[str, ...] = ()
    """Overrides `a.b=value` of the DeepSpeed JSON that core.engine.setup generates (engine cases only)."""
    kind: str = "ours"
    """"ours" (plain loop or engine), "official" / "official-sdpa" (benchmarks/official_mae.py: attention as timm
    0.3.2 computed it / timm 1.0's fused SDPA) or "ceiling" (benchmarks/ceiling.py)."""
    compiled: bool = False
    """engine.compile: true (engine cases only)."""

    @property
    def runner(self) -> str:
        if self.kind in OFFICIAL_RUNNERS:
            return OFFICIAL_RUNNERS[self.kind]
        if self.kind == "ceiling":
            return "autocast-Linear ceiling"
        if self.zero_stage is None:
            return "plain torch loop"
        compiled = " compiled" if self.compiled else ""
        return f"engine ZeRO-{self.zero_stage}{compiled}" + "".join(f" + `{item}`" for item in self.ds)


# ---------------------------------------------------------------- driver: interleaved rounds, summary, table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="base", help="ViT size preset (default: base)")
    p.add_argument("--size", type=int, default=224, help="image side in pixels, patch 16 (default: 224)")
    p.add_argument("--batch", type=int, default=8, help="images per step (default: 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per process (default: 2)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per process (default: 5)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every config (default: 2)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS (default: every core)")
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages (default: 0,1,2,3)")
    p.add_argument("--allocators", default="glibc,tcmalloc", help="mallocs for the stages (default: %(default)s)")
    p.add_argument("--optimizer", default="fused", choices=OPTIMIZERS, help="AdamW kernel (default: fused)")
    p.add_argument("--ds", action="append", default=[], metavar="KEY=VALUE", help="DeepSpeed JSON override to try")
    p.add_argument("--ds-stages", help="stages to run again with the --ds overrides (default: --stages)")
    p.add_argument("--compile-stages", default="", help="stages to run again with engine.compile: true (default: none)")
    p.add_argument("--matrix", action="store_true", help="add plain/ZeRO-1 x fused/forloop x every malloc")
    p.add_argument("--max-others-load", type=float, default=0.2, help="repeat a run when others used more (0.2)")
    p.add_argument("--retries", type=int, default=2, help="repeats allowed per run (default: 2)")
    p.add_argument(
        "--official-mae",
        type=Path,
        metavar="PATH",
        help="facebookresearch/mae checkout: add its training step and the autocast-Linear ceiling to the rounds",
    )
    p.add_argument(
        "--official-allocator",
        choices=MALLOC_NAMES,
        help="malloc of the official code's runs (default: ours, the last of --allocators; glibc: as its own "
        "`python main_pretrain.py` runs)",
    )
    p.add_argument("--quick", action="store_true", help="ViT-Ti at 64 px, 1 warm-up + 3 steps, one round")
    p.add_argument("--out", type=Path, default=RESULTS, help="markdown result file (default: benchmarks/results/)")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.size, args.warmup, args.steps, args.rounds = "tiny", 64, 1, 3, 1
    return args


def installed(names: list[str]) -> list[str]:
    """`names` less the mallocs whose library is missing (with a note)."""
    missing = [name for name in names if allocator_env(name) is None]
    for name in missing:
        print(f"[bench] {name}: {PRELOADS[name]} not found, skipped (Debian: apt-get install -y lib{name}...)")
    return [name for name in names if name not in missing]


def build_cases(args: argparse.Namespace) -> tuple[list[Case], list[Case], list[Case]]:
    """(main table, malloc x kernel table, official code and ceiling)."""
    stages = [int(stage) for stage in args.stages.split(",")]
    ds_stages = [int(stage) for stage in (args.ds_stages or args.stages).split(",")] if args.ds else []
    compile_stages = [int(stage) for stage in args.compile_stages.split(",") if stage]
    main = []
    for allocator in installed(args.allocators.split(",")):
        main += [Case(stage, args.optimizer, allocator) for stage in [None, *stages]]
        main += [Case(stage, args.optimizer, allocator, tuple(args.ds)) for stage in ds_stages]
        main += [Case(stage, args.optimizer, allocator, compiled=True) for stage in compile_stages]
    matrix = []
    if args.matrix:
        for optimizer, allocator in itertools.product(("fused", "forloop"), installed(list(MALLOC_NAMES))):
            matrix += [Case(None, optimizer, allocator), Case(1, optimizer, allocator)]
    side = []
    if args.official_mae:  # torch's AdamW picks its for-loop kernel on CPU, where main_pretrain.py sets none
        allocator = installed(args.allocators.split(","))[-1]
        official = args.official_allocator or allocator
        if not installed([official]):
            raise SystemExit(f"--official-allocator {official}: its library is not installed")
        side = [Case(None, "forloop", official, kind=kind) for kind in OFFICIAL_RUNNERS]
        side.append(Case(None, "-", allocator, kind="ceiling"))
    return main, matrix, side


def run_case(case: Case, args: argparse.Namespace, scratch: Path, count_flops: bool = False) -> dict:
    """One fresh process for `case`; returns the worker's timings (and the step's FLOPs if `count_flops`)."""
    run_dir = Path(tempfile.mkdtemp(dir=scratch))
    spec = {**asdict(case), **{k: getattr(args, k) for k in ("model", "size", "batch", "warmup", "steps")}}
    spec.update(run_dir=str(run_dir), out=str(run_dir / "result.json"), official_mae=str(args.official_mae))
    spec["flops"] = count_flops
    env = worker_env(args.threads, PYTHONPATH=str(REPO))
    env = {k: v for k, v in env.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    env.update(allocator_env(case.allocator))
    return run_worker("benchmarks.engine_step", spec, env, case)


def run_all(cases: list[Case], args: argparse.Namespace, after_round=None) -> dict[Case, list[dict]]:
    """Every case once per round, odd rounds in reverse order so that drift in machine load evens out; a run during
    which other processes used more than --max-others-load of the machine is repeated up to --retries times.
    `after_round(results, rounds_done)` is called after every round (to write what is measured so far)."""
    results: dict[Case, list[dict]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as scratch:
        for r in range(args.rounds):
            for case in cases if r % 2 == 0 else cases[::-1]:
                for _ in range(args.retries + 1):
                    run = run_case(case, args, Path(scratch), count_flops=r == 0)
                    print(
                        f"[bench] round {r + 1}/{args.rounds} {case.runner}, {case.optimizer}, {case.allocator}: "
                        f"{statistics.median(run['step']):.3f} s/step, others' load {run['others_load']:.0%}",
                        flush=True,
                    )
                    if run["others_load"] <= args.max_others_load:
                        break
                results[case].append(run)
            if after_round is not None:
                after_round(results, r + 1)
    return results


def summarize(runs: list[dict]) -> dict:
    """Medians pooled over every round's timed steps, plus each round's own median to show the noise."""
    pooled = lambda key: statistics.median(v for run in runs for v in run[key])  # noqa: E731
    return {
        "median": pooled("step"),
        "cpu": pooled("cpu"),
        "min": min(v for run in runs for v in run["step"]),
        "rounds": [statistics.median(run["step"]) for run in runs],
        "others_load": max(run["others_load"] for run in runs),
        "backward": pooled("backward"),
        "step_phase": pooled("step_phase"),
        "optimizer": pooled("optimizer"),
        "fault_mib": pooled("faults") * os.sysconf("SC_PAGE_SIZE") / 2**20,
        "max_rss_gib": max(run["max_rss_gib"] for run in runs),
    }


def render_table(cases: list[Case], stats: dict[Case, dict]) -> list[str]:
    """Markdown rows; `vs plain` divides by the plain loop with the same AdamW kernel and malloc."""
    lines = [
        "| runner | AdamW | malloc | s/step median | min | vs plain (median / min) | per-round medians "
        "| others' load (max) | backward | step phase (share) | AdamW.step | faulted MiB/step | peak RSS GiB |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        s = stats[case]
        plain = stats.get(Case(None, case.optimizer, case.allocator))
        ratio = f"{s['median'] / plain['median']:.2f} / {s['min'] / plain['min']:.2f}" if plain else "-"
        lines.append(
            f"| {case.runner} | {case.optimizer} | {case.allocator} | {s['median']:.3f} | {s['min']:.3f} | {ratio} "
            f"| {' / '.join(f'{v:.3f}' for v in s['rounds'])} | {s['others_load']:.0%} | {s['backward']:.3f} "
            f"| {s['step_phase']:.3f} ({s['step_phase'] / s['median']:.0%}) | {s['optimizer']:.3f} "
            f"| {s['fault_mib']:.0f} | {s['max_rss_gib']:.2f} |"
        )
    spread = max((max(s["rounds"]) - min(s["rounds"])) / s["median"] for s in (stats[c] for c in cases))
    return [*lines, "", f"Largest spread of per-round medians in this table: {spread:.0%} of the median."]


def environment(args: argparse.Namespace, load_before: tuple[float, ...], rounds_done: int) -> list[str]:
    """Where and how the numbers were taken, and how many of the rounds asked for are in the tables."""
    done = "" if rounds_done == args.rounds else f" ({rounds_done} done when this was written)"
    return [
        *machine_lines(args.threads),
        f"- model: MAE ViT-{args.model.capitalize()}/16 at {args.size} px, batch {args.batch}, "
        "bf16 autocast over fp32 weights, world size 1 (one-process gloo group)",
        f"- per process: {args.warmup} warm-up + {args.steps} timed steps; {args.rounds} interleaved rounds{done}; "
        f"runs repeated (up to {args.retries}x) when other processes used over {args.max_others_load:.0%} of the "
        "machine",
        f"- 1-min load average before / after: {load_before[0]:.2f} / {os.getloadavg()[0]:.2f}",
        f"- command: `{' '.join(['python', '-m', 'benchmarks.bench_engine', *sys.argv[1:]])}`",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    main_cases, matrix_cases, side_cases = build_cases(args)
    load_before = os.getloadavg()

    def write(results: dict[Case, list[dict]], rounds_done: int) -> None:
        """The result file from the rounds done so far: a run cut short still leaves its complete rounds."""
        stats = {case: summarize(runs) for case, runs in results.items() if case.kind != "ceiling"}
        lines = ["# Engine vs plain torch loop", "", *environment(args, load_before, rounds_done), ""]
        lines += ["## Engine overhead at each ZeRO stage", "", *render_table(main_cases, stats), ""]
        if matrix_cases:
            lines += ["## AdamW kernel x malloc (plain loop and ZeRO-1)", "", *render_table(matrix_cases, stats), ""]
        if side_cases:
            from benchmarks.side_by_side import section

            lines += section(main_cases, side_cases, stats, results)
        publish("\n".join(lines), args.out)

    run_all(list(dict.fromkeys(main_cases + matrix_cases + side_cases)), args, after_round=write)
    return 0


def publish(text: str, out: Path) -> None:
    """Print a result table and write it to `out` (benchmarks/results/ by default)."""
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"[bench] written to {out}")


if __name__ == "__main__":
    sys.exit(main())
