"""What starting an evaluation loader's DataLoader workers costs per evaluation, by start method, side by side.

    .venv/bin/python -m benchmarks.bench_eval_workers                 # 3 rounds, 2 workers, 8 passes per process

Each case runs in a fresh process that first joins a one-process gloo group (so the process runs threads, as a rank
does), then makes an evaluation loader (`make_eval_loader`, 256 synthetic 16 px samples in 4 shards, batch 32) and
times whole passes over it, the loader made afresh for each pass as fine-tuning does at every evaluation (persistent
workers: made once). The first pass includes what happens once per process (the fork server's start and imports);
the later passes are what every further evaluation pays. The same passes with num_workers=0 are the reference: a
pass's time minus theirs is the workers' cost.

    fork          DataLoader's default on Linux: workers forked from the (threaded) rank; what issue 27 replaced
    forkserver    our loaders (data/workers.py): a single-threaded server per rank forks each worker
    spawn         each worker a fresh interpreter that imports torch and the data modules
    forkserver, persistent workers   workers started once and kept between passes

Cases are interleaved over --rounds (reversed on odd rounds); the table gives medians over every round.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.workers import machine_lines, run_worker, worker_env

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "benchmarks" / "results" / "eval_workers.md"
CASES = {
    "none": "num_workers=0 (reference)",
    "fork": "fork",
    "forkserver": "forkserver (ours)",
    "spawn": "spawn",
    "persistent": "forkserver, persistent workers",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=8, help="passes per process, the first one included")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(json.loads(args.worker))
    with tempfile.TemporaryDirectory() as tmp:
        shards = _write_shards(Path(tmp))
        load_before = os.getloadavg()[0]
        times: dict[str, list[list[float]]] = {case: [] for case in CASES}
        for round_ in range(args.rounds):
            for case in CASES if round_ % 2 == 0 else reversed(CASES):
                spec = {"case": case, "shards": shards, "passes": args.passes, "workers": args.workers}
                spec["out"] = str(Path(tmp) / f"{case}_{round_}.json")
                times[case].append(
                    run_worker("benchmarks.bench_eval_workers", spec, worker_env(threads=1), case)["seconds"]
                )
                print(f"round {round_} {case}: " + " ".join(f"{t * 1000:.0f}" for t in times[case][-1]), flush=True)
        lines = _report(times, args, load_before)
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _write_shards(root: Path) -> list[str]:
    from tests.launching import write_synthetic

    out = write_synthetic(root / "val", "val", 256, 64, seed=0)
    return sorted(str(p) for p in out.glob("*.tar"))


def _worker(spec: dict) -> int:
    """One process: a gloo group of one, then `passes` timed passes of the case; seconds per pass to spec["out"]."""
    import torch.distributed as dist

    from data import worker_process, workers
    from data.pipeline import make_eval_loader
    from data.transforms import eval_transform

    dist.init_process_group("gloo", init_method=f"file://{spec['out']}.store", rank=0, world_size=1)
    case, num_workers = spec["case"], spec["workers"]
    if case in ("fork", "spawn"):
        worker_process.START_METHOD = case  # what worker_process.context() asks multiprocessing for
    transform = eval_transform(16, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), crop_pct=1.0)

    def loader():
        return make_eval_loader(
            spec["shards"], transform=transform, batch_size=32, rank=0, world_size=1,
            num_workers=0 if case == "none" else num_workers,
        )  # fmt: skip

    kept = None
    if case == "persistent":  # the same stream, in a loader whose workers stay between passes
        kept = workers.worker_loader(
            loader().dataset, num_workers=num_workers, timeout_s=worker_process.LOADER_TIMEOUT_S, rank=0,
            batch_size=None, persistent_workers=True,
        )  # fmt: skip
    seconds = []
    for _ in range(spec["passes"]):
        start = time.perf_counter()
        num_samples = sum(len(batch["label"]) for batch in (kept if kept is not None else loader()))
        seconds.append(time.perf_counter() - start)
        assert num_samples == 256, num_samples
    Path(spec["out"]).write_text(json.dumps({"seconds": seconds}))
    dist.destroy_process_group()
    return 0


def _report(times: dict[str, list[list[float]]], args: argparse.Namespace, load_before: float) -> list[str]:
    def median_ms(values: list[float]) -> float:
        return statistics.median(values) * 1000

    first = {case: median_ms([passes[0] for passes in runs]) for case, runs in times.items()}
    later = {case: median_ms([t for passes in runs for t in passes[1:]]) for case, runs in times.items()}
    lines = [
        "# Evaluation loader workers: cost per evaluation by start method",
        "",
        *machine_lines(threads=1),
        f"- per process: a one-process gloo group, then {args.passes} passes over 256 samples (16 px, 4 shards, "
        f"batch 32) with {args.workers} workers, the loader made afresh for each pass (persistent: once); "
        f"{args.rounds} interleaved rounds; multiprocessing {multiprocessing.get_all_start_methods()}",
        f"- 1-min load average before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f} (a shared machine: read "
        "the side-by-side differences, not the absolute times)",
        f"- command: `python -m benchmarks.bench_eval_workers {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        "",
        "| start method | first pass, ms (median) | later passes, ms (median) | later pass minus num_workers=0, ms |",
        "|---|---:|---:|---:|",
    ]
    for case, title in CASES.items():
        extra = "" if case == "none" else f"{later[case] - later['none']:.0f}"
        lines.append(f"| {title} | {first[case]:.0f} | {later[case]:.0f} | {extra} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
