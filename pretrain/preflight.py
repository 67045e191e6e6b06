"""Pretraining's launch-time check (run by core/preflight.py before any process starts): a BEiT-style tokenizer
target loads and its code grid is the encoder's patch grid. A tokenizer export is small (a VQ-VAE of a few MB), so
it is loaded in full, exactly as the ranks will."""

from __future__ import annotations

from core.config import Config
from core.preflight import Findings
from core.sections import BEiTObjective


def check(cfg: Config, findings: Findings) -> None:
    o = cfg.objective
    if not (isinstance(o, BEiTObjective) and o.target.kind == "tokenizer"):
        return
    # Imported only for the recipes that need them: they pull in timm and torchvision, which would delay every launch.
    import safetensors

    from pretrain.targets import TokenizerCodes
    from pretrain.tokenizer import load_tokenizer

    try:
        target = TokenizerCodes(load_tokenizer(o.target.path), cfg.model.grid)
    except (ValueError, OSError, KeyError, TypeError, RuntimeError, safetensors.SafetensorError) as err:
        # a missing or foreign manifest, missing or mismatched weights, another grid
        message = str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"
        findings.fail("objective.target.path", message, file=o.target.path)
        return
    findings.ok(f"objective.target.path: tokenizer of {target.num_classes} codes")
