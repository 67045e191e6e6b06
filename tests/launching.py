"""Helpers for tests that run the pipeline for real: tiny recipes, synthetic shards, ./launch.sh, run outputs.

Every recipe a test writes or launches names its device (`engine.device: cpu`, or `cuda` in tests/gpu) and every
process it starts gets the matching DeepSpeed accelerator (`DS_ACCELERATOR`): left at `auto`, a GPU host would run
the CPU suite on its GPU, where losses and weights are not the CPU's bits. `write_recipe` and `launch` refuse a
recipe that does not, so CI catches one as well as a GPU host would.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import yaml

from core.launch.ports import free_port  # noqa: F401  (the tests' ports, from tests.launching)

REPO = Path(__file__).resolve().parents[1]

TINY_MODEL = {"size": "tiny", "embed_dim": 32, "depth": 2, "num_heads": 2, "img_size": 16, "patch_size": 4}


DEVICES = ("cpu", "cuda")
"""The values of `engine.device` a test may run: never `auto`, which follows the host."""


def _require_pinned(device: object, where: Path) -> str:
    if device not in DEVICES:
        raise ValueError(
            f"{where}: engine.device is {device!r}; a test recipe pins it to 'cpu' ('cuda' in tests/gpu), so that a "
            "GPU host runs the tests CI runs"
        )
    return device


def _engine_device(recipe: dict) -> object:
    engine = recipe.get("engine")
    return engine.get("device") if isinstance(engine, dict) else None


def write_recipe(path: Path, recipe: dict) -> Path:
    """Write `recipe` as YAML to `path`, refusing one whose `engine.device` is not pinned (see the module's doc)."""
    _require_pinned(_engine_device(recipe), path)
    path.write_text("# ./launch.sh " + path.name + "  (written by the test)\n" + yaml.safe_dump(recipe))
    return path


def pinned_device(recipe: Path, overrides: Sequence[str] = ()) -> str:
    """The `engine.device` the recipe file runs on with command-line `overrides` (the last `engine.device=` one
    wins, as in core/recipe/config.py).

    Raises:
        ValueError: If that is `auto` or unset (a recipe with a `base:` must then say it itself).
    """
    device = _engine_device(yaml.safe_load(recipe.read_text()) or {})
    for override in overrides:
        key, _, value = override.partition("=")
        if key == "engine.device":
            device = value
    return _require_pinned(device, recipe)


def fake_nvidia_smi(bin_dir: Path, num_gpus: int, driver: str = "470.57.02") -> Path:
    """An `nvidia-smi` in `bin_dir` (put it first on PATH) for a node with `num_gpus` H100s and driver `driver`:
    `-L` lists them, `--query-gpu=driver_version` prints the version once per GPU. Returns `bin_dir`."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    gpus = "".join(
        f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d}-0000-0000-0000-000000000000)\\n" for i in range(num_gpus)
    )
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = "-L" ] && printf "{gpus}" && exit 0\n'
        f'case "$*" in *--query-gpu=driver_version*) printf "{driver}\\n%.0s" $(seq {num_gpus}); exit 0;; esac\n'
        "exit 6\n"
    )
    script.chmod(0o755)
    return bin_dir


def fake_scontrol(bin_dir: Path, hostnames: dict[str, list[str]]) -> Path:
    """An `scontrol` in `bin_dir` (put it first on PATH) whose `show hostnames NODELIST` prints the hosts
    `hostnames[NODELIST]` lists, one per line (any other call fails). Returns `bin_dir`."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        f'[ "$*" = "show hostnames {nodelist}" ] && printf "%s\\n" {" ".join(hosts)} && exit 0'
        for nodelist, hosts in hostnames.items()
    ]
    script = bin_dir / "scontrol"
    script.write_text("#!/bin/sh\n" + "\n".join(lines) + "\nexit 1\n")
    script.chmod(0o755)
    return bin_dir


def launch_env(nproc: int = 2, extra_env: dict | None = None, device: str = "cpu") -> dict[str, str]:
    """The environment ./launch.sh gets in the tests: `nproc` processes, a free port, this Python, one thread each,
    DeepSpeed's accelerator for `device` (DeepSpeed picks CUDA's wherever a GPU is visible, unless told)."""
    return {
        **os.environ,
        "NPROC_PER_NODE": str(nproc),
        "MASTER_PORT": str(free_port()),
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": device,
        **(extra_env or {}),
    }


def run_in_session(
    cmd: list[str], *, timeout: float, merge_output: bool = False, **popen
) -> subprocess.CompletedProcess:
    """`subprocess.run` in a session of its own, whose whole process group is killed (SIGKILL) on timeout, not only
    the direct child: a timed-out run leaves nothing behind (its ranks, in sessions of their own under torchrun, die
    with it: core/engine/parent_death.py). Output is captured as text, stderr into stdout with `merge_output`.

    Raises:
        subprocess.TimeoutExpired: After the kill, with the output so far.
    """
    stderr = subprocess.STDOUT if merge_output else subprocess.PIPE
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True, **popen
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as expired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr) from expired
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def launch(recipe: Path, *overrides: str, nproc: int = 2, timeout: int = 300, extra_env: dict | None = None):
    """Run ./launch.sh as a user would, with the accelerator of the recipe's pinned device (`pinned_device`);
    returns the CompletedProcess (stdout and stderr merged). On timeout the whole run is killed (`run_in_session`)."""
    device = pinned_device(recipe, overrides)
    return run_in_session(
        [str(REPO / "launch.sh"), str(recipe), *overrides],
        cwd=REPO,
        env=launch_env(nproc, extra_env, device),
        timeout=timeout,
        merge_output=True,
    )


def accelerate_launch(
    recipe: Path, *flags: str, module: str = "pretrain", timeout: int = 300
) -> subprocess.CompletedProcess:
    """`accelerate launch FLAGS -m MODULE RECIPE` from the repository, as a user would start the stage instead of
    ./launch.sh (accelerate's console script beside this Python), with the accelerator of the recipe's pinned device
    and one thread per process; returns the CompletedProcess (stdout and stderr merged). On timeout the whole run is
    killed (`run_in_session`)."""
    device = pinned_device(recipe)
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": device}
    cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", *flags, "-m", module, str(recipe)]
    return run_in_session(cmd, cwd=REPO, env=env, timeout=timeout, merge_output=True)


def torchrun(
    script: str | Path, *args, nproc: int = 2, timeout: int = 300, device: str = "cpu"
) -> subprocess.CompletedProcess:
    """Run the worker `script` (a name in tests/dist, or a path) with `args` under torchrun: `nproc` processes, one
    thread each, with DeepSpeed's accelerator for `device` ("cpu", or "cuda" for a tests/gpu worker). Asserts that
    every process exited 0 (failing with the end of its stderr) and returns the CompletedProcess (stdout and stderr
    apart). On timeout the whole run is killed (`run_in_session`)."""
    path = script if isinstance(script, Path) else REPO / "tests" / "dist" / script
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--master-port", str(free_port()), str(path), *map(str, args)]
    assert device in DEVICES, device
    # The repository before the caller's own PYTHONPATH, not instead of it: a GPU host may carry packages there.
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": device}
    proc = run_in_session(cmd, cwd=REPO, env=env, timeout=timeout)
    assert proc.returncode == 0, f"{script} {' '.join(map(str, args))}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return proc


MARKER = "MIMPIPE_TEST_MARKER"
"""An environment variable a test sets to tell its run's processes apart: every process of the run inherits it."""


def process_running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def marked_processes(marker: str) -> set[int]:
    """Pids of the running processes whose environment holds `MARKER=marker`."""
    wanted, found = f"{MARKER}={marker}".encode(), set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and wanted in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return {pid for pid in found if process_running(pid)}


def wait_gone(pids, seconds: float = 10.0) -> set[int]:
    """Waits up to `seconds` for the processes `pids` to end; returns those still running."""
    deadline = time.monotonic() + seconds
    while (running := {pid for pid in pids if process_running(pid)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["train/loss"] for m in read_metrics(run_dir) if "train/loss" in m}


def assert_resume_repeats(
    run_dir: Path,
    resumed: Path,
    *,
    from_step: int,
    last_step: int,
    nproc: int = 2,
    rel: float = 1e-6,
    launcher: Callable[[Path], subprocess.CompletedProcess] | None = None,
) -> None:
    """Copies the finished `run_dir` to `resumed` with its checkpoints after `from_step` removed, launches it again
    with `nproc` processes (`launch`, or `launcher(recipe)`) and checks that steps from_step+1..last_step give the
    same losses, to `rel` (a CPU run repeats its bits; tests/gpu states the tolerance a CUDA run keeps)."""
    shutil.copytree(run_dir, resumed)
    for later in range(from_step + 1, last_step + 1):
        shutil.rmtree(resumed / "checkpoints" / f"step_{later:08d}", ignore_errors=True)
    (resumed / "checkpoints" / "latest").write_text(f"step_{from_step:08d}")
    (resumed / "metrics.jsonl").unlink()
    recipe_path = resumed.with_suffix(".yaml")
    recipe_path.write_text((run_dir / "config.yaml").read_text().replace(str(run_dir), str(resumed)))
    proc = launch(recipe_path, nproc=nproc) if launcher is None else launcher(recipe_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "resumed from" in proc.stdout and f"at step {from_step}" in proc.stdout
    before, after = losses(run_dir), losses(resumed)
    assert sorted(after) == list(range(from_step + 1, last_step + 1))
    for step in after:
        assert after[step] == pytest.approx(before[step], rel=rel, abs=1e-7), (step, after, before)


def write_synthetic(out: Path, split: str, num: int, shard_size: int, seed: int) -> Path:
    """`python -m data write --source synthetic` of `num` 16 px images of 4 classes into `out`, run in this process
    (its command line parsed as the command's; a subprocess would import torch and the data modules again, ~2 s)."""
    from data.__main__ import main as data_command

    argv = ["write", "--source", "synthetic", "--split", split, "--out", str(out), "--shard-size", str(shard_size)]
    argv += ["--num-samples", str(num), "--image-size", "16", "--num-classes", "4", "--seed", str(seed)]
    with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None):  # its summary and progress
        data_command(argv)
    return out


def copy_shards(src: Path, dst: Path, *, drop: str, in_shards: set[int] | None = None, index: bool = True) -> Path:
    """Copy a shard directory, leaving out the `.{drop}` member of every sample in shard numbers `in_shards` (all
    shards when None), and index.json unless `index` is False: shards as a foreign tool might have written them."""
    dst.mkdir(parents=True)
    for number, shard in enumerate(sorted(src.glob("*.tar"))):
        if in_shards is not None and number not in in_shards:
            shutil.copy(shard, dst / shard.name)
            continue
        with tarfile.open(shard) as tar_in, tarfile.open(dst / shard.name, "w") as tar_out:
            for member in tar_in.getmembers():
                if not member.name.endswith(f".{drop}"):
                    tar_out.addfile(member, tar_in.extractfile(member))
    if index:
        shutil.copy(src / "index.json", dst / "index.json")
    return dst


def pretrain_recipe(shards: dict[str, Path], run_dir: Path, **sections) -> dict:
    recipe = {
        "stage": "pretrain",
        "run_dir": str(run_dir),
        "model": dict(TINY_MODEL),
        "data": {"train": str(shards["train"]), "global_batch_size": 32, "num_workers": 1, "shuffle_buffer": 64},
        "objective": {"kind": "mae", "decoder_embed_dim": 32, "decoder_depth": 1, "decoder_num_heads": 2},
        "optim": {"base_lr": 1e-3},
        "schedule": {"steps": 6, "warmup_steps": 2},
        "engine": {"device": "cpu", "zero_stage": 2},
        "checkpoint": {"every_steps": 3, "keep_last": 2},
        "logging": {"every_steps": 1, "image_every_steps": 3},
    }
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value} if isinstance(value, dict) else value
    return recipe


def finetune_recipe(shards: dict[str, Path], run_dir: Path, init: Path, **engine) -> dict:
    """Tiny fine-tuning from the export `init`, 16 -> 20 px (pos-embed 4x4 -> 5x5), 4 steps, evaluation at 2 and 4."""
    return {
        "stage": "finetune",
        "run_dir": str(run_dir),
        "model": {**TINY_MODEL, "img_size": 20, "global_pool": "avg", "init": str(init)},
        "data": {
            "train": str(shards["train"]),
            "val": str(shards["val"]),
            "global_batch_size": 32,
            "num_workers": 1,
            "eval_batch_size_per_device": 16,
            "crop_scale": [0.5, 1.0],
            "eval_crop_pct": 1.0,
        },
        "objective": {"kind": "classification", "label_smoothing": 0.1},
        "optim": {"base_lr": 1e-3, "betas": [0.9, 0.999]},
        "schedule": {"steps": 4, "warmup_steps": 1},
        "engine": {"device": "cpu", "zero_stage": 1, **engine},
        "checkpoint": {"every_steps": 4},
        "logging": {"every_steps": 2},
        "eval": {"every_steps": 2},
    }


def write_class_ordered(out: Path, prefix: str, num_classes: int, per_class: int = 40, shard_size: int = 50) -> Path:
    """Shards written class by class, as another tool reading a folder tree in sorted order would write them: sample
    i (key `{prefix}_{i:08d}`, a 4x4 grey image) has label i // per_class."""
    from PIL import Image

    from data.write import write_shards

    samples = (
        (f"{prefix}_{i:08d}", Image.new("L", (4, 4), i % 256), i // per_class, {})
        for i in range(num_classes * per_class)
    )
    classes = [f"c{k}" for k in range(num_classes)]
    write_shards(samples, str(out), shard_size=shard_size, split=prefix, classes=classes, source="class-ordered")
    return out


# A batch of 40 drawn i.i.d. from 10 equally likely classes has a chi-square statistic with 9 degrees of freedom:
# mean 9, standard deviation sqrt(18) (so 1.2 for the mean of 12 batches), above 40 once in 400,000 batches.
# `write_class_ordered` shards of 10 classes read the default way average 9.0 in simulation (2,400 batches, at most
# 34.5); read one shard at a time with a one-shard buffer, as before, they average above 60.
MAX_MEAN_CHI2, MAX_BATCH_CHI2 = 15.0, 40.0


def chi_square(labels: list[int], num_classes: int) -> float:
    """Pearson's statistic of the class counts of `labels` against a uniform distribution."""
    counts = [labels.count(k) for k in range(num_classes)]
    expected = len(labels) / num_classes
    return sum((c - expected) ** 2 / expected for c in counts)


def position_after(batches: Sequence[dict], num_batches: int) -> dict:
    """The data position the training loop holds after consuming the first `num_batches` of `batches`
    (`TrainState.consume`, which takes each batch's cursor): what a checkpoint then saves for this rank."""
    from core.engine.train_state import TrainState

    state = TrainState()
    for batch in batches[:num_batches]:
        state.consume(dict(batch))  # a copy: the batch keeps its cursor for the caller
    return state.data_position
