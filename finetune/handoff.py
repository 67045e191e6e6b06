"""Hand a pretrained encoder to fine-tuning: load, resize the position grid, zero-initialise the head, report.

Reads our export folder (config.json + model.safetensors [+ mimpipe.json]) or a bare `.safetensors` file; nothing
is ever unpickled. Every checkpoint tensor ends up in exactly one bucket of the `LoadReport`:

    loaded       copied unchanged into the model (possibly under a mapped name)
    resized      pos_embed interpolated to the model's patch grid (ViT paper, section 3.2)
    mapped       renamed: `norm.*` <-> `fc_norm.*` when the pooling (cls token vs global average) changes
    dropped      not part of the target encoder: decoder_*, mask_token, a pretraining head ...
and every model tensor the checkpoint does not provide is `initialised` (the head, zeroed as in the ViT paper).
An encoder tensor that does not fit (shape, missing, unexpected) is an error, never skipped.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch
from timm.layers import resample_abs_pos_embed
from timm.models import VisionTransformer

# Parts of a timm ViT that pool and classify; a pretrained encoder never provides them for the new task.
HEAD_MODULES = ("head", "attn_pool")
# The final norm sits before pooling for the cls token (`norm`) and after it for global average pooling (`fc_norm`).
NORM_PAIR = ("norm", "fc_norm")


@dataclass
class LoadReport:
    """What `load_encoder` did, key by key (model key names unless said otherwise)."""

    source: str
    loaded: list[str] = field(default_factory=list)
    resized: list[tuple[str, tuple[int, int], tuple[int, int]]] = field(default_factory=list)
    """(key, checkpoint grid, model grid), e.g. ('pos_embed', (7, 7), (8, 8))."""
    mapped: list[tuple[str, str]] = field(default_factory=list)
    """(checkpoint key, model key)."""
    dropped: list[str] = field(default_factory=list)
    """Checkpoint keys."""
    initialised: list[str] = field(default_factory=list)
    manifest: dict = field(default_factory=dict)
    """The export's mimpipe.json, when there is one."""

    def format(self) -> str:
        """Multi-line summary for the console; long key lists are grouped by name prefix."""
        lines = [f"Encoder weights from {self.source}"]
        facts = {k: v for k, v in self.manifest.items() if isinstance(v, str | int | float | bool)}
        if facts:
            lines.append("  manifest: " + ", ".join(f"{k}={v}" for k, v in facts.items()))
        sections = [
            ("loaded", len(self.loaded), _summarise(self.loaded)),
            ("resized", len(self.resized), [f"{k} {a[0]}x{a[1]} -> {b[0]}x{b[1]}" for k, a, b in self.resized]),
            ("mapped", len(self.mapped), [f"{src} -> {dst}" for src, dst in self.mapped]),
            ("dropped", len(self.dropped), _summarise(self.dropped)),
            ("initialised", len(self.initialised), _summarise(self.initialised)),
        ]
        left = self.manifest.get("not_exported") or []
        if left:  # the objective's own tensors (decoder, mask token, prediction head): never part of the export
            sections.append(("left at pretraining", len(left), _summarise(left)))
        for name, count, items in sections:
            lines.append(f"  {name} ({count}): {', '.join(items) if items else '-'}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """JSON-ready copy (tuples become lists when dumped)."""
        return dataclasses.asdict(self)


def load_encoder(model: VisionTransformer, path: str | Path, *, head_init: str = "zero") -> LoadReport:
    """Load pretrained encoder weights into `model` in place and report what happened to every tensor.

    Args:
        model: The fine-tuning timm ViT (any patch grid, any pooling, any number of classes).
        path: An export folder holding model.safetensors (config.json gives the pretraining grid), or a
            `.safetensors` file (its position grid must then be square).
        head_init: "zero" zeroes the classifier weight and bias (ViT paper); "keep" leaves timm's init.

    Returns:
        The load report.

    Raises:
        ValueError: Unknown `head_init`, an unreadable path, or a checkpoint of another architecture (the message
            names the file and every mismatched, missing or unexpected encoder key with both shapes).
    """
    if head_init not in ("zero", "keep"):
        raise ValueError(f"head_init must be 'zero' or 'keep', got {head_init!r}")
    weights_file, config, manifest = _resolve(Path(path))
    checkpoint = safetensors.torch.load_file(weights_file, device="cpu")
    report = LoadReport(source=str(weights_file), manifest=manifest)

    model_state = model.state_dict()
    renames = _norm_renames(model_state, checkpoint)
    report.mapped = sorted(renames.items())
    encoder_state = {}
    for key, tensor in checkpoint.items():
        name = renames.get(key, key)
        root = name.split(".")[0]
        if root in HEAD_MODULES or not hasattr(model, root):
            report.dropped.append(key)
        else:
            encoder_state[name] = tensor

    source_grid = _check_fits(model, model_state, encoder_state, config, weights_file)
    target_grid = tuple(model.patch_embed.grid_size)
    if "pos_embed" in encoder_state and source_grid != target_grid:
        encoder_state["pos_embed"] = resample_abs_pos_embed(
            encoder_state["pos_embed"].float(),  # interpolate in fp32 whatever the stored dtype
            new_size=list(target_grid),
            old_size=list(source_grid),
            num_prefix_tokens=_num_pos_prefix(model),
            interpolation="bicubic",
        )
        report.resized.append(("pos_embed", source_grid, target_grid))

    result = model.load_state_dict(encoder_state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    resized = {key for key, _, _ in report.resized}
    report.loaded = [k for k in model_state if k in encoder_state and k not in resized]
    report.initialised = [k for k in model_state if k not in encoder_state]
    assert set(result.missing_keys) == set(report.initialised), (result.missing_keys, report.initialised)
    if head_init == "zero" and isinstance(model.head, torch.nn.Linear):
        with torch.no_grad():
            model.head.weight.zero_()
            model.head.bias.zero_()
    return report


def _resolve(path: Path) -> tuple[Path, dict, dict]:
    """Weights file, config.json and mimpipe.json (empty dicts when absent) for an export folder or a file."""
    if path.is_dir():
        weights_file = path / "model.safetensors"
        if not weights_file.is_file():
            raise ValueError(f"encoder folder {path} has no model.safetensors")
        return weights_file, _read_json(path / "config.json"), _read_json(path / "mimpipe.json")
    if path.suffix == ".safetensors" and path.is_file():
        return path, {}, {}
    raise ValueError(f"encoder path {path} is neither an export folder nor a .safetensors file (no pickles loaded)")


def _read_json(path: Path) -> dict:
    """The file's JSON object, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _norm_renames(model_state: dict, checkpoint: dict) -> dict[str, str]:
    """Checkpoint key -> model key for the final norm when the checkpoint has it on the other side of pooling."""
    renames = {}
    for src, dst in (NORM_PAIR, NORM_PAIR[::-1]):
        src_keys = [k for k in checkpoint if k.startswith(f"{src}.")]
        if src_keys and not _has(checkpoint, dst) and _has(model_state, dst) and not _has(model_state, src):
            renames |= {k: dst + k[len(src) :] for k in src_keys}
    return renames


def _has(state: dict, module: str) -> bool:
    return any(k.startswith(f"{module}.") for k in state)


def _num_pos_prefix(model: VisionTransformer) -> int:
    """Prefix (cls / register) tokens that carry a position embedding; grid positions follow them."""
    return 0 if model.no_embed_class else model.num_prefix_tokens


def _check_fits(
    model: VisionTransformer, model_state: dict, encoder_state: dict, config: dict, weights_file: Path
) -> tuple[int, int]:
    """Raise a ValueError listing every encoder key that does not fit; return the checkpoint's patch grid."""
    problems, target_grid = [], tuple(model.patch_embed.grid_size)
    source_grid = target_grid
    for key, tensor in encoder_state.items():
        if key not in model_state:
            problems.append(f"unexpected encoder key {key}: checkpoint {tuple(tensor.shape)}, not in the model")
            continue
        want = tuple(model_state[key].shape)
        if key == "pos_embed" and tensor.ndim == 3 and tensor.shape[-1] == want[-1]:
            grid = _pos_grid(tensor.shape[1] - _num_pos_prefix(model), config, target_grid)
            if grid is not None:
                source_grid = grid
                continue
            problems.append(f"pos_embed: checkpoint {tuple(tensor.shape)} vs model {want} (no patch grid fits)")
        elif tuple(tensor.shape) != want:
            problems.append(f"{key}: checkpoint {tuple(tensor.shape)} vs model {want}")
    for key, tensor in model_state.items():
        if key not in encoder_state and key.split(".")[0] not in HEAD_MODULES:
            problems.append(f"missing encoder key {key}: model {tuple(tensor.shape)}, not in the checkpoint")
    if problems:
        raise ValueError(f"{weights_file} does not fit the model ({len(problems)} keys):\n  " + "\n  ".join(problems))
    return source_grid


def _pos_grid(num_patches: int, config: dict, target_grid: tuple[int, int]) -> tuple[int, int] | None:
    """The checkpoint's (rows, cols) patch grid: from config.json's img_size / patch_size; without a config, the
    model's grid when the counts agree, else a square one."""
    args = config.get("model_args", {})
    if "img_size" in args and "patch_size" in args:
        img, patch = (_pair(args[k]) for k in ("img_size", "patch_size"))
        grid = (img[0] // patch[0], img[1] // patch[1])
        return grid if grid[0] * grid[1] == num_patches else None
    if target_grid[0] * target_grid[1] == num_patches:
        return target_grid
    side = math.isqrt(num_patches)
    return (side, side) if side * side == num_patches else None


def _pair(value: int | list[int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (value[0], value[1])


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
