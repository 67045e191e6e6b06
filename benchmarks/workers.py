"""What the interleaved benchmarks share: every measurement runs in a fresh worker process
(`python -m MODULE --worker SPEC`)
that makes its own one-process group and writes its timings as JSON to `spec["out"]`."""

from __future__ import annotations

import datetime
import io
import json
import os
import platform
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
_LAUNCHER_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT")


def quickstart_vit() -> list[str]:
    """recipes/quickstart.yaml's ViT as `model.*` overrides. The fine-tuning recipes that start from its export take
    the architecture from the export (`model.init`), so a run of them from scratch (`model.init=null`) names it."""
    model = yaml.safe_load((REPO / "recipes" / "quickstart.yaml").read_text())["model"]
    return [f"model.{key}={value}" for key, value in model.items()]


def worker_env(threads: int, **extra: str) -> dict[str, str]:
    """This process's environment for a worker: no launcher variables (each worker makes its own group on a free
    port), `threads` OpenMP threads, offline, DeepSpeed on the CPU accelerator; `extra` on top."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_KEYS}
    env.update(OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu", **extra)
    return env


def run_worker(module: str, spec: dict, env: dict[str, str], what: object, cwd: Path = REPO) -> dict:
    """Run `python -m module --worker SPEC` in `cwd` (the first place imports look) and return the JSON it wrote to
    `spec["out"]`; a failed worker raises naming `what` with the end of its output."""
    command = [sys.executable, "-m", module, "--worker", json.dumps(spec)]
    proc = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    return json.loads(Path(spec["out"]).read_text())


def machine_lines(threads: int) -> list[str]:
    """The head of a result file: when, on which CPU with how many threads, with which library versions."""
    import torch

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), platform.machine())
    return [
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- CPU: {cpu}, {os.cpu_count()} cores visible; OMP_NUM_THREADS={threads}",
        f"- torch {torch.__version__}, deepspeed {version('deepspeed')}, timm {version('timm')}, "
        f"python {platform.python_version()}, {' '.join(platform.libc_ver())}",
    ]


def arms_header(
    command: str, threads: int, scale: float, outcome: dict[str, str], *, note: str = "", extra: Sequence[str] = ()
) -> list[str]:
    """The head of a resumable benchmark's result file: the command (and `note` after it), the machine, a smoke
    run's warning (`scale` < 1), `extra` lines, and the arms `outcome` says failed or were blocked."""
    header = [f"Command: `{command}`{note}", "", *machine_lines(threads)]
    if scale != 1:
        header += ["", f"**A smoke run: every step count x {scale:g}; the numbers say nothing about quality.**"]
    header += list(extra)
    unrun = [f"{name} ({what})" for name, what in outcome.items() if what in ("failed", "blocked")]
    return header + (["", f"Not finished: {', '.join(unrun)}"] if unrun else [])


def write_result(text: str, out: Path, tag: str) -> None:
    """Write a benchmark's markdown to `out` (folders made) and show it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"[{tag}] written to {out}")


def extract_tree(rev: str, scratch: Path) -> Path:
    """The repository's files at git revision `rev`, unpacked under `scratch`, less its benchmarks/: the worker is
    this tree's, only the product code it imports is the revision's."""
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, check=True, stdout=subprocess.PIPE).stdout
    root = scratch / f"tree-{rev.replace('/', '_').replace('~', '_')}"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        product = [member for member in tar.getmembers() if member.name.split("/")[0] != "benchmarks"]
        tar.extractall(root, members=product, filter="data")
    return root


def replace_section(path: Path, text: str, begin: str, end: str) -> None:
    """Put `text` (a section from the line `begin` to the line `end`) into the results file `path`, in place of an
    earlier one, else at the end: benchmarks that share a results file each keep their own section."""
    old = path.read_text() if path.is_file() else ""
    if begin in old and end in old:
        new = old[: old.index(begin)] + text + old[old.index(end) + len(end) :]
    else:
        new = (old.rstrip("\n") + "\n\n" if old else "") + text + "\n"
    path.write_text(new)
