"""Two fine-tuning variants that wrap the classifier: the linear probe (MAE) and an EMA of the weights.

Linear probe: the encoder is frozen and the head becomes BatchNorm1d(affine=False) + Linear on the pooled features
(cls token or average, from `model.global_pool`), trained with LARS or SGD. For export the batch norm, a fixed affine
map in eval mode, is folded into the Linear (`fold_probe_head`), so the probe loads into a plain timm ViT.

EMA: a frozen copy of the classifier whose weights follow `ema = decay * ema + (1 - decay) * weights` after every
applied optimizer step. It lives inside the objective so DeepSpeed checkpoints and resumes it with the model (it has
no gradients, so no optimizer state); it is evaluated next to the live weights. Not with ZeRO-3, which would
partition it.
"""

from __future__ import annotations

import copy

import torch
from timm.models import VisionTransformer
from torch import nn

_BN_EPS = 1e-6  # MAE's linear-probe batch norm


def make_linear_probe(model: VisionTransformer) -> VisionTransformer:
    """Freeze every encoder parameter and replace the head by BatchNorm1d(affine=False) + the existing Linear head."""
    if not isinstance(model.head, nn.Linear):
        raise ValueError(f"linear probe needs a Linear head, got {type(model.head).__name__}")
    model.requires_grad_(False)
    head = model.head
    head.requires_grad_(True)
    model.head = nn.Sequential(nn.BatchNorm1d(head.in_features, affine=False, eps=_BN_EPS), head)
    return model


@torch.no_grad()
def fold_probe_head(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A probe's state dict with its BatchNorm1d(affine=False) + Linear head (`head.0.*`, `head.1.*`) folded into the
    equivalent single Linear (`head.weight`, `head.bias`) of a plain timm ViT; other state dicts are returned as is."""
    if "head.1.weight" not in state_dict:
        return state_dict
    out = {k: v for k, v in state_dict.items() if not k.startswith("head.")}
    mean, var = state_dict["head.0.running_mean"], state_dict["head.0.running_var"]  # (D,)
    weight = state_dict["head.1.weight"] * (var + _BN_EPS).rsqrt()  # (K, D)
    out["head.weight"] = weight
    out["head.bias"] = state_dict["head.1.bias"] - weight @ mean
    return out


class WeightEMA(nn.Module):
    """A frozen exponential moving average of `module`'s parameters (buffers are copied, e.g. batch-norm stats).

    The average is held in fp32 buffers of a copy of `module`, not in parameters: DeepSpeed's fp16 mode casts every
    parameter of the objective to fp16, where a step of (1 - decay) x the distance (decay 0.9999) falls below the
    resolution and the average would never move; it leaves buffers as they are.
    """

    def __init__(self, module: nn.Module, decay: float):
        super().__init__()
        if not 0.0 < decay < 1.0:
            raise ValueError(f"optim.ema_decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.module = copy.deepcopy(module).requires_grad_(False).eval()
        self.param_names = [name for name, _ in module.named_parameters()]
        self.buffer_names = [name for name, _ in module.named_buffers()]
        for owner in self.module.modules():
            for name, param in list(owner.named_parameters(recurse=False)):
                delattr(owner, name)
                owner.register_buffer(name, param.detach().float())

    @torch.no_grad()
    def update(self, source: nn.Module) -> None:
        """One EMA step towards `source` (same architecture as the copy)."""
        ema = dict(self.module.named_buffers())
        params = dict(source.named_parameters())
        ema_params = [ema[name] for name in self.param_names]
        torch._foreach_lerp_(ema_params, [params[name].detach().float() for name in self.param_names], 1.0 - self.decay)
        buffers = dict(source.named_buffers())
        for name in self.buffer_names:
            ema[name].copy_(buffers[name])

    def train(self, mode: bool = True) -> WeightEMA:
        super().train(mode)
        self.module.eval()  # the average is only ever evaluated
        return self
