"""Fine-tuning's launch-time checks (run by core/preflight.py before any process starts): `model.init` opens, its
format is detected and it fits the recipe's model; `distill.teacher` opens; the number of classes is known.

`model.init` is fitted as `load_encoder` would (`finetune.handoff.fit_problems`) without reading weights: a
safetensors file's header gives the shapes, and the recipe's model is built on the meta device, so even a ViT-H
costs no memory. A pickle has no header and is loaded (memory-mapped when torch saved it as a zip).
"""

from __future__ import annotations

import torch

from core.config import Config
from core.models import build_model
from core.preflight import Findings, describe_spec
from data.specs import dataset_classes
from finetune.checkpoints import read_checkpoint
from finetune.handoff import PATCH_KERNEL, fit_problems
from finetune.teacher import teacher_is_folder


def check(cfg: Config, findings: Findings) -> None:
    if cfg.model.init:
        check_init(cfg, findings)
    if cfg.distill.kind != "none":
        check_teacher(cfg, findings)
    check_num_classes(cfg, findings)


def check_init(cfg: Config, findings: Findings) -> None:
    """`model.init` opens (a pickle that needs trust is refused), and every encoder tensor fits the recipe's model
    (width, depth, patch kernel, LayerScale), up to what the hand-off resizes (patch grid, patch size)."""
    init = cfg.model.init
    try:
        ckpt = read_checkpoint(init, trust=cfg.model.trust_checkpoint, shapes_only=True)
    except ValueError as err:  # missing, unreadable, untrusted pickle, not a ViT: the message names the file
        findings.fail("model.init", str(err), file=init)
        return
    with torch.device("meta"):
        model = build_model(cfg, plain=True)  # pooling "auto" builds the cls-token layout; norm / fc_norm are mapped
    problems = fit_problems(model, ckpt)
    if problems:
        findings.fail(
            "model.init",
            f"{describe_encoder(ckpt.state)} does not fit the recipe's model ({describe_encoder(model.state_dict())}): "
            f"{len(problems)} keys differ, first {problems[0]}",
            file=ckpt.source,
        )
        return
    findings.ok(f"model.init: {ckpt.format}, {describe_encoder(ckpt.state)}")


def check_teacher(cfg: Config, findings: Findings) -> None:
    """`distill.teacher` opens, and a bare checkpoint comes with `distill.teacher_arch`."""
    teacher = cfg.distill.teacher
    try:
        teacher_is_folder(cfg.distill)
        ckpt = read_checkpoint(teacher, trust=cfg.model.trust_checkpoint, shapes_only=True)
    except ValueError as err:
        findings.fail("distill.teacher", str(err), file=teacher)
        return
    findings.ok(f"distill.teacher: {ckpt.format}, {describe_encoder(ckpt.state)}")


def check_num_classes(cfg: Config, findings: Findings) -> None:
    """Without `model.num_classes`, the class names come from the index.json beside the training shards."""
    if cfg.model.num_classes:
        return
    try:
        classes = dataset_classes(cfg.data.train)
    except ValueError:  # data.train does not resolve: already reported
        return
    if not classes:
        findings.fail(
            "model.num_classes",
            "not set, and no index.json beside the training shards lists the classes",
            file=describe_spec(cfg.data.train),
        )


def describe_encoder(state: dict[str, torch.Tensor]) -> str:
    """The encoder a state dict holds, read from its shapes: 'ViT 768 wide, 12 blocks, patch 16x16', 'T2T-ViT 384
    wide, 14 blocks' or 'VT-ResNet, tokens 1024 wide, 2 VT modules'."""
    depth = len({key.split(".")[1] for key in state if key.startswith("blocks.")})
    if PATCH_KERNEL in state:  # a ViT or hybrid
        kernel = state[PATCH_KERNEL].shape  # (D, C, ph, pw)
        return f"ViT {kernel[0]} wide, {depth} blocks, patch {kernel[-2]}x{kernel[-1]}"
    if "tokens_to_token.project.weight" in state:
        return f"T2T-ViT {state['tokens_to_token.project.weight'].shape[0]} wide, {depth} blocks"
    num_modules = len({key.split(".")[1] for key in state if key.startswith("layer4.")})
    width = state["layer4.0.transformer.fc1.weight"].shape[0] if num_modules else "?"
    return f"VT-ResNet, tokens {width} wide, {num_modules} VT modules"
