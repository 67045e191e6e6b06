"""Fixed per-step cost on the quickstart models: the engine's training step against a plain timm loop, side by side.

    .venv/bin/python -m benchmarks.bench_overhead                       # fine-tuning and MAE, ZeRO-0/1/2, 3 rounds
    .venv/bin/python -m benchmarks.bench_overhead --before HEAD~3       # + the engine as it was at a git revision
    .venv/bin/python -m benchmarks.bench_overhead --profile ft:1        # cProfile of one case, top entries printed

The quickstart recipes (recipes/quickstart_finetune.yaml: ViT 128 wide, 4 blocks at 28 px, batch 128, layer decay
0.85; recipes/quickstart.yaml: MAE at 28 px, batch 256) are tiny: a step is tens of milliseconds, so what the engine
does per step besides the arithmetic (Python per parameter group, DeepSpeed's bookkeeping, syncs) shows as a ratio
against a plain loop of the same model, batch, bf16 autocast and AdamW. Every case runs in a fresh process on one
in-memory batch (the data path is measured by `bench_data.py`), and the cases are interleaved over --rounds, in
reverse order on odd rounds. `--before REV` runs the engine cases a second time on the tree of a git revision
(`git archive`), so a change is measured against the code it replaces in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.workers import extract_tree, machine_lines, quickstart_vit, run_worker, worker_env

REPO = Path(__file__).resolve().parents[1]

RESULTS = REPO / "benchmarks" / "results" / "overhead.md"
NEVER = 10**9  # logging / checkpoint period that never comes round in a benchmark run
RECIPES = {"ft": "recipes/quickstart_finetune.yaml", "mae": "recipes/quickstart.yaml"}
TITLES = {"ft": "quickstart fine-tuning", "mae": "quickstart MAE pretraining"}
NUM_CLASSES = 10
TCMALLOC = Path(f"/usr/lib/{platform.machine()}-linux-gnu/libtcmalloc_minimal.so.4")


@dataclass(frozen=True)
class Case:
    """One configuration: `objective` (ft or mae) in a plain loop (zero_stage None) or the engine at a ZeRO stage,
    on this tree or (`tree` = a git revision) on an older one."""

    objective: str
    zero_stage: int | None
    tree: str = ""

    @property
    def runner(self) -> str:
        if self.zero_stage is None:
            return "plain timm loop"
        return f"engine ZeRO-{self.zero_stage}" + (f" @ {self.tree}" if self.tree else "")


# ---------------------------------------------------------------- worker: one configuration in its own process


def build_config(spec: dict):
    from core.recipe.config import load_config

    overrides = [
        f"run_dir={spec['run_dir']}",
        f"engine.zero_stage={spec['zero_stage'] or 0}",
        "engine.device=cpu",
        f"schedule.steps={spec['warmup'] + spec['steps'] + 1}",
        f"logging.every_steps={NEVER}",
        "logging.image_every_steps=0",
        "logging.tensorboard=false",
        f"checkpoint.every_steps={NEVER}",
        "model.init=null",
        *quickstart_vit(),  # quickstart_finetune.yaml takes it from the export; MAE's recipe states it (the same)
    ]
    return load_config(REPO / RECIPES[spec["objective"]], overrides)


def build_objective(cfg, objective: str):
    """A function that builds the stage's objective, as the stage does (random weights: the hand-off does not change
    the step's cost)."""
    if objective == "mae":
        from pretrain.objectives import objective_builder

        return objective_builder(cfg)
    try:
        from core.models.build import build_model
    except ImportError:  # a --before tree from before core/engine/stage.py was split
        from core.engine.stage import build_model
    from finetune.classification import Classification

    return lambda: Classification(
        build_model(cfg, num_classes=NUM_CLASSES, plain=True), label_smoothing=cfg.objective.label_smoothing
    )


def make_batch(cfg, objective: str) -> dict:
    """One batch of the stage's shape: image (B, 3, H, W), label (B,) for fine-tuning."""
    import torch

    from data.pipeline import zero_counts

    gen = torch.Generator().manual_seed(0)
    size, batch = cfg.model.img_size, cfg.data.global_batch_size
    out = {"image": torch.randn(batch, 3, size, size, generator=gen), **zero_counts()}
    if objective == "ft":
        out["label"] = torch.randint(0, NUM_CLASSES, (batch,), generator=gen)
    return out


def run_plain(cfg, spec: dict, batch: dict, marks: list[tuple[float, float]]) -> None:
    """A plain timm training loop: timm's layer-decay / weight-decay groups, torch's fused AdamW, the lr set on every
    group each step (as timm's schedulers do), bf16 autocast forward, backward, step, zero_grad."""
    import torch
    from timm.optim import param_groups_layer_decay, param_groups_weight_decay

    from core.engine.schedule import lr_at
    from core.engine.setup import set_attention

    torch.manual_seed(0)
    model = build_objective(cfg, spec["objective"])()
    set_attention(model, cfg.engine.attention, torch.device("cpu"))  # the kernel the engine picks
    o, skip = cfg.optim, model.no_weight_decay()
    if o.layer_decay < 1.0:
        groups = param_groups_layer_decay(
            model, weight_decay=o.weight_decay, no_weight_decay_list=skip, layer_decay=o.layer_decay
        )
    else:
        groups = param_groups_weight_decay(model, weight_decay=o.weight_decay, no_weight_decay_list=skip)
    optimizer = torch.optim.AdamW(groups, lr=cfg.peak_lr, betas=o.betas, eps=o.eps, fused=True)
    total = cfg.schedule.steps
    for step in range(1, spec["warmup"] + spec["steps"] + 1):
        marks.append((time.perf_counter(), time.process_time()))
        lr = lr_at(
            step, peak_lr=cfg.peak_lr, min_lr=o.min_lr, warmup_steps=cfg.schedule.warmup_steps, total_steps=total
        )
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(batch)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    marks.append((time.perf_counter(), time.process_time()))


class MeasurementDone(Exception):
    """Raised by the benchmark's batch stream once every timed step has been drawn."""


def run_engine(cfg, spec: dict, batch: dict, marks: list[tuple[float, float]]) -> None:
    """The real loop (`core.engine.loop.train`) on the real DeepSpeed engine; a mark at every batch draw."""
    import torch

    from core.engine.distributed import init_distributed
    from core.engine.loop import train
    from core.engine.setup import parallelize
    from core.engine.train_state import TrainState
    from core.recipe.config import dump_config
    from core.report.logging import MetricsLogger

    dist = init_distributed("cpu")
    run_dir = Path(spec["run_dir"])
    torch.manual_seed(0)
    engine, optimizer = parallelize(build_objective(cfg, spec["objective"]), cfg=cfg, dist=dist, run_dir=run_dir)

    def batches():
        for _ in range(spec["warmup"] + spec["steps"]):
            marks.append((time.perf_counter(), time.process_time()))
            yield batch
        marks.append((time.perf_counter(), time.process_time()))
        raise MeasurementDone  # before the loop's last step, which would also write a checkpoint

    total = cfg.schedule.steps
    logger = MetricsLogger(run_dir, enabled=False, tensorboard=False, total_steps=total)
    kwargs = dict(
        cfg=cfg, dist=dist, run_dir=run_dir, config_yaml=dump_config(cfg), state=TrainState(), total_steps=total,
        warmup_steps=cfg.schedule.warmup_steps, logger=logger,
    )  # fmt: skip
    with contextlib.suppress(MeasurementDone):
        try:
            from core.engine.loop import LoopHooks
            from core.engine.stage import StageRun
        except ImportError:  # a --before tree whose train() still took every field as a keyword
            train(engine=engine, optimizer=optimizer, batches=batches(), **kwargs)
        else:
            run = StageRun(recipe="", samples=None, resume=None, **kwargs)
            train(run, engine, optimizer, batches(), LoopHooks())


def worker(spec_json: str) -> None:
    """Runs one configuration and writes its step times (and, with `profile`, cProfile's top entries) to JSON."""
    spec = json.loads(spec_json)
    cfg = build_config(spec)
    batch = make_batch(cfg, spec["objective"])
    marks: list[tuple[float, float]] = []
    run = run_plain if spec["zero_stage"] is None else run_engine
    profiler = cProfile.Profile() if spec["profile"] else None
    with profiler or contextlib.nullcontext():
        run(cfg, spec, batch, marks)
    pairs = list(zip(marks, marks[1:], strict=False))[spec["warmup"] :]
    result = {"step": [b[0] - a[0] for a, b in pairs], "cpu": [b[1] - a[1] for a, b in pairs]}
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(os.environ.get("BENCH_SORT", "tottime")).print_stats(
            int(os.environ.get("BENCH_TOP", "40"))
        )
        result["profile"] = text.getvalue()
    Path(spec["out"]).write_text(json.dumps(result))


# ---------------------------------------------------------------- driver: interleaved rounds, summary, table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--objectives", default="ft,mae", help="ft (fine-tuning) and/or mae (default: %(default)s)")
    p.add_argument("--stages", default="0,1,2", help="ZeRO stages of the engine cases (default: %(default)s)")
    p.add_argument("--before", metavar="REV", help="also run the engine cases on the tree of this git revision")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per process (default: 10)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per process (default: 60)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every case (default: 3)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS (default: every core)")
    p.add_argument("--profile", metavar="OBJ:STAGE", help="profile one case (stage 'plain' for the plain loop)")
    p.add_argument("--out", type=Path, default=RESULTS, help="markdown result file (default: %(default)s)")
    return p.parse_args(argv)


def build_cases(args: argparse.Namespace) -> list[Case]:
    stages = [int(stage) for stage in args.stages.split(",")]
    cases = []
    for objective in args.objectives.split(","):
        cases += [Case(objective, None), *(Case(objective, stage) for stage in stages)]
        cases += [Case(objective, stage, args.before) for stage in stages] if args.before else []
    return cases


def run_case(case: Case, args: argparse.Namespace, scratch: Path, trees: dict[str, Path], profile: bool) -> dict:
    """One fresh process for `case`; returns the worker's timings."""
    run_dir = Path(tempfile.mkdtemp(dir=scratch))
    spec = {**asdict(case), **{k: getattr(args, k) for k in ("warmup", "steps")}, "profile": profile}
    spec.update(run_dir=str(run_dir), out=str(run_dir / "result.json"))
    # `python -m` looks in its working directory first: the product packages come from the tree under test, and
    # `benchmarks` (not in an extracted tree) from PYTHONPATH
    code_root = trees[case.tree] if case.tree else REPO
    env = worker_env(args.threads, PYTHONPATH=str(REPO))
    if TCMALLOC.exists():  # as launch.sh runs
        env["LD_PRELOAD"] = str(TCMALLOC)
    return run_worker("benchmarks.bench_overhead", spec, env, case, cwd=code_root)


def run_all(cases: list[Case], args: argparse.Namespace) -> dict[Case, list[dict]]:
    """Every case once per round, odd rounds in reverse order, so that drift in machine load evens out."""
    results: dict[Case, list[dict]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory(prefix="bench_overhead_") as scratch:
        trees = {args.before: extract_tree(args.before, Path(scratch))} if args.before else {}
        for r in range(args.rounds):
            for case in cases if r % 2 == 0 else cases[::-1]:
                run = run_case(case, args, Path(scratch), trees, profile=False)
                results[case].append(run)
                print(f"[bench] round {r + 1}/{args.rounds} {TITLES[case.objective]}, {case.runner}: "
                      f"{statistics.median(run['step']) * 1e3:.1f} ms/step, "
                      f"{statistics.median(run['cpu']) * 1e3:.1f} CPU ms/step", flush=True)  # fmt: skip
    return results


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(v for run in runs for v in run[key])


def render_table(cases: list[Case], results: dict[Case, list[dict]]) -> list[str]:
    """Markdown rows; the `vs plain` columns divide by the plain loop's median of the same objective."""
    lines = [
        "| objective | runner | ms/step median | images/s | vs plain | CPU ms/step median | CPU vs plain "
        "| per-round medians (ms) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for case in cases:
        runs, plain = results[case], results[Case(case.objective, None)]
        wall, cpu = _median(runs, "step"), _median(runs, "cpu")
        batch = 64 if case.objective == "ft" else 256
        rounds = " / ".join(f"{statistics.median(run['step']) * 1e3:.1f}" for run in runs)
        lines.append(
            f"| {TITLES[case.objective]} | {case.runner} | {wall * 1e3:.1f} | {batch / wall:.0f} "
            f"| {wall / _median(plain, 'step'):.3f} | {cpu * 1e3:.1f} | {cpu / _median(plain, 'cpu'):.3f} | {rounds} |"
        )
    return lines


def environment(args: argparse.Namespace, load_before: float) -> list[str]:
    return [
        *machine_lines(args.threads),
        f"- per process: {args.warmup} warm-up + {args.steps} timed steps on one in-memory batch; {args.rounds} "
        f"interleaved rounds; world size 1 (one-process gloo group), bf16 autocast over fp32 weights",
        f"- 1-min load average before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f} (other jobs shared the "
        "machine: read the ratios, taken side by side, not the absolute times)",
        f"- command: `{' '.join(['python', '-m', 'benchmarks.bench_overhead', *sys.argv[1:]])}`",
    ]


def profile_one(args: argparse.Namespace) -> int:
    objective, stage = args.profile.split(":")
    case = Case(objective, None if stage == "plain" else int(stage))
    with tempfile.TemporaryDirectory(prefix="bench_overhead_") as scratch:
        result = run_case(case, args, Path(scratch), {}, profile=True)
    print(f"{TITLES[objective]}, {case.runner}: {statistics.median(result['step']) * 1e3:.1f} ms/step")
    print(result["profile"])
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.profile:
        return profile_one(args)
    cases = build_cases(args)
    load_before = os.getloadavg()[0]
    results = run_all(cases, args)
    lines = ["# Engine vs plain timm loop on the quickstart models", "", *environment(args, load_before), ""]
    lines += render_table(cases, results)
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"[bench] written to {args.out}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2])
        sys.exit(0)
    sys.exit(main())
