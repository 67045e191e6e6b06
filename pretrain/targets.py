"""What a masked patch is asked to predict in BEiT-style pretraining: one small module per `objective.target.kind`.

Every target maps a batch to per-patch targets, in the encoder's row-major patch order:
    mean_color_3bit   (B, L) long in [0, 512): the patch's mean RGB at 3 bits per channel (the ViT paper's best)
    color_3bit_4x4    (B, L, 16) long in [0, 512): the patch downsized to 4x4, each cell's 3-bit colour
    pixels_l2         (B, L, P) float: the patch's (normalised-image) pixels, for L2 regression
    tokenizer         (B, L) long in [0, V): the code of each patch from a frozen image tokenizer

Colours are quantised on the un-normalised image in [0, 1] (the dataset's mean/std undone): a channel value c
falls in bin min(floor(8c), 7), and a colour's class is 64 r + 8 g + b.

Shape legend: B batch, C = 3 channels, H/W image size, p patch size, gh/gw patch grid, L = gh * gw patches,
P = p * p * C values per patch, V vocabulary size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.mae import normalize_patches, patchify

COLOR_BITS = 3
NUM_COLORS = 2 ** (3 * COLOR_BITS)  # 512


def quantize_color(rgb: torch.Tensor) -> torch.Tensor:
    """(..., 3) colours in [0, 1] -> (...) long class in [0, 512): 3 bits per channel, red most significant."""
    levels = 2**COLOR_BITS
    bins = (rgb.float() * levels).floor().clamp(0, levels - 1).long()  # (..., 3)
    return (bins[..., 0] * levels + bins[..., 1]) * levels + bins[..., 2]


def class_colors(classes: torch.Tensor) -> torch.Tensor:
    """(...) long classes of `quantize_color` -> (..., 3) float RGB in [0, 1], each channel at its bin's centre."""
    levels = 2**COLOR_BITS
    bins = torch.stack([classes // (levels * levels), classes // levels % levels, classes % levels], dim=-1)
    return (bins.float() + 0.5) / levels


class _ColorTarget(nn.Module):
    """Shared by the colour targets: undoes the dataset normalisation to get pixels back in [0, 1]."""

    num_classes = NUM_COLORS

    def __init__(self, patch_size: tuple[int, int], mean: Sequence[float], std: Sequence[float]):
        super().__init__()
        self.patch_size = tuple(patch_size)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)

    def pixels(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, 3, H, W) un-normalised image in [0, 1]."""
        return (batch["image"].float() * self.std + self.mean).clamp(0.0, 1.0)


class MeanColor3Bit(_ColorTarget):
    """The ViT paper's masked-patch target: each patch's mean colour, 3 bits per channel (512 classes)."""

    num_outputs = 1

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        means = F.avg_pool2d(self.pixels(batch), self.patch_size)  # (B, 3, gh, gw)
        return quantize_color(means.flatten(2).transpose(1, 2))  # (B, L)


class Color3Bit4x4(_ColorTarget):
    """Each patch downsized to 4x4 (area average), every cell's 3-bit colour: 16 predictions of 512 classes."""

    num_outputs = 16

    def __init__(self, patch_size: tuple[int, int], mean: Sequence[float], std: Sequence[float]):
        super().__init__(patch_size, mean, std)
        if min(self.patch_size) < 4:
            raise ValueError(f"target color_3bit_4x4 needs patches of at least 4x4 pixels, got {self.patch_size}")

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        pixels = self.pixels(batch)
        b, c, h, w = pixels.shape
        ph, pw = self.patch_size
        patches = pixels.reshape(b, c, h // ph, ph, w // pw, pw).permute(0, 2, 4, 1, 3, 5)  # (B, gh, gw, 3, p, p)
        cells = F.adaptive_avg_pool2d(patches.reshape(-1, c, ph, pw), 4)  # (B * L, 3, 4, 4)
        cells = cells.reshape(b, -1, c, 16).transpose(2, 3)  # (B, L, 16, 3), cells row-major
        return quantize_color(cells)  # (B, L, 16)


class PixelsL2(nn.Module):
    """The patch's pixels of the normalised image (per-patch standardised when `norm_pix`), for L2 regression."""

    num_classes = 0

    def __init__(self, patch_size: tuple[int, int], *, norm_pix: bool = False, in_chans: int = 3):
        super().__init__()
        self.patch_size = tuple(patch_size)
        self.norm_pix = norm_pix
        self.num_outputs = self.patch_size[0] * self.patch_size[1] * in_chans

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        target = patchify(batch["image"].float(), self.patch_size)  # (B, L, P)
        return normalize_patches(target)[0] if self.norm_pix else target


class TokenizerCodes(nn.Module):
    """Code indices of a frozen image tokenizer, computed on `batch["tokenizer_image"]` (the tokenizer's own view).

    The tokenizer is held outside the module tree on purpose: it is frozen and reloaded from its own export, so it
    belongs in no optimizer, checkpoint or encoder export, and ZeRO-3 must not partition it.
    """

    num_outputs = 1

    def __init__(self, tokenizer: nn.Module, grid: tuple[int, int]):
        super().__init__()
        if tuple(tokenizer.grid) != tuple(grid):
            raise ValueError(
                f"tokenizer grid {tuple(tokenizer.grid)} (img_size {tokenizer.config['img_size']} / downsample "
                f"{tokenizer.config['downsample']}) does not match the encoder's patch grid {tuple(grid)}"
            )
        self.__dict__["tokenizer"] = tokenizer.eval().requires_grad_(False)
        self.num_classes = tokenizer.config["codebook_size"]

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        view = batch["tokenizer_image"]
        tokenizer, first = self.tokenizer, next(self.tokenizer.parameters(), None)
        if first is not None and first.device != view.device:  # moved once; the FLOP count's fake copy never is
            tokenizer = tokenizer.to(view.device)
        # In the tokenizer's own dtype: under fp16 the batch arrives in half, and the tokenizer, outside the module
        # tree DeepSpeed casts, stays as it was loaded (fp32).
        view = view.to(first.dtype if first is not None else view.dtype)
        return tokenizer.encode(view).flatten(1)  # (B, L)
