"""Recipe sections of the objectives whose targets are a teacher's features (data2vec 2.0, I-JEPA), and the EMA
schedule of that teacher, which they share (core/recipe/objective_kinds.py puts them in the one
`objective` union)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from core.recipe.sections import Section


class EMASchedule(Section):
    """The teacher's decay: `teacher = decay * teacher + (1 - decay) * student` after every applied optimizer step,
    `decay` rising linearly from `start` to `end` over the first `steps` optimizer steps, then held at `end`."""

    start: float = Field(0.9998, ge=0.0, le=1.0)
    """Decay at step 0 (data2vec 2.0 ViT-B: 0.9998; L: 0.9998)."""
    end: float = Field(0.99999, ge=0.0, le=1.0)
    """Decay from `steps` on (data2vec 2.0: 0.99999)."""
    steps: int = Field(100_000, gt=0)
    """Optimizer steps over which the decay rises linearly from start to end (data2vec 2.0: 100k updates)."""

    def decay_at(self, step: int) -> float:
        """The decay applied by the update of optimizer step `step` (1-based)."""
        if step >= self.steps:
            return self.end
        return self.start + (self.end - self.start) * step / self.steps


class ConvDecoderConfig(Section):
    """data2vec 2.0's light decoder over the token grid: `num_layers` x (grouped KxK conv, LayerNorm without affine,
    GELU), each after the first with a residual, then a Linear back to the encoder's width."""

    embed_dim: int = Field(768, gt=0)
    """Channels of the decoder's convolutions (data2vec 2.0: 768)."""
    kernel_size: int = Field(3, gt=0)
    """Side of each convolution's square kernel, odd (data2vec 2.0: 3 for ViT-B, 5 for L/H)."""
    num_layers: int = Field(6, gt=0)
    """Convolution layers (data2vec 2.0: 6 for ViT-B, 3 for L/H)."""
    groups: int = Field(16, gt=0)
    """Groups of each convolution; must divide embed_dim (data2vec 2.0: 16)."""

    @model_validator(mode="after")
    def _check(self) -> ConvDecoderConfig:
        if self.embed_dim % self.groups:
            raise ValueError(f"groups {self.groups} does not divide embed_dim {self.embed_dim}")
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (the grid keeps its size), got {self.kernel_size}")
        return self


class Data2Vec2Objective(Section):
    """data2vec 2.0 (Baevski et al. 2023): the student encodes the visible tokens of `num_masks` differently masked
    copies of each image; a light convolutional decoder predicts, at every masked token, the EMA teacher's target
    computed once per image on the whole image (the mean of its top blocks' FFN outputs, each instance-normalised,
    the mean layer-normalised). Needs model.arch vit."""

    kind: Literal["data2vec2"] = "data2vec2"
    """data2vec2: data2vec 2.0 with an EMA teacher (see the section's description); model.arch vit."""
    mask_ratio: float = Field(0.8, gt=0.0, lt=1.0)
    """Fraction of tokens masked in each copy (data2vec 2.0: 0.8 for ViT-B, 0.75 for L/H); every copy keeps exactly
    int(tokens x (1 - ratio)) visible, as data2vec 2.0's masks do."""
    mask_block: int = Field(3, gt=0)
    """Side, in tokens, of the square blocks the visible region is made of (inverse block masking; data2vec 2.0: 3)."""
    mask_adjust: float = Field(0.07, ge=0.0, lt=1.0)
    """Added to the kept fraction when drawing block centres, so that overlapping blocks still cover about the kept
    fraction before the count is made exact (data2vec 2.0 images: 0.07)."""
    num_masks: int = Field(16, gt=0)
    """Masked copies of each image the student sees, all sharing one teacher pass (data2vec 2.0: 16 for ViT-B, 8 for
    L/H). The student's batch per rank is this times the per-rank image batch."""
    top_k_blocks: int = Field(10, gt=0)
    """The teacher's last blocks whose FFN outputs are averaged into the target (ViT-B: 10 of 12; L: 18 of 24)."""
    ema: EMASchedule = EMASchedule()
    """The teacher's EMA decay schedule."""
    decoder: ConvDecoderConfig = ConvDecoderConfig()
    """The convolutional decoder (pretraining only; not exported)."""
    cls_loss_weight: float = Field(0.01, ge=0.0)
    """Weight of the class token regressing the mean target over the image's tokens (data2vec 2.0: 0.01); 0: off."""
    mask_noise_std: float = Field(0.01, ge=0.0)
    """Standard deviation of the noise that fills the masked slots of the decoder's grid (data2vec 2.0: 0.01)."""
    export: Literal["student", "teacher"] = "student"
    """Which encoder the export holds: the student (trained by the optimizer) or the EMA teacher."""


class PredictorConfig(Section):
    """I-JEPA's predictor: a narrow ViT over the context tokens and a mask token at each target position."""

    depth: int = Field(12, gt=0)
    """Transformer blocks (I-JEPA ViT-H/14: 12)."""
    embed_dim: int = Field(384, gt=0)
    """Width; at most the encoder's (I-JEPA ViT-H/14: 384)."""
    num_heads: int = Field(12, gt=0)
    """Attention heads; must divide embed_dim (I-JEPA: 12)."""

    @model_validator(mode="after")
    def _check(self) -> PredictorConfig:
        if self.embed_dim % self.num_heads:
            raise ValueError(f"num_heads {self.num_heads} does not divide embed_dim {self.embed_dim}")
        return self


class IJEPAObjective(Section):
    """I-JEPA (Assran et al. 2023): the context encoder (the recipe's ViT, without a class token) sees one large block
    of the image with the target blocks removed; a narrow predictor predicts, at each of `num_targets` target blocks,
    the EMA target encoder's features of the whole image (its last output, layer-normalised without affine). No pixel
    reconstruction, no hand-made augmentation. Needs model.arch vit and model.class_token false."""

    kind: Literal["ijepa"] = "ijepa"
    """ijepa: I-JEPA with an EMA target encoder (see the section's description); model.arch vit, class_token false."""
    num_targets: int = Field(4, gt=0)
    """Target blocks per image (I-JEPA: 4)."""
    target_scale: tuple[float, float] = (0.15, 0.2)
    """Each target block's area as a fraction of the token grid (drawn once per batch; I-JEPA: 0.15-0.2)."""
    target_aspect: tuple[float, float] = (0.75, 1.5)
    """Target blocks' height / width (I-JEPA: 0.75-1.5)."""
    context_scale: tuple[float, float] = (0.85, 1.0)
    """The context block's area before the targets are removed from it (I-JEPA: 0.85-1.0, aspect 1)."""
    min_keep: int = Field(10, gt=0)
    """The context keeps more than this many tokens once the targets are removed (I-JEPA: 10)."""
    predictor: PredictorConfig = PredictorConfig()
    """The predictor's shape (pretraining only; not exported)."""
    ema: EMASchedule = EMASchedule(start=0.996, end=1.0, steps=100_000)
    """The target encoder's momentum, rising linearly (I-JEPA: 0.996 -> 1.0 over the whole run: set steps to
    schedule.steps)."""
    loss: Literal["smooth_l1", "l2"] = "smooth_l1"
    """smooth_l1: the released code's (beta 1); l2: the paper's squared error."""
    export: Literal["student", "teacher"] = "teacher"
    """Which encoder the export holds: the EMA target encoder (the one the paper evaluates), or the context encoder."""
