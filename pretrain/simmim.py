"""SimMIM (Xie et al. 2022, "SimMIM: a Simple Framework for Masked Image Modeling") around a ViT-family encoder.

The encoder sees the whole token grid: the tokens selected by the batch's mask (square units of tokens drawn in the
data workers, see data/masking.py `UnitMaskGenerator`) are replaced by one learned mask token before the position
embedding is added. A light linear head (a 1x1 convolution to s * s * C values per token, then a pixel shuffle, as
SimMIM's decoder) regresses the raw normalised pixels; the loss is the L1 distance over the masked pixels only,
divided by the number of masked pixel values. The encoder keeps its timm names, so it exports like MAE's; the mask
token and the head stay behind.

Where the mask acts, per encoder:
    plain ViT   the mask token replaces masked patch embeddings after patch_embed (SimMIM). Patches do not overlap,
                so no masked pixel reaches a visible token.
    hybrid, T2T the masked pixels are first set to 0 (the dataset mean after normalisation) before the stem, then the
                mask token replaces the masked tokens on the grid after HybridEmbed / tokens_to_token. The ResNet's
                receptive fields and T2T's overlapping soft splits would otherwise carry masked pixels into the
                visible tokens next to them, and the head could copy them instead of inferring them; the mask token
                on the grid gives the transformer the same learned signal as on the plain ViT.

Shape legend:
    B: batch    C: image channels    H, W: image sides    gh, gw: token grid    L = gh * gw    D: encoder width
    s: pixels per token side
"""

from __future__ import annotations

import torch
from timm.layers import PatchEmbed, trunc_normal_
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from core.models.t2t_vit import T2TViT
from pretrain.encoder import check_encoder, embed_tokens, forward_encoder, patch_positions, token_grid


def encoder_image_size(encoder: VisionTransformer | T2TViT) -> tuple[int, int]:
    """(H, W) the encoder is built for."""
    return tuple(encoder.img_size if isinstance(encoder, T2TViT) else encoder.patch_embed.img_size)


class SimMIM(nn.Module):
    """Masked image modelling with a mask token at the encoder's input and a linear pixel head.

    Args:
        encoder: timm ViT (plain or hybrid) with a class token and no head (register tokens allowed: prefix tokens,
            never masked nor decoded), or a T2T-ViT without head. Its image must be exactly its token grid times a
            whole number of pixels per token.
        in_chans: Image channels the head predicts.
    """

    def __init__(self, encoder: VisionTransformer | T2TViT, *, in_chans: int = 3):
        super().__init__()
        check_encoder(encoder, "SimMIM")
        self.encoder, self.in_chans = encoder, in_chans
        (height, width), self.grid = encoder_image_size(encoder), token_grid(encoder)
        self.stride = height // self.grid[0]
        if (self.grid[0] * self.stride, self.grid[1] * self.stride) != (height, width):
            raise ValueError(f"SimMIM: image {(height, width)} is not the token grid {self.grid} x whole pixels")
        # Pixels are hidden before the stem only where the stem mixes neighbouring pixels (see the module docstring).
        self.mask_pixels = not (isinstance(encoder, VisionTransformer) and type(encoder.patch_embed) is PatchEmbed)
        dim = encoder.embed_dim
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.decoder = nn.Conv2d(dim, self.stride**2 * in_chans, kernel_size=1)  # per token: s * s * C values
        self.pixel_shuffle = nn.PixelShuffle(self.stride)
        trunc_normal_(self.mask_token, std=0.02)
        self.decoder.apply(_init_head)  # module by module, as a ZeRO-3 build needs (see MAE.init_weights)

    def no_weight_decay(self) -> set[str]:
        """Full names kept out of weight decay: position embedding, cls token and mask token."""
        names = {f"encoder.{name}" for name in self.encoder.no_weight_decay()} | {"mask_token"}
        return names & {name for name, _ in self.named_parameters()}

    def pixel_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """(B, gh, gw) token mask -> (B, 1, H, W) pixel mask, True = masked."""
        return mask.repeat_interleave(self.stride, dim=1).repeat_interleave(self.stride, dim=2).unsqueeze(1)

    def forward_encoder(self, imgs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images and (B, gh, gw) bool mask -> (B, P + L, D) encoder output over the whole grid (P
        prefix tokens: class, registers)."""
        if self.mask_pixels:
            imgs = imgs.masked_fill(self.pixel_mask(mask), 0.0)  # 0 = the dataset mean after normalisation
        tokens = embed_tokens(self.encoder, imgs)  # (B, L, D)
        masked = mask.flatten(1).unsqueeze(-1)  # (B, L, 1)
        tokens = torch.where(masked, self.mask_token.to(tokens.dtype), tokens) + patch_positions(self.encoder)
        return forward_encoder(self.encoder, tokens)

    def forward_decoder(self, latent: torch.Tensor) -> torch.Tensor:
        """(B, P + L, D) encoder output -> (B, C, H, W) predicted pixels (the prefix tokens are not decoded)."""
        patches = latent[:, self.encoder.num_prefix_tokens :]  # (B, L, D)
        grid_tokens = patches.transpose(1, 2).unflatten(2, self.grid)  # (B, D, gh, gw)
        return self.pixel_shuffle(self.decoder(grid_tokens))  # (B, s * s * C, gh, gw) -> (B, C, H, W)

    def forward_loss(self, imgs: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """L1 over the masked pixels, divided by their number of values (SimMIM), in float32.

        Args:
            imgs: (B, C, H, W) target images (normalised, as the encoder saw them before masking).
            pred: (B, C, H, W) predictions.
            mask: (B, gh, gw) bool, True = masked.
        """
        pixels = self.pixel_mask(mask).float()  # (B, 1, H, W)
        error = (pred.float() - imgs.float()).abs()  # (B, C, H, W)
        return (error * pixels).sum() / (pixels.sum() * self.in_chans).clamp(min=1.0)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Mask, encode, decode and score one batch.

        Args:
            batch: "image" (B, C, H, W) normalised images, "mask" (B, gh, gw) bool from the data workers.

        Returns:
            "loss" (float32 scalar), "mask" (B, L) bool, "pred" (B, C, H, W) predicted pixels (for pictures).
        """
        imgs, mask = batch["image"], batch["mask"].bool()
        if tuple(mask.shape[1:]) != self.grid:
            raise ValueError(f"SimMIM: batch mask grid {tuple(mask.shape[1:])} is not the encoder's {self.grid}")
        pred = self.forward_decoder(self.forward_encoder(imgs, mask))  # (B, C, H, W)
        return {"loss": self.forward_loss(imgs, pred, mask), "mask": mask.flatten(1), "pred": pred}


def _init_head(module: nn.Module) -> None:
    if isinstance(module, nn.Conv2d):
        trunc_normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)
