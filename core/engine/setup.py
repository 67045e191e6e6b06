"""DeepSpeed set-up: the generated DeepSpeed JSON, the optimizer, and `parallelize`, the one keyword-only function
that applies distribution to an objective from outside."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from timm.layers import Attention
from timm.optim import Lars, param_groups_layer_decay, param_groups_weight_decay
from torch import nn

from core.compat import deepspeed as ds_compat
from core.compat import timm as timm_compat
from core.compat.deepspeed_muon import muon_kernels_uncompiled
from core.engine.compiled import (
    compile_batch_sizes,
    compile_blocks,
    compile_objective,
    compiles,
    use_compile_cache,
)
from core.engine.distributed import DistInfo, all_reduce
from core.engine.precision import resolve_precision
from core.engine.zero3_runtime import gather_per_block, use_linear32
from core.engine.zero_init import build_partitioned
from core.recipe.config import Config


class Guarded:
    """Mixin for a torch optimizer whose update can be vetoed, and which checks the gradients it is handed.

    DeepSpeed's ZeRO wrappers call the optimizer's `step` on their flat fp32 partitions (on the parameters themselves
    at ZeRO-0) with the reduced, unscaled gradients, ZeRO-1/2 once per parameter group and ZeRO-3 once per
    sub-group. The loop sets `skip` around one `engine.step()` (`guard`), so that it holds for every call inside it:
    - `skip`: after a non-finite loss on any rank, parameters, moments and step counts stay exactly as they were. A
      bool, or a 0-d float tensor on the device (1.0: skip) that a fused optimizer takes as its `found_inf`, the flag
      torch's GradScaler hands it: the kernel then leaves everything as it was without the host ever reading the flag.
      An unfused optimizer (SGD, LARS: the linear probes) reads it, one host sync per step.
    - every call also measures the squared L2 norm of the gradients it is handed (one foreach norm, on the device),
      summed over the ranks when each holds its own partition (`reduce_norm`: ZeRO-1/2/3 on several ranks; one
      all-reduce of one value per call), and adds it to `grad_sq_norm`. A non-finite norm (NaN or inf gradients
      under a finite loss) skips this call's update and every later call's of the same step on every rank, and sets
      `nonfinite`. A non-finite value that reaches only one parameter group leaves the groups stepped before it
      updated; one from backward reaches the first layer's weight and bias, which sit in every group's first call.
    """

    skip: bool | torch.Tensor = False
    reduce_norm: bool = False
    grad_sq_norm: torch.Tensor | None = None
    """The squared norm of the gradients of the step inside `guard` (global under `reduce_norm`); None before a call."""
    nonfinite: torch.Tensor | None = None
    """1.0 when some call of the step inside `guard` was handed non-finite gradients on some rank; None before a call
    (DeepSpeed skipped the step itself: an fp16 overflow, or a non-finite norm it computed to clip)."""

    def step(self, closure=None):
        if self.skip is True:  # known on the host (the guard around deepspeed.initialize): nothing to measure
            return None
        params = [p for group in self.param_groups for p in group["params"]]  # ZeRO-3: one group's sub-group filled
        grads = [p.grad for p in params if p.grad is not None]
        device = params[0].device
        sq_norm = torch.stack(torch._foreach_norm(grads)).square().sum() if grads else torch.zeros((), device=device)
        if self.reduce_norm:
            sq_norm = all_reduce(sq_norm.float())
        bad = (~torch.isfinite(sq_norm)).float()
        self.grad_sq_norm = sq_norm if self.grad_sq_norm is None else self.grad_sq_norm + sq_norm
        self.nonfinite = bad if self.nonfinite is None else torch.maximum(self.nonfinite, bad)
        skip = torch.maximum(self.nonfinite, torch.as_tensor(self.skip, dtype=torch.float32, device=device))
        if not self.defaults.get("fused"):
            return None if bool(skip) else super().step(closure)
        self.found_inf = skip  # read by torch's fused step as `getattr(self, "found_inf", None)`
        try:
            return super().step(closure)
        finally:
            del self.found_inf

    @contextlib.contextmanager
    def guard(self, *, skip: bool | torch.Tensor):
        """Apply `skip` to every optimizer call made inside the block (one engine step), and measure its gradients."""
        self.skip, self.grad_sq_norm, self.nonfinite = skip, None, None
        try:
            yield
        finally:
            self.skip = False


class GuardedAdamW(Guarded, torch.optim.AdamW):
    """AdamW (pretraining, fine-tuning) with the loop's guard."""


class GuardedSGD(Guarded, torch.optim.SGD):
    """SGD with momentum (linear probing) with the loop's guard."""


class GuardedLars(Guarded, Lars):
    """timm's LARS (MAE's linear probe) with the loop's guard."""


BF16_REDUCED_MODULES = ("torch.nn.Linear", "torch.nn.Conv1d", "torch.nn.Conv2d", "torch.nn.Conv3d")
"""With `engine.grad_reduce_dtype: bf16`: the module classes (exact classes, as DeepSpeed matches them) whose weight
and bias gradients ZeRO-1/2/3 reduce in bf16. In a ViT they hold >99% of the parameters."""


def deepspeed_config(cfg: Config, world_size: int) -> dict:
    """Every DeepSpeed key that changes behaviour, written explicitly (DeepSpeed's defaults move between versions:
    e.g. `gradient_clipping` defaults to 1.0, which MAE does not use)."""
    e = cfg.engine
    assert e.precision != "auto", "engine.precision auto is resolved for the device first (resolve_precision)"
    bf16_reduce = e.grad_reduce_dtype == "bf16" and world_size > 1
    return {
        "train_batch_size": cfg.data.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.batch_size_per_device(world_size),
        "gradient_accumulation_steps": e.grad_accum_steps,
        "gradient_clipping": cfg.optim.grad_clip,
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer synchronises the device at every forward's start and every step's end (two host
        # waits per step on a GPU, each leaving it idle while the host queues the next kernels); the loop measures
        # throughput itself (perf/images_per_sec) without waiting.
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        # bf16 is torch autocast over fp32 weights and fp32 optimizer state, entered by the engine itself around its
        # forward (`torch_autocast`), so that it holds inside `engine(...)` on every accelerator. An autocast entered
        # around the engine instead is switched off inside it on CUDA. DeepSpeed's bf16 mode would make the weights
        # bf16 (and the fp32 masters a second copy).
        "bf16": {"enabled": False},
        "torch_autocast": {
            "enabled": e.precision == "bf16",
            "dtype": "bfloat16",
            # The modules whose parameters' gradients ZeRO-1/2/3 reduce in the autocast dtype (`grad_reduce_dtype`);
            # the other gradients (norms, position embeddings, tokens) are always reduced in fp32. One rank reduces
            # nothing, and a round trip through bf16 would only round its gradients.
            "lower_precision_safe_modules": list(BF16_REDUCED_MODULES) if bf16_reduce else [],
        },
        "fp16": {
            "enabled": e.precision == "fp16",
            "loss_scale": 0,
            "initial_scale_power": e.fp16_initial_scale_power,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "consecutive_hysteresis": False,
            "min_loss_scale": 1,
        },
        "zero_optimization": {
            "stage": e.zero_stage,
            # ZeRO-1/2 compute the global grad norm on every step only to clip or to log it (with a host sync); without
            # clipping the Guarded optimizer measures it on the device. fp16 keeps it for overflow checks.
            "compute_grad_norm": not (e.zero_stage in (1, 2) and cfg.optim.grad_clip == 0 and e.precision != "fp16"),
            "contiguous_gradients": True,
            # Reduce a gradient bucket while backward fills the next one (a second side stream on CUDA). DeepSpeed
            # synchronises the device before each bucket's reduction then: one rank has nothing to reduce or overlap.
            "overlap_comm": e.zero_stage in (1, 2) and world_size > 1,
            "reduce_scatter": True,
            # Buffer sizes in elements (fp32: 200 MB at 5e7). DeepSpeed's 5e8 defaults mean a 2 GB gradient bucket per
            # rank, more than ViT-L's whole gradient, and ZeRO-3 then keeps every gathered weight alive from forward
            # to backward (reuse distance 1e9). A smaller gradient bucket lowers ZeRO-3's peak memory without
            # slowing the step at ZeRO-2 or ZeRO-3.
            "reduce_bucket_size": 20_000_000,
            "allgather_partitions": True,
            "allgather_bucket_size": 50_000_000,
            "round_robin_gradients": False,
            "offload_optimizer": {"device": e.offload_optimizer, "pin_memory": False},
            "offload_param": {"device": e.offload_param, "pin_memory": False},
            "stage3_prefetch_bucket_size": 20_000_000,
            "stage3_param_persistence_threshold": 100_000,
            "stage3_max_live_parameters": 50_000_000,
            "stage3_max_reuse_distance": 50_000_000,
            # The optimizer steps ZeRO-3 partitions in groups of this many elements, each through one fp32 gradient
            # buffer of that size (DeepSpeed's 1e9 default makes it as big as ViT-L's whole partition).
            "sub_group_size": 10_000_000,
            # DeepSpeed's replacement for F.linear, patched into torch for the whole process; at ZeRO-3 `parallelize`
            # installs Linear32 (zero3_runtime.py) on the objective's layers instead.
            "memory_efficient_linear": False,
            # Inside zero.Init, `Module.apply` gathers each module's weights: the objectives initialise through it.
            "override_module_apply": True,
            "stage3_gather_16bit_weights_on_model_save": False,
        },
        "activation_checkpointing": {"partition_activations": False, "contiguous_memory_optimization": False},
    }


def build_optimizer(objective: nn.Module, cfg: Config, layout: nn.Module | None = None) -> Guarded:
    """AdamW with no weight decay on biases, norm weights and the objective's `no_weight_decay()` names; with
    `optim.layer_decay` < 1, groups carry an `lr_scale` per depth from the objective's timm `group_matcher`.

    `layout`: a meta-device twin of a ZeRO-3 partitioned `objective` (see zero_init.py); the groups are made from its
    parameter shapes and names, then filled with the objective's parameters of the same names.
    """
    source = objective if layout is None else layout
    skip = source.no_weight_decay() if hasattr(source, "no_weight_decay") else set()
    o = cfg.optim
    if o.layer_decay < 1.0:
        if not hasattr(source, "group_matcher"):
            raise ValueError(f"optim.layer_decay needs an objective with a group_matcher; {type(source).__name__}")
        groups = param_groups_layer_decay(
            source, weight_decay=o.weight_decay, no_weight_decay_list=skip, layer_decay=o.layer_decay
        )
    else:
        groups = param_groups_weight_decay(source, weight_decay=o.weight_decay, no_weight_decay_list=skip)
    groups = [g for g in groups if any(p.requires_grad for p in g["params"])]  # a frozen encoder (linear probe)
    for group in groups:  # the loop sets each step's decay (optim.weight_decay_end) where the group has one
        group["wd_scale"] = 1.0 if group["weight_decay"] else 0.0
    if layout is not None:
        name_of = {id(p): name for name, p in layout.named_parameters()}
        params = dict(objective.named_parameters())
        for group in groups:
            group["params"] = [params[name_of[id(p)]] for p in group["params"]]
    if o.kind == "sgd":
        return GuardedSGD(groups, lr=cfg.peak_lr, momentum=o.momentum)
    if o.kind == "lars":
        return GuardedLars(groups, lr=cfg.peak_lr, momentum=o.momentum)
    # The fused kernel updates in one pass with no temporaries; the default CPU path allocates several
    # parameter-sized buffers per step, which costs more than the arithmetic on big flat ZeRO partitions.
    return GuardedAdamW(groups, lr=cfg.peak_lr, betas=o.betas, eps=o.eps, fused=True)


def set_tf32(device: torch.device, enabled: bool) -> None:
    """`engine.tf32` on CUDA: fp32 matmuls and cuDNN convolutions on TF32 tensor cores (torch leaves matmuls in full
    fp32 by default, cuDNN's convolutions already in TF32). Nothing changes on other devices."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def set_attention(module: nn.Module, kind: str, device: torch.device) -> str:
    """Pick the attention kernel of every timm `Attention` in `module` (`engine.attention`); returns the choice.

    On CPU, torch's fused scaled_dot_product_attention is slower in bf16 than timm's explicit matmul-softmax
    path at ViT shapes (its backward especially; see benchmarks/), so `auto` takes the explicit path there.
    """
    choice = resolve_attention(kind, device)
    for sub in module.modules():
        if isinstance(sub, Attention):
            sub.fused_attn = choice == "sdpa"
    return choice


def resolve_attention(kind: str, device: torch.device) -> str:
    """`engine.attention` made concrete for `device`: "sdpa" or "math"."""
    return "sdpa" if kind == "sdpa" or (kind == "auto" and device.type == "cuda") else "math"


def parallelize(
    objective: nn.Module | Callable[[], nn.Module],
    *,
    cfg: Config,
    dist: DistInfo,
    run_dir: Path,
    load_universal: bool = False,
    after_build: Callable[[nn.Module], object] | None = None,
):
    """Wrap `objective` in a DeepSpeed engine on `dist.device`; writes `run_dir/deepspeed.json` on rank 0.

    `objective` may be a function that builds it: under ZeRO-3 it is then built inside deepspeed.zero.Init, so no
    rank ever holds all of its fp32 weights (see zero_init.py); at other stages it is simply called.
    `load_universal`: the checkpoint to resume is a DeepSpeed universal checkpoint (a world-size change).
    `after_build`: called with the built objective before it moves to the device or into the engine (a warm start;
    under ZeRO-3 its parameters are partitioned then, see zero_init.gathered).
    `cfg.engine.precision: auto` is made concrete for `dist.device` in place, where the caller has not done it
    (`start_stage` has, to log why).

    Returns:
        (engine, optimizer): the DeepSpeed engine and the Guarded optimizer it steps.
    """
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    resolve_precision(cfg, dist.device)
    ds_compat.check(*ds_compat.needed(cfg.engine.zero_stage, cfg.engine.precision))  # a changed internal stops here
    timm_compat.check()  # likewise timm's (core/compat/webdataset.py checks webdataset's when the pipeline is imported)
    if cfg.engine.precision == "fp16" and not get_accelerator().is_fp16_supported():
        raise ValueError(
            f"engine.precision fp16: DeepSpeed's {get_accelerator().device_name()} accelerator has no fp16 on this "
            f"machine (on CPU it needs AVX512-FP16); use engine.precision=bf16"
        )
    set_tf32(dist.device, cfg.engine.tf32)
    ds_config = deepspeed_config(cfg, dist.world_size)
    ds_config["checkpoint"] = {"load_universal": load_universal}
    if dist.is_main:
        (run_dir / "deepspeed.json").write_text(json.dumps(ds_config, indent=2))
    layout = None
    if not isinstance(objective, nn.Module):
        if cfg.engine.zero_stage == 3:
            objective, layout = build_partitioned(objective, ds_config)
        else:
            objective = objective()
    if after_build is not None:
        after_build(objective)
    if layout is None:
        objective.to(dist.device)  # zero.Init placed the partitions on the device already
    set_attention(objective, cfg.engine.attention, dist.device)
    if compiles(cfg, dist.device):
        use_compile_cache()
        compile_blocks(objective, compile_batch_sizes(cfg, dist.world_size), mode=cfg.engine.compile_mode)
        if cfg.engine.compile_scope == "objective":
            compile_objective(objective, cfg.batch_size_per_device(dist.world_size), mode=cfg.engine.compile_mode)
    optimizer = build_optimizer(objective, cfg, layout)
    if cfg.engine.zero_stage == 3:
        gather_per_block(objective)
        use_linear32(objective)
    # skip: DeepSpeed's ZeRO-0 fp16 optimizer steps once on zero gradients to create the optimizer state, which would
    # apply one weight decay to the fp32 weights (not to their fp16 copy) and count one Adam step; torch optimizers
    # create their state on their first real step anyway.
    patches = {name for name, setting in ds_compat.SETTINGS.items() if getattr(cfg.engine, setting)}
    patches = {name for name in patches if ds_compat.applies(name)}  # each skipped with a warning if unchecked
    shared = ds_compat.fp32_master_shared() if "fp32_master_shared" in patches else contextlib.nullcontext()
    with shared, optimizer.guard(skip=True), muon_kernels_uncompiled():
        engine, *_ = deepspeed.initialize(model=objective, optimizer=optimizer, config=ds_config)
    if "skip_identity_grad_passes" in patches:
        ds_compat.skip_identity_grad_passes(engine.optimizer)
    if "zero12_master_shared" in patches:
        ds_compat.share_zero12_masters(engine.optimizer)
    if "single_rank_no_allreduce" in patches:
        ds_compat.skip_single_rank_allreduce(engine)
    optimizer.reduce_norm = cfg.engine.zero_stage > 0 and dist.world_size > 1  # each rank steps its own partition
    return engine, optimizer
