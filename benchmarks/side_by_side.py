"""bench_engine's section on the official MAE code: each runner's step against the official one's, its model FLOP/s
and its share of the autocast-Linear ceiling measured in the same rounds, and issue 15's goals read off them.

Every figure comes twice: by wall-clock time, and by the process's own CPU time, which at `--threads 1` is its work
alone: other processes on a shared machine stretch the wall-clock time of a step but not the CPU time it uses."""

from __future__ import annotations

import statistics

from benchmarks.ceiling import LinearShape, utilisation

SPEEDUP_GOAL = 1.5  # ZeRO-2 step vs the official code's
CEILING_GOAL = 0.85  # share of the autocast-Linear ceiling
OVERHEAD_GOAL = 0.03  # engine over the plain loop at ZeRO 0-2
ZERO2_RUNNERS = ("engine ZeRO-2", "engine ZeRO-2 compiled")  # read against the official code, where measured


def section(main_cases: list, side_cases: list, stats: dict, results: dict) -> list[str]:
    """The official code's rows beside ours (ours: the ceiling's malloc), the ceiling, and issue 15's goals.

    Args:
        main_cases: bench_engine's main-table Cases; those with the ceiling's malloc (ours) and no --ds are compared.
        side_cases: The official code's cases (kind "official", and "official-sdpa" for timm 1.0's attention), with
            ours or another malloc, and the ceiling's (kind "ceiling").
        stats: bench_engine's summary of every case but the ceiling.
        results: Every case's raw runs (the plain loop's and the official code's carry `flops`).
    """
    officials = [case for case in side_cases if case.kind != "ceiling"]
    official_case = next(case for case in officials if case.kind == "official")
    ceiling_case = next(case for case in side_cases if case.kind == "ceiling")
    ceiling = summarize_ceiling(results[ceiling_case])
    theirs = {
        case: {**stats[case], "flops": statistics.median(run["flops"] for run in results[case] if run["flops"])}
        for case in officials
    }
    official = theirs[official_case]
    ours = [case for case in main_cases if case.allocator == ceiling_case.allocator and not case.ds]
    plain = [run["flops"] for case in ours if case.zero_stage is None for run in results[case] if run["flops"]]
    flops = statistics.median(plain)
    ours_by_name = {case.runner: {**stats[case], "flops": flops} for case in ours}
    rows = [(case.runner, theirs[case]) for case in officials] + list(ours_by_name.items())
    others = {case.runner: theirs[case] for case in officials if case is not official_case}
    return [
        f"## Side by side with the official MAE code ({mallocs(ceiling_case.allocator, official_case.allocator)})",
        "",
        *render_side_by_side(rows, official, ceiling),
        "",
        *goal_lines(ours_by_name, official, ceiling),
        *reference_lines(ours_by_name, others),
        "",
    ]


def mallocs(ours: str, official: str) -> str:
    """The section title's note of the mallocs: one name when both run under it."""
    return ours if ours == official else f"ours under {ours}, the official code under {official}"


def summarize_ceiling(runs: list[dict]) -> dict:
    """Pooled median TFLOP/s of the autocast-Linear trials by wall-clock and by CPU time, each round's wall-clock
    median, the best trial, the bare matmul."""
    flops = LinearShape(**runs[0]["shape"]).flops()
    return {
        "median": statistics.median(v for run in runs for v in run["tflops"]),
        "cpu": statistics.median(flops / max(v, 1e-9) / 1e12 for run in runs for v in run["cpu"]),
        "rounds": [statistics.median(run["tflops"]) for run in runs],
        "max": max(v for run in runs for v in run["tflops"]),
        "matmul": statistics.median(run["matmul_tflops"] for run in runs),
        "others_load": max(run["others_load"] for run in runs),
        "shape": runs[0]["shape"],
    }


def render_side_by_side(rows: list[tuple[str, dict]], official: dict, ceiling: dict) -> list[str]:
    """The markdown table and the ceiling's line.

    Args:
        rows: (runner name, bench_engine summary with `flops`) for the official code first, then ours.
        official: The official runner's summary.
        ceiling: `summarize_ceiling`'s result.
    """
    lines = [
        "| runner | s/step median | min | per-round medians | others' load (max) | backward | step phase | AdamW.step "
        "| official / this (median / min) | CPU s/step | official / this (CPU) | GFLOP/step | TFLOP/s (wall / CPU) "
        "| of ceiling (wall / CPU) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in rows:
        wall, cpu = _shares(s, ceiling)
        lines.append(
            f"| {name} | {s['median']:.3f} | {s['min']:.3f} | {' / '.join(f'{v:.3f}' for v in s['rounds'])} "
            f"| {s['others_load']:.0%} | {s['backward']:.3f} | {s['step_phase']:.3f} | {s['optimizer']:.3f} "
            f"| {official['median'] / s['median']:.2f} / {official['min'] / s['min']:.2f} | {s['cpu']:.3f} "
            f"| {official['cpu'] / s['cpu']:.2f} | {s['flops'] / 1e9:.0f} "
            f"| {s['flops'] / s['median'] / 1e12:.3f} / {s['flops'] / s['cpu'] / 1e12:.3f} | {wall:.0%} / {cpu:.0%} |"
        )
    rows_in, d_in, d_out = (ceiling["shape"][k] for k in ("rows", "d_in", "d_out"))
    per_round = " / ".join(f"{v:.3f}" for v in ceiling["rounds"])
    return [
        *lines,
        "",
        f"Ceiling: an fp32 `nn.Linear` [{rows_in}, {d_in}] x [{d_in}, {d_out}] forward + backward under bf16 autocast, "
        f"median {ceiling['median']:.3f} TFLOP/s by wall-clock over every trial (per round {per_round}; best trial "
        f"{ceiling['max']:.3f}; others' load up to {ceiling['others_load']:.0%}), {ceiling['cpu']:.3f} by CPU time; "
        f"a bare bf16 1024x1024 matmul: {ceiling['matmul']:.3f} TFLOP/s. `of ceiling` is the runner's model FLOP/s "
        "(FlopCounterMode, forward + backward) over the ceiling's, wall-clock over wall-clock and CPU over CPU.",
    ]


def goal_lines(stats_by_name: dict[str, dict], official: dict, ceiling: dict) -> list[str]:
    """Issue 15's three goals, each with the values measured (wall-clock / CPU time) and whether each meets it: the
    step and the ceiling share of ZeRO-2, eager and compiled where measured, and the overhead of ZeRO 0-2 (eager)."""
    lines = []
    for name in ZERO2_RUNNERS:
        runner, label = stats_by_name.get(name), name.removeprefix("engine ")
        if runner:
            speedups = (official["median"] / runner["median"], official["cpu"] / runner["cpu"])
            lines.append(
                _goal(f"{label} step vs the official code", speedups, f">= {SPEEDUP_GOAL}x", "{:.2f}x", SPEEDUP_GOAL)
            )
            lines.append(
                _goal(
                    f"{label} of the ceiling",
                    _shares(runner, ceiling),
                    f">= {CEILING_GOAL:.0%}",
                    "{:.0%}",
                    CEILING_GOAL,
                )
            )
    plain = stats_by_name.get("plain torch loop")
    for stage in (0, 1, 2):
        engine = stats_by_name.get(f"engine ZeRO-{stage}")
        if plain and engine:
            over = (engine["median"] / plain["median"] - 1, engine["cpu"] / plain["cpu"] - 1)
            lines.append(
                _goal(
                    f"ZeRO-{stage} over the plain loop", over, f"<= {OVERHEAD_GOAL:.0%}", "{:+.1%}", -OVERHEAD_GOAL, -1
                )
            )
    return lines


def reference_lines(stats_by_name: dict[str, dict], others: dict[str, dict]) -> list[str]:
    """ZeRO-2's step (eager, and compiled where measured) against each other variant of the official code, e.g. on
    timm 1.0's SDPA attention, how issue 15's reference figures were taken: a comparison, not a goal."""
    lines = []
    for name, other in others.items():
        for ours in ZERO2_RUNNERS:
            if ours in stats_by_name:
                runner = stats_by_name[ours]
                lines.append(
                    f"- {ours.removeprefix('engine ')} step vs the {name}: {other['median'] / runner['median']:.2f}x / "
                    f"{other['cpu'] / runner['cpu']:.2f}x by wall-clock / CPU time"
                )
    return lines


def _shares(s: dict, ceiling: dict) -> tuple[float, float]:
    """(wall-clock, CPU-time) share of the ceiling that runner summary `s` reaches."""
    return utilisation(s["flops"], s["median"], ceiling["median"]), utilisation(s["flops"], s["cpu"], ceiling["cpu"])


def _goal(what: str, values: tuple[float, float], goal: str, fmt: str, bound: float, sign: int = 1) -> str:
    """'- what: wall / CPU (goal ...: met / not met)': met where sign * value >= bound."""
    shown = " / ".join(fmt.format(v) for v in values)
    verdicts = " / ".join("met" if sign * v >= bound else "not met" for v in values)
    return f"- {what}: {shown} by wall-clock / CPU time (goal {goal}: {verdicts})"
