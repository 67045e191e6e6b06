"""perf/mfu's pieces: the FLOPs FlopCounterMode counts for a training step, and the peak it is divided by."""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

import core.models.build  # noqa: F401  (registers t2t_vit_* and vt_resnet* with timm)
from core.engine.distributed import DistInfo
from core.engine.setup import set_attention
from core.engine.utilisation import (
    CPU_ATTENTION_FLOPS,
    Utilisation,
    count_step_flops,
    gpu_peak_tflops,
    start_meter,
)
from core.recipe.config import Config
from core.report.logging import MetricsLogger
from finetune.classification import Classification
from pretrain.beit import MaskedPatchPrediction
from pretrain.mae import MAE
from pretrain.targets import MeanColor3Bit
from tests.helpers.models import tiny_vit

CPU = torch.device("cpu")
CLASSES = 4


def _step(batch_size: int = 8, **vit) -> tuple[Classification, dict]:
    """A tiny ViT classifier in train mode (drop path draws from the RNG) and one batch for it."""
    objective = Classification(tiny_vit(num_classes=CLASSES, drop_path_rate=0.1, **vit).train())
    gen = torch.Generator().manual_seed(1)
    batch = {"image": torch.randn(batch_size, 3, 16, 16, generator=gen), "label": torch.arange(batch_size) % CLASSES}
    return objective, batch


def _analytic_flops(model, batch_size: int) -> int:
    """Forward + backward of a ViT: every matmul costs 2 x its multiply-adds forward and twice that backward (input
    and weight gradients), except the patch embedding, whose input (the image) needs no gradient."""
    dim, depth = model.embed_dim, len(model.blocks)
    patches = model.patch_embed.num_patches
    tokens = patches + model.num_prefix_tokens
    hidden = model.blocks[0].mlp.fc1.out_features
    linears = batch_size * tokens * depth * (3 * dim * dim + dim * dim + 2 * dim * hidden)  # qkv, proj, fc1, fc2
    attention = batch_size * depth * 2 * tokens * tokens * dim  # q k^T and attn v
    head = batch_size * dim * CLASSES
    patch_embed = batch_size * patches * 3 * model.patch_embed.patch_size[0] ** 2 * dim
    return 2 * 3 * (linears + attention + head) + 2 * 2 * patch_embed


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_counted_flops_match_the_analytic_count(precision):
    objective, batch = _step()
    counted = count_step_flops(objective, batch, precision=precision, device=CPU)
    assert counted == pytest.approx(_analytic_flops(objective.model, 8), rel=0.01)


def _real_count(module, batch: dict) -> int:
    """What counting did before fake tensors: a real copy running forward and backward on the real batch in bf16
    (timm's explicit attention, as the count takes on CPU)."""
    twin = copy.deepcopy(module)
    set_attention(twin, "math", CPU)
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = twin(batch)
        out["loss"].float().backward()
    return counter.get_total_flops()


def _images(batch_size: int, side: int = 16) -> torch.Tensor:
    return torch.randn(batch_size, 3, side, side, generator=torch.Generator().manual_seed(1))


def _patch_mask(batch_size: int) -> torch.Tensor:
    mask = torch.zeros(batch_size, 4, 4, dtype=torch.bool)
    mask.view(batch_size, -1)[:, ::3] = True  # 6 of 16 patches
    return mask


FAKE_COUNTED = {  # objective, its batch: plain ViT classifier, MAE (dropped tokens, decoder), BEiT-style (gathered
    # patches), and the archs whose modules call F.scaled_dot_product_attention themselves (T2T-ViT, VT-ResNet)
    "classification": lambda: _step(),
    "mae": lambda: (MAE(tiny_vit().train(), decoder_embed_dim=32, decoder_depth=2, decoder_num_heads=2), _step()[1]),
    "beit": lambda: (
        MaskedPatchPrediction(tiny_vit().train(), MeanColor3Bit((4, 4), (0.5,) * 3, (0.25,) * 3), num_masked=6),
        {"image": _images(8), "mask": _patch_mask(8)},
    ),
    "t2t_vit": lambda: (
        Classification(timm.create_model("t2t_vit_t_14", img_size=32, depth=2, num_classes=10).train()),
        {"image": _images(2, side=32), "label": torch.arange(2)},
    ),
    "vt_resnet": lambda: (
        Classification(timm.create_model("vt_resnet18", token_dim=64, num_classes=10).train()),
        {"image": _images(2, side=32), "label": torch.arange(2)},
    ),
}


@pytest.mark.parametrize("kind", sorted(FAKE_COUNTED))
def test_fake_tensor_count_equals_a_real_forward_and_backward(kind):
    objective, batch = FAKE_COUNTED[kind]()
    assert count_step_flops(objective, batch, precision="bf16", device=CPU) == _real_count(objective, batch)


def test_counting_allocates_no_memory_and_resets_the_cuda_peak(monkeypatch):
    """On a GPU the count must not hold a copy of the weights or a step's activations (it would run out of memory
    exactly where a recipe needs activation checkpointing), and the peak it leaves must be the training step's."""
    objective, batch = _step(batch_size=32)
    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", resets.append)
    cuda = torch.device("cuda")  # the CUDA branch, taken on CPU tensors (fp32: no CUDA autocast to enter)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        counted = count_step_flops(objective, batch, precision="fp32", device=cuda)
    allocated = sum(max(event.self_cpu_memory_usage, 0) for event in prof.key_averages())
    weights = sum(p.numel() * p.element_size() for p in objective.parameters())
    assert allocated < weights / 10  # a real copy allocates all the weights, then the activations
    assert resets == [cuda]
    explicit = count_step_flops(objective, batch, precision="fp32", device=CPU)
    assert resets == [cuda]  # on CPU, nothing to reset
    # On CUDA the twin keeps the run's fused attention, whose backward recomputes Q K^T (torch counts its CUDA
    # kernels so): 2 x B x T^2 x D more per block
    model = objective.model
    tokens = model.patch_embed.num_patches + model.num_prefix_tokens
    assert counted == explicit + len(model.blocks) * 2 * 32 * tokens**2 * model.embed_dim


def test_start_meter_logs_no_mfu_for_a_step_that_reads_tensor_values():
    class ReadsBack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, batch: dict) -> dict:
            scale = float(batch["x"].abs().max())  # a host read: fake tensors have no value to give
            return {"loss": self.proj(batch["x"] / scale).square().mean()}

    cfg = Config.model_validate({"data": {"global_batch_size": 2}})
    cfg.engine.peak_tflops = 1.0
    messages = []
    run = SimpleNamespace(cfg=cfg, dist=DistInfo(0, 0, 1, CPU), logger=SimpleNamespace(console=messages.append))
    run.peak = None
    batch = {"x": torch.randn(2, 4)}
    assert start_meter(run, ReadsBack(), batch) is None
    assert messages == [
        "[mimpipe] perf/mfu not logged: the step reads tensor values on the host (aten._local_scalar_dense.default)"
    ]


def test_cpu_sdpa_is_counted_like_the_explicit_attention():
    """torch's counter has no formula for the CPU fused kernel: the count must still include attention."""
    objective, batch = _step()
    math_count = count_step_flops(objective, batch, precision="bf16", device=CPU)
    set_attention(objective, "sdpa", CPU)
    assert count_step_flops(objective, batch, precision="bf16", device=CPU) == math_count
    assert all(block.attn.fused_attn for block in objective.model.blocks)  # the run's own choice is kept


def test_a_module_calling_sdpa_itself_is_counted_like_explicit_attention():
    """T2T-ViT and VT call F.scaled_dot_product_attention directly, so on CPU they reach the fused kernel, which
    torch's counter has no formula for: forward and backward must still count as the explicit products do."""

    class Attend(torch.nn.Module):
        def __init__(self, fused: bool):
            super().__init__()
            self.fused, self.proj = fused, torch.nn.Linear(32, 32)

        def forward(self, batch: dict) -> dict:
            q = k = v = self.proj(batch["x"])  # (B, N, 32)
            if self.fused:
                out = F.scaled_dot_product_attention(q, k, v)
            else:
                out = (q @ k.transpose(1, 2) / 32**0.5).softmax(dim=-1) @ v
            return {"loss": out.square().mean()}

    batch = {"x": torch.randn(2, 50, 32)}
    explicit = count_step_flops(Attend(fused=False), batch, precision="fp32", device=CPU)
    assert explicit > 3 * 2 * (2 * 2 * 50 * 32 * 32)  # more than the Linear's forward and backward: attention is in
    recompute = 2 * 2 * 50 * 50 * 32  # the fused backward recomputes Q K^T, as torch counts its GPU kernels too
    assert count_step_flops(Attend(fused=True), batch, precision="fp32", device=CPU) == explicit + recompute


def test_activation_checkpointing_recomputation_is_not_counted():
    objective, batch = _step()
    plain = count_step_flops(objective, batch, precision="bf16", device=CPU)
    objective.model.set_grad_checkpointing(True)
    assert count_step_flops(objective, batch, precision="bf16", device=CPU) == plain
    assert objective.model.grad_checkpointing


def test_counting_leaves_parameters_grads_hooks_and_rngs_alone():
    objective, batch = _step()
    objective(batch)["loss"].backward()  # the run's gradients, which counting must not add to
    params = {name: p.detach().clone() for name, p in objective.named_parameters()}
    grads = {name: p.grad.clone() for name, p in objective.named_parameters()}
    calls = []
    objective.model.blocks[0].register_forward_hook(lambda *args: calls.append(1))  # like DeepSpeed's hooks

    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    count_step_flops(objective, batch, precision="bf16", device=CPU)
    after = torch.rand(4), random.random(), np.random.rand()
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    assert after == (pytest.approx(torch.rand(4)), random.random(), np.random.rand())

    assert calls == []
    for name, p in objective.named_parameters():
        assert torch.equal(p, params[name]) and torch.equal(p.grad, grads[name]), name


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA L4", 121.0),
        ("Tesla V100-SXM2-16GB", 125.0),
        ("NVIDIA L40S", None),
        ("NVIDIA H100 NVL", None),
    ],
)
def test_gpu_peak_from_the_device_name(name, tflops):
    assert gpu_peak_tflops(name) == tflops


def test_mfu_is_the_step_flops_rate_over_the_peak():
    # 4 ranks, 1 TFLOP per rank per step of 256 samples, 512 samples/s = 2 steps/s -> 2 TFLOP/s of 10 TFLOP/s
    meter = Utilisation(flops_per_step=1e12, samples_per_step=256, peak_flops=10e12)
    assert meter.mfu(512.0) == pytest.approx(0.2)


def test_start_meter_counts_accumulation(capsys):
    objective, batch = _step()
    cfg = Config.model_validate({"data": {"global_batch_size": 32}, "engine": {"grad_accum_steps": 2}})
    cfg.engine.peak_tflops = 0.5
    run = SimpleNamespace(cfg=cfg, dist=DistInfo(0, 0, 2, CPU), logger=MetricsLogger(None, enabled=False), peak=None)
    meter = start_meter(run, objective, batch)
    one_micro_batch = count_step_flops(objective, batch, precision="bf16", device=CPU)
    assert meter == Utilisation(2 * one_micro_batch, 32, 0.5e12)


def test_only_rank_0_counts_and_measures(monkeypatch):
    """perf/mfu is rank 0's to log: another rank neither counts the step's FLOPs nor measures a peak."""
    objective, batch = _step()
    cfg = Config.model_validate({"data": {"global_batch_size": 16}})
    monkeypatch.setattr("core.engine.utilisation.count_step_flops", lambda *a, **k: pytest.fail("counted"))
    monkeypatch.setattr("core.engine.cpu_peak.measure_cpu_tflops", lambda *a, **k: pytest.fail("measured"))
    run = SimpleNamespace(cfg=cfg, dist=DistInfo(1, 1, 2, CPU), logger=MetricsLogger(None, enabled=False), peak=None)
    assert start_meter(run, objective, batch) is None


def test_start_meter_takes_the_peak_found_before_the_data_workers_started(monkeypatch):
    objective, batch = _step()
    cfg = Config.model_validate({"data": {"global_batch_size": 16}})
    monkeypatch.setattr("core.engine.cpu_peak.measure_cpu_tflops", lambda *a, **k: pytest.fail("measured again"))
    logger = MetricsLogger(None, enabled=False)
    run = SimpleNamespace(cfg=cfg, dist=DistInfo(0, 0, 1, CPU), logger=logger, peak=(0.25, "measured at start-up"))
    meter = start_meter(run, objective, batch)
    assert meter.peak_flops == 0.25e12 and meter.samples_per_step == 16
