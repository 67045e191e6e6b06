"""The segmentation objective: an encoder's feature maps into a head, per-pixel cross-entropy at the input's
resolution (pixels with the ignore id left out).

Heads (`objective.head`):
    upernet  four blocks of a ViT (depth/3, depth/2, 2 depth/3, depth: 4, 6, 8, 12 at depth 12), brought to strides
             4, 8, 16, 32 of the image (`ViTPyramid`), into UperNet; an auxiliary FCN head on the stride-16 map adds
             its loss with `aux_weight` in training (BEiT's and MAE's ADE20K set-up)
    linear   BatchNorm + 1x1 convolution on the last block's patch tokens, after the encoder's final norm (DINOv2's
             linear probe; with `freeze_encoder` the encoder is not trained)
    fpn      a ResNet's four stages (strides 4-32) into panoptic FPN's semantic branch (finetune/fpn_heads.py)
    vt_fpn   the same with the VT paper's visual tokens in place of the FPN's per-level convolutions
The logits are upsampled bilinearly to the input's size; evaluation resizes them again to each mask's own size.

Shapes: B batch, K classes, D encoder width, H/W the input, h/w the token grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.layers import freeze_batch_norm_2d, to_2tuple
from torch import nn

from data.segmentation import IGNORE_INDEX
from finetune.classification import reroot_rule
from finetune.fpn_heads import PanopticFPN
from finetune.seg_heads import AUX_LOSS_WEIGHT, FCNHead, LinearHead, UperNetHead, ViTPyramid

HEADS = ("upernet", "linear", "fpn", "vt_fpn")
DEFAULT_CHANNELS = {"upernet": 512, "fpn": 256, "vt_fpn": 256}
"""A head's width when the recipe gives none (mmsegmentation's UperNet; panoptic FPN); the linear head has none."""
RESNET_STAGES = [1, 2, 3, 4]  # timm ResNet's feature indices of layer1-4 (strides 4-32); 0 is the stem
AUX_CHANNELS = 256  # the auxiliary FCN head's width (mmsegmentation's UperNet set-up)


def pyramid_blocks(depth: int) -> list[int]:
    """The 0-based indices of the four blocks UperNet reads: depth/3, depth/2, 2 depth/3 and depth (1-based)."""
    return [max(depth // 3, 1) - 1, max(depth // 2, 1) - 1, max(2 * depth // 3, 1) - 1, depth - 1]


def token_stride(encoder: nn.Module) -> int:
    """Image pixels per token of a ViT (its patch embedding's), hybrid (its stem's and patches') or T2T-ViT (16)."""
    embed = getattr(encoder, "patch_embed", encoder)
    return to_2tuple(embed.img_size)[0] // to_2tuple(embed.grid_size)[0]


class SegmentationModel(nn.Module):
    """An encoder (timm's `forward_intermediates`) and a segmentation head.

    Args:
        encoder: The encoder, without a classifier: a timm VisionTransformer (plain or hybrid) or T2T-ViT for
            "upernet" and "linear", a timm ResNet for "fpn" and "vt_fpn".
        head: One of `HEADS`.
        num_classes: K.
        channels: The head's width (None: `DEFAULT_CHANNELS`).
        aux: Build UperNet's auxiliary FCN head.
    """

    def __init__(
        self, encoder: nn.Module, head: str, num_classes: int, *, channels: int | None = None, aux: bool = True
    ):
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"objective.head {head!r}: one of {HEADS}")
        self.encoder, self.head_kind = encoder, head
        self.channels = channels or DEFAULT_CHANNELS.get(head)
        self.neck, self.aux_head = None, None
        if head in ("fpn", "vt_fpn"):
            self.blocks = RESNET_STAGES
            widths = [encoder.feature_info[i]["num_chs"] for i in RESNET_STAGES]
            self.head = PanopticFPN(widths, self.channels, num_classes, visual_tokens=head == "vt_fpn")
            return
        dim, depth = encoder.embed_dim, len(encoder.blocks)
        # What no head reads (the pooled features' norm; the final norm, for UperNet's raw block outputs) stays as
        # handed over, frozen: the exported encoder keeps every tensor timm's model has.
        for name in ("fc_norm", "norm") if head == "upernet" else ("fc_norm",):
            getattr(encoder, name, nn.Identity()).requires_grad_(False)
        if head == "upernet":
            self.blocks = pyramid_blocks(depth)
            self.neck = ViTPyramid(dim, token_stride(encoder))
            self.head = UperNetHead([dim] * 4, self.channels, num_classes)
            self.aux_head = FCNHead(dim, AUX_CHANNELS, num_classes) if aux else None
        else:
            self.blocks = [depth - 1]
            self.head = LinearHead(dim, num_classes)

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, 3, H, W) -> logits (B, K, H, W) and, in training with an auxiliary head, its logits (B, K, H, W)."""
        read = sorted(set(self.blocks))  # a shallow encoder reads one block twice
        maps = self.encoder.forward_intermediates(
            image, indices=read, norm=self.head_kind == "linear", output_fmt="NCHW", intermediates_only=True
        )  # each (B, D, h, w)
        maps = [maps[read.index(block)] for block in self.blocks]
        size = image.shape[-2:]
        if self.head_kind == "linear":
            return _upsample(self.head(maps[-1]), size), None
        levels = self.neck(maps) if self.neck is not None else maps  # strides 4, 8, 16, 32 (a ResNet's as they are)
        logits = _upsample(self.head(levels), size)
        aux = _upsample(self.aux_head(levels[2]), size) if self.aux_head is not None and self.training else None
        return logits, aux


class Segmentation(nn.Module):
    """The objective: returns the loss and the scalars to log.

    Args:
        model: The segmentation model.
        aux_weight: Weight of the auxiliary head's loss.
        freeze_encoder: Train the head alone: the encoder's parameters get no gradient and its BatchNorm layers
            (a hybrid's ResNet stem) keep their statistics.
    """

    def __init__(self, model: SegmentationModel, *, aux_weight: float = AUX_LOSS_WEIGHT, freeze_encoder: bool = False):
        super().__init__()
        if freeze_encoder:
            model.encoder = freeze_batch_norm_2d(model.encoder).requires_grad_(False)
        self.model, self.aux_weight = model, aux_weight

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """batch "image" (B, 3, H, W) and, to train, "seg" (B, H, W) class ids -> "logits" (B, K, H, W) fp32 and,
        with "seg", "loss" (fp32 scalar: mean over the scored pixels, plus `aux_weight` x the auxiliary head's) and
        "pixel_acc" (of this batch)."""
        logits, aux = self.model(batch["image"])
        out = {"logits": logits.float()}
        if "seg" not in batch:
            return out
        target = batch["seg"]
        loss = F.cross_entropy(out["logits"], target, ignore_index=IGNORE_INDEX)
        if aux is not None and self.aux_weight:
            loss = loss + self.aux_weight * F.cross_entropy(aux.float(), target, ignore_index=IGNORE_INDEX)
        scored = target != IGNORE_INDEX
        correct = (out["logits"].argmax(dim=1) == target) & scored
        out["loss"] = loss
        out["pixel_acc"] = correct.sum().float() / scored.sum().clamp(min=1)
        return out

    def no_weight_decay(self) -> set[str]:
        """The encoder's position embedding and prefix tokens (timm's list), under `model.encoder.`."""
        names = {name for name, _ in self.named_parameters()}
        listed = getattr(self.model.encoder, "no_weight_decay", set)()  # a ResNet has none
        return {f"model.encoder.{name}" for name in listed} & names

    def group_matcher(self, coarse: bool = False) -> dict:
        """The encoder's layer groups for layer decay; the neck and heads match none, so they take the last group's
        learning rate (no decay), as BEiT's layer-decay optimizer constructor treats them."""
        rules = self.model.encoder.group_matcher(coarse).items()
        return {group: reroot_rule(rule, "model.encoder.") for group, rule in rules}


def _upsample(logits: torch.Tensor, size: torch.Size) -> torch.Tensor:
    return logits if logits.shape[-2:] == size else F.interpolate(logits, size, mode="bilinear", align_corners=False)
