"""The bf16 autocast-Linear ceiling a training step's utilisation is read against, measured in the benchmark's rounds.

A ViT step is mostly Linear layers under autocast: an fp32 weight cast to bf16, a bf16 matmul, an fp32-accumulated
bias, and in backward the input and weight gradients. Timing that on the model's own shapes (by default the MAE
encoder MLP's first layer, [B * (1 + L_vis), D] x [D, 4D]) gives what the hardware delivers for the step's kind of
work, a little under a bare bf16 matmul (`core.engine.cpu_peak.measure_cpu_tflops`, reported beside it).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

# ViT widths by the size presets bench_engine's --model takes.
EMBED_DIMS = {"tiny": 192, "small": 384, "base": 768, "large": 1024, "huge": 1280}


@dataclass(frozen=True)
class LinearShape:
    """A Linear applied to `rows` tokens: (rows, d_in) x (d_in, d_out)."""

    rows: int
    d_in: int
    d_out: int

    def flops(self, backward: bool = True) -> int:
        """Multiply-adds x 2 of forward, plus backward's input and weight gradients (twice forward) when asked."""
        forward = 2 * self.rows * self.d_in * self.d_out
        return 3 * forward if backward else forward


def encoder_mlp_shape(model: str, batch: int, img_size: int, patch: int = 16, mask_ratio: float = 0.75) -> LinearShape:
    """The MAE encoder's fc1 at this size: rows are the batch's class tokens and visible patches, as MAE keeps
    int(L * (1 - mask_ratio)) of the L patches."""
    num_patches = (img_size // patch) ** 2
    visible = int(num_patches * (1 - mask_ratio))
    dim = EMBED_DIMS[model]
    return LinearShape(rows=batch * (1 + visible), d_in=dim, d_out=4 * dim)


def utilisation(flops_per_step: float, seconds_per_step: float, ceiling_tflops: float) -> float:
    """Fraction of the ceiling that `flops_per_step` done every `seconds_per_step` reaches."""
    if seconds_per_step <= 0 or ceiling_tflops <= 0:
        raise ValueError(f"need positive step time and ceiling, got {seconds_per_step} s and {ceiling_tflops} TFLOP/s")
    return flops_per_step / seconds_per_step / (ceiling_tflops * 1e12)


def time_autocast_linear(shape: LinearShape, trials: int, clock=None) -> list[float]:
    """TFLOP/s of forward + backward of an fp32 `nn.Linear` under bf16 CPU autocast, one value per trial.

    Each trial is one forward and backward after two untimed warm-up ones; `clock.mark()` (engine_step's Clock) is
    called before each trial and after the last, so that the benchmark can attribute other processes' load to it.
    """
    gen = torch.Generator().manual_seed(0)
    layer = nn.Linear(shape.d_in, shape.d_out)
    x = torch.randn(shape.rows, shape.d_in, generator=gen, requires_grad=True)  # (rows, d_in)
    grad_out = torch.randn(shape.rows, shape.d_out, generator=gen).bfloat16()  # (rows, d_out), autocast's dtype

    def once() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)  # (rows, d_out) bf16
        out.backward(grad_out)

    for _ in range(2):
        once()
    tflops = []
    for _ in range(trials):
        if clock is not None:
            clock.mark()
        t0 = time.perf_counter()
        once()
        tflops.append(shape.flops() / (time.perf_counter() - t0) / 1e12)
    if clock is not None:
        clock.mark()
    return tflops


TRIALS = 40  # forward + backward trials per ceiling process: about 3 s for ViT-B's fc1 at batch 32


def measure_ceiling(spec: dict, clock) -> dict:
    """bench_engine's ceiling runner (in engine_step's worker): the autocast-Linear trials on the encoder MLP shape of
    `spec`'s model, batch and image size, then a bare bf16 matmul (core.engine.cpu_peak.measure_cpu_tflops) for
    comparison."""
    from core.engine.cpu_peak import measure_cpu_tflops

    shape = encoder_mlp_shape(spec["model"], spec["batch"], spec["size"])
    tflops = time_autocast_linear(shape, TRIALS, clock)
    return {"tflops": tflops, "matmul_tflops": measure_cpu_tflops("bf16"), "shape": asdict(shape)}
