"""The pretraining stage, as `python -m pretrain` runs it (pretrain/__main__.py): config, distributed init, data,
objective, engine, loop, export; or `export RUN_DIR`, or a BEiT tokenizer's training."""

from __future__ import annotations

import sys

from core.engine.gather import gather_state_dict
from core.engine.inspection_hook import both, inspection_hook
from core.engine.loop import LoopHooks
from core.engine.run import finish_stage, run_loop, seed_everything, start_engine, start_stage
from core.engine.stream import train_stream
from core.engine.teacher import has_teacher, teacher_hook
from core.export.folder import export_state_dict
from pretrain.export import exported_module, pretrain_manifest
from pretrain.export import main as export_main
from pretrain.feature_monitor import monitors
from pretrain.objectives import objective_builder, train_transform
from pretrain.pictures import picture_hook
from pretrain.train_tokenizer import train_tokenizer
from pretrain.warm_start import resolve_warm_start, warm_starter


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        return export_main(argv[1:])

    # Config (a warm start's architecture from model.init where the recipe leaves it out), distributed init, run dir,
    # resume point
    run = start_stage("python -m pretrain", argv, resolve=resolve_warm_start)
    cfg, dist = run.cfg, run.dist
    if cfg.stage == "tokenizer":
        return train_tokenizer(run)

    # Data: the endless training stream, positioned where the resumed run left it
    batches = train_stream(run, train_transform(cfg), labels=False)

    # Objective (same init on every rank; model.init warm-starts it) and engine
    seed_everything(cfg.seed)
    engine, optimizer = start_engine(run, objective_builder(cfg), after_build=warm_starter(run))

    # Pictures of the objective's output on one fixed batch with fixed masks, comparable across steps, and the ViT
    # paper's inspection of the encoder
    log_images = both(picture_hook(run, engine), inspection_hook(run, engine.module))

    # Loop, with the kNN monitor (eval.knn) and the label-free one (eval.features), each every its every_steps and
    # at the last step; an EMA teacher follows the student after every applied update
    hooks = LoopHooks(
        evaluate=monitors(run, engine),
        log_images=log_images,
        after_update=teacher_hook(engine) if has_teacher(engine.module) else None,
    )
    code = run_loop(run, engine, optimizer, batches, hooks)
    if code:
        return code

    # Export the encoder (consolidated from every ZeRO stage) in timm's layout.
    exported = exported_module(cfg, engine.module)
    state_dict = gather_state_dict(engine, getattr(exported, "encoder", exported), dist)  # the teacher's timm ViT
    if dist.is_main and cfg.checkpoint.export_at_end:
        manifest = pretrain_manifest(
            cfg, step=run.state.step, source=run.recipe, objective_keys=engine.module.state_dict()
        )
        out = export_state_dict(
            cfg, state_dict, run.run_dir / "export", num_classes=0, manifest=manifest, run_dir=run.run_dir
        )
        run.logger.console(
            f"[mimpipe] encoder exported to {out} (timm.create_model('local-dir:{out}', pretrained=True))"
        )
    finish_stage(run)
    return 0
