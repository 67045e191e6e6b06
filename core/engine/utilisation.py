"""Model FLOPs utilisation (`perf/mfu`): the model FLOPs of a training step, counted once at start-up, times steps
per second, over the peak of the devices in use.

The FLOPs are counted by torch's `FlopCounterMode` on a copy of the objective running forward and backward on the
stream's first micro-batch, so the count follows the model, the objective (MAE's dropped tokens, a decoder, a head)
and the attention kernel. The copy and the batch are fake tensors (shapes, no data, no memory), so counting computes
nothing and allocates nothing, and training itself is untouched (the RNGs are restored afterwards). The peak per
device is `engine.peak_tflops`, or the datasheet figure of a known GPU, or a matmul measured on the CPU and kept in a
cache file, measured again when it proves low (core/engine/cpu_peak.py).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeCopyMode,
    FakeTensorMode,
)
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from core.compat.deepspeed import is_partitioned
from core.engine.checkpoint import RNGState
from core.engine.cpu_peak import cached_cpu_tflops, raise_cpu_peak
from core.engine.precision import autocast_context, to_device
from core.engine.setup import set_attention
from core.engine.stage import StageRun

# Dense (no sparsity) bf16 tensor-core TFLOP/s per GPU, from NVIDIA's datasheets: H100 SXM / PCIe and H200
# ("NVIDIA H100 Tensor Core GPU" and "NVIDIA H200" datasheets), A100 ("NVIDIA A100 Tensor Core GPU"), L4, A10, and
# V100 (no bf16: its fp16 tensor-core figure). fp16 peaks equal these; first matching pattern wins.
GPU_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"H100.*PCIe", 756.0),
    (r"H100.*(SXM|HBM3)", 989.0),
    (r"H200", 989.0),
    (r"A100", 312.0),
    (r"\bA10\b", 125.0),
    (r"\bL4\b", 121.0),
    (r"V100", 125.0),
)


@dataclass
class Utilisation:
    """Turns throughput into model FLOPs utilisation."""

    flops_per_step: float
    """Model FLOPs of one optimizer step on one rank: forward + backward of a micro-batch x accumulation steps."""
    samples_per_step: int
    """Samples of one optimizer step over all ranks (the global batch)."""
    peak_flops: float
    """Peak FLOP/s of one device."""
    measured_precision: str | None = None
    """The precision of a CPU peak that was measured (core/engine/cpu_peak.py), which `check_peak` may raise; None
    for a datasheet or configured peak."""

    def mfu(self, images_per_sec: float) -> float:
        """Fraction of the devices' peak the step's model FLOPs reach at `images_per_sec` (all ranks together).

        Every rank does `flops_per_step` per step, so the world's FLOPs over the world's peak is one rank's over
        one device's.
        """
        return self.flops_per_step * images_per_sec / self.samples_per_step / self.peak_flops

    def check_peak(self, images_per_sec: float) -> str | None:
        """Where the rate at `images_per_sec` exceeds a measured CPU peak (an MFU above 100%), measure the peak again
        and raise it (`raise_cpu_peak`); returns the line saying so, else None."""
        if self.measured_precision is None or self.mfu(images_per_sec) <= 1.0:
            return None
        achieved = self.flops_per_step * images_per_sec / self.samples_per_step
        peak, line = raise_cpu_peak(self.measured_precision, achieved / 1e12, self.peak_flops / 1e12)
        self.peak_flops = peak * 1e12
        return line


def _cpu_attention(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}
"""torch's FlopCounterMode has formulas for the GPU attention kernels but none for the CPU one, which modules that
call F.scaled_dot_product_attention themselves (T2T-ViT, VT) reach on CPU; timm's blocks are switched to their
explicit attention for the count instead."""


def count_step_flops(module: nn.Module, batch: dict, *, precision: str, device: torch.device) -> int:
    """Model FLOPs of forward + backward of `module` on `batch` (already on `device`), counted on a fake twin.

    The twin is a deep copy made of fake tensors (torch's FakeTensorMode): they carry `device`, dtype and shape, so
    the step dispatches to the kernels the run would use (autocast and attention included), but no data and no
    memory, on the device or anywhere: counting costs no activations, so a recipe that needs activation
    checkpointing to fit counts as easily as any, and nothing is computed. The twin leaves `module`'s parameters and
    gradients alone and has no hooks (DeepSpeed's would reduce its gradients); the Python, NumPy and torch RNGs are
    restored. torch's counter knows the CUDA attention kernels but not the CPU fused one, so on CPU the twin uses
    timm's explicit matmul-softmax attention, which does the same matmuls. Activation checkpointing is off in the
    twin: its recomputation is work the hardware does, not the model's FLOPs. On CUDA the peak-memory counter is
    reset afterwards, so `perf/max_memory_gb` is the training steps' own.

    Raises:
        DataDependentOutputException, DynamicOutputShapeException: the step reads tensor values on the host (an
            `.item()`, a boolean-mask index); fake tensors have none.
    """

    rng = RNGState().state_dict()
    fake = FakeTensorMode()
    twin = _fake_twin(module, fake)
    if device.type == "cpu":
        set_attention(twin, "math", device)
    fake_batch = {key: fake.from_tensor(v) if isinstance(v, torch.Tensor) else v for key, v in batch.items()}
    try:
        with fake, FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
            with autocast_context(precision, device):
                out = twin(fake_batch)
            out["loss"].float().backward()
    finally:
        RNGState().load_state_dict(rng)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return counter.get_total_flops()


def _fake_twin(module: nn.Module, fake: FakeTensorMode) -> nn.Module:
    """A deep copy of `module` whose tensors are `fake`'s (no memory), without hooks and activation checkpointing."""
    memo = {
        id(value): type(value)() for sub in module.modules() for name, value in vars(sub).items() if "hooks" in name
    }
    with FakeCopyMode(fake):
        twin = copy.deepcopy(module, memo)
    for sub in twin.modules():  # model FLOPs: activation checkpointing's recomputed forward is not the model's work
        if getattr(sub, "grad_checkpointing", False):
            sub.grad_checkpointing = False
    return twin


def gpu_peak_tflops(name: str) -> float | None:
    """The datasheet bf16 dense TFLOP/s of the GPU called `name` (torch.cuda.get_device_name), None if unknown."""
    for pattern, tflops in GPU_PEAK_TFLOPS:
        if re.search(pattern, name):
            return tflops
    return None


def device_peak(configured: float | None, precision: str, device: torch.device) -> tuple[float | None, str]:
    """Peak TFLOP/s of one device and how it was chosen; (None, why) when it is unknown.

    `configured` (`engine.peak_tflops`) wins. On a GPU the datasheet bf16 dense peak; fp32 runs are measured against
    it too (their matmuls run as TF32 or slower: the gap is what bf16 would gain). On CPU a matmul in the run's
    precision, measured by the first launch on this machine and read from `cpu_peak_cache()` by the later ones.
    """
    if configured is not None:
        return configured, "engine.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tflops = gpu_peak_tflops(name)
        if tflops is None:
            return None, f"no datasheet peak known for GPU {name!r}: set engine.peak_tflops to log perf/mfu"
        return tflops, f"{name} datasheet bf16 dense peak"
    return cached_cpu_tflops(precision)


def start_meter(run: StageRun, module: nn.Module, batch: dict) -> Utilisation | None:
    """Count a step's FLOPs on `batch` (a micro-batch of the stream, on the host) and take the peak (`run.peak`,
    found before the data workers started, else found now); prints both. Returns the meter, or None when perf/mfu
    cannot be logged, and on every rank but 0, which logs it (their ranks' counts would be the same)."""

    cfg, dist, logger = run.cfg, run.dist, run.logger
    if not dist.is_main:
        return None
    precision = cfg.engine.precision
    if is_partitioned(module):
        logger.console("[mimpipe] perf/mfu not logged: FLOPs are not counted on ZeRO-3 partitioned parameters")
        return None
    peak, source = run.peak or device_peak(cfg.engine.peak_tflops, precision, dist.device)
    if peak is None:
        logger.console(f"[mimpipe] perf/mfu not logged: {source}")
        return None
    try:
        flops = count_step_flops(
            module, to_device(batch, dist.device, precision), precision=precision, device=dist.device
        )
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        logger.console(f"[mimpipe] perf/mfu not logged: the step reads tensor values on the host ({error})")
        return None
    per_step = flops * cfg.engine.grad_accum_steps
    logger.console(
        f"[mimpipe] utilisation: {per_step / 1e9:.4g} GFLOP per optimizer step per rank (FlopCounterMode); peak "
        f"{peak:.4g} TFLOP/s per device ({source}) x {dist.world_size}"
    )
    samples = cfg.batch_size_per_device(dist.world_size) * cfg.engine.grad_accum_steps * dist.world_size
    measured = precision if dist.device.type == "cpu" and cfg.engine.peak_tflops is None else None
    return Utilisation(per_step, samples, peak * 1e12, measured)
