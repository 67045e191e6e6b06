"""The recipe's `model` section, and what each `model.arch` can be trained with (the cross-section checks that
`Config` runs for it)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from core.recipe.geometry import HYBRID_STRIDES, VIT_SIZES, soft_split_grid
from core.recipe.objective_kinds import Objective
from core.recipe.sections import Section, SimMIMObjective


class ModelConfig(Section):
    arch: Literal["vit", "vit_hybrid", "t2t_vit", "vt_resnet", "resnet"] = "vit"
    """vit: the plain ViT; vit_hybrid: timm's ResNet-stem ViT (`hybrid_backbone`'s feature map is the patch grid);
    t2t_vit: T2T-ViT (`t2t_variant`, core/models/t2t_vit.py); vt_resnet: VT-ResNet (`vt_variant`, core/models/vt.py);
    resnet: timm's ResNet (`resnet_variant`), the backbone of the FPN segmentation heads."""
    size: Literal["tiny", "small", "base", "large", "huge"] = "base"
    """ViT size preset (vit, vit_hybrid); `embed_dim`/`depth`/`num_heads` override it."""
    img_size: int | tuple[int, int] = 224
    """Input resolution (square int or [height, width])."""
    patch_size: int = Field(16, gt=0)
    """vit: patch side in pixels (default 16); vit_hybrid: patch side on the backbone's feature map (default 1, as
    timm: every feature-map cell is a token); t2t_vit, vt_resnet: unused (their stems fix the token grid)."""
    hybrid_backbone: Literal["resnet_stem", "r26", "r50"] = "r50"
    """vit_hybrid: the ResNetV2 in front of the ViT, as timm builds it: r50 (stages 3-4-9, stride 16:
    `vit_base_r50_s16_224`, the ViT paper's hybrid), r26 (2-2-2-2, stride 32: `vit_small_r26_s32_224`), resnet_stem
    (the stem alone, stride 4: `vit_tiny_r_s16_p8_224`, for small images)."""
    t2t_variant: Literal["14", "19", "24", "t_14", "t_19", "t_24"] = "14"
    """t2t_vit: T2T-ViT-14/19/24 (Performer T2T layers) or T2T-ViT_t-14/19/24 (transformer T2T layers);
    `embed_dim`/`depth`/`num_heads` override the variant's backbone."""
    vt_variant: Literal[18, 34, 50, 101] = 18
    """vt_resnet: VT-ResNet-18/34/50/101; `embed_dim` overrides the token width (1024)."""
    vt_tokenizer: Literal["filter", "cluster"] = "filter"
    """vt_resnet: the first VT module's tokenizer: filter (learned filters, the same for every image) or cluster (the
    VT paper's clustering-based tokenizer: each image's 16 k-means centres of its normalised pixels as the filters)."""
    resnet_variant: Literal[18, 34, 50, 101] = 50
    """resnet: ResNet-18/34/50/101 (timm's `resnet18` ... `resnet101`; ImageNet weights load through `init`)."""
    embed_dim: int | None = Field(None, gt=0)
    """Token width; None: the size preset's (tiny 192, small 384, base 768, large 1024, huge 1280) or the variant's."""
    depth: int | None = Field(None, gt=0)
    """Transformer blocks; None: the size preset's or the variant's."""
    num_heads: int | None = Field(None, gt=0)
    """Attention heads per block (must divide embed_dim); None: the size preset's or the variant's."""
    drop_path_rate: float = Field(0.0, ge=0.0, lt=1.0)
    """Stochastic depth: the largest probability of skipping a block's residual branch, rising linearly over the blocks
    (MAE fine-tuning ViT-B: 0.1); 0 turns it off."""
    reg_tokens: int = Field(0, ge=0)
    """Register tokens (Darcet et al. 2024, "Vision Transformers Need Registers"; timm's `reg_tokens`): learned
    tokens after the class token, with a position of their own (arch vit and vit_hybrid). Prefix tokens like the
    class token: never masked, never pooled, never reconstructed; exported with the encoder (config.json's
    `reg_tokens`). Fine-tuning from an export needs the export's number (the hand-off refuses another)."""
    class_token: bool = True
    """A class token in front of the patches (arch vit and vit_hybrid). I-JEPA's encoders have none: they pool by
    averaging the patch tokens (model.global_pool avg); fine-tuning from such an export needs false here too."""
    layer_scale_init: float | None = Field(None, gt=0.0)
    """LayerScale: per-channel residual scales initialised to this value (BEiT: 0.1); None turns it off."""
    global_pool: Literal["auto", "token", "avg"] = "auto"
    """Fine-tuning pooling: cls token, or average of patch tokens + fc_norm (MAE's fine-tuning default); auto takes
    the init export's `pooling_hint` (else the cls token). Pretraining always uses the cls-token layout."""
    init: str | None = None
    """Weights to start from: our export folder, an official MAE/DeiT checkpoint, a timm state dict
    (.pth/.bin/.safetensors), or a Hub repo `hf-hub:ORG/NAME[@REVISION]` (read through the Hugging Face cache;
    HF_HUB_OFFLINE=1 honoured); see core/export/handoff.py. Pretraining continues from them (warm start: the encoder,
    and the decoder when the file holds one in MAE's layout; pretrain/warm_start.py). The architecture keys the recipe
    leaves out (and data.mean/std) are the checkpoint's; one it sets must agree, but for img_size and patch_size, which
    the hand-off resizes to (core/export/architecture.py, docs/handoff.md)."""
    trust_checkpoint: bool = False
    """Allow unpickling non-tensor objects from `init` (official MAE checkpoints carry argparse args). Only for files
    you trust: a pickle can run code."""
    head_init: Literal["zero", "trunc_normal"] = "zero"
    """Classifier head init: zero weight and bias (ViT paper), or truncated normal with `head_init_std` (MAE)."""
    head_init_std: float = Field(2e-5, gt=0.0)
    """Standard deviation of the `trunc_normal` classifier head (MAE: 2e-5)."""
    pos_embed_resize: Literal["interpolate", "sincos"] = "interpolate"
    """On a patch-grid change: bicubic interpolation of the pretrained grid, or (for encoders pretrained with fixed
    2-D sin-cos position embeddings, e.g. MAE) regenerate sin-cos values for the new grid."""
    num_classes: int | None = Field(None, gt=0)
    """Fine-tuning: number of classes; default from the training shards' index.json."""

    @property
    def image_hw(self) -> tuple[int, int]:
        return (self.img_size, self.img_size) if isinstance(self.img_size, int) else tuple(self.img_size)

    @property
    def grid(self) -> tuple[int, int]:
        """The encoder's token grid (gh, gw) (VT-ResNet: its stride-16 feature map)."""
        h, w = self.image_hw
        if self.arch == "t2t_vit":
            return soft_split_grid((h, w))
        return h // self.pixel_stride, w // self.pixel_stride

    @property
    def vit_depth(self) -> int:
        """Transformer blocks of a ViT (arch vit or vit_hybrid): `depth`, else the size's."""
        return self.depth or VIT_SIZES[self.size]["depth"]

    @property
    def vit_width(self) -> int:
        """Token width of a ViT (arch vit or vit_hybrid): `embed_dim`, else the size's."""
        return self.embed_dim or VIT_SIZES[self.size]["embed_dim"]

    @property
    def pixel_stride(self) -> int:
        """Image pixels per token side (vit: the patch; hybrid: backbone stride x patch; T2T, VT: 16; ResNet: its
        last stage's 32)."""
        if self.arch == "vit":
            return self.patch_size
        if self.arch == "vit_hybrid":
            return HYBRID_STRIDES[self.hybrid_backbone] * self.patch_size
        return 32 if self.arch == "resnet" else 16

    @model_validator(mode="before")
    @classmethod
    def _hybrid_patch_default(cls, data):
        """A hybrid's patches are cut from the feature map: timm's default there is 1 (one token per cell), not 16."""
        if isinstance(data, dict) and data.get("arch") == "vit_hybrid" and "patch_size" not in data:
            data = {**data, "patch_size": 1}
        return data

    @model_validator(mode="after")
    def _check_class_token(self) -> ModelConfig:
        if not self.class_token and self.arch not in ("vit", "vit_hybrid"):
            raise ValueError(f"class_token false needs arch vit or vit_hybrid (timm's ViT), got {self.arch!r}")
        if not self.class_token and self.global_pool == "token":
            raise ValueError("global_pool token needs a class token: class_token is false (use avg or auto)")
        return self

    @model_validator(mode="after")
    def _check_patch(self) -> ModelConfig:
        if self.init and not {"img_size", "patch_size"} <= self.model_fields_set:
            return self  # the checkpoint's, checked when the stage completes the recipe (core/export/architecture.py)
        h, w = self.image_hw
        if self.arch in ("vit", "vit_hybrid") and (h % self.pixel_stride or w % self.pixel_stride):
            what = "model.patch_size" if self.arch == "vit" else "the hybrid backbone's stride x model.patch_size"
            raise ValueError(f"model.img_size {self.img_size} is not divisible by {what} ({self.pixel_stride})")
        if self.arch == "t2t_vit":
            soft_split_grid((h, w))  # raises on an image too small for the three soft splits
        return self


def check_arch(model: ModelConfig, objective: Objective, *, activation_checkpointing: bool, distill: str) -> None:
    """What each `model.arch` can be trained with (raises ValueError naming the fields).

    Args:
        model: The recipe's `model` section.
        objective: Its `objective` section.
        activation_checkpointing: `engine.activation_checkpointing`.
        distill: `distill.kind`.
    """
    arch, kind = model.arch, objective.kind
    if arch == "resnet" and kind != "segmentation":
        raise ValueError(
            f"model.arch resnet is the backbone of the FPN segmentation heads (objective.kind segmentation, "
            f"objective.head fpn or vt_fpn), not of objective.kind {kind}"
        )
    if kind in ("mae", "data2vec2", "ijepa") and arch != "vit":
        raise ValueError(
            f"objective.kind {kind} needs model.arch vit, got {arch!r}: it drops the masked tokens before the encoder, "
            "which needs patches the encoder sees independently (a ResNet stem, T2T's overlapping soft splits and "
            "VT's convolutions all see neighbouring pixels); use objective.kind simmim"
        )
    if kind in ("beit", "simmim") and arch == "vt_resnet":
        raise ValueError(
            f"objective.kind {kind} does not fit model.arch vt_resnet: VT's 16 visual tokens are pooled from the "
            "whole feature map by attention, so there is no token per image patch to mask and predict; VT is "
            "fine-tuned only (from scratch or from ImageNet ResNet stages)"
        )
    if kind in ("beit", "simmim"):
        grid, stride = model.grid, model.pixel_stride
        if (grid[0] * stride, grid[1] * stride) != model.image_hw:
            raise ValueError(
                f"objective.kind {kind}: model.img_size {model.img_size} must be the token grid {grid} x "
                f"{stride} px per token (model.arch {arch}: an img_size divisible by {stride})"
            )
    if isinstance(objective, SimMIMObjective):
        unit, grid = objective.mask_patch_size, model.grid
        if grid[0] % unit or grid[1] % unit:
            raise ValueError(f"objective.mask_patch_size {unit} does not divide the token grid {grid}")
        num_units = math.prod(grid) // unit**2
        num_masked = math.ceil(objective.mask_ratio * num_units)
        if num_masked >= num_units:
            raise ValueError(
                f"objective.mask_ratio {objective.mask_ratio} masks all {num_units} mask units of "
                f"{unit}x{unit} tokens on the grid {grid}; lower it or objective.mask_patch_size"
            )
    if model.reg_tokens and arch not in ("vit", "vit_hybrid"):
        raise ValueError(f"model.reg_tokens needs model.arch vit or vit_hybrid (timm's ViT), got {arch!r}")
    if model.reg_tokens and distill != "none":
        raise ValueError(
            "model.reg_tokens does not fit distill: DeiT's distilled ViT (a distillation token beside the class "
            "token) has no register tokens in timm; set model.reg_tokens=0 or distill.kind=none"
        )
    if activation_checkpointing and arch not in ("vit", "vit_hybrid"):
        raise ValueError(
            f"engine.activation_checkpointing is implemented for model.arch vit and vit_hybrid, not {arch}"
        )
    if distill != "none" and arch != "vit":
        raise ValueError(f"distill needs model.arch vit (DeiT's distillation token), got {arch!r}")
    if arch == "vt_resnet" and model.global_pool == "token":
        raise ValueError("model.global_pool token does not fit model.arch vt_resnet (it averages its visual tokens)")
