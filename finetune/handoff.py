"""The fine-tuning stages' first steps: the recipe completed from `model.init` (its architecture, normalisation and
pooling; core/export/architecture.py), then `model.init` loaded into the freshly built model (core/export/handoff.py
does the loading, resizing and mapping), and its load report shown and kept."""

from __future__ import annotations

import json

from torch import nn

from core.engine.stage import StageRun
from core.export.architecture import InitArchitecture, init_architecture, resolve_architecture
from core.export.handoff import load_encoder, resolve_global_pool
from core.recipe.config import Config


def resolve_init(cfg: Config) -> InitArchitecture | None:
    """Complete `cfg` in place from `model.init` before anything is built: the architecture keys and `data.mean/std`
    the recipe leaves out, then `model.global_pool: auto` from the checkpoint's pooling hint. Returns what was taken
    (None without `model.init`). launch.sh's pre-flight and the stage's start both run it.

    Raises:
        InitMismatch: A recipe key the checkpoint contradicts (one line naming the key and both values).
        ValueError: `model.init` cannot be read.
    """
    found = resolve_architecture(cfg)
    resolve_global_pool(cfg)
    return found


def hand_off(model: nn.Module, run: StageRun) -> None:
    """Load `model.init` into `model`, when the recipe names one: the report, with the keys the recipe took from the
    checkpoint, goes to the console, TensorBoard's text and run_dir/load_report.json."""
    m = run.cfg.model
    if not m.init:
        return
    report = load_encoder(
        model, m.init, head_init=m.head_init, head_init_std=m.head_init_std, pos_embed_resize=m.pos_embed_resize,
        trust_checkpoint=m.trust_checkpoint,
    )  # fmt: skip
    report.notes.insert(0, init_architecture(run.cfg).line())  # the same keys the start took (the recipe's are kept)
    run.logger.console(f"[mimpipe] hand-off from {m.init}\n{report.format()}")
    run.logger.text("finetune/load_report", 0, report.format())
    if run.dist.is_main:
        (run.run_dir / "load_report.json").write_text(json.dumps(report.as_dict(), indent=2))
