"""Segmentation heads over a ResNet's four stages: panoptic FPN's semantic branch, and the VT paper's VT-FPN.

Panoptic FPN (Kirillov et al. 2019, the baseline of the VT paper's segmentation): an FPN turns the stages C2-C5
(strides 4-32) into maps P2-P5 of one width: a 1x1 lateral convolution per stage, a top-down path that adds each
coarser map (2x nearest upsampling) to the finer one, and a 3x3 output convolution per level. The semantic branch
brings every level to stride 4 in steps of (3x3 convolution, GroupNorm, ReLU, 2x bilinear upsampling) at half the
width, one step per factor of 2 (P2 gets one step without upsampling), sums them and classifies each pixel (1x1).

VT-FPN (Wu et al. 2020, section 4.2) replaces the per-level output convolutions: each level's map becomes 8 visual
tokens of width 1024 through a filter-based tokenizer, the 32 tokens of all levels go through one transformer
together (so levels exchange information), and a projector per level maps its tokens back onto its map as a
residual (core/models/vt.py's modules). The semantic branch is the same. A 3x3 convolution costs 9 C^2 per pixel;
the tokenizer and projector cost a few C per pixel, so at P2 (a quarter of the image's side) VT-FPN is much cheaper
(benchmarks/results/segmentation.md counts both).

Shapes: B batch, C FPN width, K classes, L visual tokens per level, T token width, h/w a level's map.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from core.models.vt import Projector, Tokenizer, TokenTransformer, init_module

VT_TOKENS = 8
"""Visual tokens per FPN level (VT-FPN's)."""
VT_TOKEN_DIM = 1024
"""Their width (VT-FPN's)."""
GN_GROUPS = 32  # the semantic branch's GroupNorm groups (panoptic FPN's), fewer when the width is not a multiple


class PanopticFPN(nn.Module):
    """FPN (or VT-FPN) over four stages and panoptic FPN's semantic branch.

    Args:
        in_channels: The four stages' widths (ResNet-50: 256, 512, 1024, 2048).
        channels: The FPN's width C (panoptic FPN: 256); the semantic branch is C/2 wide.
        num_classes: K.
        visual_tokens: VT-FPN: visual tokens in place of the per-level output convolutions.
    """

    def __init__(self, in_channels: list[int], channels: int, num_classes: int, *, visual_tokens: bool = False):
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(c, channels, 1) for c in in_channels)
        if visual_tokens:
            self.tokens = VisualTokenFPN(channels, len(in_channels))
            self.output = None
        else:
            self.tokens = None
            self.output = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in in_channels)
        width = channels // 2
        self.semantic = nn.ModuleList(_semantic_branch(channels, width, level) for level in range(len(in_channels)))
        self.classifier = nn.Conv2d(width, num_classes, 1)
        self.apply(init_module)  # VT-ResNet's: Kaiming convolutions, truncated-normal token projections
        nn.init.normal_(self.classifier.weight, std=0.01)  # small first logits (mmsegmentation's classifier init)
        nn.init.zeros_(self.classifier.bias)

    def forward_fpn(self, stages: list[torch.Tensor]) -> list[torch.Tensor]:
        """Four (B, C_i, h_i, w_i) at strides 4-32 -> P2-P5, each (B, C, h_i, w_i)."""
        maps = [lateral(x) for lateral, x in zip(self.lateral, stages, strict=True)]
        for i in range(len(maps) - 2, -1, -1):  # top-down: coarsest first
            maps[i] = maps[i] + F.interpolate(maps[i + 1], size=maps[i].shape[-2:], mode="nearest")
        if self.tokens is not None:
            return self.tokens(maps)
        return [conv(m) for conv, m in zip(self.output, maps, strict=True)]

    def forward(self, stages: list[torch.Tensor]) -> torch.Tensor:
        """Four stages at strides 4-32 -> logits (B, K, h_0, w_0) at the finest stage's stride (4)."""
        levels = self.forward_fpn(stages)
        size = levels[0].shape[-2:]
        fused = sum(_resize(branch(p), size) for branch, p in zip(self.semantic, levels, strict=True))
        return self.classifier(fused)


class VisualTokenFPN(nn.Module):
    """VT-FPN's replacement of the per-level convolutions: tokenize each level, one transformer over all levels'
    tokens, project each level's tokens back onto its map (residual).

    Args:
        channels: The FPN's width C.
        num_levels: FPN levels (4).
    """

    def __init__(self, channels: int, num_levels: int):
        super().__init__()
        self.tokenizers = nn.ModuleList(
            Tokenizer(channels, VT_TOKEN_DIM, VT_TOKENS, recurrent=False) for _ in range(num_levels)
        )
        self.transformer = TokenTransformer(VT_TOKEN_DIM)
        self.projectors = nn.ModuleList(Projector(channels, VT_TOKEN_DIM) for _ in range(num_levels))

    def forward(self, maps: list[torch.Tensor]) -> list[torch.Tensor]:
        """Levels (B, C, h_i, w_i) -> the same shapes."""
        pixels = [m.flatten(2).transpose(1, 2) for m in maps]  # each (B, h_i w_i, C)
        tokens = torch.cat([tok(x, None) for tok, x in zip(self.tokenizers, pixels, strict=True)], dim=1)  # (B, 4L, T)
        tokens = self.transformer(tokens).split(VT_TOKENS, dim=1)  # 4 x (B, L, T)
        out = []
        for projector, x, t, m in zip(self.projectors, pixels, tokens, maps, strict=True):
            out.append(projector(x, t).transpose(1, 2).reshape(m.shape))  # (B, h w, C) -> (B, C, h, w)
        return out


def _semantic_branch(channels: int, width: int, level: int) -> nn.Sequential:
    """Level `level` (stride 4 * 2^level) to stride 4: max(level, 1) steps of 3x3 conv, GroupNorm, ReLU, each but
    the level-0 one followed by 2x bilinear upsampling."""
    steps = []
    for i in range(max(level, 1)):
        conv = nn.Conv2d(channels if i == 0 else width, width, 3, padding=1, bias=False)
        steps += [conv, nn.GroupNorm(math.gcd(GN_GROUPS, width), width), nn.ReLU(inplace=True)]
        if level > 0:
            steps.append(nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False))
    return nn.Sequential(*steps)


def _resize(x: torch.Tensor, size: torch.Size) -> torch.Tensor:
    """A branch's output to the stride-4 size (odd input sizes leave a coarse level a pixel short)."""
    return x if x.shape[-2:] == size else F.interpolate(x, size, mode="bilinear", align_corners=False)
