"""The encoders `mimpipe evaluate` compares (finetune/report_card.py), each resolved before any image is embedded: what
rebuilds it at the evaluation's image size, and how its images are shown, with where each setting came from.

    CHECKPOINT       read as
    export folder    config.json (architecture, model_args, pretrained_cfg) and mimpipe.json (pooling_hint)
    run_dir          RUN_DIR/export; without one, its latest complete checkpoint, consolidated from any ZeRO stage by
                     the reader `pretrain export` uses (core/engine/gather.py) into a temporary export
    any other file   official MAE / DeiT, timm state dicts, hybrid, T2T-ViT, VT-ResNet: the structure read from the
                     weights as `finetune convert` reads it (--num-heads for a width that is not timm's, --arch)

The architecture flags (--arch, --num-heads) follow the rule of `model.init` in a recipe (core/export/architecture.py):
each applies only to a checkpoint that does not fix that value itself (a weights file; an export folder's config.json
fixes its architecture and heads). A checkpoint whose own config says otherwise keeps it (one line says so); a flag
that no checkpoint of the call takes and one contradicts is refused, naming both values.

Settings, each from the first source that has it:

    image size   --img-size (every checkpoint: what the evaluation changes, position embeddings resized, as a
                 recipe's model.img_size); the checkpoint's own (config.json's model_args, or its position grid x
                 patch); the training shards' (index.json)
    mean, std    --mean / --std; config.json's pretrained_cfg; ImageNet's for official MAE and DeiT files (as
                 `finetune convert` writes them); timm's default for the architecture
    crop_pct     --crop-pct; config.json's pretrained_cfg; timm's default for the architecture
    pooling      --pooling (cls | mean); the checkpoint's hint (mimpipe.json's pooling_hint, or fc_norm without a
                 final norm: mean); cls, or mean for an encoder without a class token (VT-ResNet)
    num_heads    config.json; --num-heads; --arch's; timm's standard for the width (a ViT's weights do not show it)

The encoder is rebuilt without a classifier and with `global_pool: token` (timm's "" without a class token): its
final norm applied to every token, the features of finetune/lbfgs_probe.py. Its weights are loaded by the hand-off
(core/export/handoff.py), the position embeddings resized to the evaluation's grid as fine-tuning resizes them. A
checkpoint that does not fit (`--arch` of another width, a grid that does not resize) is refused here, naming both
sides.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import timm
import torch
from timm.data import DEFAULT_CROP_PCT, IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import to_2tuple
from torch import nn

from core.engine.checkpoint import resumable_tag
from core.engine.distributed import DistInfo
from core.engine.gather import consolidated_state_dict
from core.export.folder import export_state_dict
from core.export.handoff import LoadReport, fit_problems, load_encoder, read_pooling_hint
from core.export.manifest import MANIFEST_NAME
from core.export.read import Checkpoint, read_checkpoint
from core.models.build import model_args
from core.recipe.config import load_config
from finetune.convert import IMAGENET_FORMATS, build_from_checkpoint

POOLING_OF_HINT = {"token": "cls", "avg": "mean"}
"""A checkpoint's `pooling_hint` (timm's global_pool) -> the features' pooling."""
RUN_DIR_POOLING_HINT = "avg"  # what `pretrain export` writes into a pretraining export's manifest


@dataclass(frozen=True)
class EncoderFlags:
    """The command's flags that say how to read and show every checkpoint (None: from the checkpoint)."""

    arch: str | None = None
    num_heads: int | None = None
    img_size: int | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    crop_pct: float | None = None
    pooling: str | None = None
    trust_checkpoint: bool = False


@dataclass
class Encoder:
    """One checkpoint, resolved: how to rebuild and load it, and how its images are shown."""

    name: str
    """The checkpoint as given on the command line: the report's row."""
    path: Path
    """What the hand-off reads: the file or export folder (a run_dir's export, or a temporary export of its latest
    checkpoint)."""
    checkpoint_format: str
    architecture: str
    model_args: dict
    """timm's arguments at the evaluation's size: no classifier, `global_pool: token`."""
    img_size: tuple[int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    crop_pct: float
    pooling: str
    has_class_token: bool
    trust_checkpoint: bool = False
    step: int | None = None
    """The training step the weights are from, when the manifest says."""
    sources: dict[str, str] = field(default_factory=dict)
    """Setting -> where it came from: "--img-size", "config.json", "checkpoint's pooling_hint", ..."""

    def build(self, img_size: tuple[int, int] | None = None) -> tuple[nn.Module, LoadReport]:
        """The encoder with its weights, in eval mode on the CPU, at `img_size` (default: the evaluation's)."""
        args = self.model_args | ({"img_size": img_size} if img_size is not None else {})
        model = timm.create_model(self.architecture, pretrained=False, **args)
        report = load_encoder(model, self.path, trust_checkpoint=self.trust_checkpoint)
        return model.eval(), report

    def describe(self) -> dict:
        """JSON-ready settings, for report.json."""
        out = dataclasses.asdict(self)
        out["path"] = str(self.path)
        return out


ARCH_FLAGS = {"arch": "--arch", "num_heads": "--num-heads"}
"""The flags that say what a checkpoint's architecture is: each only for a checkpoint that does not fix it itself."""


@dataclass(frozen=True)
class FlagUse:
    """What one checkpoint made of the architecture flags."""

    taken: frozenset[str]
    """`ARCH_FLAGS` keys applied to it (a weights file)."""
    contradicted: dict[str, str]
    """Key -> the line naming the flag's value and the checkpoint's own (its config.json says otherwise)."""


def resolve_encoders(
    specs: list[str], flags: EncoderFlags, *, scratch: Path, dist: DistInfo, shards_img_size: int | None = None
) -> list[Encoder]:
    """Every checkpoint of `specs` resolved (`resolve_encoder`), before any image is embedded. An architecture flag
    applies to the checkpoints that do not fix that value; one whose config.json says otherwise keeps its own (rank 0
    says so in one line); a flag that no checkpoint takes and one contradicts is refused.

    Raises:
        ValueError: As `resolve_encoder`; a flag only contradicted (naming its value, the checkpoint and its value).
    """
    resolved = [_resolve(spec, flags, scratch=scratch, dist=dist, shards_img_size=shards_img_size) for spec in specs]
    for key, flag in ARCH_FLAGS.items():
        refusals = [use.contradicted[key] for _, use in resolved if key in use.contradicted]
        if refusals and not any(key in use.taken for _, use in resolved):
            raise ValueError(f"{refusals[0]}; {flag} applies only to a weights file, which does not fix it")
    for encoder, use in resolved:
        for line in use.contradicted.values() if dist.is_main else ():
            print(f"[mimpipe] evaluate {encoder.name}: {line}: the checkpoint's kept (the flag is for weights files)")
    return [encoder for encoder, _ in resolved]


def resolve_encoder(
    spec: str, flags: EncoderFlags, *, scratch: Path, dist: DistInfo, shards_img_size: int | None = None
) -> Encoder:
    """`spec` resolved (see the module docstring); reads shapes, not weights, where the file allows.

    Args:
        spec: A checkpoint the hand-off accepts, or a run_dir.
        flags: The command's flags.
        scratch: A folder for a run_dir checkpoint's temporary export.
        dist: This process's place in the group (a run_dir's checkpoint is chosen by rank 0 for all: collective).
        shards_img_size: The training shards' image side, when their index says: the size of last resort.

    Raises:
        ValueError: Naming the checkpoint: unreadable, of another width than `--arch`, not loadable at the size,
            no image size anywhere, a class-token pooling for an encoder without one, an architecture flag its own
            config.json contradicts.
    """
    return resolve_encoders([spec], flags, scratch=scratch, dist=dist, shards_img_size=shards_img_size)[0]


def _resolve(
    spec: str, flags: EncoderFlags, *, scratch: Path, dist: DistInfo, shards_img_size: int | None
) -> tuple[Encoder, FlagUse]:
    """One checkpoint resolved, and what it made of the architecture flags."""
    path = _weights_path(Path(spec), scratch, dist)
    ckpt = read_checkpoint(path, trust=flags.trust_checkpoint, shapes_only=True)
    own = _fixes_architecture(ckpt)
    with torch.device("meta"):  # shapes only: nothing allocated
        if own:  # config.json's architecture and model_args, whatever the flags say
            reference = timm.create_model(f"local-dir:{ckpt.source.parent}", pretrained=False)
        else:
            reference = build_from_checkpoint(ckpt, flags.arch, flags.num_heads)
    use = _flag_use(spec, flags, reference) if own else FlagUse(_given(flags), {})
    args = model_args(reference)
    sources = {}
    heads = _num_heads(reference)
    if heads is not None:
        sources["num_heads"] = _heads_source(ckpt, flags, reference, own)
    img_size, sources["img_size"] = _first(
        ("--img-size", flags.img_size), ("checkpoint", args.get("img_size")), ("training shards", shards_img_size)
    )
    if img_size is None:
        raise ValueError(f"{spec}: no image size in the checkpoint or the training shards' index: pass --img-size")
    img_size = to_2tuple(img_size)
    args = {**args, "img_size": img_size, "num_classes": 0}
    if "global_pool" in args:  # the final norm on every token (timm: "token", or "" without a class token); we pool
        args["global_pool"] = "token" if args.get("class_token", True) else ""
    architecture = reference.pretrained_cfg["architecture"]
    with torch.device("meta"):
        model = timm.create_model(architecture, pretrained=False, **args)
    problems = fit_problems(model, ckpt)
    if problems:
        raise ValueError(f"{spec} does not load at {img_size[0]}x{img_size[1]}:\n  " + "\n  ".join(problems))

    mean, sources["mean"] = _data_setting("mean", flags.mean, ckpt, reference, IMAGENET_DEFAULT_MEAN)
    std, sources["std"] = _data_setting("std", flags.std, ckpt, reference, IMAGENET_DEFAULT_STD)
    crop_pct, sources["crop_pct"] = _data_setting("crop_pct", flags.crop_pct, ckpt, reference, None)
    has_cls = isinstance(getattr(model, "cls_token", None), torch.Tensor)
    hint = read_pooling_hint(path, trust_checkpoint=flags.trust_checkpoint)
    pooling, sources["pooling"] = _first(
        ("--pooling", flags.pooling),
        ("checkpoint's pooling hint", POOLING_OF_HINT.get(hint)),
        ("default", "cls" if has_cls else "mean"),
    )
    if pooling == "cls" and not has_cls:
        raise ValueError(f"{spec}: --pooling cls, but its {architecture} has no class token (use --pooling mean)")
    encoder = Encoder(
        name=spec, path=path, checkpoint_format=ckpt.format, architecture=architecture, model_args=args,
        img_size=img_size, mean=tuple(mean), std=tuple(std), crop_pct=float(crop_pct), pooling=pooling,
        has_class_token=has_cls, trust_checkpoint=flags.trust_checkpoint, step=ckpt.manifest.get("step"),
        sources=sources,
    )  # fmt: skip
    return encoder, use


def _fixes_architecture(ckpt: Checkpoint) -> bool:
    """Whether the checkpoint's own config.json (an export folder's) fixes its architecture: timm's `architecture` and
    `model_args`, which `timm.create_model("local-dir:...")` builds."""
    return bool(ckpt.config.get("architecture")) and isinstance(ckpt.config.get("model_args"), dict)


def _given(flags: EncoderFlags) -> frozenset[str]:
    return frozenset(key for key in ARCH_FLAGS if getattr(flags, key) is not None)


def _flag_use(spec: str, flags: EncoderFlags, reference: nn.Module) -> FlagUse:
    """The architecture flags against a checkpoint that fixes its own (`reference`, built from its config.json): none
    applies; each that says otherwise, with the line naming both values."""
    contradicted = {}
    heads = _num_heads(reference)
    if flags.num_heads is not None and flags.num_heads != heads:
        contradicted["num_heads"] = f"--num-heads {flags.num_heads}: {spec} has num_heads {heads} (config.json)"
    if flags.arch is not None:
        if not timm.is_model(flags.arch):
            contradicted["arch"] = f"--arch {flags.arch}: not a timm architecture ({spec} has its config.json)"
        else:
            with torch.device("meta"):
                named = timm.create_model(flags.arch, pretrained=False)
            differs = next((key for key in _SHAPE if _shape(named, key) != _shape(reference, key)), None)
            if differs is not None:
                theirs, ours = _shape(named, differs), _shape(reference, differs)
                contradicted["arch"] = f"--arch {flags.arch} has {differs} {theirs}, {spec} has {ours} (config.json)"
    return FlagUse(frozenset(), contradicted)


_SHAPE = ("type", "embed_dim", "depth", "num_heads")


def _shape(model: nn.Module, key: str) -> object:
    """One structural fact of a model: its class, width, depth or heads (None where it has none)."""
    if key == "type":
        return type(model).__name__
    if key == "num_heads":
        return _num_heads(model)
    blocks = getattr(model, "blocks", None)
    return len(blocks) if key == "depth" and blocks is not None else getattr(model, key, None)


def _num_heads(model: nn.Module) -> int | None:
    """A transformer's attention heads per block (None without blocks of attention: VT-ResNet, ResNet)."""
    blocks = getattr(model, "blocks", None)
    attn = getattr(blocks[0], "attn", None) if blocks is not None and len(blocks) else None
    return getattr(attn, "num_heads", None)


def _heads_source(ckpt: Checkpoint, flags: EncoderFlags, reference: nn.Module, own: bool) -> str:
    """Where a checkpoint's number of heads came from (report.json's sources)."""
    if own:
        return "config.json"
    if flags.num_heads is not None:
        return "--num-heads"
    if flags.arch is not None:
        return f"--arch {flags.arch}"
    if "tokens_to_token.project.weight" in ckpt.state:
        return "the T2T-ViT variant's"
    return f"timm's standard for width {getattr(reference, 'embed_dim', '?')}"


def _data_setting(key: str, flag, ckpt: Checkpoint, reference: nn.Module, imagenet) -> tuple[object, str]:
    """(value, source) of a preprocessing setting: the flag; config.json's pretrained_cfg; `imagenet` for official
    MAE and DeiT weights; timm's default for the architecture (`reference`'s pretrained_cfg); timm's crop_pct."""
    config = ckpt.config.get("pretrained_cfg") or {}
    official = imagenet if ckpt.format in IMAGENET_FORMATS else None
    architecture = reference.pretrained_cfg.get("architecture")
    return _first(
        (f"--{key.replace('_', '-')}", flag),
        ("config.json", config.get(key)),
        ("ImageNet (official weights)", official),
        (f"timm's {architecture}", reference.pretrained_cfg.get(key)),
        ("timm's default", DEFAULT_CROP_PCT if key == "crop_pct" else None),
    )


def _first(*candidates: tuple[str, object]) -> tuple[object, str]:
    """(value, source) of the first candidate whose value is not None; (None, "") when none has one."""
    return next(((value, source) for source, value in candidates if value is not None), (None, ""))


def _weights_path(path: Path, scratch: Path, dist: DistInfo) -> Path:
    """What the hand-off reads for `path`: itself, unless it is a run_dir (a folder with checkpoints/ and no weights
    of its own): its export, else its latest complete checkpoint's encoder written as an export under `scratch`."""
    ckpt_dir = path / "checkpoints"
    if not ckpt_dir.is_dir() or (path / MANIFEST_NAME).is_file():
        return path
    if (path / "export" / MANIFEST_NAME).is_file():
        return path / "export"
    tag = resumable_tag(ckpt_dir, dist.rank, dist.world_size)  # the checkpoint a relaunch would resume from
    if tag is None:
        raise ValueError(f"run_dir {path} has no export and no complete checkpoint in {ckpt_dir}")
    cfg = load_config(ckpt_dir / tag / "config.yaml")
    state = consolidated_state_dict(ckpt_dir, tag, cfg.engine.zero_stage)
    encoder = {k.removeprefix("encoder."): v for k, v in state.items() if k.startswith("encoder.")}
    if not encoder:
        raise ValueError(f"{ckpt_dir / tag} holds no encoder.* weights (a fine-tuning run?): evaluate its export")
    step = int(tag.removeprefix("step_"))
    manifest = {"method": cfg.objective.kind, "step": step, "source": str(ckpt_dir / tag)}
    manifest["pooling_hint"] = RUN_DIR_POOLING_HINT
    out = scratch / f"{len(list(scratch.iterdir()))}-{path.name}-{tag}"  # two run_dirs may share a name
    return export_state_dict(cfg, encoder, out, num_classes=0, manifest=manifest)
