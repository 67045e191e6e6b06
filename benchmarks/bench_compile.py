"""Eager against compiled blocks (`engine.compile`) on the quickstart models, side by side in one process.

The objectives are the quickstart recipes' own (`recipes/quickstart_finetune.yaml`: the 128-wide 4-block ViT
classifier at 28 px, batch 128; `recipes/quickstart.yaml`: MAE on it at 28 px with its 96-wide 2-block decoder, batch
256), built as the stages build them, trained in a plain loop (bf16 autocast, AdamW) on in-memory random batches, so
the timing is the model step alone, without the engine's and the data path's costs (the same in both modes). Two
copies with the same weights, one with `compile_blocks`, run alternately `--steps` steps at a time over `--rounds`
rounds, so that a busy machine slows both alike; the per-step median of each is reported.

The compiled copy's first step holds the compile: cold when TORCHINDUCTOR_CACHE_DIR (set here to `--cache-dir`) is
empty, warm when an earlier run with the same thread count filled it (the kernels are keyed by it too). From both:
the steps/s after warm-up, and the time of the quickstart's training steps (1000 / 700) with the compile counted:
first step + the other steps at the median rate.

    .venv/bin/python -m benchmarks.bench_compile --cache-dir /tmp/inductor_cold     # cold: an empty directory
    .venv/bin/python -m benchmarks.bench_compile --cache-dir /tmp/inductor_cold     # again: warm
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

RECIPES = {"finetune": ("recipes/quickstart_finetune.yaml", 1000), "pretrain": ("recipes/quickstart.yaml", 700)}


def build(stage: str):
    """(objective, batch function) of the recipe, as the stage builds it (no weights loaded: speed only)."""
    import torch

    from benchmarks.workers import quickstart_vit
    from core.models.build import build_model
    from core.recipe.config import load_config
    from pretrain.objectives import objective_builder

    cfg = load_config(RECIPES[stage][0], ["model.init=null", *quickstart_vit()] if stage == "finetune" else [])
    batch, size = cfg.data.global_batch_size, cfg.model.img_size
    if stage == "finetune":
        from finetune.classification import Classification

        objective = Classification(build_model(cfg, num_classes=10), label_smoothing=0.1)
        labels = torch.arange(batch) % 10
        return objective, lambda g: {"image": torch.randn(batch, 3, size, size, generator=g), "label": labels}
    objective = objective_builder(cfg)()
    return objective, lambda g: {"image": torch.randn(batch, 3, size, size, generator=g)}


def measure(stage: str, steps: int, rounds: int) -> dict:
    import copy

    import torch

    from core.engine.compiled import compile_blocks, compile_seconds
    from core.engine.setup import set_attention

    torch.manual_seed(0)
    eager, batches = build(stage)
    set_attention(eager, "auto", torch.device("cpu"))
    compiled = copy.deepcopy(eager)
    batch_size = batches(torch.Generator())["image"].shape[0]
    compile_blocks(compiled, {batch_size})
    runs = {"eager": eager, "compiled": compiled}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for k, m in runs.items()}
    gen = torch.Generator().manual_seed(1)

    def step(kind: str) -> float:
        batch = batches(gen)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = runs[kind](batch)["loss"]
        loss.backward()
        optimizers[kind].step()
        optimizers[kind].zero_grad(set_to_none=True)
        return time.perf_counter() - start

    before = compile_seconds()
    first = {kind: step(kind) for kind in ("eager", "compiled")}
    compiling = compile_seconds() - before
    times = {kind: [] for kind in runs}
    for r in range(rounds):
        for kind in ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager"):
            times[kind] += [step(kind) for _ in range(steps)]
    return {"first": first, "compile": compiling, "median": {k: statistics.median(v) for k, v in times.items()}}


def report(stage: str, res: dict, total_steps: int) -> list[str]:
    rows = []
    for kind in ("eager", "compiled"):
        per_step = res["median"][kind]
        total = res["first"][kind] + (total_steps - 1) * per_step
        compile_s = f"{res['compile']:.1f}" if kind == "compiled" else "-"
        rows.append(
            f"| {stage} | {kind} | {res['first'][kind]:.1f} | {compile_s} | {1 / per_step:.2f} | "
            f"{total / 60:.2f} min ({total_steps} steps) |"
        )
    ratio = res["median"]["eager"] / res["median"]["compiled"]
    rows.append(f"| {stage} | compiled / eager | | | {ratio:.2f}x | |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", required=True, help="TORCHINDUCTOR_CACHE_DIR for this run (empty: cold)")
    parser.add_argument("--stages", default="finetune,pretrain")
    parser.add_argument("--steps", type=int, default=10, help="steps per mode per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=None, help="append the markdown table here")
    args = parser.parse_args()
    cache = Path(args.cache_dir)
    state = "not empty" if cache.exists() and any(cache.iterdir()) else "empty"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # before inductor reads it

    import torch

    from benchmarks.workers import machine_lines

    lines = [
        *machine_lines(torch.get_num_threads()),
        "",
        f"`python -m benchmarks.bench_compile --steps {args.steps} --rounds {args.rounds}`, inductor cache {cache} "
        f"{state} before the run; "
        f"load average {os.getloadavg()[0]:.1f} at the start",
        "",
        "| recipe | mode | first step s | of it compile s | steps/s after warm-up | first step + the rest at that "
        "rate |",
        "|---|---|---|---|---|---|",
    ]
    for stage in args.stages.split(","):
        torch._dynamo.reset()
        res = measure(stage, args.steps, args.rounds)
        lines += report(stage, res, RECIPES[stage][1])
        print("\n".join(lines[-3:]), flush=True)
    lines.append(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as out:
            out.write(text + "\n\n")


if __name__ == "__main__":
    main()
