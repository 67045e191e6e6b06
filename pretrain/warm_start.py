"""Warm-started pretraining: `model.init` in a pretraining recipe continues from released or earlier weights.

The recipe is completed from the checkpoint first, as fine-tuning's is (core/export/architecture.py): the architecture
keys and normalisation it leaves out are the checkpoint's, and a key it contradicts is refused in one line. The encoder
is loaded by fine-tuning's hand-off (core/export/handoff.py: our export, an official MAE or DeiT
checkpoint, a timm state dict; the position embedding resized to the recipe's grid, the patch kernel to its patch
size), and every other tensor of the objective (MAE's decoder and mask token, a BEiT-style head, SimMIM's mask token
and head) is taken from the checkpoint when it holds one of that name and shape: the official MAE layout
(`models_mae.py`) uses our names, so its decoder comes along; a plain encoder leaves them fresh. The optimizer state is
fresh and the schedule's warmup applies. The console and run_dir/load_report.json list what was loaded, resized and
left fresh. A run that resumes from its own checkpoint loads it afterwards, which wins (run_dir, then init, then
scratch).

The start runs on the built objective before it goes into the engine (`parallelize`'s `after_build`), so the meta
build that sizes checkpoints never loads anything. Under ZeRO-3 the objective's parameters are partitioned by then:
every rank gathers them whole for the load (each rank holds the full fp32 objective for that moment) and rank 0's
values are partitioned back to every rank (zero_init.gathered), then the engine starts from them.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from torch import nn

from core.engine.zero_init import gathered
from core.export.architecture import InitArchitecture, init_architecture, resolve_architecture
from core.export.handoff import load_encoder
from core.export.read import read_checkpoint
from core.recipe.config import Config

ENCODER = "encoder."


def resolve_warm_start(cfg: Config) -> InitArchitecture | None:
    """`start_stage`'s `resolve` (pretrain/preflight.py runs the same resolution): the architecture keys and
    `data.mean/std` the recipe leaves out, from `model.init` (None without one).

    Raises:
        InitMismatch: A recipe key the checkpoint contradicts (one line naming the key and both values).
        ValueError: `model.init` cannot be read.
    """
    return resolve_architecture(cfg)


def warm_starter(run) -> Callable[[nn.Module], dict] | None:
    """`start_engine`'s `after_build` for a recipe that names `model.init` (else None): the warm start."""
    if not run.cfg.model.init:
        return None
    return lambda objective: warm_start(objective, run)


def warm_start(objective: nn.Module, run) -> dict:
    """Load `model.init` into `objective` (its `encoder` by the hand-off, the rest by name and shape), partitioned
    by ZeRO-3 or not; report it on the console and in run_dir/load_report.json. Returns the report as a dict.

    Raises:
        ValueError: As the hand-off does: an unreadable file, or an encoder of another architecture (naming the keys).
    """
    with gathered(list(objective.parameters())):
        return _load(objective, run)


def _load(objective: nn.Module, run) -> dict:
    m = run.cfg.model
    report = load_encoder(
        objective.encoder, m.init, head_init="keep", pos_embed_resize=m.pos_embed_resize,
        trust_checkpoint=m.trust_checkpoint,
    )  # fmt: skip
    state = read_checkpoint(m.init, trust=m.trust_checkpoint).state
    own = {k: v for k, v in objective.state_dict().items() if not k.startswith(ENCODER)}
    loaded = {k: state[k] for k, v in own.items() if k in state and tuple(state[k].shape) == tuple(v.shape)}
    mismatched = [f"{k}: checkpoint {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
                  if k in state and k not in loaded]  # fmt: skip
    with torch.no_grad():
        objective.load_state_dict(loaded, strict=False)
    fresh = [k for k in own if k not in loaded]
    report.dropped = [k for k in report.dropped if k not in loaded]  # the hand-off's leftovers the objective took
    report.notes.insert(0, init_architecture(run.cfg).line())  # the keys the start took from the checkpoint
    lines = [
        f"[mimpipe] warm start from {m.init} (optimizer state fresh, warmup applies)",
        report.format(),
        f"objective beside the encoder: {len(loaded)} tensors loaded, {len(fresh)} fresh"
        + (f" ({', '.join(mismatched[:4])})" if mismatched else ""),
    ]
    run.logger.console("\n".join(lines))
    result = {**report.as_dict(), "objective_loaded": sorted(loaded), "objective_fresh": fresh}
    if run.dist.is_main:
        (run.run_dir / "load_report.json").write_text(json.dumps(result, indent=2))
    return result
