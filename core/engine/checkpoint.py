"""Checkpoints under `run_dir/checkpoints/`: one DeepSpeed tag per save plus, per rank, a JSON file with the step,
the data-stream position and every RNG state; the resolved config sits beside them as YAML.

Write order: all ranks save their shards -> barrier -> rank 0 replaces `latest` atomically -> old tags are pruned.
A crash at any point leaves `latest` naming a complete checkpoint.
Resume order (see `find_resume`): the run_dir's own `latest`, else training starts from scratch (an `init`
checkpoint, if any, is applied by the stage before this).
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from core.engine.distributed import DistInfo, barrier

LATEST = "latest"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    with open(tmp) as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    """Python, NumPy and torch (CPU and CUDA) RNG states as JSON-safe values."""
    b64 = lambda t: base64.b64encode(t.numpy().tobytes()).decode()  # noqa: E731
    np_state = np.random.get_state()
    state = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    unb64 = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)  # noqa: E731
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([unb64(s) for s in state["cuda"]])


def _tag(step: int) -> str:
    return f"step_{step:08d}"


def save_checkpoint(
    engine, *, run_dir: Path, step: int, dist: DistInfo, train_state: dict, config_yaml: str, keep_last: int
) -> Path:
    """Save model, optimizer, step, data position and RNG; returns the tag directory."""
    ckpt_dir = run_dir / "checkpoints"
    tag = _tag(step)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step}, save_latest=False)
    tag_dir = ckpt_dir / tag
    state = {"step": step, "world_size": dist.world_size, "rng": rng_state(), **train_state}
    _atomic_write(tag_dir / f"rank_{dist.rank:05d}.json", json.dumps(state))
    if dist.is_main:
        _atomic_write(tag_dir / "config.yaml", config_yaml)
    barrier()
    if dist.is_main:
        _atomic_write(ckpt_dir / LATEST, tag)
        tags = sorted(p for p in ckpt_dir.glob("step_*") if p.is_dir())
        for old in tags[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return tag_dir


def find_resume(run_dir: Path, rank: int, world_size: int, step: int | None = None) -> dict | None:
    """This rank's saved train state from `latest` (or the given step), or None for a fresh run.

    Raises:
        ValueError: The checkpoint lacks this rank's state, or was written by another world size (its ZeRO
            partitions and per-rank data positions only fit the world size that wrote them).
    """
    ckpt_dir = run_dir / "checkpoints"
    if step is not None:
        tag = _tag(step)
    elif (ckpt_dir / LATEST).is_file():
        tag = (ckpt_dir / LATEST).read_text().strip()
    else:
        return None
    state_file = ckpt_dir / tag / f"rank_{rank:05d}.json"
    if not state_file.is_file():
        raise ValueError(f"checkpoint {ckpt_dir / tag} has no state for rank {rank} ({state_file} missing)")
    state = json.loads(state_file.read_text())
    if state.get("world_size", world_size) != world_size:
        raise ValueError(
            f"checkpoint {ckpt_dir / tag} was written by {state['world_size']} processes, this run has {world_size}: "
            f"resume with the same world size, or start a new run_dir from its export (model.init)"
        )
    return {"tag": tag, **state}


def load_checkpoint(engine, *, run_dir: Path, resume: dict) -> None:
    """Load DeepSpeed model/optimizer state of `resume["tag"]` and restore this rank's RNG."""
    ckpt_dir = run_dir / "checkpoints"
    path, _ = engine.load_checkpoint(
        str(ckpt_dir), tag=resume["tag"], load_optimizer_states=True, load_lr_scheduler_states=False
    )
    if path is None:
        raise ValueError(f"could not load checkpoint {ckpt_dir / resume['tag']}")
    set_rng_state(resume["rng"])
