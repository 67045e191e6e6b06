"""Linear32 (core/engine/zero3_runtime.py): the same numbers as F.linear, bit for bit, without saving a low-precision
weight copy. The ZeRO-3 engine paths that use it are covered in tests/dist/test_zero_init_dist.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import Block
from torch import nn

from core.engine.zero3_runtime import Linear32, use_linear32


def _run(linear, x, weight, bias, precision: str):
    """Forward + backward of `linear` on leaf copies of the inputs; returns (output, grads of x / weight / bias)."""
    x, weight = x.clone().requires_grad_(), nn.Parameter(weight.clone())
    bias = None if bias is None else nn.Parameter(bias.clone())
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        out = linear(x, weight, bias)
    out.float().pow(2).sum().backward()
    return out, x.grad, weight.grad, None if bias is None else bias.grad


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 5, 16), (7, 16), (4, 50, 16)])
def test_linear32_matches_f_linear(precision, with_bias, shape):
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(*shape, generator=g), torch.randn(8, 16, generator=g)
    bias = torch.randn(8, generator=g) if with_bias else None
    ours = _run(Linear32.apply, x, weight, bias, precision)
    ref = _run(F.linear, x, weight, bias, precision)
    assert ours[0].dtype == ref[0].dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
    for a, b in zip(ours, ref, strict=True):  # output and the gradients of x / weight / bias: bit for bit
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_linear32_saves_the_parameter_not_a_bf16_copy():
    """Between forward and backward the only weight-sized tensor referenced is the parameter itself: ZeRO-3 may free
    its gathered storage. F.linear under autocast keeps a bf16 copy of the weight instead."""
    weight = nn.Parameter(torch.randn(64, 32))
    x = torch.randn(4, 32, requires_grad=True)  # as inside a network: the input needs its gradient

    def saved_by(linear) -> list[torch.Tensor]:
        saved = []
        keep = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
        with keep, torch.autocast("cpu", dtype=torch.bfloat16):
            linear(x, weight, None)
        return [t for t in saved if t.numel() == weight.numel()]

    ours, ref = saved_by(Linear32.apply), saved_by(F.linear)
    assert len(ours) == 1 and ours[0] is weight
    assert [t.dtype for t in ref] == [torch.bfloat16]


def test_use_linear32_routes_every_linear_of_a_block_and_keeps_its_output():
    torch.manual_seed(0)
    block = Block(32, 4, qkv_bias=True)
    x = torch.randn(2, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = block(x)
        assert use_linear32(block) == 4  # qkv, proj, fc1, fc2
        after = block(x)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
