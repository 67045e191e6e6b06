"""Where a MAE training step's time goes: torch.profiler's per-op table of the plain loop's step (bench_engine's
`run_plain`: forward under bf16 autocast, backward, fused AdamW), and optionally of the official MAE code's step.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 .venv/bin/python -m benchmarks.profile_step
    .venv/bin/python -m benchmarks.profile_step --official-mae ~/mae --batch 32 --steps 2 --rows 30

It prints, per runner, the ops by self CPU time and a summary by kind (matmuls, attention softmax, layer norm, GELU,
copies and casts, the rest) with each kind's share of the profiled steps.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Op name prefixes -> kind, first match wins; what matches none is "other". The for-loop AdamW's add_ / mul_ / div
# fall under "elementwise" (their names do not tell them from the model's).
KINDS = (
    (
        "matmul",
        ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear", "mkldnn", "aten::_convolution"),
    ),
    ("softmax", ("aten::_softmax",)),
    ("layer norm", ("aten::native_layer_norm",)),
    ("gelu", ("aten::gelu",)),
    ("copies and casts", ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat", "aten::contiguous")),
    ("optimizer", ("aten::_fused_adamw", "Optimizer", "aten::_foreach", "aten::lerp", "aten::addc", "aten::sqrt")),
    ("elementwise", ("aten::add", "aten::mul", "aten::div", "aten::sub", "aten::sum", "aten::fill_", "aten::zero_")),
)


def kind_of(name: str) -> str:
    """The KINDS group an op's name belongs to."""
    return next((kind for kind, prefixes in KINDS if name.startswith(prefixes)), "other")


def kind_totals(events) -> dict[str, float]:
    """Self CPU seconds per kind over profiler `key_averages()` events."""
    totals: dict[str, float] = collections.Counter()
    for event in events:
        totals[kind_of(event.key)] += event.self_cpu_time_total / 1e6
    return dict(totals)


def profile(step, steps: int, rows: int, title: str) -> None:
    """Runs `step` under torch.profiler `steps` times and prints the per-op table and the per-kind summary."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    print(f"\n## {title}: {steps} steps\n")
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48))
    totals = kind_totals(events)
    whole = sum(totals.values())
    for kind, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"{kind:>18}: {seconds / steps:7.3f} s/step ({seconds / whole:.0%})")


def ours_step(args: argparse.Namespace):
    """The plain loop's step on our MAE objective (core.engine.setup.set_attention's CPU kernel, fused AdamW)."""
    import tempfile

    import torch
    from timm.optim import param_groups_weight_decay

    from benchmarks.engine_step import build_config, mae_builder
    from core.engine.setup import set_attention

    spec = {"run_dir": tempfile.mkdtemp(), "model": args.model, "size": args.size, "batch": args.batch}
    cfg = build_config({**spec, "zero_stage": 0, "warmup": 0, "steps": 1})
    torch.manual_seed(0)
    objective = mae_builder(cfg)()
    set_attention(objective, cfg.engine.attention, torch.device("cpu"))
    groups = param_groups_weight_decay(objective, cfg.optim.weight_decay, objective.no_weight_decay())
    optimizer = torch.optim.AdamW(groups, lr=cfg.peak_lr, betas=cfg.optim.betas, fused=True)
    batch = {"image": torch.randn(args.batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))}

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = objective(batch)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def official_step(args: argparse.Namespace):
    """The official code's step as benchmarks/official_mae.py runs it, without train_one_epoch's logging."""
    import torch
    from timm.optim import param_groups_weight_decay

    from benchmarks.official_mae import build_official_model, load_official

    official = load_official(args.official_mae)
    torch.manual_seed(0)
    model = build_official_model(official.models_mae, args.model, args.size)
    optimizer = torch.optim.AdamW(param_groups_weight_decay(model, 0.05), lr=1e-4, betas=(0.9, 0.95))
    scaler = official.misc.NativeScalerWithGradNormCount()
    images = torch.randn(args.batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _, _ = model(images, mask_ratio=0.75)
        loss.item()
        scaler(loss, optimizer, parameters=model.parameters())
        optimizer.zero_grad()

    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="base", help="ViT size preset (default: base)")
    p.add_argument("--size", type=int, default=224, help="image side in pixels, patch 16 (default: 224)")
    p.add_argument("--batch", type=int, default=32, help="images per step (default: 32)")
    p.add_argument("--steps", type=int, default=2, help="profiled steps after one warm-up (default: 2)")
    p.add_argument("--rows", type=int, default=25, help="ops listed per table (default: 25)")
    p.add_argument("--official-mae", type=Path, metavar="PATH", help="also profile the official code's step")
    args = p.parse_args(argv)
    runners = [("ours (plain loop)", ours_step)]
    if args.official_mae:
        runners.append(("official MAE code", official_step))
    for title, build in runners:
        step = build(args)
        step()  # warm-up: first-call allocations and kernel selection
        profile(step, args.steps, args.rows, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
