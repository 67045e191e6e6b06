"""bench_engine's section on the official MAE code: each runner's step against the official one's, its model FLOP/s
and its share of the autocast-Linear ceiling measured in the same rounds, and issue 15's goals read off them."""

from __future__ import annotations

import statistics

from benchmarks.ceiling import utilisation

SPEEDUP_GOAL = 1.5  # ZeRO-2 step vs the official code's
CEILING_GOAL = 0.85  # share of the autocast-Linear ceiling
OVERHEAD_GOAL = 0.03  # engine over the plain loop at ZeRO 0-2


def section(main_cases: list, side_cases: list, stats: dict, results: dict) -> list[str]:
    """The official code's row beside ours (same malloc), the ceiling, and issue 15's goals.

    Args:
        main_cases: bench_engine's main-table Cases; those with the official case's malloc and no --ds are compared.
        side_cases: (the official case, the ceiling case).
        stats: bench_engine's summary of every case but the ceiling.
        results: Every case's raw runs (the plain loop's and the official code's carry `flops`).
    """
    official_case, ceiling_case = side_cases
    official, ceiling = stats[official_case], summarize_ceiling(results[ceiling_case])
    ours = [case for case in main_cases if case.allocator == official_case.allocator and not case.ds]
    flops = statistics.median(run["flops"] for case in ours if case.zero_stage is None for run in results[case])
    official["flops"] = statistics.median(run["flops"] for run in results[official_case])
    rows = [(official_case.runner, official)] + [(case.runner, {**stats[case], "flops": flops}) for case in ours]
    return [
        f"## Side by side with the official MAE code ({official_case.allocator})",
        "",
        *render_side_by_side(rows, official, ceiling),
        "",
        *goal_lines({case.runner: {**stats[case], "flops": flops} for case in ours}, official, ceiling),
        "",
    ]


def summarize_ceiling(runs: list[dict]) -> dict:
    """Pooled median TFLOP/s of the autocast-Linear trials, each round's median, the best trial, the bare matmul."""
    return {
        "median": statistics.median(v for run in runs for v in run["tflops"]),
        "rounds": [statistics.median(run["tflops"]) for run in runs],
        "max": max(v for run in runs for v in run["tflops"]),
        "matmul": statistics.median(run["matmul_tflops"] for run in runs),
        "others_load": max(run["others_load"] for run in runs),
        "shape": runs[0]["shape"],
    }


def render_side_by_side(rows: list[tuple[str, dict]], official: dict, ceiling: dict) -> list[str]:
    """Markdown table and goal lines.

    Args:
        rows: (runner name, bench_engine summary with `flops`) for the official code first, then ours.
        official: The official runner's summary.
        ceiling: `summarize_ceiling`'s result.
    """
    lines = [
        "| runner | s/step median | min | per-round medians | others' load (max) | backward | step phase | AdamW.step "
        "| official / this (median / min) | GFLOP/step | TFLOP/s | of ceiling |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in rows:
        speedup = f"{official['median'] / s['median']:.2f} / {official['min'] / s['min']:.2f}"
        tflops = s["flops"] / s["median"] / 1e12
        share = utilisation(s["flops"], s["median"], ceiling["median"])
        lines.append(
            f"| {name} | {s['median']:.3f} | {s['min']:.3f} | {' / '.join(f'{v:.3f}' for v in s['rounds'])} "
            f"| {s['others_load']:.0%} | {s['backward']:.3f} | {s['step_phase']:.3f} | {s['optimizer']:.3f} "
            f"| {speedup} | {s['flops'] / 1e9:.0f} | {tflops:.3f} | {share:.0%} |"
        )
    rows_in, d_in, d_out = (ceiling["shape"][k] for k in ("rows", "d_in", "d_out"))
    cols = " / ".join(f"{v:.3f}" for v in ceiling["rounds"])
    lines += [
        "",
        f"Ceiling: an fp32 `nn.Linear` [{rows_in}, {d_in}] x [{d_in}, {d_out}] forward + backward under bf16 autocast, "
        f"median {ceiling['median']:.3f} TFLOP/s over every trial (per round {cols}; best trial {ceiling['max']:.3f}; "
        f"others' load up to {ceiling['others_load']:.0%}); a bare bf16 1024x1024 matmul: {ceiling['matmul']:.3f} "
        "TFLOP/s. `of ceiling` is the runner's model FLOP/s (FlopCounterMode, forward + backward) over that median.",
    ]
    return lines


def goal_lines(stats_by_name: dict[str, dict], official: dict, ceiling: dict) -> list[str]:
    """Issue 15's three goals, each with the value measured and whether it is met."""
    lines = []
    zero2 = stats_by_name.get("engine ZeRO-2")
    plain = stats_by_name.get("plain torch loop")
    if zero2:
        speedup = official["median"] / zero2["median"]
        share = utilisation(zero2["flops"], zero2["median"], ceiling["median"])
        lines.append(
            f"- ZeRO-2 step vs the official code: {speedup:.2f}x "
            f"(goal >= {SPEEDUP_GOAL}x: {_met(speedup >= SPEEDUP_GOAL)})"
        )
        lines.append(
            f"- ZeRO-2 of the ceiling: {share:.0%} (goal >= {CEILING_GOAL:.0%}: {_met(share >= CEILING_GOAL)})"
        )
    if plain:
        for stage in (0, 1, 2):
            engine = stats_by_name.get(f"engine ZeRO-{stage}")
            if engine:
                over = engine["median"] / plain["median"] - 1
                lines.append(
                    f"- ZeRO-{stage} over the plain loop: {over:+.1%} (goal <= {OVERHEAD_GOAL:.0%}: "
                    f"{_met(over <= OVERHEAD_GOAL)})"
                )
    return lines


def _met(ok: bool) -> str:
    return "met" if ok else "not met"
