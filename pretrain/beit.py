"""BEiT-style masked-patch prediction around a timm VisionTransformer encoder.

The encoder sees every patch; the patches selected by the batch's mask (made in the data workers, see
data/masking.py) are corrupted before the position embedding is added, and a head predicts each selected patch's
target (pretrain/targets.py): a discrete class (colour, tokenizer code) with cross-entropy, or pixels with L2.
The loss covers the selected positions only. Every mask selects the same number of patches (the mask generators'
exact count), so the selected positions are gathered at a size known before the data: boolean-mask indexing would
make the host wait for the device to learn how many there are, in every forward. The encoder keeps timm's names,
so it exports like MAE's; the mask token and the head stay behind.

Corruption of the selected patches:
    mask_token   all become the learnable mask token (BEiT)
    mixed        80% the mask token, 10% another random patch's embedding from the batch, 10% unchanged (ViT paper)

Shape legend:
    B: batch    L: patches    D: encoder width    M: selected patches per image    N = B * M
    K: classes per prediction (0 for regression)    O: predictions per patch (1, 16, or P pixel values)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from pretrain.encoder import check_encoder, embed_tokens, forward_encoder, patch_positions, token_grid

# The ViT paper's split of the selected patches: mask token, random other patch, unchanged.
MIXED_SPLIT = (0.8, 0.1, 0.1)


def _init_head(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        nn.init.zeros_(module.bias)


def _take(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B, L, ...) per-patch values at (B, M) positions -> (B * M, ...), rows in row-major (image, patch) order."""
    index = positions.view(*positions.shape, *(1,) * (x.ndim - 2)).expand(-1, -1, *x.shape[2:])  # (B, M, ...)
    return x.gather(1, index).flatten(0, 1)


class MaskedPatchPrediction(nn.Module):
    """Predict a target for every masked patch from an encoder that sees all patches.

    Args:
        encoder: timm ViT (plain or hybrid) with a class token and no head (register tokens allowed: prefix tokens,
            never masked nor predicted), or a T2T-ViT without head; the mask applies to its token grid (patches,
            the hybrid's feature-map patches, T2T's tokens after the soft splits).
        target: A module from pretrain/targets.py: maps the batch to per-patch targets and says `num_classes`
            (0 = regression) and `num_outputs` (predictions per patch).
        num_masked: Patches every mask selects (M; `num_masked` of the recipe's mask generator).
        corruption: "mask_token" or "mixed" (see the module docstring).
        head: "linear", or "mlp" (Linear, GELU, LayerNorm, Linear).
    """

    def __init__(
        self,
        encoder: VisionTransformer,
        target: nn.Module,
        *,
        num_masked: int,
        corruption: str = "mask_token",
        head: str = "linear",
    ):
        super().__init__()
        check_encoder(encoder, "masked-patch prediction")
        num_patches = math.prod(token_grid(encoder))
        if not 0 < num_masked <= num_patches:
            raise ValueError(f"num_masked must be in [1, {num_patches}] (the encoder's patches), got {num_masked}")
        if corruption not in ("mask_token", "mixed"):
            raise ValueError(f"corruption must be 'mask_token' or 'mixed', got {corruption!r}")
        if head not in ("linear", "mlp"):
            raise ValueError(f"head must be 'linear' or 'mlp', got {head!r}")
        self.encoder, self.target, self.corruption, self.num_masked = encoder, target, corruption, num_masked
        dim = encoder.embed_dim
        self.num_classes, self.num_outputs = target.num_classes, target.num_outputs
        out_dim = self.num_outputs * max(self.num_classes, 1)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        if head == "linear":
            self.head = nn.Linear(dim, out_dim)
        else:
            self.head = nn.Sequential(
                nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, out_dim)
            )
        trunc_normal_(self.mask_token, std=0.02)
        self.head.apply(_init_head)  # module by module, as a ZeRO-3 build needs (see MAE.init_weights)

    def no_weight_decay(self) -> set[str]:
        """Full names kept out of weight decay: position embedding, cls token and mask token."""
        names = {f"encoder.{name}" for name in self.encoder.no_weight_decay()} | {"mask_token"}
        return names & {name for name, _ in self.named_parameters()}

    def corrupt(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Replace the selected patch embeddings.

        Args:
            x: (B, L, D) patch embeddings (before the position embedding).
            mask: (B, L) bool, True = selected.

        Returns:
            (B, L, D) corrupted embeddings.
        """
        to_token = mask
        if self.corruption == "mixed":
            draw = torch.rand(mask.shape, device=x.device)  # (B, L)
            to_token = mask & (draw < MIXED_SPLIT[0])
            to_random = mask & (draw >= MIXED_SPLIT[0]) & (draw < MIXED_SPLIT[0] + MIXED_SPLIT[1])
            flat = x.reshape(-1, x.shape[-1])  # (B * L, D)
            donors = flat[torch.randint(flat.shape[0], mask.shape, device=x.device)]  # (B, L, D)
            x = torch.where(to_random.unsqueeze(-1), donors, x)
        return torch.where(to_token.unsqueeze(-1), self.mask_token.to(x.dtype), x)

    def selected_positions(self, mask: torch.Tensor) -> torch.Tensor:
        """(B, L) bool mask with M True per row -> (B, M) long positions of the selected patches, ascending.

        The count is checked on the device (`_assert_async`: no host sync; a failure surfaces as a device error).
        """
        torch._assert_async(
            (mask.sum(1) == self.num_masked).all(),
            f"masked-patch prediction: a mask does not select {self.num_masked} patches",
        )
        # A stable sort keeps the selected positions in row-major order, as `x[mask]` would list them
        order = torch.argsort(mask.to(torch.uint8), dim=1, descending=True, stable=True)  # (B, L)
        return order[:, : self.num_masked]

    def forward_encoder(self, imgs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) images and (B, L) selection -> (B, P + L, D) encoder output (P prefix tokens: class,
        registers)."""
        x = self.corrupt(embed_tokens(self.encoder, imgs), mask) + patch_positions(self.encoder)  # (B, L, D)
        return forward_encoder(self.encoder, x)

    def forward_loss(self, pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Loss over the selected patches, in float32.

        Args:
            pred: (N, O * K) head outputs (O * P values for regression), N = B * M.
            target: (N,) or (N, O) class indices, or (N, P) values.

        Returns:
            (loss, accuracy over all N * O predictions; None for regression).
        """
        pred = pred.float()
        if not self.num_classes:
            return F.mse_loss(pred, target.float()), None
        logits = pred.reshape(-1, self.num_classes)  # (N * O, K)
        labels = target.reshape(-1)  # (N * O,)
        return F.cross_entropy(logits, labels), (logits.argmax(-1) == labels).float().mean()

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Corrupt, encode and score one batch.

        Args:
            batch: "image" (B, C, H, W) normalised images, "mask" (B, gh, gw) bool from the data workers, plus what
                the target reads (e.g. "tokenizer_image").

        Returns:
            "loss" (float32 scalar), "mlm_acc" (classification targets), "mask" (B, L) bool, "pred" (N, O * K),
            "target" the selected patches' targets, (N,) / (N, O) / (N, P) (for pictures of the predictions); the
            N rows in row-major (image, patch) order.
        """
        mask = batch["mask"].flatten(1).bool()  # (B, L)
        positions = self.selected_positions(mask)  # (B, M)
        with torch.no_grad():
            target = _take(self.target(batch), positions)  # (N,) / (N, O) / (N, P)
        latent = self.forward_encoder(batch["image"], mask)  # (B, P + L, D)
        patches = latent[:, self.encoder.num_prefix_tokens :]  # (B, L, D): the prefix tokens are never predicted
        pred = self.head(_take(patches, positions))  # (N, O * K): the head runs on the selected patches only
        loss, accuracy = self.forward_loss(pred, target)
        out = {"loss": loss, "mask": mask, "pred": pred, "target": target}
        if accuracy is not None:
            out["mlm_acc"] = accuracy
        return out
