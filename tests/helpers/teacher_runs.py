"""Reading the finished runs of the objectives with an EMA teacher (data2vec 2.0, I-JEPA) in tests/dist: the
objective's weights consolidated from a checkpoint of any ZeRO stage (as `pretrain export` consolidates them,
core/engine/gather.py), one encoder of them by timm's names, the reference EMA update, the init file every run starts
from, a finished run cut back to one of its checkpoints, and `python -m pretrain export` as a user runs it."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from core.engine.gather import consolidated_state_dict
from core.recipe.config import load_config
from core.recipe.teacher_sections import EMASchedule
from pretrain.objectives import objective_builder
from tests.launching import REPO

STUDENT, TEACHER = "encoder.", "teacher.encoder."
"""Where the student (I-JEPA's context encoder) and the EMA teacher (I-JEPA's target encoder) sit in the objective."""
BESIDE = ("decoder.", "predictor.", "teacher.")
"""The objective's own modules beside the encoders (data2vec 2.0's decoder, I-JEPA's predictor) and the teacher."""


def consolidated(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The objective's fp32 weights in the checkpoint of `step`, consolidated from its ZeRO stage."""
    ckpt_dir, tag = run_dir / "checkpoints", f"step_{step:08d}"
    stage = load_config(ckpt_dir / tag / "config.yaml").engine.zero_stage
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's progress
        return consolidated_state_dict(ckpt_dir, tag, stage)


def part(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The encoder under `prefix` (STUDENT, TEACHER, or "": an init file's), by timm's names."""
    return {
        k.removeprefix(prefix): v
        for k, v in state.items()
        if k.startswith(prefix) and not k.removeprefix(prefix).startswith(BESIDE)
    }


def ema_step(teacher: dict, student: dict, step: int, ema: dict) -> dict[str, torch.Tensor]:
    """The reference teacher after optimizer step `step`: lerped towards the student in fp32 by 1 - decay_at(step),
    `ema` the recipe's objective.ema."""
    weight = torch.tensor(1.0 - EMASchedule(**ema).decay_at(step))
    return {name: torch.lerp(value, student[name], weight) for name, value in teacher.items()}


def assert_weights_equal(actual: dict, expected: dict, what: str) -> None:
    """Same names, and each tensor equal to 1e-6 relative and 1e-7 absolute (a lerp in another order, not a step)."""
    assert set(actual) == set(expected), (what, sorted(set(actual) ^ set(expected)))
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{what} {n}: {m}")


def assert_same_tensors(actual: dict, expected: dict) -> None:
    """Same names, and every tensor equal bit for bit."""
    assert set(actual) == set(expected), sorted(set(actual) ^ set(expected))
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


def write_init_file(recipe: Path, path: Path, seed: int = 1234) -> Path:
    """A `model.init` file for `recipe`'s objective, built here after seeding `seed`: the student by timm's names and
    the objective's own modules (a decoder, a predictor) by the objective's names, not the teacher (which copies the
    student before step 1). Returns `path`."""
    torch.manual_seed(seed)
    objective = objective_builder(load_config(recipe))()
    state = objective.encoder.state_dict() | {
        k: v for k, v in objective.state_dict().items() if k.startswith(BESIDE) and not k.startswith("teacher.")
    }
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path


def copy_at_step(run_dir: Path, dst: Path, step: int) -> Path:
    """A copy of the finished `run_dir` at `dst` cut back to its checkpoint of `step`, as tests/launching.py
    `assert_resume_repeats` makes one; returns its recipe (the run's config.yaml, run_dir pointed at the copy)."""
    shutil.copytree(run_dir, dst)
    for later in (dst / "checkpoints").glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    (dst / "checkpoints" / "latest").write_text(f"step_{step:08d}")
    (dst / "metrics.jsonl").unlink()
    recipe = dst.with_suffix(".yaml")
    recipe.write_text((run_dir / "config.yaml").read_text().replace(str(run_dir), str(dst)))
    return recipe


def pretrain_export(run_dir: Path, out: Path, *args: str) -> dict[str, torch.Tensor]:
    """`python -m pretrain export RUN_DIR ARGS --out OUT`, as a user runs it; returns the exported weights."""
    cmd = [sys.executable, "-m", "pretrain", "export", str(run_dir), *args, "--out", str(out)]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(str(out / "model.safetensors"))
