"""Recipe: the tiny MAE of the session's `zero2_run` (tests/launching.py `pretrain_recipe`: 2 ranks, ZeRO-2, 6 steps,
checkpoints at 3 and 6) started by `accelerate launch` instead of ./launch.sh. accelerate only starts the processes
(core/launch/accelerate.py): the world, the losses (bit for bit on the CPU), the checkpoints and a resume are
launch.sh's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.launching import accelerate_launch, assert_resume_repeats, losses

pytest.importorskip("accelerate")
pytestmark = pytest.mark.dist


def same_recipe(run_dir: Path, new_run_dir: Path) -> Path:
    """`run_dir`'s resolved config as a recipe that trains into `new_run_dir`."""
    recipe = new_run_dir.with_suffix(".yaml")
    recipe.write_text((run_dir / "config.yaml").read_text().replace(str(run_dir), str(new_run_dir)))
    return recipe


def tensors(value, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a loaded checkpoint file, by its path of keys."""
    if isinstance(value, torch.Tensor):
        return {path: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else ()
    return {name: t for key, item in items for name, t in tensors(item, f"{path}/{key}").items()}


def assert_same_checkpoint(expected: Path, got: Path) -> None:
    """The same files, every tensor of DeepSpeed's (weights, each rank's optimizer partition) equal, and each rank's
    training state (step, data position, RNGs) the same."""
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in expected.iterdir())
    for file in sorted(expected.glob("*.pt")):
        want = tensors(torch.load(file, map_location="cpu", weights_only=False))
        have = tensors(torch.load(got / file.name, map_location="cpu", weights_only=False))
        assert sorted(have) == sorted(want) and want, file.name
        unequal = [key for key in want if not torch.equal(have[key], want[key])]
        assert unequal == [], (file.name, unequal)
    for file in sorted(expected.glob("rank_*.json")):
        assert json.loads((got / file.name).read_text()) == json.loads(file.read_text()), file.name


def test_accelerate_launch_cpu_of_two_processes_repeats_launch_sh_bit_for_bit(zero2_run, tmp_path):
    """`accelerate launch --num_processes 2 --cpu -m pretrain RECIPE`: accelerate starts one process, which becomes
    torchrun's agent for the two."""
    run_dir, _ = zero2_run
    ours = tmp_path / "run"
    proc = accelerate_launch(same_recipe(run_dir, ours), "--num_processes", "2", "--cpu")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "world size 2 on cpu" in proc.stdout
    assert "global batch 32 = 16 per device x 1 accumulation x 2 ranks" in proc.stdout
    assert losses(ours) == losses(run_dir)  # bit for bit
    assert (ours / "checkpoints" / "latest").read_text() == "step_00000006"
    for tag in ("step_00000003", "step_00000006"):
        assert_same_checkpoint(run_dir / "checkpoints" / tag, ours / "checkpoints" / tag)
    assert (ours / "export" / "model.safetensors").read_bytes() == (
        run_dir / "export" / "model.safetensors"
    ).read_bytes()


@pytest.mark.faults
def test_a_relaunch_through_accelerates_torchrun_resumes_as_launch_sh_does(zero2_run, tmp_path):
    """launch.sh's run stopped after its step-3 checkpoint, relaunched by `accelerate launch --multi_gpu` (torchrun
    inside accelerate, as on GPUs; the recipe pins the CPU): steps 4-6 repeat bit for bit."""
    run_dir, _ = zero2_run
    assert_resume_repeats(
        run_dir,
        tmp_path / "run",
        from_step=3,
        last_step=6,
        rel=0.0,
        launcher=lambda recipe: accelerate_launch(recipe, "--multi_gpu", "--num_processes", "2"),
    )
