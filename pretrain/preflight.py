"""Pretraining's launch-time checks (run by core/launch/preflight.py before any process starts): a BEiT-style tokenizer
target loads and its code grid is the encoder's patch grid (a tokenizer export is small, a VQ-VAE of a few MB, so it
is loaded in full, exactly as the ranks will); a warm start's `model.init: hf-hub:ORG/NAME` is in the Hub cache (or,
online, downloaded into it now, once, for the ranks to read), and a warm start's `model.init` completes the recipe as
the stage's start will (core/export/architecture.py: a key it contradicts is one line); the kNN monitor's bank and
queries have images and labels, and a shard for every rank."""

from __future__ import annotations

from core.launch.preflight import Findings, check_split
from core.recipe.config import Config
from core.recipe.sections import BEiTObjective


def check(cfg: Config, findings: Findings, world_size: int) -> None:
    """The tokenizer target, and the kNN monitor's sets: images with labels, a shard for each of `world_size` ranks."""
    check_tokenizer(cfg, findings)
    check_hub_init(cfg, findings)
    check_warm_start(cfg, findings)
    knn = cfg.eval.knn
    if not knn.enabled:
        return
    sets = (
        ("bank", knn.bank.shards, "data.train", cfg.data.train),
        ("query", knn.query.shards, "data.val", cfg.data.val),
    )
    for name, spec, default_key, default in sets:  # the monitor reads labels, also in pretraining
        key = f"eval.knn.{name}.shards" + ("" if spec else f" ({default_key})")
        check_split(key, spec or default, cfg.data.label_field, True, findings, num_ranks=world_size)


def resolve(cfg: Config) -> None:
    """Complete `cfg` as the entry point does before it compares it with a checkpoint's: a warm start's architecture
    from `model.init` where the recipe leaves it out."""
    if cfg.model.init:
        from core.export.architecture import resolve_architecture  # timm: only for a warm start

        resolve_architecture(cfg)  # what pretrain/warm_start.py `resolve_warm_start` does at the stage's start


def check_warm_start(cfg: Config, findings: Findings) -> None:
    """A warm start's `model.init` opens and completes the recipe (in `cfg`, as the stage's start will); the plan
    says which keys came from it, and a recipe key it contradicts is one line naming the key and both values."""
    if not cfg.model.init or any(p.key == "model.init" for p in findings.problems):  # a Hub repo not cached: said
        return
    from core.export.architecture import InitMismatch, resolve_architecture  # timm: only for a warm start

    try:
        found = resolve_architecture(cfg)  # as pretrain/warm_start.py `resolve_warm_start` at the stage's start
    except InitMismatch as err:
        findings.fail(err.key, err.detail)
        return
    except ValueError as err:  # missing, unreadable, untrusted pickle: the message names the file
        findings.fail("model.init", str(err), file=cfg.model.init)
        return
    findings.note(found.line())


def check_hub_init(cfg: Config, findings: Findings) -> None:
    """A warm start from the Hub (`model.init: hf-hub:ORG/NAME`) finds the repo's files in the Hub cache, or
    downloads them now when online: offline, a missing cache entry stops the launch in one line."""
    init = cfg.model.init
    if not (init and init.startswith("hf-hub:")):
        return
    from core.export.hub import hub_folder  # huggingface_hub and timm: only for the recipes that name the Hub

    try:
        folder = hub_folder(init)
    except ValueError as err:
        findings.fail("model.init", str(err), file=init)
        return
    findings.ok(f"model.init: {init} in the Hub cache ({folder.name[:12]})")


def check_tokenizer(cfg: Config, findings: Findings) -> None:
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
