"""The hot path on CUDA, where the CPU tests can only simulate it: BEiT-style prediction's forward and backward make
the host wait for the device nowhere, and counting perf/mfu's FLOPs allocates nothing on the GPU and leaves its
peak-memory counter at the training step's. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from core.engine.setup import set_attention
from core.engine.utilisation import count_step_flops
from finetune.classification import Classification
from pretrain.beit import MaskedPatchPrediction
from pretrain.targets import Color3Bit4x4
from tests.helpers.models import tiny_vit

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda")


@pytest.mark.parametrize("corruption", ["mask_token", "mixed"])
def test_beit_forward_and_backward_never_sync(corruption):
    objective = MaskedPatchPrediction(
        tiny_vit().train(), Color3Bit4x4((4, 4), (0.5,) * 3, (0.25,) * 3), num_masked=6, corruption=corruption
    ).to(DEVICE)
    mask = torch.zeros(8, 4, 4, dtype=torch.bool)
    mask.view(8, -1)[:, ::3] = True  # 6 of 16 patches
    batch = {"image": torch.randn(8, 3, 16, 16).to(DEVICE), "mask": mask.to(DEVICE)}
    for sync_debug in ("default", "error"):  # a first pass to set up the kernels and workspaces, then the checked one
        torch.cuda.set_sync_debug_mode(sync_debug)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = objective(batch)
            out["loss"].backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out["loss"]).item()


def test_flop_count_allocates_nothing_on_the_gpu_and_resets_its_peak():
    objective = Classification(tiny_vit(num_classes=4, drop_path_rate=0.1).train()).to(DEVICE)
    set_attention(objective, "auto", DEVICE)  # as the engine sets it: torch's fused attention on CUDA
    batch = {"image": torch.randn(64, 3, 16, 16, device=DEVICE), "label": torch.arange(64, device=DEVICE) % 4}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(DEVICE)
    counted = count_step_flops(objective, batch, precision="bf16", device=DEVICE)
    assert torch.cuda.memory_allocated(DEVICE) == before
    assert torch.cuda.max_memory_allocated(DEVICE) == before  # the peak is reset to what the run holds
    cpu = torch.device("cpu")
    cpu_count = count_step_flops(objective.cpu(), {k: v.cpu() for k, v in batch.items()}, precision="bf16", device=cpu)
    # CUDA keeps the run's fused attention, whose backward recomputes Q K^T: 2 x B x T^2 x D more per block
    model = objective.model
    tokens = model.patch_embed.num_patches + model.num_prefix_tokens
    assert counted == cpu_count + len(model.blocks) * 2 * 64 * tokens**2 * model.embed_dim
