"""Segmentation heads over an encoder's feature maps: UperNet with its auxiliary FCN head (the ADE20K set-up of
BEiT and MAE), and the linear probe of patch tokens (DINOv2's protocol).

UperNet (Xiao et al. 2018, as mmsegmentation's UPerHead): pyramid pooling on the coarsest map, lateral 1x1
convolutions on the others, a top-down path that adds each coarser map (upsampled) to the finer one, 3x3
convolutions, every level upsampled to the finest and fused by one 3x3 convolution, then a 1x1 classifier. Every
convolution is followed by BatchNorm and ReLU. The auxiliary FCN head classifies the stride-16 map on its own; its
loss is added with weight 0.4 and it is not used for prediction.

A plain ViT gives one map at its patch stride at each depth; `ViTPyramid` brings four of them to strides 4, 8, 16
and 32 of the image (at patch 16: two 2x2 transposed convolutions, one, none, a 2x2 max-pool, as BEiT's
segmentation backbone does).

Shapes: B batch, D encoder width, C head width, K classes, h/w a level's map, H/W the input.
"""

import torch
import torch.nn.functional as F
from torch import nn

AUX_LOSS_WEIGHT = 0.4
"""Weight of the auxiliary FCN head's loss (BEiT's and MAE's UperNet set-up)."""


def conv_bn_relu(in_channels: int, out_channels: int, kernel_size: int) -> nn.Sequential:
    """A bias-free convolution (same padding), BatchNorm and ReLU."""
    conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True))


class ViTPyramid(nn.Module):
    """Four maps of a plain ViT, all at its token stride, to strides 4, 8, 16 and 32 of the image.

    Each level is scaled by (token stride) / (its stride): up by 2x2 transposed convolutions (two for 4x, with
    BatchNorm and GELU between them, as BEiT's segmentation backbone does at patch 16), down by a max-pool, or kept.
    At patch 16: up 4x, up 2x, as is, down 2x; at patch 4: as is, down 2x, 4x, 8x.

    Args:
        dim: The encoder width D (every output keeps it).
        token_stride: Image pixels per token (the patch size; 16 for T2T-ViT and the hybrid).
    """

    STRIDES = (4, 8, 16, 32)

    def __init__(self, dim: int, token_stride: int):
        super().__init__()
        self.levels = nn.ModuleList(_rescale(dim, token_stride, stride) for stride in self.STRIDES)

    def forward(self, maps: list[torch.Tensor]) -> list[torch.Tensor]:
        """Four (B, D, h, w) at the token stride -> (B, D, H/4, W/4), (B, D, H/8, W/8), (B, D, H/16, W/16),
        (B, D, H/32, W/32)."""
        return [level(m) for level, m in zip(self.levels, maps, strict=True)]


def _rescale(dim: int, token_stride: int, stride: int) -> nn.Module:
    """The module that takes a map at `token_stride` to `stride` (both powers of two)."""
    if token_stride >= stride:
        ups = [nn.ConvTranspose2d(dim, dim, 2, stride=2) for _ in range((token_stride // stride).bit_length() - 1)]
        between = [[up, nn.BatchNorm2d(dim), nn.GELU()] for up in ups[:-1]]
        return nn.Sequential(*(m for part in between for m in part), *ups[-1:])  # empty: identity
    return nn.MaxPool2d(stride // token_stride)


class UperNetHead(nn.Module):
    """Pyramid pooling + FPN fusion over four maps, finest first.

    Args:
        in_channels: The four maps' widths.
        channels: The head's width C (mmsegmentation: 512; BEiT-B and MAE-B on ADE20K: 768).
        num_classes: K.
        pool_scales: Output sides of the pyramid pooling's adaptive average pools.
        dropout: Before the classifier.
    """

    def __init__(
        self,
        in_channels: list[int],
        channels: int,
        num_classes: int,
        pool_scales: tuple[int, ...] = (1, 2, 3, 6),
        dropout: float = 0.1,
    ):
        super().__init__()
        self.pool_scales = pool_scales
        self.ppm = nn.ModuleList(conv_bn_relu(in_channels[-1], channels, 1) for _ in pool_scales)
        self.bottleneck = conv_bn_relu(in_channels[-1] + len(pool_scales) * channels, channels, 3)
        self.lateral = nn.ModuleList(conv_bn_relu(c, channels, 1) for c in in_channels[:-1])
        self.fpn = nn.ModuleList(conv_bn_relu(channels, channels, 3) for _ in in_channels[:-1])
        self.fuse = conv_bn_relu(len(in_channels) * channels, channels, 3)
        self.dropout = nn.Dropout2d(dropout)
        self.classifier = nn.Conv2d(channels, num_classes, 1)

    def forward(self, maps: list[torch.Tensor]) -> torch.Tensor:
        """Four (B, C_i, h_i, w_i), finest first -> (B, K, h_0, w_0)."""
        top = maps[-1]
        pooled = [
            _resize(stage(F.adaptive_avg_pool2d(top, scale)), top.shape[-2:])
            for scale, stage in zip(self.pool_scales, self.ppm, strict=True)
        ]
        levels = [lateral(m) for lateral, m in zip(self.lateral, maps, strict=False)]
        levels.append(self.bottleneck(torch.cat([top, *pooled], dim=1)))  # (B, C, h_3, w_3)
        for i in range(len(levels) - 1, 0, -1):  # top-down: each coarser level added to the next finer one
            levels[i - 1] = levels[i - 1] + _resize(levels[i], levels[i - 1].shape[-2:])
        outs = [conv(level) for conv, level in zip(self.fpn, levels, strict=False)] + [levels[-1]]
        size = outs[0].shape[-2:]
        fused = self.fuse(torch.cat([outs[0], *(_resize(o, size) for o in outs[1:])], dim=1))  # (B, C, h_0, w_0)
        return self.classifier(self.dropout(fused))


class FCNHead(nn.Module):
    """The auxiliary head: one 3x3 convolution block on one map, then a 1x1 classifier (mmsegmentation's FCNHead,
    num_convs 1, as the UperNet set-up uses it)."""

    def __init__(self, in_channels: int, channels: int, num_classes: int, dropout: float = 0.1):
        super().__init__()
        self.conv = conv_bn_relu(in_channels, channels, 3)
        self.dropout = nn.Dropout2d(dropout)
        self.classifier = nn.Conv2d(channels, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, h, w) -> (B, K, h, w)."""
        return self.classifier(self.dropout(self.conv(x)))


class LinearHead(nn.Module):
    """BatchNorm and a 1x1 convolution on the last block's patch tokens (DINOv2's linear segmentation probe)."""

    def __init__(self, dim: int, num_classes: int):
        super().__init__()
        self.norm = nn.BatchNorm2d(dim)
        self.classifier = nn.Conv2d(dim, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, D, h, w) -> (B, K, h, w)."""
        return self.classifier(self.norm(x))


def _resize(x: torch.Tensor, size: torch.Size | tuple[int, int]) -> torch.Tensor:
    """Bilinear resize of a (B, C, h, w) map (align_corners=False, as mmsegmentation's heads do)."""
    return x if x.shape[-2:] == size else F.interpolate(x, size=size, mode="bilinear", align_corners=False)
