"""CUDA against a CPU reference. In-process: the tiny MAE's forward and backward on CUDA in fp32, bf16 and fp16 with
the CPU's weights, images and masks. End to end: the tiny MAE recipe (tests/launching.py `pretrain_recipe`) through
./launch.sh on CUDA in bf16 and fp16, against the same recipe on the CPU in fp32. Skipped without a GPU."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from core.models.vit import build_vit
from pretrain.mae import MAE
from tests.launching import TINY_MODEL, launch, losses, pretrain_recipe, write_recipe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
# Relative error allowed against the CPU's fp32: fp32 differs in the order of sums only (TF32 is turned off), fp16
# keeps 10 bits of mantissa, bf16 7. The CPU's own autocast stays 10x inside these: 0.03% / 0.5% (bf16), 0.004% /
# 0.07% (fp16) in loss / prediction.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _forward_backward(mae: MAE, images: torch.Tensor, dtype: torch.dtype, monkeypatch) -> dict:
    """One forward and backward of `mae` on `images` under autocast to `dtype` (none for fp32). MAE draws its masks
    with `torch.rand` on the images' device; here they come from the CPU's generator, seeded alike for every call,
    so CPU and CUDA mask the same patches. Returns loss, prediction, mask and gradients, as CPU float32."""
    generator, cpu_rand = torch.Generator().manual_seed(2), torch.rand
    with monkeypatch.context() as patch:
        patch.setattr(torch, "rand", lambda *size, device=None: cpu_rand(*size, generator=generator).to(device))
        with torch.autocast(images.device.type, dtype=dtype, enabled=dtype != torch.float32):
            out = mae({"image": images})
    out["loss"].backward()
    grads = {name: p.grad.float().cpu() for name, p in mae.named_parameters() if p.grad is not None}
    return {
        "loss": out["loss"].detach().float().cpu(),
        "pred": out["pred"].detach().float().cpu(),
        "mask": out["mask"].cpu(),
        "grads": grads,
    }


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_mae_forward_and_backward_on_cuda_match_the_cpu(dtype, monkeypatch):
    torch.manual_seed(0)
    encoder = build_vit("tiny", **{k: v for k, v in TINY_MODEL.items() if k != "size"})
    cpu = MAE(encoder, decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=2, norm_pix_loss=True)
    cuda = copy.deepcopy(cpu).to(DEVICE)
    images = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))  # (B, C, H, W)
    reference = _forward_backward(cpu, images, torch.float32, monkeypatch)
    # cuDNN runs fp32 convolutions (the patch embedding) in TF32 unless told not to; matmuls are fp32 by default.
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        result = _forward_backward(cuda, images.to(DEVICE), dtype, monkeypatch)

    tolerance = TOLERANCE[dtype]
    assert torch.equal(result["mask"], reference["mask"]) and int(reference["mask"].sum()) == 8 * 12
    assert result["loss"].item() == pytest.approx(reference["loss"].item(), rel=tolerance)
    assert _relative_error(result["pred"], reference["pred"]) < tolerance
    assert result["grads"].keys() == reference["grads"].keys()
    every = [torch.cat([g.flatten() for g in run["grads"].values()]) for run in (result, reference)]
    assert _relative_error(*every) < 2 * tolerance
    cosine = {
        name: F.cosine_similarity(g.flatten(), reference["grads"][name].flatten(), dim=0).item()
        for name, g in result["grads"].items()
    }
    assert min(cosine.values()) > 1 - 2 * tolerance, cosine


@pytest.fixture(scope="module")
def cpu_run(shards, tmp_path_factory):
    """The tiny MAE recipe on the CPU in fp32, one process: the reference of the CUDA runs."""
    tmp = tmp_path_factory.mktemp("cpu_reference")
    recipe = pretrain_recipe(shards, tmp / "run", engine={"zero_stage": 2, "precision": "fp32", "device": "cpu"})
    proc = launch(write_recipe(tmp / "tiny_mae_cpu.yaml", recipe), nproc=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return losses(tmp / "run")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_tiny_mae_trains_on_cuda_like_on_the_cpu(cpu_run, shards, tmp_path, precision):
    """Same seed, same data, same initial weights: every step's loss within 5% of the CPU's. Each device draws its
    masks from its own generator (a different draw of 12 of 16 patches per image moves this loss by ~0.5%)."""
    recipe = pretrain_recipe(
        shards, tmp_path / "run", engine={"zero_stage": 2, "precision": precision, "device": "cuda"}
    )
    proc = launch(write_recipe(tmp_path / "tiny_mae_cuda.yaml", recipe), nproc=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "on cuda" in proc.stdout
    steps = losses(tmp_path / "run")
    assert sorted(steps) == sorted(cpu_run) == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(v) for v in steps.values())
    for step, loss in steps.items():
        assert loss == pytest.approx(cpu_run[step], rel=0.05), (step, steps, cpu_run)
