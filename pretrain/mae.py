"""Masked autoencoder (MAE) objective around a timm VisionTransformer encoder.

The encoder keeps timm's structure and parameter names, so its state_dict loads strictly into a fresh timm model;
this module adds the random masking, a light transformer decoder and the pixel reconstruction loss. The encoder's
position embedding is overwritten with fixed 2-D sin-cos values and frozen for pretraining. Register tokens
(`model.reg_tokens`) are prefix tokens like the class token: never masked, passed through the decoder beside it,
never predicted.

Shape legend:
    B: batch    C: image channels    H, W: image height, width    ph, pw: patch height, width
    gh, gw: patch grid (H / ph, W / pw)    L: gh * gw patches    L_vis: visible (kept) patches
    D: encoder width    Dd: decoder width    P: ph * pw * C pixels per patch
    T: prefix tokens (the class token, then the register tokens)
"""

from collections.abc import Sequence
from functools import partial

import torch
from timm.layers import to_2tuple
from timm.models import checkpoint_seq
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from core.models.pos_embed import sincos_pos_embed_2d
from core.report.pictures import image_grid
from pretrain.encoder import check_encoder, forward_encoder, init_embedding, init_layer, patch_positions

# MAE's norm_pix_loss adds this to the per-patch variance before the square root.
_NORM_PIX_EPS = 1e-6


def patchify(imgs: torch.Tensor, patch_size: tuple[int, int]) -> torch.Tensor:
    """(B, C, H, W) -> (B, L, P); patches row-major, pixels within a patch ordered (ph, pw, C) as in MAE."""
    ph, pw = patch_size
    b, c, h, w = imgs.shape
    x = imgs.reshape(b, c, h // ph, ph, w // pw, pw)  # (B, C, gh, ph, gw, pw)
    x = x.permute(0, 2, 4, 3, 5, 1)  # (B, gh, gw, ph, pw, C)
    return x.reshape(b, (h // ph) * (w // pw), ph * pw * c)


def unpatchify(x: torch.Tensor, patch_size: tuple[int, int], grid_size: tuple[int, int]) -> torch.Tensor:
    """(B, L, P) -> (B, C, H, W); the inverse of `patchify` for a (gh, gw) grid."""
    ph, pw = patch_size
    gh, gw = grid_size
    b = x.shape[0]
    x = x.reshape(b, gh, gw, ph, pw, -1)  # (B, gh, gw, ph, pw, C)
    x = x.permute(0, 5, 1, 3, 2, 4)  # (B, C, gh, ph, gw, pw)
    return x.reshape(b, -1, gh * ph, gw * pw)


def normalize_patches(patches: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MAE's norm_pix target: each patch standardised by its own mean and (unbiased) variance.

    Args:
        patches: (B, L, P) pixel patches.

    Returns:
        (normalised patches (B, L, P), mean (B, L, 1), std (B, L, 1)) with std = sqrt(var + 1e-6).
    """
    mean = patches.mean(dim=-1, keepdim=True)  # (B, L, 1)
    std = (patches.var(dim=-1, keepdim=True) + _NORM_PIX_EPS).sqrt()  # (B, L, 1); var unbiased as in MAE
    return (patches - mean) / std, mean, std


class MAE(nn.Module):
    """MAE pretraining objective: encode the visible patches, decode all, regress the masked patches' pixels."""

    def __init__(
        self,
        encoder: VisionTransformer,
        *,
        mask_ratio: float = 0.75,
        norm_pix_loss: bool = True,
        decoder_embed_dim: int = 512,
        decoder_depth: int = 8,
        decoder_num_heads: int = 16,
    ) -> None:
        """Wraps `encoder` and builds the decoder.

        Args:
            encoder: timm ViT with a class token, 'token' pooling and no head (register tokens allowed).
            mask_ratio: Fraction of patches hidden from the encoder.
            norm_pix_loss: Regress per-patch standardised pixels instead of raw (normalised-image) pixels.
            decoder_embed_dim: Decoder width Dd.
            decoder_depth: Number of decoder blocks.
            decoder_num_heads: Decoder attention heads.

        Raises:
            ValueError: On an unsupported encoder or a mask ratio that keeps no patch or masks none.
        """
        super().__init__()
        check_encoder(encoder, "MAE", token_pool=True)
        num_patches = encoder.patch_embed.num_patches
        num_keep = int(num_patches * (1 - mask_ratio))
        if not 0 < num_keep < num_patches:
            raise ValueError(f"mask_ratio {mask_ratio} keeps {num_keep} of {num_patches} patches; need 1 to L-1")
        self.encoder = encoder
        self.mask_ratio = mask_ratio
        self.norm_pix_loss = norm_pix_loss
        self.patch_size: tuple[int, int] = tuple(encoder.patch_embed.patch_size)
        self.grid_size: tuple[int, int] = tuple(encoder.patch_embed.grid_size)
        self.num_prefix = encoder.num_prefix_tokens  # T: the class token and the register tokens
        in_chans = encoder.patch_embed.proj.in_channels

        self.decoder_embed = nn.Linear(encoder.embed_dim, decoder_embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_embed_dim))
        # Fixed, recomputed from the grid at construction, so it is kept out of the state_dict.
        self.register_buffer(
            "decoder_pos_embed",
            sincos_pos_embed_2d(decoder_embed_dim, self.grid_size, self.num_prefix),  # (1, T + L, Dd), prefix zeros
            persistent=False,
        )
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        self.decoder_blocks = nn.Sequential(
            *[
                Block(decoder_embed_dim, decoder_num_heads, mlp_ratio=4.0, qkv_bias=True, norm_layer=norm_layer)
                for _ in range(decoder_depth)
            ]
        )
        self.decoder_norm = norm_layer(decoder_embed_dim)
        self.decoder_pred = nn.Linear(decoder_embed_dim, self.patch_size[0] * self.patch_size[1] * in_chans)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """MAE's initialisation, in this order (it fixes which random numbers each tensor draws): xavier Linear and
        unit LayerNorms, then the xavier patch embedding, the fixed (frozen) sin-cos encoder pos_embed and N(0, 0.02)
        tokens (class, registers, mask).

        Module by module through `apply`, each call setting only that module's own parameters: the form in which a
        ZeRO-3 build (core/engine/zero_init.py) lends each module its full weights."""
        self.apply(init_layer)
        self.apply(self._init_embedding)
        self.encoder.pos_embed.requires_grad_(False)

    def _init_embedding(self, module: nn.Module) -> None:
        init_embedding(module, self.encoder, self.grid_size)
        if module is self:
            nn.init.normal_(self.mask_token, std=0.02)

    def no_weight_decay(self) -> set[str]:
        """Full names of the parameters excluded from weight decay: position embeddings and learned tokens."""
        param_names = {name for name, _ in self.named_parameters()}
        names = {f"encoder.{name}" for name in self.encoder.no_weight_decay()} | {"mask_token"}
        return names & param_names

    def patchify(self, imgs: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, L, P)."""
        return patchify(imgs, self.patch_size)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, P) -> (B, C, H, W) on the encoder's patch grid."""
        return unpatchify(x, self.patch_size, self.grid_size)

    def random_masking(self, x: torch.Tensor, mask_ratio: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keeps a random subset of int(L * (1 - mask_ratio)) tokens per sample.

        Args:
            x: (B, L, D) patch tokens.
            mask_ratio: Fraction of tokens to drop.

        Returns:
            x_visible (B, L_vis, D); mask (B, L) float, 1 = masked, in image order; ids_restore (B, L), the
            permutation that puts [kept tokens, dropped tokens] back in image order.
        """
        b, num_patches, dim = x.shape
        num_keep = int(num_patches * (1 - mask_ratio))
        noise = torch.rand(b, num_patches, device=x.device)  # (B, L)
        ids_shuffle = torch.argsort(noise, dim=1)  # (B, L) ascending noise: the first num_keep are kept
        ids_restore = torch.argsort(ids_shuffle, dim=1)  # (B, L)
        ids_keep = ids_shuffle[:, :num_keep]  # (B, L_vis)
        x_visible = torch.gather(x, 1, ids_keep.unsqueeze(-1).expand(-1, -1, dim))  # (B, L_vis, D)
        mask = torch.ones(b, num_patches, device=x.device)  # (B, L) in shuffled order
        mask[:, :num_keep] = 0
        mask = torch.gather(mask, 1, ids_restore)  # (B, L) in image order
        return x_visible, mask, ids_restore

    def forward_encoder(self, imgs: torch.Tensor, mask_ratio: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Runs the timm encoder's own modules on the prefix tokens plus the visible patches only.

        Args:
            imgs: (B, C, H, W) normalised images.
            mask_ratio: Fraction of patches to hide.

        Returns:
            latent (B, T + L_vis, D), mask (B, L), ids_restore (B, L).
        """
        x = self.encoder.patch_embed(imgs) + patch_positions(self.encoder)  # (B, L, D)
        x, mask, ids_restore = self.random_masking(x, mask_ratio)  # (B, L_vis, D)
        return forward_encoder(self.encoder, x), mask, ids_restore

    def forward_decoder(self, latent: torch.Tensor, ids_restore: torch.Tensor) -> torch.Tensor:
        """Fills the masked positions with the mask token, restores image order and predicts every patch.

        Args:
            latent: (B, T + L_vis, D) encoder output.
            ids_restore: (B, L) from `random_masking`.

        Returns:
            pred (B, L, P) pixel predictions (per-patch standardised when norm_pix_loss).
        """
        x = self.decoder_embed(latent)  # (B, T + L_vis, Dd)
        b, num_patches = ids_restore.shape
        prefix, visible = x[:, : self.num_prefix], x[:, self.num_prefix :]  # (B, T, Dd), (B, L_vis, Dd)
        mask_tokens = self.mask_token.expand(b, num_patches - visible.shape[1], -1)  # (B, L - L_vis, Dd)
        patches = torch.cat([visible, mask_tokens], dim=1)  # (B, L, Dd) kept-first order
        patches = torch.gather(patches, 1, ids_restore.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # image order
        # Casting the parameters to fp16 leaves this fixed buffer fp32: add it in x's dtype
        x = torch.cat([prefix, patches], dim=1) + self.decoder_pos_embed.to(x.dtype)  # (B, T + L, Dd)
        # engine.activation_checkpointing (the encoder's timm switch, set in core/models/vit.py) covers the decoder too
        x = checkpoint_seq(self.decoder_blocks, x) if self.encoder.grad_checkpointing else self.decoder_blocks(x)
        x = self.decoder_norm(x)  # (B, T + L, Dd)
        return self.decoder_pred(x)[:, self.num_prefix :]  # (B, L, P): the prefix tokens are never predicted

    def forward_loss(self, imgs: torch.Tensor, pred: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Mean squared error per patch, averaged over the masked patches only; computed in float32.

        Args:
            imgs: (B, C, H, W) normalised images.
            pred: (B, L, P) predictions.
            mask: (B, L), 1 = masked.

        Returns:
            Scalar float32 loss.
        """
        target = self.patchify(imgs).float()  # (B, L, P)
        if self.norm_pix_loss:
            target = normalize_patches(target)[0]
        loss_per_patch = (pred.float() - target).pow(2).mean(dim=-1)  # (B, L)
        mask = mask.float()
        return (loss_per_patch * mask).sum() / mask.sum()

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Masks, encodes, decodes and scores one batch.

        Args:
            batch: {"image": (B, C, H, W) normalised images}.

        Returns:
            {"loss": scalar float32, "pred": (B, L, P), "mask": (B, L) with 1 = masked}.
        """
        imgs = batch["image"]
        latent, mask, ids_restore = self.forward_encoder(imgs, self.mask_ratio)
        pred = self.forward_decoder(latent, ids_restore)
        return {"loss": self.forward_loss(imgs, pred, mask), "pred": pred, "mask": mask}


@torch.no_grad()
def reconstruction_grid(
    images: torch.Tensor,
    pred: torch.Tensor,
    mask: torch.Tensor,
    *,
    patch_size: int | tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    norm_pix_loss: bool,
    max_images: int = 8,
) -> torch.Tensor:
    """Picture of MAE reconstructions for TensorBoard's `add_image`.

    One row per sample with four titled panels: original | masked (masked patches grey) | reconstruction |
    reconstruction pasted into the visible patches. With norm_pix_loss the prediction is first mapped back to
    pixels with each original patch's own mean and std, as MAE's visualisation does.

    Args:
        images: (B, C, H, W) images normalised with `mean`/`std`.
        pred: (B, L, P) predictions from `MAE.forward`.
        mask: (B, L), 1 = masked.
        patch_size: Patch side, or (ph, pw).
        mean: Per-channel normalisation mean.
        std: Per-channel normalisation std.
        norm_pix_loss: Whether `pred` is in per-patch standardised units.
        max_images: Rows to draw at most.

    Returns:
        (3, H_grid, W_grid) float tensor in [0, 1]: `core.report.pictures.image_grid` with column titles, small images
        upscaled (nearest) to at least 112 px.
    """
    patch_size = to_2tuple(patch_size)
    images, pred, mask = images[:max_images].float(), pred[:max_images].float(), mask[:max_images].float()
    grid_size = (images.shape[2] // patch_size[0], images.shape[3] // patch_size[1])
    if norm_pix_loss:
        _, patch_mean, patch_std = normalize_patches(patchify(images, patch_size))  # (B, L, 1) each
        pred = pred * patch_std + patch_mean  # (B, L, P)
    mean_t = torch.as_tensor(mean, dtype=torch.float32, device=images.device).view(1, -1, 1, 1)
    std_t = torch.as_tensor(std, dtype=torch.float32, device=images.device).view(1, -1, 1, 1)
    original = (images * std_t + mean_t).clamp(0, 1)  # (B, C, H, W)
    reconstruction = (unpatchify(pred, patch_size, grid_size) * std_t + mean_t).clamp(0, 1)  # (B, C, H, W)
    pixel_mask = unpatchify(mask.unsqueeze(-1).expand_as(pred), patch_size, grid_size)  # (B, C, H, W) 1 = masked
    masked = original * (1 - pixel_mask) + 0.5 * pixel_mask
    pasted = original * (1 - pixel_mask) + reconstruction * pixel_mask
    return image_grid(
        [original, masked, reconstruction, pasted], ["original", "masked", "reconstruction", "pred + visible"]
    )
