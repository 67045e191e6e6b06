"""Helpers for tests that run the pipeline for real: tiny recipes, synthetic shards, ./launch.sh, run outputs."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

TINY_MODEL = {"size": "tiny", "embed_dim": 32, "depth": 2, "num_heads": 2, "img_size": 16, "patch_size": 4}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_recipe(path: Path, recipe: dict) -> Path:
    path.write_text("# ./launch.sh " + path.name + "  (written by the test)\n" + yaml.safe_dump(recipe))
    return path


def launch(recipe: Path, *overrides: str, nproc: int = 2, timeout: int = 300, extra_env: dict | None = None):
    """Run ./launch.sh as a user would; returns the CompletedProcess (stdout and stderr merged)."""
    env = {
        **os.environ,
        "NPROC_PER_NODE": str(nproc),
        "MASTER_PORT": str(free_port()),
        "PYTHON": sys.executable,
        "OMP_NUM_THREADS": "1",
        **(extra_env or {}),
    }
    return subprocess.run(
        [str(REPO / "launch.sh"), str(recipe), *overrides],
        cwd=REPO,
        env=env,
        timeout=timeout,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["train/loss"] for m in read_metrics(run_dir) if "train/loss" in m}


def write_synthetic(out: Path, split: str, num: int, shard_size: int, seed: int) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "data",
        "write",
        "--source",
        "synthetic",
        "--split",
        split,
        "--out",
        str(out),
        "--shard-size",
        str(shard_size),
        "--num-samples",
        str(num),
        "--image-size",
        "16",
        "--num-classes",
        "4",
        "--seed",
        str(seed),
    ]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
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
        "engine": {"zero_stage": 2},
        "checkpoint": {"every_steps": 3, "keep_last": 2},
        "logging": {"every_steps": 1, "image_every_steps": 3},
    }
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value} if isinstance(value, dict) else value
    return recipe
