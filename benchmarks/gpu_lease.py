"""A short GPU lease spent in value order (benchmarks/gpu_lease.sh runs it after installing what the machine lacks):
MAE's step timed and traced at the settings a user had and at the best ones, then A/B arms, each a fresh process,
until the budget is spent. The table is rewritten after every arm, so a lease cut short still leaves one.

    python -m benchmarks.gpu_lease OUT [--budget 540] [--arms NAME,...] [--device cuda]

Arms (`ARMS`, most valuable first):
- `step`: benchmarks/gpu_step.py's worker: warm-up steps (the compile in the first), then `TIMED_STEPS` steps timed on
  the GPU's clock with no synchronisation inside the step: images/s, MFU (the loop's perf/mfu meter), peak memory,
  the timed steps' last loss, compile seconds.
- `trace`: benchmarks/gpu_trace.py's worker: a few steady steps under torch.profiler, summarised by
  benchmarks/trace_summary.py (GPU time by kind, idle time, kernels per step, launch-bound or not) into
  OUT/NAME.md; the raw trace in OUT/NAME.json.gz.
- `data`: bench_gpu's `./launch.sh` run with the recipe's data workers: perf/data_wait_fraction and images/s, with
  the JPEGs decoded in the workers or on the GPU (`data.decode`).
- `decode`: benchmarks/bench_decode.py on the GPU: nvJPEG's pixels against the CPU's and the workers', the device
  side's decode rate and host CPU per batch (OUT/decode.md).
- `tests`: `pytest tests/gpu`, if time is left.

An arm gets at most its `cap_s` seconds and what is left of the budget; one that runs out is killed with its whole
process group and its row says so; one that fails leaves its output's last line in the row. OUT/lease.md and
OUT/lease.json hold every arm's outcome, OUT/lease.log every arm's output: with the two traces, few files, as a lease
machine sends back at most 8.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path

from benchmarks.workers import REPO, worker_env

TIMED_STEPS, WARMUP_STEPS = 20, 3
MIN_ARM_S = 45  # an arm is not started with less than this left: a process, a model and a step take that long


@dataclass(frozen=True)
class Arm:
    """One measurement of the lease."""

    name: str
    what: str
    kind: str
    """"step", "trace", "data" or "tests"."""
    recipe: str = "mae_vitl"
    batch: int = 256
    compiled: bool = False
    overrides: tuple[str, ...] = ()
    cap_s: int = 150


Z0, Z1 = ("engine.zero_stage=0",), ("engine.zero_stage=1",)
ARMS = (
    Arm("vitl-eager-z1", "ViT-L/16 as the recipe ran before: eager, ZeRO-1", "step", overrides=Z1, cap_s=120),
    Arm(
        "vitl-compiled-z0", "ViT-L/16 compiled (the whole step), ZeRO-0", "step", compiled=True, overrides=Z0, cap_s=240
    ),
    Arm("trace-vitl-compiled-z0", "trace: ViT-L/16 compiled, ZeRO-0", "trace", compiled=True, overrides=Z0),
    Arm("trace-vitl-eager-z1", "trace: ViT-L/16 eager, ZeRO-1", "trace", overrides=Z1, cap_s=100),
    Arm("vitl-eager-z0", "ViT-L/16 eager, ZeRO-0", "step", overrides=Z0, cap_s=100),
    Arm("vitl-compiled-z1", "ViT-L/16 compiled, ZeRO-1", "step", compiled=True, overrides=Z1),
    Arm(
        "vitl-compiled-z0-b512", "ViT-L/16 compiled, ZeRO-0, batch 512", "step", batch=512, compiled=True, overrides=Z0
    ),
    Arm(
        "vitl-cudagraphs-z0",
        "ViT-L/16 compiled, CUDA graphs (reduce-overhead), ZeRO-0",
        "step",
        compiled=True,
        overrides=(*Z0, "engine.compile_mode=reduce-overhead"),
        cap_s=240,
    ),
    Arm("vitb-eager-z1", "ViT-B/16 eager, ZeRO-1", "step", recipe="mae_vitb", overrides=Z1, cap_s=90),
    Arm("vitb-compiled-z0", "ViT-B/16 compiled, ZeRO-0", "step", recipe="mae_vitb", compiled=True, overrides=Z0),
    Arm(
        "d2v-vitb-compiled-z0",
        "data2vec 2.0 ViT-B/16 compiled, ZeRO-0 (256 images x 16 copies; the teacher's pass counted)",
        "step",
        recipe="data2vec2_vitb",
        compiled=True,
        overrides=Z0,
        cap_s=200,
    ),
    Arm(
        "ijepa-vith14-compiled-z0",
        "I-JEPA ViT-H/14 compiled, ZeRO-0 (128 images; the target encoder's pass and the predictor counted)",
        "step",
        recipe="ijepa_vith14",
        batch=128,
        compiled=True,
        overrides=Z0,
        cap_s=240,
    ),
    Arm(
        "d2v-vitl-compiled-z0",
        "data2vec 2.0 ViT-L/16 compiled, ZeRO-0 (128 images x 16 copies; the teacher's pass counted)",
        "step",
        recipe="data2vec2_vitl",
        batch=128,
        compiled=True,
        overrides=Z0,
        cap_s=240,
    ),
    Arm(
        "vitl-compiled-z0-b1024",
        "ViT-L/16 compiled, ZeRO-0, batch 1024",
        "step",
        batch=1024,
        compiled=True,
        overrides=Z0,
    ),
    Arm(
        "vitl-blocks-z0",
        "ViT-L/16 compiled per block, ZeRO-0",
        "step",
        compiled=True,
        overrides=(*Z0, "engine.compile_scope=blocks"),
    ),
    Arm(
        "vitl-checkpointed-z0",
        "ViT-L/16 compiled, activation checkpointing, ZeRO-0",
        "step",
        compiled=True,
        overrides=(*Z0, "engine.activation_checkpointing=true"),
    ),
    Arm(
        "data-vitb-worker",
        "data: ViT-B/16 compiled, JPEGs decoded in the workers",
        "data",
        recipe="mae_vitb",
        compiled=True,
        overrides=Z0,
        cap_s=180,
    ),
    Arm(
        "data-vitb-device",
        "data: ViT-B/16 compiled, JPEGs decoded on the GPU",
        "data",
        recipe="mae_vitb",
        compiled=True,
        overrides=(*Z0, "data.decode=device"),
        cap_s=180,
    ),
    Arm("decode", "nvJPEG decode and crop of batches of 256 against the workers'", "decode", cap_s=240),
    Arm("tests", "pytest tests/gpu", "tests", cap_s=400),
)


@dataclass
class Outcome:
    """What an arm gave: `status` ("done", "timed out", "failed", "not run") and its numbers."""

    arm: Arm
    status: str
    seconds: float = 0.0
    note: str = ""
    values: dict = field(default_factory=dict)


def run_logged(command: list[str], log: Path, timeout: float, env: dict[str, str]) -> int:
    """Run `command` in its own process group with its output appended to `log`; kill the whole group (inductor's
    compile workers, data workers) when `timeout` seconds pass. Returns the exit code; raises TimeoutError."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(command)[:300]}\n")
        out.flush()
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(f"timed out after {timeout:.0f} s") from None


def last_line(log: Path) -> str:
    """The last non-empty line `log` holds (the failure of the command that wrote last)."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return (lines[-1] if lines else "no output").replace("|", "/")[:200]


def step_values(arm: Arm, result: dict) -> dict:
    """images/s, MFU, step milliseconds, memory and compile time of a gpu_step.py result."""
    if result.get("oom"):
        return {"oom": True}
    step_ms = statistics.median(result["step_ms"])
    flops, peak = result.get("flops_per_step"), result.get("peak_flops")
    return {
        "images_per_sec": arm.batch / (step_ms / 1e3),
        "mfu": flops / (step_ms / 1e3) / peak if flops and peak else None,
        "step_ms": step_ms,
        "step_ms_range": [min(result["step_ms"]), max(result["step_ms"])],
        "peak_allocated_gib": result["peak_allocated_gib"],
        "compile_seconds": result["compile_seconds"],
        "last_loss": result["losses"][-1],
    }


class Lease:
    """The arms run one after another inside `budget_s`; the table is rewritten after each."""

    def __init__(self, out: Path, budget_s: float, device: str, scratch: Path, threads: int):
        self.out, self.device, self.scratch, self.threads = out, device, scratch, threads
        self.deadline = time.monotonic() + budget_s
        self.outcomes: list[Outcome] = []
        out.mkdir(parents=True, exist_ok=True)
        scratch.mkdir(parents=True, exist_ok=True)
        (out / "lease.log").write_text("")
        self.environment = environment_lines(budget_s)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, arms: tuple[Arm, ...]) -> list[Outcome]:
        for arm in arms:
            if self.left() < MIN_ARM_S:
                self.outcomes.append(Outcome(arm, "not run", note=f"{max(self.left(), 0):.0f} s of the budget left"))
            else:
                self.outcomes.append(self.one(arm))
            self.write()
        return self.outcomes

    def one(self, arm: Arm) -> Outcome:
        timeout, start = min(arm.cap_s, self.left()), time.monotonic()
        print(f"[lease] {arm.name}: {arm.what} (at most {timeout:.0f} s)", flush=True)
        try:
            values = getattr(self, f"_{arm.kind}")(arm, timeout)
            outcome = Outcome(arm, "done", values=values)
        except TimeoutError as err:
            outcome = Outcome(arm, "timed out", note=str(err))
        except RuntimeError as err:
            outcome = Outcome(arm, "failed", note=str(err))
        outcome.seconds = time.monotonic() - start
        print(f"[lease] {arm.name}: {outcome.status} in {outcome.seconds:.0f} s {outcome.note}", flush=True)
        return outcome

    def _worker(self, module: str, arm: Arm, timeout: float, **extra) -> dict:
        run_dir = Path(tempfile.mkdtemp(dir=self.scratch))
        spec = {
            "recipe": arm.recipe, "batch": arm.batch, "precision": "bf16", "compiled": arm.compiled,
            "shards": str(self.shards(arm.batch)), "run_dir": str(run_dir), "warmup": WARMUP_STEPS,
            "steps": TIMED_STEPS, "device": self.device, "overrides": list(arm.overrides),
            "out": str(run_dir / "result.json"), **extra,
        }  # fmt: skip
        log = self.out / "lease.log"
        env = {**worker_env(self.threads), "DS_ACCELERATOR": self.device}
        code = run_logged([sys.executable, "-m", module, "--worker", json.dumps(spec)], log, timeout, env)
        if code != 0:
            raise RuntimeError(f"exit {code}: {last_line(log)}")
        return json.loads(Path(spec["out"]).read_text())

    def _step(self, arm: Arm, timeout: float) -> dict:
        return step_values(arm, self._worker("benchmarks.gpu_step", arm, timeout))

    def _trace(self, arm: Arm, timeout: float) -> dict:
        from benchmarks.trace_summary import render

        summary = self._worker(
            "benchmarks.gpu_trace", arm, timeout, steps=3, trace=str(self.out / f"{arm.name}.json.gz")
        )
        (self.out / f"{arm.name}.md").write_text(f"# {arm.what}, batch {arm.batch}\n\n{render(summary)}")
        return {"summary": f"{arm.name}.md"}

    def _data(self, arm: Arm, timeout: float) -> dict:
        from benchmarks.bench_gpu import NUM_IMAGES, data_wait

        measured = data_wait(
            arm.recipe, arm.batch, arm.compiled, self.shards(NUM_IMAGES), self.scratch / arm.name, steps=40,
            extra=arm.overrides, timeout=timeout,
        )  # fmt: skip
        if measured.get("error", "").startswith("timed out"):
            raise TimeoutError(measured["error"])
        if "error" in measured:
            raise RuntimeError(measured["error"])
        return measured

    def _decode(self, arm: Arm, timeout: float) -> dict:
        out = self.out / "decode.md"
        command = [sys.executable, "-m", "benchmarks.bench_decode", "--device", self.device, "--per-size", "128"]
        command += ["--device-batch", str(arm.batch), "--out", str(out), "--data-dir", str(self.scratch / "decode")]
        code = run_logged(command, self.out / "lease.log", timeout, dict(os.environ))
        if code != 0:
            raise RuntimeError(f"exit {code}: {last_line(self.out / 'lease.log')}")
        return {"summary": out.name}

    def _tests(self, arm: Arm, timeout: float) -> dict:
        log = self.out / "lease.log"
        command = [sys.executable, "-m", "pytest", "-q", "-n", "8", "-p", "no:cacheprovider", "-rfE", "tests/gpu"]
        code = run_logged(command, log, timeout, dict(os.environ))
        return {"exit_code": code, "summary": last_line(log)}

    def shards(self, num_images: int) -> Path:
        """Shards of at least `num_images` generated ImageNet-like JPEGs (bench_data's), written once."""
        from benchmarks.bench_data import build_dataset

        root = self.scratch / f"data_{num_images}"
        build_dataset(root, num_images, num_classes=10)
        return root / "shards"

    def write(self) -> None:
        (self.out / "lease.json").write_text(
            json.dumps([{**asdict(o), "arm": asdict(o.arm)} for o in self.outcomes], indent=1)
        )
        lines = ["# GPU lease (benchmarks/gpu_lease.py)", "", *self.environment, "", *render_table(self.outcomes)]
        (self.out / "lease.md").write_text("\n".join(lines) + "\n")


def environment_lines(budget_s: float) -> list[str]:
    """The machine, the libraries and the date, as the table's head."""
    import torch

    gpu = "no CUDA device"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
    ) if shutil.which("nvidia-smi") else None  # fmt: skip
    driver = smi.stdout.strip() if smi is not None and smi.returncode == 0 else "unknown"
    libraries = ", ".join(f"{name} {version(name)}" for name in ("deepspeed", "timm", "webdataset", "pydantic"))
    return [
        f"- date: {time.strftime('%Y-%m-%d %H:%M %Z')}; budget {budget_s:.0f} s",
        f"- GPU: {gpu}; driver {driver}; CUDA {torch.version.cuda}; {os.cpu_count()} CPU cores",
        f"- torch {torch.__version__}, {libraries}, python {platform.python_version()}",
    ]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_table(outcomes: list[Outcome]) -> list[str]:
    """The lease's table, one row per arm in the order they ran."""
    lines = [
        "| arm | what | batch | status | images/s | MFU | step ms: median (min-max) | peak GiB | compile s | last loss "
        "| seconds | note |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for o in outcomes:
        v, a = o.values, o.arm
        note = o.note or ("out of memory" if v.get("oom") else "")
        if a.kind in ("trace", "decode") and "summary" in v:
            note = f"[summary]({v['summary']})"
        elif a.kind == "data" and o.status == "done":
            note = f"perf/data_wait_fraction {_fmt(v.get('wait'), '.1%')}, perf/mfu {_fmt(v.get('mfu'), '.1%')}"
        elif a.kind == "tests" and o.status == "done":
            note = f"exit {v['exit_code']}: {v['summary']}"
        ips = v.get("images_per_sec", v.get("ips"))
        steps = (
            f"{v['step_ms']:.1f} ({v['step_ms_range'][0]:.1f}-{v['step_ms_range'][1]:.1f})" if "step_ms" in v else "-"
        )
        lines.append(
            f"| {a.name} | {a.what} | {a.batch} | {o.status} | {_fmt(ips, '.1f')} | {_fmt(v.get('mfu'), '.1%')} | "
            f"{steps} | {_fmt(v.get('peak_allocated_gib'), '.1f')} | {_fmt(v.get('compile_seconds'), '.0f')} | "
            f"{_fmt(v.get('last_loss'), '.4f')} | {o.seconds:.0f} | {note} |"
        )
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for lease.md, lease.json, lease.log and the traces")
    parser.add_argument("--budget", type=float, default=540, help="seconds for all arms together (default 540)")
    parser.add_argument("--arms", default=",".join(arm.name for arm in ARMS), help="comma-separated arm names")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--threads", type=int, default=min(len(os.sched_getaffinity(0)), 8))
    args = parser.parse_args(argv)
    known = {arm.name for arm in ARMS}
    unknown = [name for name in args.arms.split(",") if name not in known]
    if unknown:
        parser.error(f"--arms: unknown {unknown}; choose from {', '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = set(args.arms.split(","))
    with tempfile.TemporaryDirectory(prefix="gpu_lease_") as scratch:
        lease = Lease(args.out, args.budget, args.device, Path(scratch), args.threads)
        lease.run(tuple(arm for arm in ARMS if arm.name in chosen))
    print((args.out / "lease.md").read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
