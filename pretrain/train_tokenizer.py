"""The tokenizer stage (`stage: tokenizer`, run by `python -m pretrain`): train the VQ-VAE of pretrain/tokenizer.py on
the same shards with the same engine, log reconstructions and codebook usage (scalars, and a histogram and bar chart of
the codes of a fixed batch), export it for BEiT-style targets.

    ./launch.sh recipes/quickstart_tokenizer.yaml   ->   RUN_DIR/export/{tokenizer.safetensors, mimpipe.json}
"""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch

from core.engine.distributed import all_reduce
from core.engine.gather import gather_state_dict
from core.engine.loop import LoopHooks
from core.engine.precision import autocast_context
from core.engine.run import finish_stage, run_loop, seed_everything, start_engine
from core.engine.stage import StageRun
from core.engine.stream import fixed_batch, train_stream
from core.export.folder import atomic_folder, check_replaceable
from core.recipe.config import Config
from core.recipe.sections import VQVAEObjective
from data.transforms import eval_transform, pretrain_transform
from pretrain.pictures import code_usage, code_usage_picture
from pretrain.tokenizer import KIND, MANIFEST_NAME, VQVAE, WEIGHTS_NAME, tokenizer_grid

USAGE_BATCH_SIZE = 64  # images of the fixed batch whose codes are counted; the first 8 are drawn


def build_tokenizer(cfg: Config) -> VQVAE:
    o: VQVAEObjective = cfg.objective
    return VQVAE(
        img_size=o.img_size,
        downsample=o.downsample,
        codebook_size=o.codebook_size,
        code_dim=o.code_dim,
        hidden_dim=o.hidden_dim,
        commitment=o.commitment,
        ema_decay=o.ema_decay,
        dead_code_threshold=o.dead_code_threshold,
    )


def export_tokenizer(model: VQVAE, out_dir: str | Path, *, manifest: dict) -> Path:
    """Write `model` as a tokenizer folder `out_dir` (returned), atomically replacing an earlier export.

    The folder holds `tokenizer.safetensors` (the state dict; floating tensors as fp32, the update counter as int64)
    and `mimpipe.json` = {**manifest, "kind": "vqvae", "tokenizer": model.config, "vocab_size", "grid"}.

    Args:
        model: The trained tokenizer (any device).
        out_dir: Export folder; created, or replaced if it already holds a mimpipe export.
        manifest: JSON-serialisable facts about the run (step, recipe, data, mean/std, ...).

    Raises:
        ValueError: `out_dir` is a non-empty folder that is not a mimpipe export.
        TypeError: `manifest` is not JSON-serialisable.
    """
    out_dir = Path(out_dir)
    check_replaceable(out_dir)
    config, grid = model.config, list(model.grid)
    full_manifest = {**manifest, "kind": KIND, "tokenizer": config, "vocab_size": config["codebook_size"], "grid": grid}
    manifest_text = json.dumps(full_manifest, indent=2) + "\n"  # fails before anything is written
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}  # the counter stays int64
    with atomic_folder(out_dir) as tmp_dir:
        safetensors.torch.save_file(tensors, tmp_dir / WEIGHTS_NAME, metadata={"format": "pt"})
        (tmp_dir / MANIFEST_NAME).write_text(manifest_text)
    return out_dir


def train_tokenizer(run: StageRun) -> int:
    """Sections as in the other stages: data, model and engine, loop, export. Returns the exit code."""
    cfg, dist = run.cfg, run.dist
    img_size = cfg.objective.img_size

    # Data: MAE's crop-and-flip at the tokenizer's resolution
    d = cfg.data
    transform = pretrain_transform(img_size, d.mean, d.std, scale=d.crop_scale, decode=d.decode)
    batches = train_stream(run, transform, labels=False)

    # Model (same init on every rank). Its EMA codebook statistics are summed over ranks so every rank keeps the
    # same codebook: the one piece of distribution the tokenizer needs, applied here from outside.
    seed_everything(cfg.seed)
    tokenizer = build_tokenizer(cfg)
    tokenizer.quantizer.reduce = all_reduce
    engine, optimizer = start_engine(run, tokenizer)

    # Pictures of one fixed batch every logging.image_every_steps: reconstructions, and code usage
    log_images = None
    if cfg.logging.image_every_steps:
        fixed_tf = eval_transform(img_size, cfg.data.mean, cfg.data.std, crop_pct=1.0)
        fixed = fixed_batch(cfg, fixed_tf, dist.device, batch_size=USAGE_BATCH_SIZE)

        def log_images(step: int) -> None:
            with torch.no_grad(), autocast_context(cfg.engine.precision, dist.device):
                codes = engine.module.encode(fixed["image"])  # (B, h, w)
                recon = engine.module.decode_codes(codes)
            picture = tokenizer_grid(fixed["image"].float(), recon.float(), cfg.data.mean, cfg.data.std)
            run.logger.image("train/reconstruction", step, picture)
            counts = code_usage(codes, cfg.objective.codebook_size)
            run.logger.histogram_counts("train/code_usage", step, counts)
            run.logger.image("train/code_usage", step, code_usage_picture(counts))

    # Loop
    code = run_loop(run, engine, optimizer, batches, LoopHooks(log_images=log_images))
    if code:
        return code

    # Export (consolidated from any ZeRO stage)
    state_dict = gather_state_dict(engine, engine.module, dist)
    if dist.is_main and cfg.checkpoint.export_at_end:
        model = build_tokenizer(cfg)
        model.load_state_dict(state_dict, strict=True)
        manifest = {
            "method": "vqvae",
            "step": run.state.step,
            "source": run.recipe,
            "data": cfg.data.model_dump(mode="json")["train"],  # a mixture as plain mappings
            "mean": list(cfg.data.mean),
            "std": list(cfg.data.std),
        }
        out = export_tokenizer(model, run.run_dir / "export", manifest=manifest)
        run.logger.console(f"[mimpipe] tokenizer exported to {out} (objective.target.path for BEiT-style pretraining)")
    finish_stage(run)
    return 0
