"""The fine-tuning stages' first step: `model.init` loaded into the freshly built model (core/export/handoff.py does
the loading, resizing and mapping), and its load report shown and kept."""

from __future__ import annotations

import json

from torch import nn

from core.engine.stage import StageRun
from core.export.handoff import load_encoder


def hand_off(model: nn.Module, run: StageRun) -> None:
    """Load `model.init` into `model`, when the recipe names one: the report goes to the console, TensorBoard's text
    and run_dir/load_report.json."""
    m = run.cfg.model
    if not m.init:
        return
    report = load_encoder(
        model, m.init, head_init=m.head_init, head_init_std=m.head_init_std, pos_embed_resize=m.pos_embed_resize,
        trust_checkpoint=m.trust_checkpoint,
    )  # fmt: skip
    run.logger.console(f"[mimpipe] hand-off from {m.init}\n{report.format()}")
    run.logger.text("finetune/load_report", 0, report.format())
    if run.dist.is_main:
        (run.run_dir / "load_report.json").write_text(json.dumps(report.as_dict(), indent=2))
