"""Typed recipe schema: defaults < recipe (< its one `base:` parent) < command-line `a.b=c` overrides.

Every section is a strict pydantic model (`extra="forbid"`): an unknown key, a wrong type or an out-of-range
value is a `ConfigError` naming the dotted key (with a close-match hint for typos) before any process starts.
The layers are merged into one plain tree in core/recipe/tree.py; core/recipe/errors.py words the errors.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from core.recipe.errors import ConfigError as ConfigError  # re-exported: callers catch it from here
from core.recipe.errors import explain
from core.recipe.ignored import check_ignored
from core.recipe.model_config import ModelConfig, check_arch
from core.recipe.objective_kinds import OBJECTIVES_BY_STAGE, Objective
from core.recipe.sections import (
    AugmentConfig,
    BEiTObjective,
    DistillConfig,
    FeatureMonitorConfig,
    KNNConfig,
    MAEObjective,
    Section,
    SegmentationObjective,
    TrainSource,
    TrainSpec,
)
from core.recipe.teacher_sections import Data2Vec2Objective, IJEPAObjective
from core.recipe.tree import recipe_tree
from data.shard_read import ShardReadPolicy
from data.worker_process import LOADER_TIMEOUT_S

_READS = ShardReadPolicy()  # the defaults of the data.read_* keys
SEGMENTATION_ARCHS = {"vit": ("upernet", "linear"), "vit_hybrid": ("upernet", "linear"),
                      "t2t_vit": ("upernet", "linear"), "resnet": ("fpn", "vt_fpn")}  # fmt: skip
"""Segmentation heads per encoder: the ViTs' token grids are read block by block, a ResNet's four stages by FPNs."""


# timm's IMAGENET_DEFAULT_MEAN/STD (tests/unit/test_layers.py checks they agree), written out: importing timm.data
# would import all of timm's models when a recipe is loaded.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class DataConfig(Section):
    train: TrainSpec = ""
    """Training shards: a directory with index.json, a brace pattern, a glob, or a list of paths/URLs. Or a mixture:
    a list of sources `{shards: SPEC, weight: W}`; every data worker draws each next sample from source i with
    probability W_i / sum(W), each source being its own stream of interleaved shards (docs/shards.md). A mixture
    has no epoch of its own: a schedule in epochs needs `data.samples_per_epoch`."""
    val: str | list[str] | None = None
    """Held-out shards for evaluation (fine-tuning)."""
    label_field: str | None = None
    """Where fine-tuning reads each sample's class: None reads `.cls`; a name reads that integer field of the
    sample's `.json` (e.g. `label`). Pretraining reads no labels."""
    global_batch_size: int = Field(256, gt=0)
    """Samples per optimizer step over all ranks and accumulation micro-steps."""
    num_workers: int = Field(2, ge=0)
    """Data loader worker processes per rank (decoding and augmenting in parallel); 0 loads in the rank's own
    process."""
    loader_timeout_s: float = Field(LOADER_TIMEOUT_S, gt=0)
    """Seconds a rank waits for one batch from its data workers before it stops with one line naming the worker
    (`data worker N of rank R gave no batch for T s`) instead of hanging on a stuck shard read or transform. It
    covers the first batch too, which fills the worker's shuffle buffer (at most 256 MiB of encoded samples) first:
    the default leaves that 30 minutes, ~150 KB/s per worker. With `num_workers: 0` there is no worker to wait for."""
    shuffle_buffer: int | None = Field(None, ge=0)
    """Samples (still encoded) each data worker holds to shuffle; 0 turns it off. Default: what `num_open_shards`
    shards hold together (counts from index.json), so that it mixes them whole, but at most 256 MiB of encoded
    samples (their size on disk) per worker; 1,000 when no index.json lists the shards. A fresh buffer gives its first
    sample at 1,000 samples and grows by one per sample given (data/order.py), so the first batch does not wait for it
    to fill."""
    num_open_shards: int = Field(8, gt=0)
    """Shards each data worker reads at once (per mixture source), drawing each next sample from one of them at
    random, so that shards written in class order still give mixed batches. An open shard holds no samples, but
    costs a file handle or, for http shards, a connection (a curl process): lower it if those run short."""
    resampled: bool = True
    """Each data worker walks through the shards in its own random order, pass after pass (endless, streams may
    overlap); false: every epoch's shard permutation is split over all ranks and workers, which never overlap."""
    samples_per_epoch: int | None = Field(None, gt=0)
    """Converts epochs to steps; default: sample count in the training shards' index.json. A mixture has none, so a
    schedule in epochs needs it set (e.g. to the main source's sample count, for epochs of the size they had
    without the other sources)."""
    mean: tuple[float, float, float] = IMAGENET_MEAN
    """Per-channel RGB mean that images are normalised with (default ImageNet's); exported with the model."""
    std: tuple[float, float, float] = IMAGENET_STD
    """Per-channel RGB standard deviation that images are normalised with (default ImageNet's); exported with the
    model."""
    crop_scale: tuple[float, float] = (0.2, 1.0)
    """RandomResizedCrop area range (MAE pretraining: 0.2-1.0)."""
    hflip: float = Field(0.5, ge=0.0, le=1.0)
    """Pretraining: probability of a horizontal flip after the crop (MAE, data2vec 2.0: 0.5; I-JEPA: 0, crops only).
    Fine-tuning flips with augment.hflip."""
    decode: Literal["worker", "device"] = "worker"
    """Where the pretraining crop's JPEGs are decoded: worker (in the data workers); device: the workers read only
    each JPEG's header and draw its box and flip (the same draws), and the training process decodes the batch on its
    device (nvJPEG on a GPU) and crops, resizes and flips it there: ~20x less worker CPU per ImageNet-sized JPEG in
    the transform (3-7x the images per worker CPU-second for the whole loader), for some GPU time (docs/speed.md).
    PNGs, greyscale, CMYK, progressive and EXIF-rotated JPEGs are still decoded in the workers. Pretraining (MAE,
    SimMIM, BEiT-style with a pixel or colour target) and the tokenizer stage; not fine-tuning, nor BEiT's tokenizer
    target (its second view)."""
    eval_crop_pct: float = Field(0.875, gt=0.0, le=1.0)
    """Evaluation view: resize the shorter side to img_size / eval_crop_pct, then centre-crop img_size (timm's
    crop_pct); 1 crops nothing away."""
    eval_batch_size_per_device: int = Field(256, gt=0)
    """Samples per device in one evaluation batch (fine-tuning's data.val; no gradients are kept)."""
    read_timeout_s: float = Field(_READS.timeout_s, gt=0.0, allow_inf_nan=False)
    """Longest wait for a shard's next sample, opening it included, before the read counts as failed and is retried
    (a hung connection, file system or `pipe:` command; docs/shards.md)."""
    read_retries: int = Field(_READS.retries, ge=0)
    """Tries after a failed shard read before the shard is given up: a training shard is then skipped (named in the
    log, counted in `data/skipped_shards`), an evaluation shard stops the run."""
    read_backoff_s: float = Field(_READS.backoff_s, ge=0.0, allow_inf_nan=False)
    """Wait before the first retry of a shard, doubled for each next one, each drawn within +-50%."""
    max_skipped_shard_fraction: float = Field(_READS.max_skipped_fraction, ge=0.0, le=1.0)
    """Stop the run once more shard reads were skipped than this fraction of max(shard reads begun, distinct
    training shards), counted over all ranks since the run began; 0 stops at the first skipped shard, 1 never."""

    @property
    def is_mixture(self) -> bool:
        """Whether `train` is a mixture of weighted sources."""
        return isinstance(self.train, list) and any(isinstance(s, TrainSource) for s in self.train)

    def read_policy(self) -> ShardReadPolicy:
        """How every loader of the run reads its shards."""
        return ShardReadPolicy(
            timeout_s=self.read_timeout_s,
            retries=self.read_retries,
            backoff_s=self.read_backoff_s,
            max_skipped_fraction=self.max_skipped_shard_fraction,
        )


class OptimConfig(Section):
    base_lr: float = Field(1.5e-4, gt=0.0)
    """Learning rate before the batch-size rule: the peak lr is base_lr x global_batch_size / lr_base_batch (`lr_rule:
    scaled`) or base_lr itself (`absolute`); the launch log prints the result."""
    lr_rule: Literal["scaled", "absolute"] = "scaled"
    """scaled: lr = base_lr * global_batch_size / lr_base_batch (MAE, DeiT); absolute: lr = base_lr (BEiT)."""
    lr_base_batch: int = Field(256, gt=0)
    """The global batch that `base_lr` is quoted for (`lr_rule: scaled`)."""
    min_lr: float = Field(0.0, ge=0.0)
    """Learning rate at the last step: after the warmup the lr follows a half cosine from the peak down to this."""
    weight_decay: float = Field(0.05, ge=0.0)
    """Decoupled weight decay (AdamW) or L2 (SGD, LARS) on the weight matrices; biases, norm weights, tokens and
    position embeddings get none."""
    weight_decay_end: float | None = Field(None, ge=0.0)
    """The weight decay at the last step, reached by a half cosine from `weight_decay` at the first (I-JEPA: 0.04 ->
    0.4); None: `weight_decay` throughout."""
    start_lr: float = Field(0.0, ge=0.0)
    """Where the lr warmup starts, rising linearly to the peak (I-JEPA: 2e-4 to 1e-3; MAE: 0)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's decay rates of the first and second moment estimates (MAE pretraining: 0.9, 0.95; fine-tuning: 0.9,
    0.999)."""
    eps: float = Field(1e-8, gt=0.0)
    """AdamW's term added to the denominator for numerical stability."""
    grad_clip: float = Field(0.0, ge=0.0)
    """Clip the global gradient norm to this value; 0 turns clipping off."""
    kind: Literal["adamw", "sgd", "lars"] = "adamw"
    """adamw (pretraining, fine-tuning); sgd or lars with `momentum` (linear probe: MAE uses LARS)."""
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    """Momentum of `kind: sgd` and `kind: lars` (unused by adamw)."""
    ema_decay: float = Field(0.0, ge=0.0, lt=1.0)
    """Keep an exponential moving average of the weights with this decay (e.g. 0.9999) and evaluate it too; 0 = off."""
    layer_decay: float = Field(1.0, gt=0.0, le=1.0)
    """Layer-wise lr decay (BEiT/MAE fine-tuning): block i (0-based) of L gets lr x layer_decay^(L - i), the
    embeddings layer_decay^(L + 1), the final norm and head the full lr; 1 turns it off."""


class ScheduleConfig(Section):
    steps: int | None = Field(None, gt=0)
    """Training length in optimizer steps. Set exactly one of `steps` and `epochs`; a recipe without a schedule section
    trains 1,000 steps."""
    epochs: float | None = Field(None, gt=0)
    """Training length in epochs, converted once to steps with `data.samples_per_epoch` (or the shards' index.json) and
    the global batch (rounded up)."""
    warmup_steps: int | None = Field(None, ge=0)
    """Optimizer steps of linear lr warmup from 0 to the peak; None and no warmup_epochs: no warmup. At most one of
    warmup_steps and warmup_epochs."""
    warmup_epochs: float | None = Field(None, ge=0)
    """Warmup length in epochs, converted to steps as `epochs` is (MAE pretraining: 40)."""

    @model_validator(mode="after")
    def _one_length(self) -> ScheduleConfig:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of schedule.steps and schedule.epochs")
        if self.warmup_steps is not None and self.warmup_epochs is not None:
            raise ValueError("set at most one of schedule.warmup_steps and schedule.warmup_epochs")
        return self


ZERO3_COMPILE_REASON = (
    "engine.compile does not work with engine.zero_stage 3: DeepSpeed 0.19 gathers and releases each block's "
    "partitioned weights in module hooks that run inside the compiled block call, where torch.compile breaks the "
    "graph at every hook (DeepSpeed's nvtx-wrapped hooks are skipped by dynamo, its pre-backward autograd.Function "
    "cannot be traced) and recompiles them on every step (each call hands it a new function object); use ZeRO 0-2 "
    "with engine.compile, or ZeRO-3 eagerly"
)


_PATCH_STAGES = {
    "share_zero3_masters": (3,),
    "share_zero12_masters": (1, 2),
    "skip_identity_grad_passes": (3,),
}
"""The ZeRO stages at which each optional DeepSpeed patch's engine setting applies."""


class EngineConfig(Section):
    zero_stage: Literal[0, 1, 2, 3] = 1
    """DeepSpeed ZeRO stage: 0 replicates everything (plain data parallel); 1 partitions the optimizer state over the
    ranks, 2 also the gradients, 3 also the parameters (docs/gpu.md)."""
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """bf16: autocast over fp32 weights and optimizer state, entered by the DeepSpeed engine around its forward
    (DeepSpeed's `torch_autocast`); fp16: DeepSpeed fp16 with dynamic loss scaling; fp32. auto: what the machine
    runs fastest: bf16 on GPUs of compute capability 8.0 and later and on CPUs with native bf16 (AVX512-BF16, AMX),
    fp16 on older GPUs (V100, T4), fp32 on other CPUs (core/launch/precision.py); the plan line says which and why,
    and run_dir/config.yaml holds the choice. An explicit bf16 is refused on a GPU without it and warned about on a
    CPU without native bf16."""
    grad_reduce_dtype: Literal["bf16", "fp32"] = "bf16"
    """bf16 runs at ZeRO-1/2/3: the dtype in which the gradients of Linear and Conv layers (>99% of a ViT's) are
    reduced across ranks; bf16 halves the bytes a step moves (docs/communication.md). Norms, position embeddings and
    tokens are reduced in fp32 either way; ZeRO-0, and a run of one rank, reduce everything in fp32."""
    tf32: bool = True
    """CUDA: fp32 matmuls and convolutions (fp32 runs, and what autocast leaves in fp32) use TF32 tensor cores
    (`torch.backends.cuda.matmul.allow_tf32`, `torch.backends.cudnn.allow_tf32`). No effect on CPU."""
    sync_every_steps: int = Field(8, gt=0)
    """How often (in optimizer steps) the ranks agree on the host whether one was asked to stop (SIGTERM) and how long
    the streak of non-finite steps is: a host read waits for the device to finish, so it is not done every step. A
    non-finite step's update is still skipped on the device at once; a stop is acted on within this many steps, and
    logging, checkpoint and the last step always read."""
    grad_accum_steps: int = Field(1, gt=0)
    """Micro-steps whose gradients are summed into one optimizer step; the per-device batch is global_batch_size /
    (world size x grad_accum_steps)."""
    max_consecutive_nonfinite: int = Field(10, gt=0)
    """Stop after this many optimizer steps in a row skipped for a non-finite loss (checked every
    `sync_every_steps`)."""
    spike_factor: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    """Loss-spike recovery (docs/numerical_faults.md): when a step's loss (mean over the ranks) or global gradient
    norm exceeds this many times its median over the previous `spike_window` steps, every rank rolls back to the
    last good checkpoint and trains on with the data after the spike. 0 (the default) turns it off: a factor too
    close to the run's normal fluctuation would roll a healthy run back; 10 suits a long run. Checked at the read
    steps (`sync_every_steps`)."""
    spike_window: int = Field(50, ge=2)
    """The steps whose median a loss or gradient norm is compared with; the first ones of a run judge nothing."""
    max_rollbacks: int = Field(3, ge=0)
    """Stop (exit code 3, one line) at a spike after this many rollbacks."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when torch sees a GPU, else the CPU, but refused on a node whose GPUs torch cannot use
    (core/launch/gpus.py); cpu: the CPU even on a GPU node."""
    attention: Literal["auto", "sdpa", "math"] = "auto"
    """sdpa: torch's fused scaled_dot_product_attention; math: timm's explicit matmul-softmax attention; auto: sdpa
    on CUDA, math on CPU, where torch's fused kernel is slower in bf16."""
    fp16_initial_scale_power: int = Field(16, ge=0, le=32)
    """`precision: fp16`: the dynamic loss scale starts at 2^this (DeepSpeed's initial_scale_power); unused
    otherwise."""
    offload_optimizer: Literal["none", "cpu"] = "none"
    """ZeRO-1/2/3: keep the fp32 master weights and AdamW moments in host memory and step them there."""
    offload_param: Literal["none", "cpu"] = "none"
    """ZeRO-3: keep the parameter partitions in host memory between uses."""
    activation_checkpointing: bool = False
    """Recompute every encoder block's activations (and MAE's decoder blocks') in the backward pass instead of
    storing them."""
    peak_tflops: float | None = Field(None, gt=0)
    """Peak TFLOP/s of one device, the denominator of `perf/mfu`. None: on a GPU its datasheet bf16 dense peak
    (H100, H200, A100, A10, L4, V100; see core/engine/utilisation.py; fp32 runs are measured against it too; an
    unknown GPU logs no mfu), on CPU a matmul in the run's precision, measured by the first launch on the machine and
    cached (docs/tensorboard.md)."""

    compile: bool | Literal["auto"] = "auto"
    """Compile the training step with torch.compile (inductor; core/engine/compiled.py): fused elementwise kernels
    and fewer launches. auto: on CUDA (but at ZeRO-3), not on a CPU, where the quickstart's steps gained at most 9%
    and the compile cost more than that saved (docs/speed.md). The first step pays the compile (reported in the
    launch log, kept out of perf/images_per_sec and perf/mfu); inductor's cache on disk (~/.cache/mimpipe/inductor)
    turns a relaunch's compile into seconds. Not with ZeRO-3."""
    compile_scope: Literal["objective", "blocks"] = "objective"
    """objective: the objective's whole step at the training micro-batch in one graph (masking, encoder, decoder,
    loss), and the blocks at the evaluation batch sizes; blocks: each transformer block on its own, what lies between
    them eager."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    """torch.compile's mode: reduce-overhead also replays the compiled graphs as CUDA graphs (one launch for a
    graph's kernels); max-autotune searches matmul kernels (minutes of compile)."""

    # Optional DeepSpeed patches (docs/deepspeed_patches.md): off by default, since what they save at the recipes'
    # scale is small, but for the single-rank all-reduce, which a one-GPU run pays on every step; each is skipped with
    # a warning on a DeepSpeed release it was not checked against.
    share_zero3_masters: bool = False
    """ZeRO-3, memory: step the fp32 parameter partitions themselves instead of DeepSpeed's second fp32 copy (ds_compat
    patch fp32_master_shared; 4 bytes per parameter per rank; not with offload_optimizer)."""
    share_zero12_masters: bool = False
    """ZeRO-1/2, memory: step each rank's partition of the fp32 parameters itself instead of DeepSpeed's fp32 master
    copy, freed after it is built (ds_compat patch zero12_master_shared; 4 bytes per parameter per rank and a copy per
    step; fp32 and bf16 without offload_optimizer)."""
    skip_identity_grad_passes: bool = False
    """ZeRO-3, speed: drop DeepSpeed's global gradient norm and unscale from the step when they change nothing
    (optim.grad_clip 0, no fp16 loss scaling) (ds_compat patch skip_identity_grad_passes)."""
    skip_single_rank_allreduce: bool = True
    """Speed, on by default: at ZeRO-0 on a run of one rank, drop the gradient all-reduce of the backward pass, an
    identity there (three passes over the gradients and a collective per step; ds_compat patch
    single_rank_no_allreduce). Other stages and world sizes keep DeepSpeed's reduction, which also fills their
    partitions."""

    @model_validator(mode="after")
    def _check_offload(self) -> EngineConfig:
        if self.compile is True and self.zero_stage == 3:
            raise ValueError(ZERO3_COMPILE_REASON)
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise ValueError("engine.offload_optimizer needs engine.zero_stage 1, 2 or 3")
        if self.offload_param != "none" and self.zero_stage != 3:
            raise ValueError("engine.offload_param needs engine.zero_stage 3")
        for name, stages in _PATCH_STAGES.items():
            if getattr(self, name) and self.zero_stage not in stages:
                raise ValueError(f"engine.{name} needs engine.zero_stage {' or '.join(map(str, stages))}")
        return self


class CheckpointConfig(Section):
    every_steps: int = Field(1000, gt=0)
    """Save a checkpoint in run_dir/checkpoints every N optimizer steps, and at the last step."""
    keep_last: int = Field(2, gt=0)
    """Complete checkpoints kept on disk; older ones are deleted after a newer one is saved."""
    export_at_end: bool = True
    """At the end of the run, write the trained model to run_dir/export (timm layout, ready for fine-tuning or
    timm.create_model); false: checkpoints only."""
    lease_timeout_s: float = Field(300.0, gt=0, allow_inf_nan=False)
    """How long a launch whose heartbeat stopped keeps run_dir: rank 0 holds run_dir/lease.json and renews it every
    fifth of this (at most every 10 s); another launch into run_dir is refused while the lease is live, and takes it
    over once it is this old, or at once when its process is seen gone on the same host (docs/run_dir.md)."""


WANDB_INSTALL = "pip install 'mimpipe[wandb]'"
"""How to get the optional wandb dependency (pyproject's `wandb` extra)."""


def wandb_installed() -> bool:
    """Whether wandb can be imported, found without importing it (an import takes seconds)."""
    try:
        return importlib.util.find_spec("wandb") is not None
    except ValueError:  # sys.modules["wandb"] is None: imports of it are blocked
        return False


class WandbConfig(Section):
    """Weights & Biases beside TensorBoard (rank 0; the same scalars, images and histograms; docs/logging.md)."""

    enabled: bool = False
    """Also log to Weights & Biases (needs `pip install 'mimpipe[wandb]'`)."""
    mode: Literal["offline", "online"] = "offline"
    """offline: files under `dir` only, uploaded later with `wandb sync`; online: streamed to the W&B server (needs
    `wandb login` or WANDB_API_KEY)."""
    project: str = "mimpipe"
    """The W&B project the run belongs to."""
    entity: str | None = None
    """The W&B user or team; None: the logged-in user's default."""
    name: str | None = None
    """The run's display name; None: the run_dir's folder name."""
    dir: str | None = None
    """Where W&B writes its `wandb/` folder; None: the run_dir (the run's id is kept there)."""


class LoggingConfig(Section):
    every_steps: int = Field(10, gt=0)
    """Log the scalars (console, metrics.jsonl, TensorBoard) every N optimizer steps, and at the last step; each log
    waits for the device."""
    image_every_steps: int = Field(500, ge=0)
    """Reconstruction grids from a fixed batch every N steps (0 = off)."""
    tensorboard: bool = True
    """Also write TensorBoard events to run_dir/tb; metrics.jsonl and the console are written either way."""
    wandb: WandbConfig = WandbConfig()
    """Weights & Biases beside TensorBoard (off by default; docs/logging.md)."""


class EvalConfig(Section):
    every_steps: int = Field(0, ge=0)
    """Fine-tuning: evaluate on data.val every N steps (0 = at the end only)."""
    per_class: bool = True
    """At the end: per-class accuracy table (console, TensorBoard text) and confusion matrix (TensorBoard image)."""
    knn: KNNConfig = KNNConfig()
    """Pretraining: the kNN monitor (knn.every_steps says how often it runs)."""
    features: FeatureMonitorConfig = FeatureMonitorConfig()
    """Pretraining: the label-free monitor (features.every_steps says how often it runs)."""


class Config(Section):
    stage: Literal["pretrain", "finetune", "tokenizer"] = "pretrain"
    """What the recipe trains: pretrain (an encoder with objective mae, beit or simmim), finetune (classification from
    model.init or scratch), tokenizer (the VQ-VAE that BEiT's tokenizer target reads)."""
    run_dir: str = "runs/default"
    """The run's folder: config, logs, checkpoints, export. Relaunching into it resumes the run (docs/run_dir.md)."""
    seed: int = 0
    """Seed of the model init, the data order and the masks; each rank adds its rank for its own random draws."""
    model: ModelConfig = ModelConfig()
    """The backbone: architecture, size, image and patch size, and fine-tuning's init and head."""
    data: DataConfig = DataConfig()
    """Training and evaluation shards, batch size, loading and preprocessing."""
    objective: Objective = MAEObjective()
    """What is trained, chosen by `kind`; without a kind: the stage's first (mae, classification, vqvae)."""
    optim: OptimConfig = OptimConfig()
    """Optimizer, learning rate and weight decay."""
    schedule: ScheduleConfig = ScheduleConfig(steps=1000)
    """Training length and lr warmup (steps or epochs)."""
    engine: EngineConfig = EngineConfig()
    """DeepSpeed (ZeRO stage, precision, offload), device and numerical-fault handling."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """How often checkpoints are saved, how many are kept, the export at the end, and the run_dir's lease."""
    logging: LoggingConfig = LoggingConfig()
    """How often scalars and pictures are logged."""
    eval: EvalConfig = EvalConfig()
    """Evaluation: fine-tuning's held-out accuracy, pretraining's kNN monitor."""
    augment: AugmentConfig = AugmentConfig()
    """Fine-tuning augmentation and regularisation on the training stream."""
    distill: DistillConfig = DistillConfig()
    """DeiT distillation from a frozen teacher (fine-tuning)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        allowed = OBJECTIVES_BY_STAGE[self.stage]
        if self.objective.kind not in allowed:
            raise ValueError(f"objective.kind {self.objective.kind!r} does not fit stage {self.stage!r} ({allowed})")
        if self.distill.kind != "none" and self.model.global_pool == "avg":
            raise ValueError("distill needs model.global_pool token (the class and distillation tokens are the heads')")
        if self.optim.ema_decay and self.engine.zero_stage == 3:
            raise ValueError(
                "optim.ema_decay does not work with engine.zero_stage 3 (the average would be partitioned)"
            )
        check_arch(
            self.model,
            self.objective,
            activation_checkpointing=self.engine.activation_checkpointing,
            distill=self.distill.kind,
        )
        if self.logging.wandb.enabled and not wandb_installed():
            raise ValueError(f"logging.wandb.enabled needs wandb, which is not installed: {WANDB_INSTALL}")
        if isinstance(self.objective, BEiTObjective):
            num_patches = math.prod(self.model.grid)
            budget = self.objective.mask.budget(num_patches)
            if not 0 < budget < num_patches:
                raise ValueError(f"objective.mask masks {budget} of {num_patches} patches; need 1 to {num_patches - 1}")
            if self.data.decode == "device" and self.objective.target.kind == "tokenizer":
                raise ValueError(
                    "data.decode device does not fit objective.target.kind tokenizer: its second view (the "
                    "tokenizer's, Lanczos) is rendered in the data workers only; use data.decode worker"
                )
        if isinstance(self.objective, Data2Vec2Objective):
            self._check_teacher_targets()
        if isinstance(self.objective, IJEPAObjective):
            self._check_ijepa()
        in_epochs = self.schedule.epochs is not None or self.schedule.warmup_epochs is not None
        if in_epochs and self.data.is_mixture and self.data.samples_per_epoch is None:
            raise ValueError(
                "a schedule in epochs with a mixture in data.train needs data.samples_per_epoch (a mixture has no "
                "epoch of its own; e.g. the sample count of its main source)"
            )
        if self.eval.knn.enabled:
            self._check_knn()
        if self.model.init and self.stage == "tokenizer":
            raise ValueError("model.init: the tokenizer stage trains a VQ-VAE from scratch; it reads no encoder")
        check_ignored(self, self.stage, self.objective.kind)
        if self.eval.features.enabled and self.stage != "pretrain":
            raise ValueError(f"eval.features needs stage pretrain, not {self.stage!r} (it watches an encoder train)")
        if isinstance(self.objective, SegmentationObjective):
            self._check_segmentation()
        if self.data.global_batch_size % self.engine.grad_accum_steps:
            raise ValueError(
                f"data.global_batch_size {self.data.global_batch_size} is not divisible by "
                f"engine.grad_accum_steps {self.engine.grad_accum_steps}"
            )
        return self

    def _check_ijepa(self) -> None:
        o, m = self.objective, self.model
        if m.class_token:
            raise ValueError("objective.kind ijepa needs model.class_token false (I-JEPA's encoders pool by average)")
        if o.predictor.embed_dim > m.vit_width:
            raise ValueError(
                f"objective.predictor.embed_dim {o.predictor.embed_dim} is wider than the encoder ({m.vit_width}); "
                "I-JEPA's predictor is a narrow ViT"
            )
        try:
            ijepa_masks(o, m.grid)
        except ValueError as err:
            raise ValueError(f"objective.{err}") from None
        self._check_ema_precision()

    def _check_ema_precision(self) -> None:
        if self.engine.precision == "fp16":
            raise ValueError(
                f"objective.kind {self.objective.kind} does not fit engine.precision fp16: DeepSpeed's fp16 mode casts "
                "the EMA teacher's weights to fp16, where a step of (1 - decay) x the distance is below the "
                "resolution; use bf16 or fp32"
            )

    def _check_teacher_targets(self) -> None:
        o, m = self.objective, self.model
        num_tokens = math.prod(m.grid)
        num_masked = num_tokens - int(num_tokens * (1 - o.mask_ratio))  # data/masking.py InverseBlockMaskGenerator
        if not 0 < num_masked < num_tokens:
            raise ValueError(
                f"objective.mask_ratio {o.mask_ratio} masks {num_masked} of {num_tokens} tokens; need 1 to "
                f"{num_tokens - 1} (at least one visible token per copy)"
            )
        if o.mask_block > min(m.grid):
            raise ValueError(f"objective.mask_block {o.mask_block} is larger than the token grid {m.grid}")
        if o.top_k_blocks > m.vit_depth:
            raise ValueError(f"objective.top_k_blocks {o.top_k_blocks} is above the encoder's depth {m.vit_depth}")
        self._check_ema_precision()

    def _check_segmentation(self) -> None:
        """What segmentation does not do: classification's mixing, erasing, policies, distillation and EMA."""
        if self.model.arch not in SEGMENTATION_ARCHS:
            raise ValueError(
                f"objective segmentation needs model.arch in {tuple(SEGMENTATION_ARCHS)}, not {self.model.arch!r}"
            )
        if self.model.arch == "resnet" and self.engine.zero_stage == 3:
            raise ValueError(
                "model.arch resnet needs engine.zero_stage 0-2: timm's ResNet initialises its layers after building "
                "them, which a ZeRO-3 build (parameters partitioned as each layer is made) would skip"
            )
        heads = SEGMENTATION_ARCHS[self.model.arch]
        if self.objective.head not in heads:
            raise ValueError(
                f"objective.head {self.objective.head} does not fit model.arch {self.model.arch}: one of {heads}"
            )
        a = self.augment
        unused = {
            "augment.mixup": a.mixup, "augment.cutmix": a.cutmix, "augment.re_prob": a.re_prob,
            "augment.auto_augment": a.auto_augment, "optim.ema_decay": self.optim.ema_decay,
        }  # fmt: skip
        for key, value in unused.items():
            if value:
                raise ValueError(f"{key} is {value!r}: segmentation does not use it (set it to 0 or null)")
        if self.distill.kind != "none":
            raise ValueError("distill is classification's: objective segmentation needs distill.kind none")
        if self.objective.eval_stride is not None and self.objective.eval_mode != "slide":
            raise ValueError("objective.eval_stride needs objective.eval_mode slide")

    def _check_knn(self) -> None:
        knn = self.eval.knn
        if self.stage != "pretrain":
            raise ValueError(
                f"eval.knn needs stage pretrain, not {self.stage!r} (fine-tuning evaluates on data.val; the tokenizer "
                "has no ViT encoder whose features a k-NN could classify)"
            )
        if knn.bank.shards is None and self.data.is_mixture:
            raise ValueError("eval.knn.bank.shards must be set when data.train is a mixture (which source to embed?)")
        if knn.bank.shards is None and not self.data.train:
            raise ValueError("eval.knn.bank.shards is not set and neither is data.train")
        if knn.query.shards is None and self.data.val is None:
            raise ValueError("eval.knn.query.shards is not set and neither is data.val (the labelled queries)")
        if knn.bank.max_samples is not None and knn.k > knn.bank.max_samples:
            raise ValueError(
                f"eval.knn.k {knn.k} is larger than eval.knn.bank.max_samples {knn.bank.max_samples} (the bank must "
                "hold at least k neighbours)"
            )

    @property
    def eval_every_steps(self) -> int:
        """How often the loop evaluates (besides the last step): when pretraining, often enough for each monitor that
        is on (the greatest common divisor of `eval.knn.every_steps` and `eval.features.every_steps`; each runs at its
        own multiples), else `eval.every_steps` (0: only at the last step)."""
        if self.stage != "pretrain":
            return self.eval.every_steps
        monitors = [m.every_steps for m in (self.eval.knn, self.eval.features) if m.enabled]
        return math.gcd(*monitors) if monitors else self.eval.knn.every_steps

    def batch_size_per_device(self, world_size: int) -> int:
        """Per-device micro-batch; raises ConfigError naming the key when the global batch does not split."""
        denom = world_size * self.engine.grad_accum_steps
        if self.data.global_batch_size % denom:
            raise ConfigError(
                f"data.global_batch_size {self.data.global_batch_size} is not divisible by world size {world_size} "
                f"x engine.grad_accum_steps {self.engine.grad_accum_steps}"
            )
        return self.data.global_batch_size // denom

    @property
    def peak_lr(self) -> float:
        """The one place the real learning rate is derived from `optim.base_lr`."""
        if self.optim.lr_rule == "absolute":
            return self.optim.base_lr
        return self.optim.base_lr * self.data.global_batch_size / self.optim.lr_base_batch

    def steps(self, samples_per_epoch: int | None) -> tuple[int, int]:
        """(total_steps, warmup_steps), converting epochs once with the samples in an epoch."""
        s = self.schedule
        needs_epochs = s.epochs is not None or s.warmup_epochs is not None
        if needs_epochs and not samples_per_epoch:
            raise ConfigError(
                "schedule in epochs needs data.samples_per_epoch or an index.json beside the shards "
                "(write one with `python -m data index SPEC`)"
            )
        per_epoch = (samples_per_epoch or 1) / self.data.global_batch_size
        total = s.steps if s.steps is not None else max(1, math.ceil(s.epochs * per_epoch))
        warmup = s.warmup_steps if s.warmup_steps is not None else math.ceil((s.warmup_epochs or 0) * per_epoch)
        return total, min(warmup, total)


def load_config(recipe: str | Path | None, overrides: list[str] = ()) -> Config:
    """Load defaults < recipe (with its optional single `base:` parent) < dotted overrides.

    Args:
        recipe: YAML recipe path, or None for the defaults alone.
        overrides: `section.key=value` strings; values are parsed as YAML.
    """
    tree = recipe_tree(recipe, overrides)
    objective = tree.setdefault("objective", {})
    if isinstance(objective, dict) and "kind" not in objective:
        objective["kind"] = OBJECTIVES_BY_STAGE.get(tree.get("stage", "pretrain"), ("mae",))[0]
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise explain(err, "defaults" if recipe is None else str(Path(recipe)), Config) from None


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (what goes to run_dir/config.yaml and into checkpoints)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def ijepa_masks(objective: IJEPAObjective, grid: tuple[int, int]):
    """I-JEPA's per-batch mask sampler for `grid` (data/multiblock.py `MultiBlockMasks`), from the recipe's objective.

    Raises:
        ValueError: Blocks that do not fit the grid, or a context that cannot keep `min_keep` tokens (naming the key).
    """
    # Imported here, for I-JEPA's recipes only: the sampler's module imports torch, which loading a recipe must not
    # (launch.sh's check runs before any process that needs torch: tests/unit/test_prestart.py).
    from data.multiblock import MultiBlockMasks

    return MultiBlockMasks(
        grid,
        num_targets=objective.num_targets,
        target_scale=objective.target_scale,
        target_aspect=objective.target_aspect,
        context_scale=objective.context_scale,
        min_keep=objective.min_keep,
    )
