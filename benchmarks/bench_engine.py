"""Engine overhead: seconds per MAE training step through `parallelize` + `train` at each ZeRO stage, against a plain
torch loop on the same model, batch, param groups and optimizer (bf16 autocast over fp32 weights, world size 1).

    .venv/bin/python benchmarks/bench_engine.py                # ViT-B MAE, batch 8 at 224 px (`make bench`)
    .venv/bin/python benchmarks/bench_engine.py --quick        # ViT-Ti at 64 px, one round: a smoke run
    .venv/bin/python benchmarks/bench_engine.py --allocators   # + plain/ZeRO-1 x optimizer kernel x malloc

Every configuration runs in a fresh subprocess (clean DeepSpeed and allocator state, its own environment), and the
configurations are interleaved over `--rounds`, alternating the order, so that load from other processes on the
machine falls on all of them alike. Step times are taken between consecutive batch draws, so `train`'s final
checkpoint (after the last draw) is never timed. See benchmarks/README.md for how to read the table.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "engine.md"
HUGE = 10**9  # logging / checkpoint period that never comes round in a benchmark run

# malloc variants, applied to a configuration's subprocess only. "glibc-keep" stops glibc from serving big blocks
# with fresh mmap()s and from trimming its heap, so a freed 400 MiB buffer is reused instead of page-faulted anew.
MALLOC_KEEP = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}
PRELOADS = {"jemalloc": "libjemalloc.so.2", "tcmalloc": "libtcmalloc_minimal.so.4"}
OPTIMIZERS = {"fused": (True, False), "foreach": (False, True), "forloop": (False, False)}  # (fused, foreach)


def find_library(soname: str) -> str | None:
    """Full path of a shared library in the usual system folders (Debian: /usr/lib/<triplet>/)."""
    for folder in ("/usr/lib/*-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        hits = sorted(glob.glob(f"{folder}/{soname}"))
        if hits:
            return hits[0]
    return None


def allocator_env(name: str) -> dict[str, str] | None:
    """Environment for the malloc variant `name`; None when its library is not installed."""
    if name == "glibc":
        return {}
    if name == "glibc-keep":
        return dict(MALLOC_KEEP)
    if name in PRELOADS:
        path = find_library(PRELOADS[name])
        return None if path is None else {"LD_PRELOAD": path}
    raise ValueError(f"--allocator: unknown allocator {name!r}; choose from glibc, glibc-keep, {', '.join(PRELOADS)}")


@dataclass(frozen=True)
class Case:
    """One configuration: a plain torch loop (zero_stage None) or the engine at a ZeRO stage."""

    zero_stage: int | None
    optimizer: str
    allocator: str

    @property
    def runner(self) -> str:
        return "plain torch loop" if self.zero_stage is None else f"engine ZeRO-{self.zero_stage}"

    @property
    def label(self) -> str:
        return f"{self.runner}, {self.optimizer} AdamW, {self.allocator}"


# ---------------------------------------------------------------- worker: one configuration in its own process


def build_config(spec: dict):
    from core.config import load_config

    overrides = [
        f"run_dir={spec['run_dir']}",
        f"model.size={spec['model']}",
        f"model.img_size={spec['size']}",
        "model.patch_size=16",
        f"data.global_batch_size={spec['batch']}",
        f"engine.zero_stage={spec['zero_stage'] or 0}",
        "engine.precision=bf16",
        "engine.device=cpu",
        f"schedule.steps={spec['warmup'] + spec['steps'] + 1}",
        "schedule.warmup_steps=1",
        f"logging.every_steps={HUGE}",
        "logging.image_every_steps=0",
        "logging.tensorboard=false",
        f"checkpoint.every_steps={HUGE}",
    ]
    return load_config(None, overrides)


def build_mae(cfg):
    """The MAE objective the pretraining stage builds, from core.models and pretrain.mae."""
    from core.models import build_vit
    from pretrain.mae import MAE

    o = cfg.objective
    encoder = build_vit(cfg.model.size, img_size=cfg.model.img_size, patch_size=cfg.model.patch_size)
    return MAE(
        encoder,
        mask_ratio=o.mask_ratio,
        norm_pix_loss=o.norm_pix_loss,
        decoder_embed_dim=o.decoder_embed_dim,
        decoder_depth=o.decoder_depth,
        decoder_num_heads=o.decoder_num_heads,
    )


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores, every process), from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class Clock:
    """Readings at the start of every step; `timed` wraps a callable and adds its durations to the current step."""

    def __init__(self):
        self.marks: list[tuple[float, int, float, float]] = []  # (wall, page faults, own CPU s, machine busy CPU s)
        self.calls: dict[str, dict[int, float]] = {}

    def mark(self) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        own = usage.ru_utime + usage.ru_stime
        self.marks.append((time.perf_counter(), usage.ru_minflt, own, busy_cpu_seconds()))

    def timed(self, name: str, fn):
        per_step = self.calls.setdefault(name, {})

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            step = len(self.marks) - 1
            per_step[step] = per_step.get(step, 0.0) + time.perf_counter() - t0
            return out

        return wrapper

    def report(self, first: int, last: int) -> dict:
        """Per-step values for steps first..last-1, and the share of the machine that other processes used."""
        deltas = [[b[k] - a[k] for k in range(4)] for a, b in itertools.pairwise(self.marks)][first:last]
        wall, _, own, busy = (self.marks[last][k] - self.marks[first][k] for k in range(4))
        return {
            "step": [d[0] for d in deltas],
            "faults": [d[1] for d in deltas],
            **{name: [calls.get(i, 0.0) for i in range(first, last)] for name, calls in self.calls.items()},
            "others_load": max(0.0, busy - own) / (wall * os.cpu_count()),
        }


def run_plain(cfg, spec: dict, batch: dict, clock: Clock) -> None:
    """Forward under autocast, backward, AdamW step, zero_grad: what the engine's step does, without the engine."""
    import torch
    from timm.optim import param_groups_weight_decay

    torch.manual_seed(0)
    objective = build_mae(cfg)
    groups = param_groups_weight_decay(
        objective, weight_decay=cfg.optim.weight_decay, no_weight_decay_list=objective.no_weight_decay()
    )
    fused, foreach = OPTIMIZERS[spec["optimizer"]]
    optimizer = torch.optim.AdamW(
        groups, lr=cfg.peak_lr, betas=cfg.optim.betas, eps=cfg.optim.eps, fused=fused, foreach=foreach
    )
    optimizer.step = clock.timed("optimizer", optimizer.step)

    def step_phase() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step_phase = clock.timed("step_phase", step_phase)
    for _ in range(spec["warmup"] + spec["steps"]):
        clock.mark()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = objective(batch)["loss"]
        loss.backward()
        step_phase()
    clock.mark()


def run_engine(cfg, spec: dict, batch: dict, clock: Clock) -> None:
    """The real loop on the real DeepSpeed engine; the clock reads at every batch draw."""
    import torch

    from core.config import dump_config
    from core.engine.distributed import init_distributed
    from core.engine.loop import TrainState, train
    from core.engine.setup import parallelize
    from core.logging import MetricsLogger

    dist = init_distributed("cpu")
    run_dir = Path(spec["run_dir"])
    torch.manual_seed(0)
    engine, optimizer = parallelize(build_mae(cfg), cfg=cfg, dist=dist, run_dir=run_dir)
    fused, foreach = OPTIMIZERS[spec["optimizer"]]
    for group in optimizer.param_groups:  # torch's AdamW reads both flags from the group at every step
        group["fused"], group["foreach"] = fused, foreach
    optimizer.step = clock.timed("optimizer", optimizer.step)
    engine.step = clock.timed("step_phase", engine.step)

    def batches():
        while True:
            clock.mark()
            yield batch

    total = spec["warmup"] + spec["steps"] + 1
    logger = MetricsLogger(run_dir, enabled=False, tensorboard=False, total_steps=total)
    train(
        cfg=cfg,
        engine=engine,
        optimizer=optimizer,
        batches=batches(),
        dist=dist,
        state=TrainState(),
        total_steps=total,
        warmup_steps=1,
        logger=logger,
        run_dir=run_dir,
        config_yaml=dump_config(cfg),
    )


def worker(spec_json: str) -> None:
    """Runs one configuration and writes its timings to spec['out'] as JSON."""
    import torch

    spec = json.loads(spec_json)
    cfg = build_config(spec)
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(spec["batch"], 3, spec["size"], spec["size"], generator=gen)  # (B, C, H, W)
    batch = {"image": images, "num_corrupt": torch.tensor(0)}
    clock = Clock()
    (run_plain if spec["zero_stage"] is None else run_engine)(cfg, spec, batch, clock)
    result = clock.report(spec["warmup"], spec["warmup"] + spec["steps"])
    result["max_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    Path(spec["out"]).write_text(json.dumps(result))


# ---------------------------------------------------------------- driver: interleaved rounds, summary, table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="base", help="ViT size preset (default: base)")
    parser.add_argument("--size", type=int, default=224, help="image side in pixels, patch 16 (default: 224)")
    parser.add_argument("--batch", type=int, default=8, help="images per step (default: 8)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per process (default: 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per process (default: 5)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every config (default: 3)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS (default: all cores)")
    parser.add_argument("--allocator", default="glibc", help="malloc for the main table (default: glibc)")
    parser.add_argument("--optimizer", default="fused", choices=OPTIMIZERS, help="AdamW kernel for the main table")
    parser.add_argument("--allocators", action="store_true", help="add the plain/ZeRO-1 x kernel x malloc table")
    parser.add_argument("--matrix-allocators", default="glibc,glibc-keep,jemalloc,tcmalloc", help="for --allocators")
    parser.add_argument("--matrix-optimizers", default="fused,forloop", help="for --allocators")
    parser.add_argument("--quick", action="store_true", help="ViT-Ti at 64 px, 1 warm-up + 3 steps, one round")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"markdown result file (default: {RESULTS})")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.size, args.warmup, args.steps, args.rounds = "tiny", 64, 1, 3, 1
    return args


def build_cases(args: argparse.Namespace) -> tuple[list[Case], list[Case]]:
    """(main table, allocator table); configurations whose malloc is not installed are left out with a note."""
    main = [Case(stage, args.optimizer, args.allocator) for stage in (None, 0, 1, 2, 3)]
    matrix = []
    if args.allocators:
        for allocator in args.matrix_allocators.split(","):
            if allocator_env(allocator) is None:
                print(f"[bench] {allocator}: {PRELOADS[allocator]} not found, skipped (apt-get install it)")
                continue
            for optimizer in args.matrix_optimizers.split(","):
                if optimizer not in OPTIMIZERS:
                    raise ValueError(f"--matrix-optimizers: unknown {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
                matrix += [Case(None, optimizer, allocator), Case(1, optimizer, allocator)]
    if allocator_env(args.allocator) is None:
        raise ValueError(f"--allocator {args.allocator}: {PRELOADS[args.allocator]} is not installed")
    return main, [c for c in matrix if c not in main]


def run_case(case: Case, args: argparse.Namespace, scratch: Path) -> dict:
    """One fresh process for `case`; returns the worker's timings."""
    run_dir = Path(tempfile.mkdtemp(dir=scratch))
    spec = {**asdict(case), **{k: getattr(args, k) for k in ("model", "size", "batch", "warmup", "steps")}}
    spec.update(run_dir=str(run_dir), out=str(run_dir / "result.json"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    env.update(allocator_env(case.allocator))
    env.update(OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(key, None)  # each worker makes its own one-process group on a free port
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{case.label} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    return json.loads(Path(spec["out"]).read_text())


def run_all(cases: list[Case], args: argparse.Namespace) -> dict[Case, list[dict]]:
    """Every case once per round; odd rounds run in reverse order so drift in machine load evens out."""
    results: dict[Case, list[dict]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory(prefix="bench_engine_") as scratch:
        for r in range(args.rounds):
            for case in cases if r % 2 == 0 else cases[::-1]:
                t0 = time.perf_counter()
                results[case].append(run_case(case, args, Path(scratch)))
                median = statistics.median(results[case][-1]["step"])
                print(
                    f"[bench] round {r + 1}/{args.rounds} {case.label}: {median:.3f} s/step "
                    f"({time.perf_counter() - t0:.0f} s incl. start-up)",
                    flush=True,
                )
    return results


def summarize(runs: list[dict]) -> dict:
    """Medians pooled over every round's timed steps, plus each round's own median to show the noise."""
    pooled = lambda key: statistics.median(v for run in runs for v in run[key])  # noqa: E731
    return {
        "median": pooled("step"),
        "min": min(v for run in runs for v in run["step"]),
        "rounds": [statistics.median(run["step"]) for run in runs],
        "others_load": statistics.median(run["others_load"] for run in runs),
        "step_phase": pooled("step_phase"),
        "optimizer": pooled("optimizer"),
        "fault_mib": pooled("faults") * os.sysconf("SC_PAGE_SIZE") / 2**20,
        "max_rss_gib": max(run["max_rss_gib"] for run in runs),
    }


def render_table(cases: list[Case], stats: dict[Case, dict]) -> list[str]:
    """Markdown rows; `vs plain` divides by the plain loop with the same AdamW kernel and malloc."""
    lines = [
        "| runner | AdamW | malloc | s/step median | min | vs plain (median / min) | per-round medians "
        "| others' load | step phase (share) | AdamW.step | faulted MiB/step | peak RSS GiB |",
        "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        s = stats[case]
        plain = stats.get(Case(None, case.optimizer, case.allocator))
        ratio = f"{s['median'] / plain['median']:.2f} / {s['min'] / plain['min']:.2f}" if plain else "-"
        lines.append(
            f"| {case.runner} | {case.optimizer} | {case.allocator} | {s['median']:.3f} | {s['min']:.3f} | {ratio} "
            f"| {' / '.join(f'{v:.3f}' for v in s['rounds'])} | {s['others_load']:.0%} "
            f"| {s['step_phase']:.3f} ({s['step_phase'] / s['median']:.0%}) | {s['optimizer']:.3f} "
            f"| {s['fault_mib']:.0f} | {s['max_rss_gib']:.2f} |"
        )
    spread = max((max(s["rounds"]) - min(s["rounds"])) / s["median"] for s in (stats[c] for c in cases))
    return [*lines, "", f"Largest spread of per-round medians in this table: {spread:.0%} of the median."]


def environment(args: argparse.Namespace, load_before: tuple[float, ...]) -> list[str]:
    """Where and how the numbers were taken."""
    import torch

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), platform.machine())
    load_after = os.getloadavg()
    return [
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- CPU: {cpu}, {os.cpu_count()} cores visible; torch threads: {args.threads}",
        f"- torch {torch.__version__}, deepspeed {version('deepspeed')}, timm {version('timm')}, "
        f"python {platform.python_version()}, {' '.join(platform.libc_ver())}",
        f"- model: MAE ViT-{args.model[0].upper()}{args.model[1:]} /16 at {args.size} px, batch {args.batch}, "
        f"bf16 autocast over fp32 weights, world size 1 (one-process gloo group)",
        f"- per process: {args.warmup} warm-up + {args.steps} timed steps; {args.rounds} interleaved rounds",
        f"- 1-min load average before / after: {load_before[0]:.2f} / {load_after[0]:.2f} (other jobs share the cores)",
        f"- command: `{' '.join([Path(sys.executable).name, *sys.argv])}`",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    main_cases, matrix_cases = build_cases(args)
    load_before = os.getloadavg()
    results = run_all(main_cases + matrix_cases, args)
    stats = {case: summarize(runs) for case, runs in results.items()}
    lines = ["# Engine vs plain torch loop", "", *environment(args, load_before), ""]
    lines += ["## Engine overhead at each ZeRO stage", "", *render_table(main_cases, stats), ""]
    if matrix_cases:
        lines += ["## AdamW kernel x malloc (plain loop and ZeRO-1)", ""]
        lines += [*render_table([c for c in main_cases if c.zero_stage in (None, 1)] + matrix_cases, stats), ""]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"[bench] written to {args.out}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        sys.path.insert(0, str(REPO))
        worker(sys.argv[2])
        sys.exit(0)
    sys.exit(main())
