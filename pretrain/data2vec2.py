"""data2vec 2.0 (Baevski et al. 2023) around a timm VisionTransformer student and its EMA teacher.

Each image is seen `num_masks` times, each copy with its own inverse block mask (made in the data workers,
data/masking.py: every copy keeps the same number of visible tokens, so the copies stack). The patch embedding runs
once per image; the student encodes each copy's visible tokens only, as MAE's encoder does. A light convolutional
decoder fills the masked slots of the token grid with small noise (no mask token) and predicts, at every token, the
teacher's target. The teacher runs once per image, on the whole image, without gradients; its target is the mean of
its top `top_k_blocks` blocks' FFN outputs, each instance-normalised over the patch tokens, the mean
layer-normalised without affine, and is shared by every copy of the image.

Loss: the squared error summed over the width and scaled by 1/sqrt(D), averaged over the masked tokens; plus, where
the encoder has a class token, `cls_loss_weight` x the same error of the student's class token against the image's
mean target, averaged over the copies.

The student's position embedding is fixed 2-D sin-cos, as MAE's, and frozen (data2vec 2.0 uses fixed positions too).

Shape legend:
    B: images    M: masked copies per image    N: B * M copies    C: image channels    H, W: image height, width
    gh, gw: token grid    L: gh * gw patch tokens    V: visible tokens per copy    D: encoder width
    Dd: decoder width    T: prefix tokens (the class token, then the register tokens)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from core.recipe.teacher_sections import ConvDecoderConfig, EMASchedule
from pretrain.encoder import check_encoder, forward_encoder, init_embedding, init_layer, patch_positions
from pretrain.teacher import EMATeacher


class ConvDecoder(nn.Module):
    """data2vec 2.0's decoder over the token grid: layers of (grouped KxK conv, LayerNorm over channels without
    affine, GELU), each with a residual where its input has its width, then a Linear back to the encoder's width."""

    def __init__(self, in_dim: int, grid: tuple[int, int], cfg: ConvDecoderConfig):
        super().__init__()
        self.grid = grid
        self.convs = nn.ModuleList(
            nn.Conv2d(
                in_dim if i == 0 else cfg.embed_dim,
                cfg.embed_dim,
                cfg.kernel_size,
                padding=cfg.kernel_size // 2,
                groups=cfg.groups,
            )
            for i in range(cfg.num_layers)
        )
        self.proj = nn.Linear(cfg.embed_dim, in_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(N, L, D) tokens in grid order -> (N, L, D) predictions.

        The grid stays channels-last in memory throughout: the convolutions take and give channels-last tensors, the
        LayerNorm over channels and the residual read them as they lie, with no transposed copy."""
        n, num_tokens, dim = x.shape
        x = x.reshape(n, *self.grid, dim)  # (N, gh, gw, D), channels last
        for conv in self.convs:
            y = conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)  # (N, gh, gw, Dd): NCHW views of channels-last memory
            y = F.gelu(F.layer_norm(y, (y.shape[-1],)))  # over channels, no affine
            x = y + x if y.shape == x.shape else y
        return self.proj(x.reshape(n, num_tokens, -1))  # (N, L, D)


def make_targets(blocks: list[torch.Tensor]) -> torch.Tensor:
    """data2vec 2.0's target from the teacher's top blocks' FFN outputs, in float32.

    Args:
        blocks: K tensors (B, L, D), the patch tokens' FFN outputs.

    Returns:
        (B, L, D): each block instance-normalised over the L tokens (per image and channel), their mean, then
        layer-normalised over D without affine.
    """
    mean = sum(_instance_norm(y.float()) for y in blocks) / len(blocks)  # (B, L, D)
    return F.layer_norm(mean, (mean.shape[-1],))


def _instance_norm(y: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """(B, L, D) -> each image's channels standardised over its L tokens (biased variance, as `F.instance_norm`)."""
    var, mean = torch.var_mean(y, dim=1, correction=0, keepdim=True)  # (B, 1, D) each
    return (y - mean) * torch.rsqrt(var + eps)


class Data2Vec2(nn.Module):
    """data2vec 2.0's objective: student, EMA teacher, convolutional decoder, masked-token regression."""

    def __init__(
        self,
        encoder: VisionTransformer,
        teacher: VisionTransformer,
        *,
        ema: EMASchedule,
        decoder: ConvDecoderConfig,
        top_k_blocks: int,
        num_masked: int,
        cls_loss_weight: float = 0.01,
        mask_noise_std: float = 0.01,
    ) -> None:
        """Wraps `encoder` (the student) and `teacher` (a second encoder of the same architecture).

        Args:
            encoder: The student: a timm ViT with a class token and no head (register tokens allowed).
            teacher: A second encoder of the student's architecture.
            ema: The teacher's decay schedule.
            decoder: The convolutional decoder's shape.
            top_k_blocks: The teacher's last blocks averaged into the target.
            num_masked: Masked tokens in every copy (the data workers' masks all mask exactly this many).
            cls_loss_weight: Weight of the class token's regression of the mean target (0: off).
            mask_noise_std: Standard deviation of the noise in the decoder's masked slots.

        Raises:
            ValueError: On an encoder MAE-style token dropping cannot take, more target blocks than blocks, or a
                mask count that leaves no visible token.
        """
        super().__init__()
        check_encoder(encoder, "data2vec 2.0")
        if not 0 < top_k_blocks <= len(encoder.blocks):
            raise ValueError(f"top_k_blocks {top_k_blocks} must be 1 to the encoder's {len(encoder.blocks)} blocks")
        self.encoder = encoder
        self.teacher = EMATeacher(teacher, ema)
        self.top_k_blocks = top_k_blocks
        self.cls_loss_weight = cls_loss_weight if encoder.has_class_token else 0.0
        self.mask_noise_std = mask_noise_std
        self.grid_size: tuple[int, int] = tuple(encoder.patch_embed.grid_size)
        num_tokens = math.prod(self.grid_size)
        if not 0 < num_masked < num_tokens:
            raise ValueError(f"num_masked {num_masked} of {num_tokens} tokens; need 1 to {num_tokens - 1}")
        self.num_visible = num_tokens - num_masked  # V: a Python constant, so that shapes are static
        self.decoder = ConvDecoder(encoder.embed_dim, self.grid_size, decoder)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """MAE's initialisation of the student and the decoder (xavier Linear, unit LayerNorm, xavier patch
        embedding, fixed sin-cos positions, N(0, 0.02) tokens), module by module through `apply` (the form a ZeRO-3
        build lends each module its full weights in). The teacher is given the student's values before the first
        step (core/engine/teacher.py)."""
        self.apply(init_layer)
        self.apply(self._init_embedding)
        self.encoder.pos_embed.requires_grad_(False)

    def _init_embedding(self, module: nn.Module) -> None:
        for encoder in (self.encoder, self.teacher.encoder):
            init_embedding(module, encoder, self.grid_size)

    def no_weight_decay(self) -> set[str]:
        """Full names of the trainable parameters kept out of weight decay: the student's tokens and positions."""
        param_names = {name for name, p in self.named_parameters() if p.requires_grad}
        return {f"encoder.{name}" for name in self.encoder.no_weight_decay()} & param_names

    def forward_encoder(self, imgs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The student on each copy's visible tokens.

        Args:
            imgs: (B, C, H, W) normalised images.
            mask: (B, M, gh, gw) bool, True = masked; the same number of visible tokens V in every copy.

        Returns:
            (latent (N, T + V, D), ids (N, L): each copy's visible token indices first, then its masked ones, each
            in grid order).
        """
        b, m = mask.shape[:2]
        mask = mask.reshape(b * m, -1)  # (N, L)
        ids = torch.argsort(mask.to(torch.int8), dim=1, stable=True)  # (N, L) visible first
        x = self.encoder.patch_embed(imgs) + patch_positions(self.encoder)  # (B, L, D): once per image
        dim = x.shape[-1]
        keep = ids[:, : self.num_visible].reshape(b, m, self.num_visible, 1).expand(-1, -1, -1, dim)  # (B, M, V, D)
        visible = torch.gather(x[:, None].expand(-1, m, -1, -1), 2, keep)  # (B, M, V, D); the expand copies nothing
        return forward_encoder(self.encoder, visible.flatten(0, 1)), ids  # copy j of image b at row b*M + j

    def forward_decoder(self, latent: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The visible tokens' latents back on the grid, the masked slots filled with N(0, mask_noise_std) noise,
        through the decoder: (N, T + V, D), (N, L) -> (N, L, D) predictions."""
        visible = latent[:, self.encoder.num_prefix_tokens :]  # (N, V, D)
        n, num_visible, dim = visible.shape
        grid = torch.randn(n, ids.shape[1], dim, device=visible.device, dtype=visible.dtype) * self.mask_noise_std
        grid = grid.scatter(1, ids[:, :num_visible, None].expand(-1, -1, dim), visible)  # (N, L, D)
        return self.decoder(grid)

    def forward_loss(
        self, pred: torch.Tensor, latent: torch.Tensor, target: torch.Tensor, ids: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Regression of the masked tokens' targets (and the class token's), float32.

        Args:
            pred: (N, L, D) decoder predictions.
            latent: (N, T + V, D) student output (its class token first).
            target: (B, L, D) the teacher's targets, one per image.
            ids: (N, L) from `forward_encoder`.

        Returns:
            {"loss", "loss_tokens", "loss_cls"}: scalars.
        """
        n, num_tokens, dim = pred.shape
        b = target.shape[0]
        # Every token's error against its image's target (broadcast over the copies, not repeated), weighted by the
        # mask: the same sum as over the gathered masked tokens, whose count is fixed (N x (L - V)).
        masked = torch.ones_like(ids, dtype=torch.float32).scatter(1, ids[:, : self.num_visible], 0.0)  # (N, L)
        err = pred.float().view(b, -1, num_tokens, dim) - target[:, None]  # (B, M, L, D)
        per_token = err.pow(2).sum(dim=-1).view(n, num_tokens)  # (N, L)
        loss_tokens = (per_token * masked).sum() / (n * (num_tokens - self.num_visible)) / math.sqrt(dim)
        loss = loss_tokens
        loss_cls = torch.zeros((), device=pred.device)
        if self.cls_loss_weight:
            cls_err = latent[:, 0].float().view(b, -1, dim) - target.mean(dim=1)[:, None]  # (B, M, D)
            loss_cls = cls_err.pow(2).sum(dim=-1).mean() / math.sqrt(dim)
            loss = loss + self.cls_loss_weight * loss_cls
        return {"loss": loss, "loss_tokens": loss_tokens.detach(), "loss_cls": loss_cls.detach()}

    @torch.no_grad()
    def teacher_targets(self, imgs: torch.Tensor) -> torch.Tensor:
        """The teacher's targets for (B, C, H, W) images: (B, L, D) float32 (`make_targets` of its top blocks)."""
        blocks, _ = self.teacher.forward_blocks(imgs, self.top_k_blocks)
        return make_targets(blocks)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One step's forward.

        Args:
            batch: {"image": (B, C, H, W) normalised images, "mask": (B, M, gh, gw) bool, True = masked}.

        Returns:
            {"loss", "loss_tokens", "loss_cls", "target_var" (the targets' variance across tokens, mean over
            channels and images: it falls towards 0 as the teacher collapses), "ema_decay"}: scalars.
        """
        imgs = batch["image"]
        target = self.teacher_targets(imgs)  # (B, L, D)
        latent, ids = self.forward_encoder(imgs, batch["mask"])
        pred = self.forward_decoder(latent, ids)
        out = self.forward_loss(pred, latent, target, ids)
        out["target_var"] = target.var(dim=1).mean()
        out["ema_decay"] = self.teacher.decay.clone()
        return out
