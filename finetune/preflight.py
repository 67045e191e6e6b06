"""Fine-tuning's launch-time checks (run by core/launch/preflight.py before any process starts): `model.init` opens, its
format is detected and it fits the recipe's model; `distill.teacher` opens; the number of classes is known and every
split's labels are below it, or, for segmentation, every split is a segmentation set with the same classes.

`model.init` first completes the recipe as the stage's start will (finetune/handoff.py `resolve_init`: the
architecture keys and normalisation the recipe leaves out are the checkpoint's, core/export/architecture.py; a key it
contradicts is one line naming the key and both values; the plan says which keys came from the checkpoint). It is then
fitted as `load_encoder` would (`core.export.handoff.fit_problems`) without reading weights: a safetensors file's
header gives the shapes, and the recipe's model is built on the meta device, so even a ViT-H costs no memory. A pickle
has no header and is loaded (memory-mapped when torch saved it as a zip).
"""

from __future__ import annotations

import itertools
import os

import torch

from core.export.architecture import InitMismatch, resolve_architecture
from core.export.handoff import PATCH_KERNEL, fit_problems
from core.export.read import read_checkpoint
from core.launch.preflight import Findings, describe_spec, shard_specs
from core.models.build import build_model
from core.recipe.config import Config
from data.decode import image_field, read_label
from data.index import shard_samples
from data.segmentation import IGNORE_INDEX, SEG_FIELD
from data.specs import dataset_classes, resolve_shards, segmentation_info, split_index
from finetune.handoff import resolve_init
from finetune.teacher import teacher_is_folder

LABEL_SAMPLES = 64
"""Samples read from the first shard of a split without an index.json to find its highest label."""


def check(cfg: Config, findings: Findings, world_size: int) -> None:
    """`model.init`, `distill.teacher`, the class count and the labels' range (data.val's shards per rank are
    core/launch/preflight.py's)."""
    if cfg.model.init:
        check_init(cfg, findings)
    if cfg.distill.kind != "none":
        check_teacher(cfg, findings)
    if cfg.objective.kind == "segmentation":
        check_segmentation(cfg, findings)
        return
    check_num_classes(cfg, findings)
    if not findings.problems:
        check_label_range(cfg, findings)


def resolve(cfg: Config) -> None:
    """Complete `cfg` as the entry point does before it compares it with a checkpoint's (finetune/handoff.py
    `resolve_init`: `model.init`'s architecture and normalisation where the recipe leaves them out, `model.global_pool:
    auto` from its hint).

    Raises:
        ValueError: `model.init` cannot be read or contradicts the recipe (`check_init` reports it).
    """
    resolve_init(cfg)


def check_init(cfg: Config, findings: Findings) -> None:
    """`model.init` opens (a pickle that needs trust is refused), completes the recipe (in `cfg`, as the stage's start
    will; a recipe key it contradicts is refused), and every encoder tensor fits the completed recipe's model (width,
    depth, patch kernel, LayerScale), up to what the hand-off resizes (patch grid, patch size)."""
    init = cfg.model.init
    try:
        ckpt = read_checkpoint(init, trust=cfg.model.trust_checkpoint, shapes_only=True)
    except ValueError as err:  # missing, unreadable, untrusted pickle, not a ViT: the message names the file
        findings.fail("model.init", str(err), file=init)
        return
    try:
        found = resolve_architecture(cfg, ckpt)
    except InitMismatch as err:  # one line naming the key and both values
        findings.fail(err.key, err.detail)
        return
    findings.note(found.line())
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


def check_segmentation(cfg: Config, findings: Findings) -> None:
    """Every split is a segmentation set: its index names the class count (which `model.num_classes`, if set, and
    the other splits agree with) and the ignored id this code knows, and its first local sample has a mask."""
    counts = {}
    for key, spec, _ in shard_specs(cfg):
        try:
            info = segmentation_info(spec)
        except ValueError as err:  # no index, or not a segmentation set's: the message names the file
            findings.fail(key, str(err))
            continue
        if info["ignore_index"] != IGNORE_INDEX:
            findings.fail(key, f"its index.json gives ignore_index {info['ignore_index']}; masks ignore {IGNORE_INDEX}")
        counts[key] = info["num_classes"]
        local = next((shard for shard in resolve_shards(spec) if os.path.isfile(shard)), None)
        first = next(shard_samples(local), None) if local else None
        if first is not None and SEG_FIELD not in first:
            findings.fail(key, f"the first sample of {local} ({first['__key__']}) has no .{SEG_FIELD} mask")
    if cfg.model.num_classes:
        counts["model.num_classes"] = cfg.model.num_classes
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{key} {count}" for key, count in counts.items())
        findings.fail(next(iter(counts)), f"the class counts differ: {listed}")
    elif counts:
        findings.ok(f"segmentation: {next(iter(counts.values()))} classes, masks beside the images")


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


def check_label_range(cfg: Config, findings: Findings) -> None:
    """Every split's labels are below the classifier's outputs (`model.num_classes`, else the training index's class
    count): the highest label from the split's index.json (its `label_counts`, else its class list, whose positions
    the labels are), else from the first `LABEL_SAMPLES` samples of its first local shard."""
    num_classes = cfg.model.num_classes or len(dataset_classes(cfg.data.train))
    source = "model.num_classes" if cfg.model.num_classes else "the classes of data.train's index.json"
    for key, spec, _ in shard_specs(cfg):
        try:
            found = highest_label(spec, cfg.data.label_field)
        except ValueError as err:  # a sample without a readable label (LabelError), an unreadable shard
            findings.fail(key, str(err))
            continue
        if found is not None and found[0] >= num_classes:
            label, where = found
            findings.fail(
                key,
                f"{where} has label {label}, but the classifier has {num_classes} outputs ({source}); labels must "
                f"be 0..{num_classes - 1}: set model.num_classes to at least {label + 1}",
            )


def highest_label(spec, label_field: str | None) -> tuple[int, str] | None:
    """(the highest label of the split, where it was read), or None when there is nothing local to read."""
    shards = resolve_shards(spec)
    path, index = split_index(spec)
    used = [label for label, count in enumerate(index.get("label_counts") or []) if count]
    if used or index.get("classes"):
        listed = "label_counts" if used else "classes"
        return (used[-1] if used else len(index["classes"]) - 1), f"{path} ({listed})"
    local = next((shard for shard in shards if os.path.isfile(shard)), None)
    if local is None:
        return None
    samples = list(itertools.islice(shard_samples(local, frozenset({"cls", "json"})), LABEL_SAMPLES))
    labels = [read_label(sample, label_field) for sample in samples if image_field(sample) is not None]
    return (max(labels), f"the first {len(samples)} samples of {local}") if labels else None


def describe_encoder(state: dict[str, torch.Tensor]) -> str:
    """The encoder a state dict holds, read from its shapes: 'ViT 768 wide, 12 blocks, patch 16x16', 'T2T-ViT 384
    wide, 14 blocks', 'VT-ResNet, tokens 1024 wide, 2 VT modules' or 'ResNet, blocks 2-2-2-2, 512 channels'."""
    depth = len({key.split(".")[1] for key in state if key.startswith("blocks.")})
    if PATCH_KERNEL in state:  # a ViT or hybrid
        kernel = state[PATCH_KERNEL].shape  # (D, C, ph, pw)
        return f"ViT {kernel[0]} wide, {depth} blocks, patch {kernel[-2]}x{kernel[-1]}"
    if "tokens_to_token.project.weight" in state:
        return f"T2T-ViT {state['tokens_to_token.project.weight'].shape[0]} wide, {depth} blocks"
    num_modules = len({key.split(".")[1] for key in state if key.startswith("layer4.")})
    if "layer4.0.transformer.fc1.weight" not in state:  # timm's ResNet: four stages of residual blocks
        blocks = "-".join(str(len({k.split(".")[1] for k in state if k.startswith(f"layer{i}.")})) for i in range(1, 5))
        width = next((t.shape[0] for k, t in reversed(state.items()) if k.startswith("layer4.") and t.ndim == 4), "?")
        return f"ResNet, blocks {blocks}, {width} channels"
    width = state["layer4.0.transformer.fc1.weight"].shape[0]
    return f"VT-ResNet, tokens {width} wide, {num_modules} VT modules"
