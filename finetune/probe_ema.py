"""Two fine-tuning variants that wrap the classifier: the linear probe (MAE) and an EMA of the weights.

Linear probe: the encoder is frozen and the classifier (`head` of a ViT, hybrid or T2T-ViT; `fc` of VT-ResNet)
becomes BatchNorm1d(affine=False) + Linear on the pooled features (cls token or average, from `model.global_pool`;
VT-ResNet's average of its visual tokens), trained with LARS or SGD. An encoder with BatchNorm layers (VT-ResNet's
ResNet stages) has them frozen too, running statistics included (timm's `FrozenBatchNorm2d`): in training mode a
BatchNorm would normalise with each batch's statistics and move its running ones, so the features the probe learns
on would not be the frozen encoder's. For export the batch norm of the probe, a fixed affine map in eval mode, is
folded into the Linear (`fold_probe_head`), so the probe loads into the plain timm model.

EMA: a frozen copy of the classifier whose weights follow `ema = decay * ema + (1 - decay) * weights` after every
applied optimizer step. It lives inside the objective so DeepSpeed checkpoints and resumes it with the model (it has
no gradients, so no optimizer state); it is evaluated next to the live weights. Not with ZeRO-3, which would
partition it.
"""

from __future__ import annotations

import copy

import torch
from timm.layers import freeze_batch_norm_2d
from torch import nn

_BN_EPS = 1e-6  # MAE's linear-probe batch norm
CLASSIFIER_NAMES = ("head", "fc")
"""Where the timm models of `core.models.build.build_model` keep their Linear classifier (VT-ResNet: `fc`)."""


def make_linear_probe(model: nn.Module) -> nn.Module:
    """Freeze every encoder parameter (and BatchNorm statistics) and put BatchNorm1d(affine=False) before the
    existing Linear classifier.

    Raises:
        ValueError: A model whose classifier is not a Linear named `head` or `fc`.
    """
    name = next((n for n in CLASSIFIER_NAMES if isinstance(getattr(model, n, None), nn.Linear)), None)
    if name is None:
        found = {n: type(getattr(model, n)).__name__ for n in CLASSIFIER_NAMES if hasattr(model, n)}
        raise ValueError(f"linear probe needs a Linear classifier `head` or `fc`, got {found or 'neither'}")
    head = getattr(model, name)
    model = freeze_batch_norm_2d(model).requires_grad_(False)  # BatchNorm2d -> FrozenBatchNorm2d, same tensors
    head.requires_grad_(True)
    setattr(model, name, nn.Sequential(nn.BatchNorm1d(head.in_features, affine=False, eps=_BN_EPS), head))
    return model


@torch.no_grad()
def fold_probe_head(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A probe's state dict with its BatchNorm1d(affine=False) + Linear classifier (`head.0.*`, `head.1.*`, or
    `fc.*` for VT-ResNet) folded into the equivalent single Linear (`head.weight`, `head.bias`) of the plain timm
    model; other state dicts are returned as is."""
    name = next((n for n in CLASSIFIER_NAMES if f"{n}.1.weight" in state_dict), None)
    if name is None:
        return state_dict
    out = {k: v for k, v in state_dict.items() if not k.startswith(f"{name}.")}
    mean, var = state_dict[f"{name}.0.running_mean"], state_dict[f"{name}.0.running_var"]  # (D,)
    weight = state_dict[f"{name}.1.weight"] * (var + _BN_EPS).rsqrt()  # (K, D)
    out[f"{name}.weight"] = weight
    out[f"{name}.bias"] = state_dict[f"{name}.1.bias"] - weight @ mean
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
    def update(self, source: nn.Module, applied: torch.Tensor | float = 1.0) -> None:
        """One EMA step towards `source` (same architecture as the copy), scaled by `applied`: 1.0 a full step, 0.0
        none (after a skipped update; a device tensor, so the loop need not read it on the host)."""
        ema = dict(self.module.named_buffers())
        params = dict(source.named_parameters())
        ema_params = [ema[name] for name in self.param_names]
        weight = (1.0 - self.decay) * applied
        torch._foreach_lerp_(ema_params, [params[name].detach().float() for name in self.param_names], weight)
        buffers = dict(source.named_buffers())
        for name in self.buffer_names:
            ema[name].copy_(buffers[name])

    def train(self, mode: bool = True) -> WeightEMA:
        super().train(mode)
        self.module.eval()  # the average is only ever evaluated
        return self
