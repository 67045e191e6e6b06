"""I-JEPA (Assran et al. 2023) around a timm VisionTransformer context encoder without a class token, and its EMA
target encoder.

Per batch the data workers draw the multi-block masks (data/multiblock.py): K target blocks and one context block
with the targets removed, the same counts in every image. The context encoder (the student) sees the context tokens
only; the target encoder (the EMA teacher, pretrain/teacher.py) sees the whole image without gradients, and its last
output, layer-normalised without affine, is the target. A narrow predictor ViT takes the context tokens (projected to
its width, each with its position) and, for one target block at a time, a mask token at each target position with
that position; it predicts the target encoder's features there. Loss: smooth L1 (the released code's) or the squared
error, averaged over every target token.

Positions are fixed 2-D sin-cos, in the encoder (frozen, as MAE's) and in the predictor (a buffer).

Shape legend:
    B: images    K: target blocks    Nc: context tokens    Nt: tokens per target block    L: patch tokens
    D: encoder width    Dp: predictor width    T: prefix tokens (register tokens; no class token)
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from timm.models import checkpoint_seq
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from core.models.pos_embed import sincos_pos_embed_2d
from core.recipe.teacher_sections import EMASchedule, PredictorConfig
from pretrain.encoder import check_encoder, forward_encoder, init_embedding, init_layer, patch_positions
from pretrain.teacher import EMATeacher

LOSSES = {"smooth_l1": F.smooth_l1_loss, "l2": F.mse_loss}
"""`objective.loss` -> the loss, averaged over every target token and channel (smooth L1 with beta 1, as released)."""


def gather_tokens(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B, L, C) tokens, (B, ..., N) indices -> (B, ..., N, C) the indexed tokens of each image."""
    b, _, c = x.shape
    flat = ids.reshape(b, -1)  # (B, n)
    out = torch.gather(x, 1, flat[..., None].expand(-1, -1, c))  # (B, n, C)
    return out.reshape(*ids.shape, c)


class Predictor(nn.Module):
    """I-JEPA's predictor: a narrow ViT over [context tokens; mask tokens at one target block's positions]."""

    def __init__(self, in_dim: int, grid: tuple[int, int], cfg: PredictorConfig):
        super().__init__()
        dim = cfg.embed_dim
        self.embed = nn.Linear(in_dim, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        self.blocks = nn.Sequential(
            *[Block(dim, cfg.num_heads, mlp_ratio=4.0, qkv_bias=True, norm_layer=norm_layer) for _ in range(cfg.depth)]
        )
        self.norm = norm_layer(dim)
        self.proj = nn.Linear(dim, in_dim)
        self.register_buffer("pos_embed", sincos_pos_embed_2d(dim, grid, 0), persistent=False)  # (1, L, Dp)

    def forward(
        self, context: torch.Tensor, context_ids: torch.Tensor, target_ids: torch.Tensor, *, checkpointing: bool = False
    ) -> torch.Tensor:
        """Predictions at every target position.

        Args:
            context: (B, Nc, D) the context encoder's output at the context tokens.
            context_ids: (B, Nc) their grid positions.
            target_ids: (B, K, Nt) each target block's grid positions.
            checkpointing: Recompute the blocks' activations in backward (engine.activation_checkpointing).

        Returns:
            (B, K, Nt, D) predictions of the target encoder's features.
        """
        b, k, nt = target_ids.shape
        pos = self.pos_embed.expand(b, -1, -1).to(context.dtype)  # (B, L, Dp)
        x = self.embed(context) + gather_tokens(pos, context_ids)  # (B, Nc, Dp)
        x = x[:, None].expand(-1, k, -1, -1).flatten(0, 1)  # (B*K, Nc, Dp): the context once per target block
        queries = self.mask_token.to(x.dtype) + gather_tokens(pos, target_ids).flatten(0, 1)  # (B*K, Nt, Dp)
        x = torch.cat([x, queries], dim=1)  # (B*K, Nc + Nt, Dp)
        x = checkpoint_seq(self.blocks, x) if checkpointing else self.blocks(x)
        x = self.proj(self.norm(x[:, -nt:]))  # (B*K, Nt, D)
        return x.reshape(b, k, nt, -1)


class IJEPA(nn.Module):
    """I-JEPA's objective: context encoder, EMA target encoder, predictor, feature regression."""

    def __init__(
        self,
        encoder: VisionTransformer,
        teacher: VisionTransformer,
        *,
        ema: EMASchedule,
        predictor: PredictorConfig,
        loss: str = "smooth_l1",
    ) -> None:
        """Wraps `encoder` (the context encoder) and `teacher` (a second encoder of the same architecture).

        Args:
            encoder: A timm ViT without a class token and without a head (register tokens allowed).
            teacher: A second encoder of the encoder's architecture: the target encoder.
            ema: The target encoder's momentum schedule.
            predictor: The predictor's shape.
            loss: "smooth_l1" or "l2".

        Raises:
            ValueError: On an encoder with a class token or a head, a predictor wider than the encoder, another loss.
        """
        super().__init__()
        check_encoder(encoder, "I-JEPA", class_token=False)
        if predictor.embed_dim > encoder.embed_dim:
            raise ValueError(f"predictor width {predictor.embed_dim} is above the encoder's {encoder.embed_dim}")
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {sorted(LOSSES)}, got {loss!r}")
        self.encoder = encoder
        self.teacher = EMATeacher(teacher, ema)
        self.grid_size: tuple[int, int] = tuple(encoder.patch_embed.grid_size)
        self.predictor = Predictor(encoder.embed_dim, self.grid_size, predictor)
        self.loss = loss
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """xavier Linear, unit LayerNorm, xavier patch embedding, fixed sin-cos positions, N(0, 0.02) tokens, module
        by module through `apply` (the form a ZeRO-3 build lends each module its full weights in); the target
        encoder is given the context encoder's values before the first step (core/engine/teacher.py)."""
        self.apply(init_layer)
        self.apply(self._init_embedding)
        self.encoder.pos_embed.requires_grad_(False)

    def _init_embedding(self, module: nn.Module) -> None:
        for encoder in (self.encoder, self.teacher.encoder):
            init_embedding(module, encoder, self.grid_size)
        if module is self.predictor:
            nn.init.normal_(module.mask_token, std=0.02)

    def no_weight_decay(self) -> set[str]:
        """Full names of the trainable parameters kept out of weight decay: the encoder's tokens and the predictor's
        mask token."""
        param_names = {name for name, p in self.named_parameters() if p.requires_grad}
        names = {f"encoder.{name}" for name in self.encoder.no_weight_decay()} | {"predictor.mask_token"}
        return names & param_names

    @torch.no_grad()
    def teacher_targets(self, imgs: torch.Tensor) -> torch.Tensor:
        """The target encoder's features of (B, C, H, W) images: (B, L, D) float32, its last output layer-normalised
        without affine (the prefix tokens left out)."""
        out = self.teacher.forward_features(imgs)[:, self.teacher.num_prefix_tokens :]  # (B, L, D)
        return F.layer_norm(out.float(), (out.shape[-1],))

    def forward_encoder(self, imgs: torch.Tensor, context_ids: torch.Tensor) -> torch.Tensor:
        """The context encoder on the context tokens: (B, C, H, W), (B, Nc) -> (B, Nc, D)."""
        x = self.encoder.patch_embed(imgs) + patch_positions(self.encoder)  # (B, L, D)
        x = forward_encoder(self.encoder, gather_tokens(x, context_ids))  # (B, T + Nc, D)
        return x[:, self.encoder.num_prefix_tokens :]

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One step's forward.

        Args:
            batch: {"image": (B, C, H, W) normalised images, "context_ids": (B, Nc), "target_ids": (B, K, Nt)}.

        Returns:
            {"loss", "target_var" (the targets' variance across tokens), "ema_decay"}: scalars.
        """
        imgs, context_ids, target_ids = batch["image"], batch["context_ids"], batch["target_ids"]
        target = self.teacher_targets(imgs)  # (B, L, D)
        context = self.forward_encoder(imgs, context_ids)  # (B, Nc, D)
        checkpointing = self.encoder.grad_checkpointing  # engine.activation_checkpointing covers the predictor too
        pred = self.predictor(context, context_ids, target_ids, checkpointing=checkpointing)  # (B, K, Nt, D)
        wanted = gather_tokens(target, target_ids)  # (B, K, Nt, D)
        loss = LOSSES[self.loss](pred.float(), wanted)
        return {"loss": loss, "target_var": target.var(dim=1).mean(), "ema_decay": self.teacher.decay.clone()}
