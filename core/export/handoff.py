"""Hand a pretrained encoder to a stage (fine-tuning today): load, resize the position grid and patch kernel,
initialise the head, report.

Accepts every format of `core/export/read.py` (our export, official MAE pretraining / fine-tuned, timm state
dicts, DeiT distilled), read without running code unless the caller trusts the file. Every checkpoint tensor ends
up in exactly one bucket of the `LoadReport`:

    loaded       copied unchanged into the model (possibly under a mapped name)
    resized      pos_embed resampled to the model's patch grid (ViT paper, section 3.2; bicubic interpolation, or
                 regenerated 2-D sin-cos; the prefix tokens' positions, class and registers, kept as they are),
                 patch_embed.proj.weight to another patch size (FlexiViT's pseudo-inverse)
    mapped       renamed: `norm.*` <-> `fc_norm.*` when the pooling (cls token vs global average) changes
    dropped      not part of the target encoder: decoder_*, mask_token, dist_token, a pretraining head ...
and every model tensor the checkpoint does not provide is `initialised` (the head: zero weight and bias as in the
ViT paper, or MAE's truncated normal). An encoder tensor that does not fit is an error, never skipped.

Shape legend: D embedding width, gh x gw patch grid, N = gh * gw, P prefix tokens with a position (cls, dist, reg),
ph x pw patch size, C input channels.

A hybrid ViT (ResNet stem) is a timm VisionTransformer: its pos_embed is resized to the feature map's patch grid in
the same way. T2T-ViT's fixed position table is rebuilt for the new token grid (it is never stored); VT-ResNet has
no position embedding and takes any resolution.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from timm.layers import resample_abs_pos_embed, resample_patch_embed, to_2tuple
from timm.models import ResNet, VisionTransformer

from core.export.read import (
    Checkpoint,
    checkpoint_keys,
    has_module,
    match_prefix_tokens,
    norm_renames,
    read_checkpoint,
    read_manifest,
)
from core.models.pos_embed import sincos_pos_embed_2d
from core.models.t2t_vit import T2TViT
from core.models.vt import VTResNet
from core.recipe.config import Config
from core.recipe.geometry import soft_split_grid

# Parts of a timm ViT that pool and classify; a pretrained encoder provides them only with `keep_head`.
HEAD_MODULES = ("head", "head_dist", "attn_pool", "fc")
# Linear classifiers that `head_init` initialises when the checkpoint does not provide them (VT-ResNet's is `fc`).
CLASSIFIERS = ("head", "head_dist", "fc")
PATCH_KERNEL = "patch_embed.proj.weight"
HEAD_INITS = ("zero", "trunc_normal", "keep")
POS_EMBED_RESIZES = {"interpolate": "bicubic interpolation", "sincos": "sin-cos regenerated"}


@dataclass
class LoadReport:
    """What `load_encoder` did, key by key (model key names unless said otherwise)."""

    source: str
    checkpoint_format: str = ""
    """One of `core.export.read.FORMATS` (not `format`: that name is the summary method)."""
    loaded: list[str] = field(default_factory=list)
    resized: list[tuple[str, tuple[int, int], tuple[int, int]]] = field(default_factory=list)
    """(key, checkpoint size, model size): patch grid for pos_embed, e.g. ('pos_embed', (7, 7), (8, 8)); kernel
    size for patch_embed.proj.weight, e.g. ('patch_embed.proj.weight', (16, 16), (14, 14))."""
    resize_method: dict[str, str] = field(default_factory=dict)
    """Key -> how it was resized: "bicubic interpolation", "sin-cos regenerated", "resample_patch_embed"."""
    mapped: list[tuple[str, str]] = field(default_factory=list)
    """(checkpoint key, model key)."""
    dropped: list[str] = field(default_factory=list)
    """Checkpoint keys."""
    initialised: list[str] = field(default_factory=list)
    head_init: str = ""
    """What the classifier got: "zero weight and bias", "trunc_normal(std=2e-05), zero bias", "timm init",
    "loaded from the checkpoint"; "" for a model without a linear classifier."""
    notes: list[str] = field(default_factory=list)
    """Other things done: unwrapping, prefix stripping, distillation-token positions."""
    manifest: dict = field(default_factory=dict)
    """The export's mimpipe.json, when there is one."""

    def format(self) -> str:
        """Multi-line summary for the console; long key lists are grouped by name prefix."""
        lines = [
            f"Encoder weights from {self.source}" + (f" ({self.checkpoint_format})" if self.checkpoint_format else "")
        ]
        facts = {k: v for k, v in self.manifest.items() if isinstance(v, str | int | float | bool)}
        if facts:
            lines.append("  manifest: " + ", ".join(f"{k}={v}" for k, v in facts.items()))
        resized = [
            f"{k} {a[0]}x{a[1]} -> {b[0]}x{b[1]}" + (f" ({self.resize_method[k]})" if k in self.resize_method else "")
            for k, a, b in self.resized
        ]
        sections = [
            ("loaded", len(self.loaded), _summarise(self.loaded)),
            ("resized", len(self.resized), resized),
            ("mapped", len(self.mapped), [f"{src} -> {dst}" for src, dst in self.mapped]),
            ("dropped", len(self.dropped), _summarise(self.dropped)),
            ("initialised", len(self.initialised), _summarise(self.initialised)),
        ]
        left = self.manifest.get("not_exported") or []
        if left:  # the objective's own tensors (decoder, mask token, prediction head): never part of the export
            sections.append(("left at pretraining", len(left), _summarise(left)))
        for name, count, items in sections:
            lines.append(f"  {name} ({count}): {', '.join(items) if items else '-'}")
        if self.head_init:
            lines.append(f"  head: {self.head_init}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """JSON-ready copy (tuples become lists when dumped)."""
        return dataclasses.asdict(self)


def load_encoder(
    model: VisionTransformer,
    path: str | Path,
    *,
    head_init: str = "zero",
    head_init_std: float = 2e-5,
    pos_embed_resize: str = "interpolate",
    trust_checkpoint: bool = False,
    keep_head: bool = False,
) -> LoadReport:
    """Load pretrained encoder weights into `model` in place and report what happened to every tensor.

    Args:
        model: The fine-tuning timm ViT (any patch grid or patch size, any pooling, any number of classes; a
            `VisionTransformerDistilled` or a hybrid too), a T2TViT / VTResNet (core/models/t2t_vit.py,
            core/models/vt.py), or timm's ResNet (the FPN segmentation heads' backbone).
        path: Our export folder, an official MAE / DeiT checkpoint, or a timm state dict (.pth, .bin, .safetensors).
        head_init: For a classifier the checkpoint does not provide: "zero" weight and bias (ViT paper),
            "trunc_normal" weight with `head_init_std` and zero bias (MAE), or "keep" timm's init.
        head_init_std: Standard deviation of the "trunc_normal" head (MAE: 2e-5).
        pos_embed_resize: On a patch-grid change, "interpolate" the checkpoint's grid (bicubic), or "sincos":
            regenerate the fixed 2-D sin-cos embedding for the new grid (prefix positions zero, as MAE).
        trust_checkpoint: Allow a full unpickle of a file that holds more than tensors (it can run code).
        keep_head: Load the checkpoint's classifier (head.*, and head_dist.* / attn_pool.* when the model has them)
            instead of initialising it; shapes must match (e.g. a distillation teacher).

    Returns:
        The load report.

    Raises:
        ValueError: An unknown option, an unreadable or untrusted file, or a checkpoint of another architecture
            (the message names the file and every mismatched, missing or unexpected key with both shapes).
    """
    _check_options(model, head_init, head_init_std, pos_embed_resize)
    ckpt = read_checkpoint(path, trust=trust_checkpoint)
    report = LoadReport(
        source=str(ckpt.source), checkpoint_format=ckpt.format, manifest=ckpt.manifest, notes=list(ckpt.notes)
    )
    model_state = model.state_dict()
    encoder_state, source_grid, problems = _match(model, model_state, ckpt, keep_head, report)
    if problems:
        raise ValueError(f"{ckpt.source} does not fit the model ({len(problems)} keys):\n  " + "\n  ".join(problems))
    _resize(model, encoder_state, source_grid, pos_embed_resize, report)
    if isinstance(model, T2TViT):
        report.notes += _t2t_grid_notes(model, ckpt.config)

    result = model.load_state_dict(encoder_state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    resized = {key for key, _, _ in report.resized}
    report.loaded = [k for k in model_state if k in encoder_state and k not in resized]
    report.initialised = [k for k in model_state if k not in encoder_state]
    assert set(result.missing_keys) == set(report.initialised), (result.missing_keys, report.initialised)
    report.head_init = _init_heads(model, encoder_state, head_init, head_init_std)
    return report


def fit_problems(model: VisionTransformer, ckpt: Checkpoint, *, keep_head: bool = False) -> list[str]:
    """Every encoder key of `ckpt` that would stop `load_encoder` (a shape that neither fits nor resizes, a key
    missing on either side), one line each; [] when it loads. Reads shapes only: `model` may be built on the meta
    device and `ckpt` read with `shapes_only` (launch-time checks, see finetune/preflight.py)."""
    report = LoadReport(source=str(ckpt.source))
    return _match(model, model.state_dict(), ckpt, keep_head, report)[2]


def read_pooling_hint(path: str | Path, *, trust_checkpoint: bool = False) -> str | None:
    """The pooling a checkpoint was trained with: "avg" or "token" from our export's `pooling_hint`, else "avg" when
    it has fc_norm and no final norm (MAE fine-tuned, timm avg-pool), else None (no evidence either way).

    Raises:
        ValueError: An unreadable file, or a pickle that needs `trust_checkpoint` (as `load_encoder`).
    """
    hint = read_manifest(path).get("pooling_hint")
    if hint in ("avg", "token"):
        return hint
    keys = checkpoint_keys(path, trust=trust_checkpoint)
    return "avg" if has_module(keys, "fc_norm") and not has_module(keys, "norm") else None


def resolve_global_pool(cfg: Config) -> None:
    """`model.global_pool: auto` becomes the pooling the `model.init` checkpoint was trained with, else "token"
    (a distilled student always pools by token)."""
    if cfg.model.global_pool == "auto":
        init, trust = cfg.model.init, cfg.model.trust_checkpoint
        hint = read_pooling_hint(init, trust_checkpoint=trust) if init and cfg.distill.kind == "none" else None
        cfg.model.global_pool = hint or "token"


def _check_options(model: VisionTransformer, head_init: str, head_init_std: float, pos_embed_resize: str) -> None:
    if not isinstance(model, VisionTransformer | T2TViT | VTResNet | ResNet):
        raise ValueError(
            f"load_encoder needs a timm VisionTransformer or ResNet, a T2TViT or VTResNet, got {type(model).__name__}"
        )
    if head_init not in HEAD_INITS:
        raise ValueError(f"head_init must be one of {HEAD_INITS}, got {head_init!r}")
    if not head_init_std > 0:
        raise ValueError(f"head_init_std must be positive, got {head_init_std}")
    if pos_embed_resize not in POS_EMBED_RESIZES:
        raise ValueError(f"pos_embed_resize must be one of {tuple(POS_EMBED_RESIZES)}, got {pos_embed_resize!r}")


def _optional_heads(keep_head: bool) -> set[str]:
    """Model modules the checkpoint need not provide: the classifier, unless it is to be loaded."""
    return set() if keep_head else set(HEAD_MODULES)


def _split(
    model: VisionTransformer,
    model_state: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor],
    renames: dict[str, str],
    keep_head: bool,
    report: LoadReport,
) -> dict[str, torch.Tensor]:
    """Model-named encoder tensors to load; every other checkpoint key goes to `report.dropped`."""
    encoder_state, model_roots = {}, {k.split(".")[0] for k in model_state}
    for key, tensor in state.items():
        name = renames.get(key, key)
        root = name.split(".")[0]
        owned = root in model_roots or isinstance(getattr(model, root, None), torch.nn.Module)
        if not owned or (root in HEAD_MODULES and not keep_head):
            report.dropped.append(key)
        else:
            encoder_state[name] = tensor
    return encoder_state


def _match(
    model: VisionTransformer,
    model_state: dict[str, torch.Tensor],
    ckpt: Checkpoint,
    keep_head: bool,
    report: LoadReport,
) -> tuple[dict[str, torch.Tensor], tuple[int, int], list[str]]:
    """Checkpoint tensors under model names (prefix tokens matched, final norm mapped, the rest dropped into
    `report`), the checkpoint's patch grid, and the keys that do not fit."""
    state, may_init, notes = match_prefix_tokens(ckpt.state, model)
    report.notes += notes
    renames = norm_renames(model_state, state)
    report.mapped = sorted(renames.items())
    encoder_state = _split(model, model_state, state, renames, keep_head, report)
    registers = _register_problem(model, state)
    if registers is not None:  # every pos_embed row after the class token would be off: the one line that says why
        return encoder_state, token_grid(model), [registers]
    problems, source_grid = _fit(model, model_state, encoder_state, ckpt, may_init | _optional_heads(keep_head))
    return encoder_state, source_grid, problems


def _register_problem(model: VisionTransformer, state: dict[str, torch.Tensor]) -> str | None:
    """The line refusing a checkpoint with another number of register tokens than the model (`model.reg_tokens`):
    they are prefix tokens with positions of their own, so pos_embed's grid would not be found either."""
    if not isinstance(model, VisionTransformer):
        return None
    tokens = state.get("reg_token")  # (1, R, D)
    have, want = (tokens.shape[1] if tokens is not None and tokens.ndim == 3 else 0), model.num_reg_tokens
    if have == want:
        return None
    return (
        f"reg_token: the checkpoint has {have} register tokens, the model {want}; build the model with "
        f"model.reg_tokens={have} (timm: reg_tokens={have})"
    )


def _fit(
    model: VisionTransformer,
    model_state: dict[str, torch.Tensor],
    encoder_state: dict[str, torch.Tensor],
    ckpt: Checkpoint,
    optional: set[str],
) -> tuple[list[str], tuple[int, int]]:
    """Every encoder key that does not fit (one line each), and the checkpoint's patch grid."""
    problems, source_grid = [], token_grid(model)
    for key, tensor in encoder_state.items():
        if key not in model_state:
            problems.append(f"unexpected encoder key {key}: checkpoint {tuple(tensor.shape)}, not in the model")
            continue
        have, want = tuple(tensor.shape), tuple(model_state[key].shape)
        if key == "pos_embed" and len(have) == 3 and have[-1] == want[-1]:
            grid = _source_grid(have[1] - _num_pos_prefix(model), ckpt.config, model, encoder_state)
            if grid is None:
                problems.append(f"pos_embed: checkpoint {have} vs model {want} (no patch grid fits)")
            source_grid = grid or source_grid
        elif key == PATCH_KERNEL and len(have) == 4 and have[:2] == want[:2]:
            continue  # another patch size: the kernel is resampled
        elif have != want:
            problems.append(f"{key}: checkpoint {have} vs model {want}")
    for key, tensor in model_state.items():
        if key not in encoder_state and key.split(".")[0] not in optional:
            problems.append(f"missing encoder key {key}: model {tuple(tensor.shape)}, not in the checkpoint")
    return problems, source_grid


def _source_grid(
    num_patches: int, config: dict, model: VisionTransformer, encoder_state: dict[str, torch.Tensor]
) -> tuple[int, int] | None:
    """The checkpoint's (gh, gw) patch grid. From config.json's img_size / patch_size when there is one; otherwise
    the first that holds `num_patches`: the model's grid, the model's image cut at the checkpoint's patch size
    (a patch-size change), a square."""
    args = config.get("model_args", {})
    if "img_size" in args and "patch_size" in args:
        img, patch = (to_2tuple(args[k]) for k in ("img_size", "patch_size"))
        ratio = to_2tuple(getattr(model.patch_embed, "feature_ratio", 1))  # a hybrid's backbone stride
        candidates = [(img[0] // (ratio[0] * patch[0]), img[1] // (ratio[1] * patch[1]))]
    else:
        img = model.patch_embed.img_size
        kernel = tuple(encoder_state.get(PATCH_KERNEL, model.patch_embed.proj.weight).shape[-2:])  # (ph, pw)
        side = math.isqrt(num_patches)
        candidates = [tuple(model.patch_embed.grid_size), (img[0] // kernel[0], img[1] // kernel[1]), (side, side)]
    return next((grid for grid in candidates if grid[0] * grid[1] == num_patches), None)


def _resize(
    model: VisionTransformer,
    encoder_state: dict[str, torch.Tensor],
    source_grid: tuple[int, int],
    method: str,
    report: LoadReport,
) -> None:
    """Resample the patch kernel to the model's patch size and pos_embed to its grid, in place, recording both."""
    if not isinstance(model, VisionTransformer):  # T2T rebuilds its fixed table for its grid; VT has no positions
        return
    kernel = encoder_state.get(PATCH_KERNEL)  # (D, C, ph, pw)
    target_patch = tuple(model.patch_embed.proj.weight.shape[-2:])
    if kernel is not None and tuple(kernel.shape[-2:]) != target_patch:
        # FlexiViT: the least-squares inverse of resizing a patch, so <resize(patch), new kernel> ~ <patch, kernel>
        encoder_state[PATCH_KERNEL] = resample_patch_embed(kernel.float(), list(target_patch))
        report.resized.append((PATCH_KERNEL, tuple(kernel.shape[-2:]), target_patch))
        report.resize_method[PATCH_KERNEL] = "resample_patch_embed"
    target_grid = tuple(model.patch_embed.grid_size)
    if "pos_embed" not in encoder_state or source_grid == target_grid:
        return
    num_prefix = _num_pos_prefix(model)
    if method == "sincos":  # fixed embeddings (MAE pretraining): exact values for the new grid, prefix zeros
        encoder_state["pos_embed"] = sincos_pos_embed_2d(model.embed_dim, target_grid, num_prefix)  # (1, P + N, D)
    else:
        encoder_state["pos_embed"] = resample_abs_pos_embed(
            encoder_state["pos_embed"].float(),  # interpolate in fp32 whatever the stored dtype
            new_size=list(target_grid),
            old_size=list(source_grid),
            num_prefix_tokens=num_prefix,
            interpolation="bicubic",
        )  # (1, P + N, D): prefix positions kept as they are
    report.resized.append(("pos_embed", source_grid, target_grid))
    report.resize_method["pos_embed"] = POS_EMBED_RESIZES[method]


def _init_heads(model: VisionTransformer, encoder_state: dict[str, torch.Tensor], how: str, std: float) -> str:
    """Initialise each linear classifier the checkpoint did not provide; say what the classifier got."""
    heads = {name: getattr(model, name, None) for name in CLASSIFIERS}
    heads = {name: head for name, head in heads.items() if isinstance(head, torch.nn.Linear)}
    fresh = [head for name, head in heads.items() if f"{name}.weight" not in encoder_state]
    if not heads:
        return ""
    if not fresh:
        return "loaded from the checkpoint"
    if how == "keep":
        return "timm init"
    with torch.no_grad():
        for head in fresh:
            if how == "zero":
                head.weight.zero_()
            else:  # timm's / MAE's truncation at +-2 absolute: for a small std, a plain normal
                torch.nn.init.trunc_normal_(head.weight, std=std)
            head.bias.zero_()
    return "zero weight and bias" if how == "zero" else f"trunc_normal(std={std:g}), zero bias"


def _t2t_grid_notes(model: T2TViT, config: dict) -> list[str]:
    """T2T-ViT's position table is fixed and not stored: at another resolution it is rebuilt, not resampled."""
    img = config.get("model_args", {}).get("img_size")
    source = soft_split_grid(to_2tuple(img)) if img is not None else model.grid_size
    if tuple(source) == tuple(model.grid_size):
        return []
    (gh, gw), (sh, sw) = model.grid_size, source
    return [f"pos_embed: T2T's fixed sin-cos table rebuilt for the {gh}x{gw} token grid (checkpoint: {sh}x{sw})"]


def token_grid(model: VisionTransformer | T2TViT | VTResNet) -> tuple[int, int] | None:
    """The model's token grid (a ViT's or hybrid's patch grid, T2T's grid after the soft splits); None for VT."""
    if isinstance(model, VisionTransformer):
        return tuple(model.patch_embed.grid_size)
    return tuple(model.grid_size) if isinstance(model, T2TViT) else None


def _num_pos_prefix(model: VisionTransformer) -> int:
    """Prefix (cls / dist / register) tokens that carry a position embedding; grid positions follow them."""
    return 0 if model.no_embed_class else model.num_prefix_tokens


def _summarise(keys: list[str], limit: int = 8) -> list[str]:
    """Group keys by the first word of their top-level name: 'decoder_* (52 tensors)', 'blocks.* (24 tensors)'."""
    if len(keys) <= limit:
        return list(keys)
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(key.split(".")[0].split("_")[0], []).append(key)
    items = []
    for word, members in groups.items():
        roots = {k.split(".")[0] for k in members}
        if len(members) == 1:
            items.append(members[0])
        elif len(roots) == 1:
            items.append(f"{roots.pop()}.* ({len(members)} tensors)")
        else:
            items.append(f"{word}_* ({len(members)} tensors)")
    return items
