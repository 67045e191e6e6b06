"""Plain functions both stage entry points share: starting a run (config, process group, run dir, resume point,
logger), the engine with its checkpoint restored, the training stream, the loop with its exit code, gathering a
module's full weights (ZeRO-3 included) and exporting them."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from core.config import Config, dump_config, load_config
from core.engine import preempt
from core.engine.checkpoint import RNGState, find_resume, load_checkpoint, load_states
from core.engine.distributed import DistInfo, init_distributed, shutdown
from core.engine.ds_compat import is_partitioned, partition_report
from core.engine.export import export_model
from core.engine.failure import log_tracebacks_to
from core.engine.fp16 import fp32_master_weights
from core.engine.loop import NonFiniteLossError, PreemptedError, TrainState, train
from core.engine.preempt import EXIT_PREEMPTED
from core.engine.setup import parallelize, resolve_attention
from core.engine.zero_init import init_partitioned_vit
from core.logging import MetricsLogger
from core.models import build_vit, vit_model_args
from core.sections import TrainSource
from data.pipeline import make_train_loader
from data.specs import dataset_size, describe_shards, train_sources

EXIT_NONFINITE = 3
"""Process exit code after `engine.max_consecutive_nonfinite` non-finite losses in a row (see `run_loop`)."""


@dataclass
class StageRun:
    """Everything a stage entry point holds between its sections."""

    cfg: Config
    recipe: str
    dist: DistInfo
    run_dir: Path
    config_yaml: str
    samples: int | None
    total_steps: int
    warmup_steps: int
    resume: dict | None
    state: TrainState
    logger: MetricsLogger


def start_stage(prog: str, argv: list[str] | None) -> StageRun:
    """Parse `RECIPE [overrides]`, load the config, join the process group, prepare run_dir, find the resume point.

    Resume order: this run_dir's `checkpoints/latest`, else from scratch (fine-tuning applies `model.init`
    first; a resumed checkpoint is loaded over it).
    """
    parser = argparse.ArgumentParser(prog=prog, description="Run a recipe: RECIPE [section.key=value ...]")
    parser.add_argument("recipe", help="YAML recipe")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.base_lr=1e-4")
    args = parser.parse_args(argv)
    cfg = load_config(args.recipe, args.overrides)
    log_tracebacks_to(cfg.run_dir)  # an error from here on leaves its traceback in run_dir/logs (see run_guarded)
    preempt.install()  # before the data stream forks its workers, which must outlive a SIGTERM (see preempt.py)
    dist = init_distributed(cfg.engine.device)
    run_dir, config_yaml = prepare_run_dir(cfg, dist)
    samples = cfg.data.samples_per_epoch or dataset_size(cfg.data.train)
    total_steps, warmup_steps = cfg.steps(samples)
    resume = find_resume(run_dir, dist.rank, dist.world_size)
    logger = MetricsLogger(run_dir, enabled=dist.is_main, tensorboard=cfg.logging.tensorboard, total_steps=total_steps)
    if resume is None:  # TensorBoard would keep a run's first hparams anyway; the resumed config is in config.yaml
        logger.hparams(cfg.model_dump(mode="json"))
    state = TrainState()
    load_states(resume, {"train": state})  # the data position is needed before the engine; the RNGs come after it
    return StageRun(
        cfg,
        args.recipe,
        dist,
        run_dir,
        config_yaml,
        samples,
        total_steps,
        warmup_steps,
        resume,
        state,
        logger,
    )


def start_engine(run: StageRun, objective: nn.Module | Callable[[], nn.Module]):
    """DeepSpeed engine for `objective` (built under the shared seed), the checkpoint restored; prints the plan.
    `objective` may be the function that builds it (see `parallelize`)."""
    cfg, dist = run.cfg, run.dist
    universal = run.resume is not None and run.resume["universal"]
    engine, optimizer = parallelize(objective, cfg=cfg, dist=dist, run_dir=run.run_dir, load_universal=universal)
    seed_everything(cfg.seed + dist.rank)  # per-rank randomness (masks, drop path) from here on
    run.logger.console(
        launch_plan(cfg, dist, total_steps=run.total_steps, warmup_steps=run.warmup_steps, samples=run.samples)
    )
    if is_partitioned(engine.module):
        run.logger.console(f"[mimpipe] ZeRO-3 partitioned parameters: {partition_report(engine.module)}")
    if run.resume is not None:
        load_checkpoint(engine, run_dir=run.run_dir, resume=run.resume, states={"rng": RNGState()})
        run.logger.console(
            f"[mimpipe] resumed from {run.run_dir / 'checkpoints' / run.resume['tag']} at step {run.state.step}"
        )
        if "from_world_size" in run.resume:
            run.logger.console(
                f"[mimpipe] world size changed from {run.resume['from_world_size']} to {dist.world_size}: model and "
                f"optimizer state loaded from {run.resume['load_tag']}; the data streams restart for the new ranks"
            )
    return engine, optimizer


def run_loop(
    run: StageRun,
    engine,
    optimizer,
    batches,
    *,
    evaluate: Callable | None = None,
    log_images: Callable | None = None,
    after_update: Callable | None = None,
) -> int:
    """The training loop; returns the process exit code.

    Returns:
        0 when every step ran; `EXIT_NONFINITE` (3) after too many non-finite losses in a row; `EXIT_PREEMPTED` (4)
        after a SIGTERM, once the checkpoint of the step reached is saved. On a non-zero code the logger is closed
        and the stage should return the code.
    """
    preempt.install()  # normally done by start_stage already; SIGTERM is only deferred while the loop runs
    try:
        train(
            cfg=run.cfg,
            engine=engine,
            optimizer=optimizer,
            batches=batches,
            dist=run.dist,
            state=run.state,
            total_steps=run.total_steps,
            warmup_steps=run.warmup_steps,
            logger=run.logger,
            run_dir=run.run_dir,
            config_yaml=run.config_yaml,
            evaluate=evaluate,
            log_images=log_images,
            after_update=after_update,
        )
    except (NonFiniteLossError, PreemptedError) as err:
        code = EXIT_PREEMPTED if isinstance(err, PreemptedError) else EXIT_NONFINITE
        run.logger.console(f"[mimpipe] {err} (exit code {code})")
        run.logger.close()  # TensorBoard keeps events in memory for up to two minutes
        return code
    finally:
        preempt.restore()
    return 0


def finish_stage(run: StageRun) -> None:
    run.logger.console(f"[mimpipe] TensorBoard: tensorboard --logdir {run.run_dir / 'tb'}")
    run.logger.close()
    shutdown()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def prepare_run_dir(cfg: Config, dist: DistInfo) -> tuple[Path, str]:
    """Create run_dir and write the resolved config to run_dir/config.yaml (rank 0)."""
    run_dir = Path(cfg.run_dir)
    config_yaml = dump_config(cfg)
    if dist.is_main:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_yaml)
    return run_dir, config_yaml


def launch_plan(cfg: Config, dist: DistInfo, *, total_steps: int, warmup_steps: int, samples: int | None) -> str:
    """What the run will do, printed once at launch: batch arithmetic, the lr actually used, a mixture's sources."""
    per_device = cfg.batch_size_per_device(dist.world_size)
    rule = (
        f"base_lr {cfg.optim.base_lr:g} x {cfg.data.global_batch_size} / {cfg.optim.lr_base_batch}"
        if cfg.optim.lr_rule == "scaled"
        else "absolute"
    )
    epochs = (
        f" (~{total_steps * cfg.data.global_batch_size / samples:.2f} epochs of {samples} samples)" if samples else ""
    )
    plan = (
        f"[mimpipe] stage {cfg.stage} | objective {cfg.objective.kind} | run_dir {cfg.run_dir}\n"
        f"[mimpipe] world size {dist.world_size} on {dist.device.type} | ZeRO-{cfg.engine.zero_stage} | "
        f"precision {cfg.engine.precision} | attention {resolve_attention(cfg.engine.attention, dist.device)}\n"
        f"[mimpipe] global batch {cfg.data.global_batch_size} = {per_device} per device x "
        f"{cfg.engine.grad_accum_steps} accumulation x {dist.world_size} ranks\n"
        f"[mimpipe] lr {cfg.peak_lr:.4g} ({rule}), min {cfg.optim.min_lr:g}, warmup {warmup_steps} of "
        f"{total_steps} steps{epochs}"
    )
    if cfg.data.is_mixture:
        plan += "\n" + mixture_plan(cfg.data.train, total_steps * cfg.data.global_batch_size)
    return plan


def mixture_plan(sources: list[TrainSource], num_samples: int) -> str:
    """One line per source of a mixture: its share of the `num_samples` the run draws and, where index.json gives
    its size, how many passes over it that makes."""
    total_weight = sum(source.weight for source in sources)
    lines = []
    for i, source in enumerate(sources):
        share = source.weight / total_weight
        size = dataset_size(source.shards)
        passes = f", ~{share * num_samples / size:.2f} passes over its {size} samples" if size else ""
        spec = describe_shards(source.shards) if isinstance(source.shards, list) else source.shards
        lines.append(f"[mimpipe] data.train[{i}] {spec}: weight {source.weight:g}, {share:.1%} of the samples{passes}")
    return "\n".join(lines)


def train_stream(cfg: Config, dist: DistInfo, transform, *, skip_batches: int, labels: bool):
    """The endless per-rank training stream, positioned after `skip_batches` micro-batches.

    `labels`: read each sample's class as `data.label_field` says (fine-tuning); False streams every sample with an
    image and labels it -1 (pretraining)."""
    return iter(
        make_train_loader(
            train_sources(cfg.data.train),
            transform=transform,
            batch_size=cfg.batch_size_per_device(dist.world_size),
            seed=cfg.seed,
            rank=dist.rank,
            world_size=dist.world_size,
            num_workers=cfg.data.num_workers,
            shuffle_buffer=cfg.data.shuffle_buffer,
            resampled=cfg.data.resampled,
            skip_batches=skip_batches,
            labels=labels,
            label_field=cfg.data.label_field,
            num_open_shards=cfg.data.num_open_shards,
        )
    )


def build_model(cfg: Config, num_classes: int = 0, *, plain: bool = False) -> nn.Module:
    """The timm ViT the recipe describes (DeiT's distilled variant when fine-tuning with `distill`, unless `plain`)."""
    m = cfg.model
    model = build_vit(
        m.size,
        img_size=m.img_size,
        patch_size=m.patch_size,
        num_classes=num_classes,
        global_pool="token" if m.global_pool == "auto" else m.global_pool,  # fine-tuning resolves auto first
        drop_path_rate=m.drop_path_rate,
        embed_dim=m.embed_dim,
        depth=m.depth,
        num_heads=m.num_heads,
        distilled=not plain and cfg.stage == "finetune" and cfg.distill.kind != "none",
        **({"init_values": m.layer_scale_init} if m.layer_scale_init is not None else {}),
    )
    if is_partitioned(model):  # built under deepspeed.zero.Init (ZeRO-3 pretraining)
        init_partitioned_vit(model)
    model.set_grad_checkpointing(cfg.engine.activation_checkpointing)
    return model


def gather_state_dict(engine, module: nn.Module, dist: DistInfo) -> dict[str, torch.Tensor] | None:
    """Full fp32 CPU copy of `module`'s weights on rank 0 (None elsewhere); all ranks must call it (ZeRO-3 gathers,
    and fp16 runs read the optimizer's fp32 master weights, see fp16.py)."""
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            state = _cpu_copy(module) if dist.is_main else None
    else:
        state = _cpu_copy(module) if dist.is_main else None
    if engine.fp16_enabled():
        masters = fp32_master_weights(engine, module)
        if state is not None:
            state.update(masters)
    return state


def _cpu_copy(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


def export_state_dict(cfg: Config, state_dict: dict, out_dir: Path, *, num_classes: int, manifest: dict) -> Path:
    """Rebuild the plain timm model on CPU, load `state_dict` strictly and export it (timm HF layout)."""
    model = build_model(cfg, num_classes=num_classes)
    model.load_state_dict(state_dict, strict=True)
    data_config = {
        "mean": cfg.data.mean,
        "std": cfg.data.std,
        "interpolation": "bicubic",
        "crop_pct": cfg.data.eval_crop_pct,
    }
    return export_model(model, out_dir, model_args=vit_model_args(model), manifest=manifest, data_config=data_config)
