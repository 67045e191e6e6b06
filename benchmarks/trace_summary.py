"""Where a training step's time goes, read from a torch.profiler Chrome trace (`.json` or `.json.gz`, as
`benchmarks/gpu_trace.py` writes one): per profiled step (`ProfilerStep#N`), GPU time by kind of kernel, GPU busy and
idle time, kernels per step, host time against GPU time, and a verdict.

    .venv/bin/python -m benchmarks.trace_summary TRACE [--json OUT] [--md OUT]

- **Steps.** Every GPU activity (kernel, memcpy, memset) belongs to the step whose host span (`ProfilerStep#N`) holds
  the runtime or driver call that launched it (`args.correlation` links the two). Activities launched before the
  profiled steps (the profiler's warm-up) are left out.
- **Kinds** (`gpu_kind`, first match wins): host-to-device copies (`Memcpy HtoD`); DeepSpeed copies and reductions
  (NCCL kernels); attention (flash, fmha, efficient attention, cuDNN SDPA); GEMM (cuBLAS, CUTLASS, nvjet, xmma,
  inductor matmul templates); optimizer (fused Adam, `multi_tensor_apply`); then any other kernel, copy or memset
  launched inside DeepSpeed's own code also counts as DeepSpeed's: inside `engine.step` (the worker's
  `mimpipe/optimizer_step` region), or inside `engine.backward` (`mimpipe/backward`) but outside autograd's evaluation
  of the model's ops, or in its `AccumulateGrad` (where DeepSpeed's gradient hooks copy into its buckets); the rest is
  norm and elementwise (layer norm, elementwise, reductions, softmax, triton fused kernels) or other. Each kind is
  given in ms per step and as a share of GPU busy time (kernels on overlapping streams can make the shares add up
  to more than 100%).
- **GPU busy / idle.** Busy: the union of a step's activity intervals. A step on the GPU runs from its first activity
  to the next step's first (the last step: to the later of its last activity's end and its host span's end); idle is
  that span less busy time.
- **Verdict.** GPU-bound when the GPU idles less than IDLE_LIMIT of its step. Otherwise launch-bound when the host is
  busy (its step's time less the time it waits in CUDA synchronisations) for at least HOST_BUSY_LIMIT of the GPU's
  step: the GPU waits for work that the host is still issuing. Else the GPU waits for something else (the host
  synchronising, data).

A trace without GPU activity (a CPU run) gets the self time of its CPU ops by benchmarks/profile_step.py's kinds.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.profile_step import KINDS as CPU_KINDS
from benchmarks.profile_step import kind_of as cpu_kind

BACKWARD_REGION = "mimpipe/backward"  # record_function regions the worker opens around engine.backward / engine.step
STEP_REGION = "mimpipe/optimizer_step"
IDLE_LIMIT = 0.2  # GPU idle below this share of its step: GPU-bound
HOST_BUSY_LIMIT = 0.8  # host busy for at least this share of the GPU's step while the GPU idles: launch-bound

H2D, DEEPSPEED, ATTENTION, GEMM = "host-to-device copies", "DeepSpeed copies and reductions", "attention", "GEMM"
OPTIMIZER, NORM, OTHER = "optimizer", "norm and elementwise", "other"
GPU_KINDS = (GEMM, ATTENTION, NORM, OPTIMIZER, DEEPSPEED, H2D, OTHER)  # the table's order
_BY_NAME = (  # (kind, pattern): what a GPU activity's name alone decides, first match wins
    (H2D, re.compile(r"^Memcpy HtoD")),
    (DEEPSPEED, re.compile(r"nccl", re.IGNORECASE)),
    (ATTENTION, re.compile(r"flash|fmha|attention|sdpa", re.IGNORECASE)),
    (GEMM, re.compile(r"gemm|cublas|cutlass|nvjet|xmma|splitk|triton_tem", re.IGNORECASE)),
    (OPTIMIZER, re.compile(r"adam|multi_tensor_apply", re.IGNORECASE)),
)
_NORM = re.compile(r"norm|elementwise|vectorized|reduce|softmax|triton", re.IGNORECASE)
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
AUTOGRAD_PREFIX = "autograd::engine::evaluate_function: "


def gpu_kind(name: str, *, in_deepspeed: bool = False) -> str:
    """The kind of a GPU activity by its name; `in_deepspeed`: launched inside DeepSpeed's own code (module doc)."""
    kind = next((kind for kind, pattern in _BY_NAME if pattern.search(name)), None)
    if kind is not None:
        return kind
    if in_deepspeed:
        return DEEPSPEED
    return NORM if _NORM.search(name) else OTHER


def load_trace(path: Path) -> dict:
    """A Chrome trace file, gzipped when its name ends in .gz."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


@dataclass
class Step:
    """One profiled step: its host span (µs) and what the GPU did for it."""

    number: int
    start: float
    end: float
    kinds_us: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))
    intervals: list[tuple[float, float]] = field(default_factory=list)
    num_kernels: int = 0
    sync_us: float = 0.0

    def busy_us(self) -> float:
        """The union of the step's GPU activity intervals."""
        busy, reach = 0.0, float("-inf")
        for start, end in sorted(self.intervals):
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        return busy


class Scopes:
    """Which of the worker's regions, and which autograd function, enclose a host event."""

    def __init__(self, events: list[dict]):
        regions = (BACKWARD_REGION, STEP_REGION)  # on the host: their GPU-side copies are "gpu_user_annotation"
        self.regions = [
            (e["ts"], e["ts"] + e["dur"], e["name"])
            for e in events
            if e.get("cat") == "user_annotation" and e["name"] in regions
        ]
        self.autograd: dict[int, list[tuple[float, float, str]]] = collections.defaultdict(list)
        for e in events:
            if e.get("cat") == "cpu_op" and e["name"].startswith(AUTOGRAD_PREFIX):
                self.autograd[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        for functions in self.autograd.values():
            functions.sort()

    def in_deepspeed(self, launch: dict) -> bool:
        """Launched inside engine.step, or inside engine.backward but not by autograd's evaluation of a model op."""
        ts = launch["ts"]
        region = next((name for start, end, name in self.regions if start <= ts < end), None)
        if region != BACKWARD_REGION:
            return region == STEP_REGION
        functions = self.autograd[launch["tid"]]
        at = bisect.bisect_right(functions, (ts, float("inf"), "")) - 1  # the last autograd function begun by ts
        inside = at >= 0 and functions[at][1] > ts
        return not inside or functions[at][2].endswith("AccumulateGrad")


def profiled_steps(events: list[dict]) -> list[Step]:
    """The host spans of the `ProfilerStep#N` annotations, in order."""
    steps = [
        Step(int(e["name"].split("#")[1]), e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")
    ]
    if not steps:
        raise ValueError("no ProfilerStep#N annotation: profile with a schedule and call prof.step() every step")
    return sorted(steps, key=lambda step: step.start)


def step_at(steps: list[Step], ts: float) -> Step | None:
    """The step whose host span holds `ts`."""
    at = bisect.bisect_right([step.start for step in steps], ts) - 1
    return steps[at] if at >= 0 and ts < steps[at].end else None


def assign_gpu_work(events: list[dict], steps: list[Step]) -> None:
    """Each GPU activity into the step that launched it, by kind; the host's synchronisation time per step."""
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }
    scopes = Scopes(events)
    for e in events:
        is_sync = e.get("cat") == "cuda_runtime" and "Synchronize" in e["name"]
        if is_sync and (step := step_at(steps, e["ts"])) is not None:
            step.sync_us += e["dur"]
        if e.get("cat") not in GPU_CATEGORIES:
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        step = step_at(steps, launch["ts"]) if launch else None
        if step is None:
            continue  # launched before the profiled steps (the profiler's warm-up), or its launch is not in the trace
        step.kinds_us[gpu_kind(e["name"], in_deepspeed=scopes.in_deepspeed(launch))] += e["dur"]
        step.intervals.append((e["ts"], e["ts"] + e["dur"]))
        step.num_kernels += e["cat"] == "kernel"


def gpu_spans(steps: list[Step]) -> list[float]:
    """Each step's span on the GPU (µs): from its first activity to the next step's first (module doc)."""
    firsts = [min((start for start, _ in step.intervals), default=step.end) for step in steps]
    nexts = firsts[1:] + [steps[-1].end]
    lasts = [max((end for _, end in step.intervals), default=first) for step, first in zip(steps, firsts, strict=True)]
    return [max(last, after) - first for first, last, after in zip(firsts, lasts, nexts, strict=True)]


def verdict(*, idle_share: float, host_busy_ms: float, gpu_step_ms: float) -> str:
    """One line: GPU-bound, launch-bound, or idle for another reason (module doc)."""
    if idle_share < IDLE_LIMIT:
        return f"GPU-bound: the GPU is busy {1 - idle_share:.0%} of its step"
    if host_busy_ms >= HOST_BUSY_LIMIT * gpu_step_ms:
        return (
            f"launch-bound: the GPU idles {idle_share:.0%} of its {gpu_step_ms:.2f} ms step while the host is busy "
            f"{host_busy_ms:.2f} ms per step issuing work"
        )
    return (
        f"the GPU idles {idle_share:.0%} of its {gpu_step_ms:.2f} ms step, but the host is busy only "
        f"{host_busy_ms:.2f} ms per step: it waits on synchronisations or data, not on launches"
    )


def kind_table(per_step: list[dict[str, float]], kinds: list[str], whole_ms: float) -> dict[str, dict[str, float]]:
    """ms per step of each kind (mean over the steps) and its share of `whole_ms` (per step)."""
    table = {}
    for kind in kinds:
        ms = sum(step.get(kind, 0.0) for step in per_step) / len(per_step)
        table[kind] = {"ms_per_step": ms, "share": ms / whole_ms if whole_ms else 0.0}
    return table


def gpu_summary(events: list[dict], steps: list[Step]) -> dict:
    """The summary of a trace with GPU activity: per step and the mean over the steps."""
    assign_gpu_work(events, steps)
    spans = gpu_spans(steps)
    rows = []
    for step, span in zip(steps, spans, strict=True):
        busy = step.busy_us()
        rows.append({
            "step": step.number, "host_ms": (step.end - step.start) / 1e3, "host_sync_ms": step.sync_us / 1e3,
            "gpu_step_ms": span / 1e3, "gpu_busy_ms": busy / 1e3, "gpu_idle_ms": (span - busy) / 1e3,
            "num_kernels": step.num_kernels, "kinds": {kind: us / 1e3 for kind, us in step.kinds_us.items()},
        })  # fmt: skip
    mean = {key: sum(row[key] for row in rows) / len(rows) for key in rows[0] if key not in ("step", "kinds")}
    idle_share = mean["gpu_idle_ms"] / mean["gpu_step_ms"] if mean["gpu_step_ms"] else 0.0
    host_busy = mean["host_ms"] - mean["host_sync_ms"]
    return {
        "gpu": True,
        "steps": [row["step"] for row in rows],
        "kinds": kind_table([row["kinds"] for row in rows], list(GPU_KINDS), mean["gpu_busy_ms"]),
        **{key: value for key, value in mean.items() if key != "num_kernels"},
        "kernels_per_step": mean["num_kernels"],
        "idle_share": idle_share,
        "verdict": verdict(idle_share=idle_share, host_busy_ms=host_busy, gpu_step_ms=mean["gpu_step_ms"]),
        "per_step": rows,
    }


def self_times(ops: list[dict]) -> list[tuple[dict, float]]:
    """Each CPU op of one thread with its self time (µs): its duration less that of the ops directly inside it."""
    ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
    own = [e["dur"] for e in ops]
    stack: list[int] = []
    for i, e in enumerate(ops):
        while stack and ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            own[stack[-1]] -= e["dur"]
        stack.append(i)
    return list(zip(ops, own, strict=True))


def cpu_summary(events: list[dict], steps: list[Step]) -> dict:
    """The summary of a trace without GPU activity: CPU ops' self time by profile_step.py's kinds."""
    threads = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            threads[e["tid"]].append(e)
    per_step = {step.number: collections.defaultdict(float) for step in steps}
    for ops in threads.values():
        for e, own in self_times(ops):
            if (step := step_at(steps, e["ts"])) is not None:
                per_step[step.number][cpu_kind(e["name"])] += own / 1e3
    kinds = [kind for kind, _ in CPU_KINDS] + ["other"]
    op_ms = sum(sum(step.values()) for step in per_step.values()) / len(steps)
    rows = [{"step": s.number, "host_ms": (s.end - s.start) / 1e3, "kinds": dict(per_step[s.number])} for s in steps]
    return {
        "gpu": False,
        "steps": [step.number for step in steps],
        "kinds": kind_table([row["kinds"] for row in rows], kinds, op_ms),
        "host_ms": sum(row["host_ms"] for row in rows) / len(rows),
        "cpu_op_ms": op_ms,
        "verdict": "no GPU activity recorded (a CPU-only trace): the kinds are CPU ops' self time",
        "per_step": rows,
    }


def summarize(trace: dict) -> dict:
    """The summary of a trace (module doc) as a JSON-ready dict; `render` makes it Markdown."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = profiled_steps(events)
    if any(e.get("cat") in GPU_CATEGORIES for e in events):
        return gpu_summary(events, steps)
    return cpu_summary(events, steps)


def render(summary: dict) -> str:
    """A Markdown table of the kinds (ms per step, share) and the lines below it."""
    share_of = "GPU busy time" if summary["gpu"] else "CPU op self time"
    lines = [f"| kind | ms/step | share of {share_of} |", "|---|---:|---:|"]
    lines += [f"| {kind} | {v['ms_per_step']:.2f} | {v['share']:.1%} |" for kind, v in summary["kinds"].items()]
    numbers = summary["steps"]
    lines += ["", f"- profiled steps: {len(numbers)} (ProfilerStep#{numbers[0]}-#{numbers[-1]})"]
    if summary["gpu"]:
        s = summary
        lines += [
            f"- GPU busy {s['gpu_busy_ms']:.2f} ms/step, idle {s['gpu_idle_ms']:.2f} ms ({s['idle_share']:.1%} of its "
            f"{s['gpu_step_ms']:.2f} ms step); {s['kernels_per_step']:.0f} kernels/step",
            f"- host {s['host_ms']:.2f} ms/step (of which waiting in CUDA synchronisations {s['host_sync_ms']:.2f} ms) "
            f"against GPU busy {s['gpu_busy_ms']:.2f} ms",
        ]
    else:
        lines.append(f"- host {summary['host_ms']:.2f} ms/step; CPU op self time {summary['cpu_op_ms']:.2f} ms/step")
    lines.append(f"- verdict: {summary['verdict']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="a torch.profiler Chrome trace, .json or .json.gz")
    parser.add_argument("--json", type=Path, help="also write the summary as JSON here")
    parser.add_argument("--md", type=Path, help="also write the Markdown here")
    args = parser.parse_args(argv)
    summary = summarize(load_trace(args.trace))
    text = render(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if args.md:
        args.md.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
