"""The engine path on CUDA: the tiny MAE recipe (tests/launching.py `pretrain_recipe`) in bf16 through ./launch.sh,
one process unless a test says otherwise. bf16 that stays bf16 inside `engine(...)`, ZeRO 0-3 on one GPU, compile,
activation checkpointing, an exact resume, fine-tuning with evaluation, and 2 ranks on NCCL when there are 2 GPUs.
Skipped without a GPU (`make gpu-check` runs them)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from tests.launching import (
    assert_resume_repeats,
    finetune_recipe,
    launch,
    losses,
    pretrain_recipe,
    read_metrics,
    torchrun,
    write_recipe,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
STEPS = [1, 2, 3, 4, 5, 6]  # pretrain_recipe's length
# Runs that repeat bit for bit on the CPU differ on CUDA in the order of their sums: the backward of MAE's token
# gather is a scatter-add, and the attention kernels' backward accumulates with atomics, in whatever order the
# threads arrive. Over the tiny recipe's 6 steps that stays well under what another mask draw moves its loss (~0.5%).
REPEAT_RTOL = 2e-3
# Compiled against eager in bf16: inductor fuses, so it rounds in other places (as in tests/unit/test_compiled.py).
COMPILED_RTOL = 2e-2
# Against the CPU in fp32 (tests/gpu/test_gpu.py): bf16, and each device draws its masks from its own generator.
CPU_RTOL = 5e-2


def _recipe(shards, run_dir: Path, engine: dict | None = None, **sections) -> dict:
    """pretrain_recipe on DEVICE in bf16, eager (engine.compile auto would compile on CUDA), with `engine` settings and
    other `sections` on top."""
    engine = {"device": DEVICE, "precision": "bf16", "compile": False, **(engine or {})}
    return pretrain_recipe(shards, run_dir, engine=engine, **sections)


def _run(recipe: dict, path: Path, nproc: int = 1) -> str:
    proc = launch(write_recipe(path, recipe), nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert f"world size {nproc} on {DEVICE}" in proc.stdout
    return proc.stdout


def _assert_losses_close(got: dict[int, float], want: dict[int, float], rtol: float) -> None:
    assert sorted(got) == sorted(want) == STEPS
    assert all(math.isfinite(v) for v in got.values())
    for step in STEPS:
        assert got[step] == pytest.approx(want[step], rel=rtol), (step, got, want)


@pytest.fixture(scope="module")
def zero2(shards, tmp_path_factory) -> Path:
    """The reference: ZeRO-2, checkpoints at 3 and 6, exported at the end. Returns its run_dir."""
    tmp = tmp_path_factory.mktemp("zero2")
    _run(_recipe(shards, tmp / "run", {"zero_stage": 2}), tmp / "tiny_mae.yaml")
    return tmp / "run"


def test_blocks_run_in_bf16_inside_the_engine(shards, tmp_path):
    """Every Linear layer inside a transformer block, encoder and decoder, outputs bf16 in the training forwards
    inside `engine(...)` and in the forwards outside it (FLOP count, pictures), and DeepSpeed does not switch the
    loop's autocast off (on CUDA it did, issue 26)."""
    recipe = _recipe(shards, tmp_path / "run", {"zero_stage": 2}, schedule={"steps": 2, "warmup_steps": 1})
    out = tmp_path / "dtypes.json"
    worker = Path(__file__).with_name("block_dtypes_worker.py")
    proc = torchrun(worker, out, write_recipe(tmp_path / "tiny_mae.yaml", recipe), nproc=1, device=DEVICE)
    assert "disabled within the DeepSpeed engine" not in proc.stdout + proc.stderr
    counts = json.loads(out.read_text())
    assert set(counts["grad"]) == {"bfloat16"} and set(counts["no_grad"]) == {"bfloat16"}, counts
    # (2 encoder + 1 decoder blocks) x (qkv, proj, fc1, fc2) per forward: 2 training steps, the FLOP count's forward
    assert counts["grad"]["bfloat16"] >= 3 * 12, counts


@pytest.mark.parametrize("stage", [0, 1])
def test_zero_stages_train_like_zero2(zero2, shards, tmp_path, stage):
    """Same seed, data, masks and initial weights: every step's loss is ZeRO-2's, within the order of CUDA's sums."""
    _run(_recipe(shards, tmp_path / "run", {"zero_stage": stage}), tmp_path / f"tiny_mae_zero{stage}.yaml")
    _assert_losses_close(losses(tmp_path / "run"), losses(zero2), REPEAT_RTOL)


def test_zero3_builds_the_cpu_build_and_trains_like_it(shards, tmp_path):
    """ZeRO-3 builds the objective inside deepspeed.zero.Init, whose parameters live on the GPU; its initial draws are
    made on the CPU generator (core/engine/zero_init.py), so the GPU's ZeRO-3 run starts where the CPU's does. (MAE's
    ZeRO-3 build draws in another order than ZeRO-0/1/2's, on every device: docs/memory.md.) Within CPU_RTOL: bf16,
    and the masks come from each device's own generator."""
    _run(_recipe(shards, tmp_path / "gpu", {"zero_stage": 3}), tmp_path / "tiny_mae_zero3.yaml")
    cpu = pretrain_recipe(shards, tmp_path / "cpu", engine={"device": "cpu", "precision": "bf16", "zero_stage": 3})
    proc = launch(write_recipe(tmp_path / "tiny_mae_zero3_cpu.yaml", cpu), nproc=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    _assert_losses_close(losses(tmp_path / "gpu"), losses(tmp_path / "cpu"), CPU_RTOL)


def test_compiled_trains_like_eager(zero2, shards, tmp_path):
    output = _run(
        _recipe(shards, tmp_path / "run", {"zero_stage": 2, "compile": True}), tmp_path / "tiny_mae_compiled.yaml"
    )
    assert re.search(r"engine\.compile \(True\): the objective's step at batch 32; .* compiled with inductor", output)
    _assert_losses_close(losses(tmp_path / "run"), losses(zero2), COMPILED_RTOL)


def test_activation_checkpointing_keeps_the_losses(zero2, shards, tmp_path):
    """The recomputed forwards give the same losses (their memory is benchmarks/bench_memory.py's question)."""
    recipe = _recipe(shards, tmp_path / "run", {"zero_stage": 2, "activation_checkpointing": True})
    _run(recipe, tmp_path / "tiny_mae_checkpointed.yaml")
    _assert_losses_close(losses(tmp_path / "run"), losses(zero2), REPEAT_RTOL)


def test_resume_repeats_the_next_losses(zero2, tmp_path):
    """From the step-3 checkpoint: steps 4-6 again, within the order of CUDA's sums (bit for bit on the CPU)."""
    assert_resume_repeats(zero2, tmp_path / "run", from_step=3, last_step=6, nproc=1, rel=REPEAT_RTOL)


def test_finetune_from_the_cuda_export_evaluates(zero2, shards, tmp_path):
    """The tiny fine-tune (16 -> 20 px) from the ZeRO-2 run's export, evaluated at steps 2 and 4 on all 203 samples."""
    recipe = finetune_recipe(shards, tmp_path / "run", zero2 / "export", device=DEVICE, precision="bf16")
    _run(recipe, tmp_path / "tiny_finetune.yaml")
    assert all(math.isfinite(v) for v in losses(tmp_path / "run").values())
    evals = [m for m in read_metrics(tmp_path / "run") if "val/top1" in m]
    assert [m["step"] for m in evals] == [2, 4] and all(m["val/samples"] == 203 for m in evals)
    assert all(0.0 <= m["val/top1"] <= 1.0 and math.isfinite(m["val/loss"]) and m["val/loss"] > 0 for m in evals)
    assert (tmp_path / "run" / "export" / "model.safetensors").is_file()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_ranks_on_nccl_train_like_two_on_the_cpu(shards, tmp_path):
    """2 ranks, one GPU each (NCCL), against the same recipe on 2 CPU ranks (gloo) in fp32: the same global batches
    of the same shards, every step's loss within CPU_RTOL."""
    _run(_recipe(shards, tmp_path / "cuda", {"zero_stage": 2}), tmp_path / "tiny_mae_nccl.yaml", nproc=2)
    cpu = pretrain_recipe(shards, tmp_path / "cpu", engine={"device": "cpu", "precision": "fp32", "zero_stage": 2})
    proc = launch(write_recipe(tmp_path / "tiny_mae_gloo.yaml", cpu), nproc=2)
    assert proc.returncode == 0, proc.stdout[-4000:]
    _assert_losses_close(losses(tmp_path / "cuda"), losses(tmp_path / "cpu"), CPU_RTOL)
