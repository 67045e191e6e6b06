"""Recipe sections for the objectives (`objective: {kind: ...}`), the fine-tuning augmentation and distillation,
the sources of a training mixture, and the strict base every section shares. core/recipe/config.py assembles them into
the one typed tree."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, PositiveInt, Tag, model_validator


class Section(BaseModel):
    # use_attribute_docstrings: the docstring under each field is its description, read at run time by
    # core/recipe/reference.py (the generated docs/recipe-reference.md, `./launch.sh --explain KEY`).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class MAEObjective(Section):
    kind: Literal["mae"] = "mae"
    """mae: MAE (He et al. 2022): the encoder sees only the visible patches, a light decoder reconstructs the masked
    ones' pixels. Needs model.arch vit."""
    mask_ratio: float = Field(0.75, gt=0.0, lt=1.0)
    """Fraction of patches masked (dropped before the encoder) per image; MAE: 0.75."""
    norm_pix_loss: bool = True
    """Reconstruct each patch's pixels standardised by that patch's own mean and variance (MAE's default, better
    features); false: the normalised image's pixels."""
    decoder_embed_dim: int = Field(512, gt=0)
    """Width of the MAE decoder (used in pretraining only; not exported)."""
    decoder_depth: int = Field(8, gt=0)
    """Transformer blocks of the MAE decoder."""
    decoder_num_heads: int = Field(16, gt=0)
    """Attention heads per MAE decoder block (must divide decoder_embed_dim)."""


class BlockwiseMask(Section):
    """BEiT's block masking: rectangles of at least `min_patches` until `num_masked` patches are covered."""

    kind: Literal["blockwise"] = "blockwise"
    """blockwise: BEiT's rectangular blocks (the default when the mask section gives no kind)."""
    num_masked: int | None = Field(None, gt=0)
    """Patches to mask per image (BEiT-B: 75 of 196); default round(0.4 x patches)."""
    min_patches: int = Field(16, gt=0)
    """Smallest block, in patches."""
    max_patches: int | None = Field(None, gt=0)
    """Largest block; default num_masked."""
    aspect_ratio: tuple[float, float] = (0.3, 1 / 0.3)
    """Block height / width range, drawn log-uniformly."""
    tries: int = Field(10, gt=0)
    """Attempts to place each block."""

    @model_validator(mode="after")
    def _check_aspect(self) -> BlockwiseMask:
        low, high = self.aspect_ratio
        if not 0 < low <= high:
            raise ValueError(f"aspect_ratio must satisfy 0 < low <= high, got {list(self.aspect_ratio)}")
        return self

    def budget(self, num_patches: int) -> int:
        return self.num_masked if self.num_masked is not None else round(0.4 * num_patches)


class RandomMask(Section):
    """Uniformly random patches (the ViT paper's masked-patch prediction: 50%)."""

    kind: Literal["random"] = "random"
    """random: patches chosen uniformly at random."""
    ratio: float = Field(0.5, gt=0.0, lt=1.0)
    """Fraction of patches selected per image (rounded)."""

    def budget(self, num_patches: int) -> int:
        return round(self.ratio * num_patches)


def _mask_kind(value: Any) -> str | None:
    """The mask section's `kind`, blockwise when the recipe leaves it out."""
    return value.get("kind", "blockwise") if isinstance(value, dict) else getattr(value, "kind", None)


Mask = Annotated[
    Annotated[BlockwiseMask, Tag("blockwise")] | Annotated[RandomMask, Tag("random")], Discriminator(_mask_kind)
]


class TargetConfig(Section):
    """What a masked patch is asked to predict."""

    kind: Literal["mean_color_3bit", "color_3bit_4x4", "pixels_l2", "tokenizer"] = "mean_color_3bit"
    """mean_color_3bit: the patch's mean RGB at 3 bits per channel (512 classes, the ViT paper's best);
    color_3bit_4x4: 16 cells of 512 classes; pixels_l2: L2 regression on the patch; tokenizer: code indices."""
    path: str | None = None
    """tokenizer: the exported tokenizer folder (RUN_DIR/export of a `stage: tokenizer` run)."""
    norm_pix: bool = False
    """pixels_l2: standardise each target patch by its own mean and variance (MAE's norm_pix_loss)."""

    @model_validator(mode="after")
    def _check_path(self) -> TargetConfig:
        if self.kind == "tokenizer" and not self.path:
            raise ValueError("target kind 'tokenizer' needs objective.target.path (a tokenizer export folder)")
        return self


class BEiTObjective(Section):
    """Masked-patch prediction over all patches (BEiT, and the ViT paper's variant with colour targets)."""

    kind: Literal["beit"] = "beit"
    """beit: every patch enters the encoder, the selected ones corrupted; a head predicts each selected patch's
    target."""
    mask: Mask = BlockwiseMask()
    """How patches are selected (`kind: blockwise` or `random`)."""
    corruption: Literal["mask_token", "mixed"] = "mask_token"
    """mask_token: every selected patch becomes the mask token (BEiT); mixed: 80% mask token, 10% another random
    patch's embedding, 10% unchanged (the ViT paper). The loss covers every selected patch."""
    target: TargetConfig = TargetConfig()
    """What each selected patch must predict."""
    head: Literal["linear", "mlp"] = "linear"
    """Prediction head on the encoder's tokens: linear, or mlp (Linear, GELU, LayerNorm, Linear)."""


class SimMIMObjective(Section):
    """SimMIM (Xie et al. 2022): masked tokens become a learned mask token at the encoder's input, the encoder sees
    the whole grid, a linear head regresses the raw (normalised) pixels, L1 on the masked pixels only. Unlike MAE it
    needs no encoder that sees patches independently: it pretrains the hybrid and T2T-ViT too."""

    kind: Literal["simmim"] = "simmim"
    """simmim: SimMIM (see the section's description); works with model.arch vit, vit_hybrid and t2t_vit."""
    mask_ratio: float = Field(0.6, gt=0.0, lt=1.0)
    """Fraction of mask units masked per image (SimMIM: 0.6); the count is ceil(ratio x units)."""
    mask_patch_size: int = Field(2, gt=0)
    """Side of a square mask unit in tokens (SimMIM: 32 px units over 16 px tokens = 2); it must divide the token
    grid."""


class VQVAEObjective(Section):
    """The image tokenizer trained by `stage: tokenizer`: a VQ-VAE with an EMA codebook and dead-code restarts."""

    kind: Literal["vqvae"] = "vqvae"
    """vqvae: the image tokenizer (stage tokenizer only)."""
    img_size: int | tuple[int, int] = 112
    """The tokenizer's input resolution (BEiT: a 112 px view for a 224 px / patch 16 encoder)."""
    downsample: int = Field(8, gt=1)
    """Pixels per code along each side (a power of two); grid = img_size / downsample."""
    codebook_size: int = Field(8192, gt=1)
    """Codes in the codebook: the tokenizer's vocabulary, the classes BEiT's head predicts (BEiT: 8192)."""
    code_dim: int = Field(32, gt=0)
    """Dimension of a code vector."""
    hidden_dim: int = Field(128, gt=0)
    """Channels of the tokenizer's convolutional encoder and decoder."""
    commitment: float = Field(0.25, ge=0.0)
    """Weight of the commitment loss, MSE between the encoder's output and its (gradient-stopped) nearest code."""
    ema_decay: float = Field(0.99, gt=0.0, lt=1.0)
    """Decay of the codebook's exponential moving averages (codes are updated by EMA, not by the optimizer)."""
    dead_code_threshold: float = Field(1.0, ge=0.0)
    """A code whose EMA usage count falls below this is restarted next to a busy one."""


class ClassificationObjective(Section):
    kind: Literal["classification"] = "classification"
    """classification: cross-entropy on class labels (stage finetune)."""
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0)
    """Applied by Mixup/CutMix to its soft targets when they are on, else by the cross-entropy."""
    mode: Literal["finetune", "linear_probe"] = "finetune"
    """linear_probe: frozen encoder, BatchNorm1d(affine=False) + linear head on the pooled features (MAE)."""


class SegmentationObjective(Section):
    kind: Literal["segmentation"] = "segmentation"
    """segmentation: per-pixel cross-entropy on segmentation shards' masks, mIoU on data.val (stage finetune;
    finetune/segment.py). model.img_size is the training crop."""
    head: Literal["upernet", "linear", "fpn", "vt_fpn"] = "upernet"
    """ViT encoders: upernet (UperNet + an auxiliary FCN head over four blocks of the ViT, brought to strides 4-32:
    BEiT's and MAE's ADE20K set-up) or linear (BatchNorm + 1x1 convolution on the last block's patch tokens: DINOv2's
    probe). model.arch resnet: fpn (panoptic FPN's semantic branch on the four stages) or vt_fpn (the VT paper's
    VT-FPN: the FPN's per-level 3x3 convolutions replaced by 8 visual tokens per level and one transformer)."""
    channels: int | None = Field(None, gt=0)
    """The head's width; default: UperNet 512 (mmsegmentation's; BEiT and MAE use 768 with ViT-B), FPN and VT-FPN
    256 (panoptic FPN's; its semantic branch is half as wide)."""
    aux_weight: float = Field(0.4, ge=0.0)
    """Weight of the auxiliary FCN head's loss (UperNet); 0 builds no auxiliary head."""
    freeze_encoder: bool = False
    """Train the head alone; the encoder keeps the weights it was handed (a probe)."""
    scale: tuple[float, float] = (0.5, 2.0)
    """Range of the random rescale before the crop, relative to `base_size` (mmsegmentation's ratio_range)."""
    base_size: int | None = Field(None, gt=0)
    """The images' short side at scale 1 (training) and for sliding evaluation; default: the crop's short side."""
    photometric: bool = True
    """Brightness, contrast, saturation and hue jitter of the training images (mmsegmentation's
    PhotoMetricDistortion)."""
    eval_mode: Literal["whole", "slide"] = "whole"
    """whole: each image resized to the crop, predicted at once; slide: short side resized to `base_size`, predicted
    in crop-sized windows (ADE20K: 512 at stride 341). Scores are taken at every mask's own size."""
    eval_stride: int | None = Field(None, gt=0)
    """The sliding windows' stride; default: 2/3 of the crop."""


class AugmentConfig(Section):
    """Fine-tuning augmentation and regularisation (timm's implementations), applied on the training stream."""

    hflip: float = Field(0.5, ge=0.0, le=1.0)
    """Probability of flipping a training image horizontally."""
    auto_augment: str | None = None
    """timm RandAugment / AutoAugment policy string, e.g. `rand-m9-mstd0.5-inc1` (MAE fine-tuning)."""
    re_prob: float = Field(0.0, ge=0.0, le=1.0)
    """Random erasing probability (MAE: 0.25), pixel mode, one box."""
    mixup: float = Field(0.0, ge=0.0)
    """Mixup alpha (MAE: 0.8); 0 turns it off."""
    cutmix: float = Field(0.0, ge=0.0)
    """CutMix alpha (MAE: 1.0); 0 turns it off."""
    mix_prob: float = Field(1.0, ge=0.0, le=1.0)
    """Probability of applying mixup or cutmix to a batch."""
    mix_switch_prob: float = Field(0.5, ge=0.0, le=1.0)
    """With both on: probability of cutmix instead of mixup."""


class DistillConfig(Section):
    """DeiT distillation: a distillation token and head trained against a frozen teacher's outputs."""

    kind: Literal["none", "soft", "hard"] = "none"
    """soft: KL to the teacher's softened output at temperature `tau`, scaled by tau^2; hard: cross-entropy on the
    teacher's argmax. Each of the two losses (true labels, teacher) is weighted 1/2 (DeiT)."""
    teacher: str | None = None
    """Teacher weights: any checkpoint `model.init` accepts (with its classifier head)."""
    teacher_arch: str | None = None
    """timm architecture of the teacher when `teacher` is a bare state dict (e.g. `vit_small_patch16_224`)."""
    tau: float = Field(3.0, gt=0.0)
    """`kind: soft`: temperature that softens the student's and the teacher's outputs (DeiT: 3)."""
    alpha: float = Field(0.5, ge=0.0, le=1.0)
    """Weight of the teacher loss (DeiT: 1/2)."""

    @model_validator(mode="after")
    def _check_teacher(self) -> DistillConfig:
        if self.kind != "none" and not self.teacher:
            raise ValueError(f"distill.kind {self.kind!r} needs distill.teacher (a checkpoint path)")
        return self


class KNNSet(Section):
    """A labelled set of the kNN monitor: its shards and how many of their samples to embed."""

    shards: str | list[str] | None = None
    """A shard spec (directory with index.json, brace pattern, glob, list); None: the bank defaults to `data.train`,
    the queries to `data.val`. Labels are read as `data.label_field` says."""
    max_samples: int | None = Field(None, gt=0)
    """Embed at most this many samples: the first samples of every shard, each shard's share in proportion to its
    size in index.json (equal shares without one), so that the set does not depend on the world size and covers
    every shard (shards written class by class still give every class). None: all of them."""


class KNNBank(KNNSet):
    """The kNN monitor's bank: as `KNNSet`, 10,000 samples unless the recipe says."""

    max_samples: int | None = Field(10000, gt=0)
    """Embed at most this many samples of the bank (spread over its shards as in eval.knn.query); None: all of them."""


class KNNConfig(Section):
    """The kNN monitor of pretraining (DINO's weighted k-NN classifier on frozen features, docs/tensorboard.md)."""

    enabled: bool = False
    """Run the kNN monitor during pretraining (needs labelled bank and query shards)."""
    every_steps: int = Field(1000, gt=0)
    """Embed the bank and the queries and classify every N optimizer steps (and at the last step)."""
    bank: KNNBank = KNNBank()
    """The labelled neighbours (default: 10,000 of the training shards)."""
    query: KNNSet = KNNSet()
    """The labelled samples classified by their neighbours in the bank (default: all of `data.val`)."""
    k: int = Field(20, gt=0)
    """Neighbours that vote (DINO: 20)."""
    temperature: float = Field(0.07, gt=0.0)
    """A neighbour's vote is exp(cosine similarity / temperature) (DINO: 0.07)."""
    pooling: Literal["cls", "mean"] = "cls"
    """The image's feature: the class token after the final norm, or the mean of the patch tokens after it."""
    batch_size_per_device: int = Field(256, gt=0)
    """Samples per device in one embedding batch of the bank or the queries."""
    fewshot: list[PositiveInt] = Field(default_factory=list)
    """Also the ViT paper's few-shot linear evaluation on the same features: per count n, 3 support sets of n bank
    images per class, each a closed-form least-squares fit to {-1, 1} targets (core/report/fewshot.py), top-1 on the
    queries averaged over the draws as `fewshot/top1_{n}shot` (the paper: 1, 5, 10, 25). Empty: off."""


class FeatureMonitorConfig(Section):
    """The label-free monitor of pretraining: RankMe's effective rank and the spread of the normalised features of
    unlabelled training images (core/report/collapse.py), with or without the kNN monitor."""

    enabled: bool = False
    """Run it: `features/effective_rank`, `features/std` (x sqrt(D): about 1 spread evenly, 0 collapsed)."""
    every_steps: int = Field(1000, gt=0)
    """Embed the images and compute both every N optimizer steps (and at the last step)."""
    shards: str | list[str] | None = None
    """Images to embed (labels unused); None: data.train (its first source's shards for a mixture)."""
    max_samples: int = Field(2048, gt=0)
    """Embed at most this many (spread over the shards as eval.knn's sets are; the effective rank is at most this)."""
    pooling: Literal["cls", "mean"] = "cls"
    """The image's feature, as eval.knn.pooling."""
    batch_size_per_device: int = Field(256, gt=0)
    """Samples per device in one embedding batch."""


class TrainSource(Section):
    """One source of a training mixture (see `DataConfig.train`)."""

    shards: str | list[str]
    """Its shards, in any form a plain `data.train` takes (directory with index.json, brace pattern, glob, list)."""
    weight: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    """Relative sampling weight: each next sample comes from this source with probability weight / sum of weights."""


def _train_kind(value: Any) -> str:
    """`mixture` for a list of sources (mappings), `shards` for a plain shard spec."""
    is_list = isinstance(value, list | tuple)
    return "mixture" if is_list and any(isinstance(v, dict | TrainSource) for v in value) else "shards"


TrainSpec = Annotated[
    Annotated[str | list[str], Tag("shards")] | Annotated[list[TrainSource], Tag("mixture")],
    Discriminator(_train_kind),
]
