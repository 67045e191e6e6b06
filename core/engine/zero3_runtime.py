"""ZeRO-3's per-step work, trimmed to what our objectives need. Three costs DeepSpeed adds over a plain loop, each
removed here without changing a number:

1. Hooks on every layer. DeepSpeed gathers and releases weights from Python hooks on each module that holds any;
   `gather_per_block` makes each transformer block one unit.
2. DeepSpeed's replacement for `F.linear` (`memory_efficient_linear`), which saves the fp32 weight instead of its
   bf16 copy, so that gathered weights can be freed between forward and backward, but adds each bias in a separate
   mixed-precision pass. `Linear32` keeps the memory saving and runs the forward as `F.linear` does.
3. Two passes over the gradients in the optimizer step that are identities without clipping or loss scaling (the
   global norm and the unscale); `skip_identity_grad_passes` drops them. It patches the ZeRO-3 optimizer's
   private methods, so it lives with the other DeepSpeed patches in `core/compat/deepspeed.py`.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import Block
from torch import nn

from core.compat.deepspeed import full_shape, is_released


def gather_per_block(objective: nn.Module) -> int:
    """Make every timm transformer `Block` in `objective` one ZeRO-3 unit: its weights are gathered on entry and
    released on exit by one pair of hooks, rather than by hooks on each of its Linear and LayerNorm layers. A block's
    layers run back to back, so its weights are live together anyway.

    Returns:
        The number of blocks marked (0 for an objective without transformer blocks, such as the tokenizer).
    """
    from deepspeed.utils import set_z3_leaf_modules

    return len(set_z3_leaf_modules(objective, [Block], raise_if_not_found=False))


class Linear32(torch.autograd.Function):
    """`F.linear` under autocast that saves the fp32 weight for backward, not its low-precision copy.

    Forward is exactly `F.linear` (inputs and weight cast to the autocast dtype, bias fused into the matmul). Backward
    casts the weight again, so between forward and backward only the parameter itself is referenced: ZeRO-3 can
    release a gathered weight after its block's forward and gather it again for backward.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kind = x.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype
        x = x.to(dtype)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight.to(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        if is_released(weight):
            raise RuntimeError(f"ZeRO-3 released a Linear weight {tuple(full_shape(weight))} before its backward")
        grad_out = grad_out.to(x.dtype)
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_out @ weight.to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = rows.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def _linear32_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return Linear32.apply(x, self.weight, self.bias)


def use_linear32(objective: nn.Module) -> int:
    """Route every `nn.Linear` in `objective` through `Linear32`; returns how many."""
    linears = [m for m in objective.modules() if type(m) is nn.Linear]
    for m in linears:
        m.forward = types.MethodType(_linear32_forward, m)
    return len(linears)
