"""Read a pretrained ViT checkpoint safely, tell its format from its keys, and map it onto timm names.

Formats (`Checkpoint.format`), told apart by their keys:

    mimpipe-export   our export folder: config.json + model.safetensors + mimpipe.json
    deit-distilled   DeiT distilled: dist_token (1, 1, D), pos_embed (1, 2 + N, D), head.* and head_dist.*
    mae-pretrain     official MAE pretraining: the encoder plus mask_token and decoder_* (a pickle with `args`)
    mae-finetune     official MAE fine-tuned: fc_norm.* after global average pooling, no final norm.*
    timm             any other timm ViT state dict (a timm ViT with global_pool='avg' reads as mae-finetune:
                     same keys, same mapping)

Files are read without running code: `.safetensors`, or `torch.load(weights_only=True)` for `.pth` / `.bin` / `.pt`.
A pickle that holds more than tensors and plain containers (official MAE/DeiT checkpoints pickle an
`argparse.Namespace`) is refused with a message naming the file, unless the caller trusts it explicitly.
Training checkpoints are unwrapped ({"model" | "state_dict" | "model_ema": state_dict, "optimizer": ...}) and a
`module.` (DDP) or `_orig_mod.` (torch.compile) prefix on every key is stripped.

Shape legend: D embedding width, N patches, P prefix tokens with a position (cls, dist).
"""

from __future__ import annotations

import json
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from timm.models import VisionTransformer

from core.export.hub import hub_folder, is_hub_spec
from core.export.manifest import MANIFEST_NAME

FORMATS = ("mimpipe-export", "mae-pretrain", "mae-finetune", "timm", "deit-distilled")
TRUST_HINT = "model.trust_checkpoint=true (python -m finetune convert: --trust-checkpoint)"
# Where training scripts put the weights, most preferred first: the raw weights before an EMA copy.
WRAPPER_KEYS = ("model", "state_dict", "model_ema", "state_dict_ema", "module")
# Prefixes that wrappers put on every key: DistributedDataParallel, torch.compile.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
# Files looked for in a folder, in order; config.json and mimpipe.json are read beside them.
FOLDER_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
# The final norm sits before pooling for the cls token (`norm`) and after it for global average pooling (`fc_norm`).
NORM_PAIR = ("norm", "fc_norm")


@dataclass
class Checkpoint:
    """A checkpoint's tensors under timm names, with where they came from."""

    state: dict[str, torch.Tensor]
    source: Path
    """The file the tensors were read from."""
    format: str
    config: dict = field(default_factory=dict)
    """config.json beside the weights (timm's model_args give the pretraining grid), or {}."""
    manifest: dict = field(default_factory=dict)
    """mimpipe.json beside the weights, or {}."""
    notes: list[str] = field(default_factory=list)
    """How the file was unwrapped, e.g. "weights from the checkpoint's 'model' entry"."""


# The first layer of each encoder `model.arch` builds: a ViT's (hybrid's) patch projection, T2T-ViT's token
# projection, VT-ResNet's stem convolution; a checkpoint has one of them.
STEM_KEYS = ("patch_embed.proj.weight", "tokens_to_token.project.weight", "conv1.weight")


def read_checkpoint(path: str | Path, *, trust: bool = False, shapes_only: bool = False) -> Checkpoint:
    """Read any accepted checkpoint and detect its format.

    Args:
        path: Our export folder (or any folder with model.safetensors / pytorch_model.bin), a `.safetensors`
            file, a torch pickle (`.pth`, `.bin`, `.pt`, ...), or `hf-hub:ORG/NAME[@REVISION]` (a Hub repo in timm's
            layout, read from the local Hub cache: core/export/hub.py).
        trust: Allow a full unpickle (arbitrary code) when the pickle holds objects other than tensors.
        shapes_only: Read only the header of a safetensors file: its tensors come back on the meta device (shapes,
            no values, float32 whatever was stored). A pickle is read as usual (memory-mapped when it is a zip).

    Returns:
        The checkpoint, keys stripped of wrapper prefixes.

    Raises:
        ValueError: A missing or unreadable file, a pickle that needs `trust`, or contents that are not a ViT state
            dict; the message names the file.
    """
    weights_file, config, manifest = _resolve(local_path(path))
    if shapes_only and weights_file.suffix == ".safetensors":
        contents, notes = _safetensors_shapes(weights_file), []
    else:
        contents, notes = _load_file(weights_file, trust)
    state, unwrap_notes = _unwrap(contents, weights_file)
    notes += unwrap_notes
    if is_hub_spec(path):
        notes.insert(0, f"{path} from the Hugging Face cache: {weights_file.parent}")
    if not any(key in state for key in STEM_KEYS):
        raise ValueError(
            f"{weights_file} is not a ViT checkpoint: none of {', '.join(STEM_KEYS)} among its {len(state)} tensors "
            f"(first keys: {', '.join(list(state)[:5])})"
        )
    fmt = "mimpipe-export" if manifest else detect_format(state)
    return Checkpoint(state, weights_file, fmt, config=config, manifest=manifest, notes=notes)


def checkpoint_keys(path: str | Path, *, trust: bool = False) -> list[str]:
    """The tensor names of a checkpoint (timm names), reading only the header of a safetensors file."""
    weights_file, _, _ = _resolve(local_path(path))
    if weights_file.suffix == ".safetensors":
        return list(_strip_prefixes(_safetensors_shapes(weights_file))[0])
    return list(_unwrap(_load_file(weights_file, trust)[0], weights_file)[0])


def read_manifest(path: str | Path) -> dict:
    """mimpipe.json of an export folder (a Hub repo's too); {} for anything else."""
    path = local_path(path)
    return read_json(path / MANIFEST_NAME) if path.is_dir() else {}


def local_path(path: str | Path) -> Path:
    """Where a checkpoint path is on this machine: itself, or for `hf-hub:ORG/NAME` the repo's snapshot folder in
    the Hub cache (downloaded unless offline).

    Raises:
        ValueError: A Hub repo that is neither cached nor downloadable (one line, naming the cache).
    """
    return hub_folder(str(path)) if is_hub_spec(path) else Path(path)


def detect_format(keys) -> str:
    """One of `FORMATS` (never "mimpipe-export", which is told by its manifest) from the tensor names."""
    keys = set(keys)
    if "dist_token" in keys:
        return "deit-distilled"
    if "mask_token" in keys or any(k.startswith("decoder_") for k in keys):
        return "mae-pretrain"
    if has_module(keys, "fc_norm") and not has_module(keys, "norm"):
        return "mae-finetune"
    return "timm"


def has_module(keys, module: str) -> bool:
    """Whether any key belongs to the top-level `module` (`norm` does not match `norm_pre` or `fc_norm`)."""
    return any(k.startswith(f"{module}.") for k in keys)


def norm_renames(model_keys, state_keys) -> dict[str, str]:
    """Checkpoint key -> model key for the final norm when the checkpoint has it on the other side of pooling."""
    renames = {}
    for src, dst in (NORM_PAIR, NORM_PAIR[::-1]):
        src_keys = [k for k in state_keys if k.startswith(f"{src}.")]
        fits_other_side = has_module(model_keys, dst) and not has_module(model_keys, src)
        if src_keys and fits_other_side and not has_module(state_keys, dst):
            renames |= {k: dst + k[len(src) :] for k in src_keys}
    return renames


def match_prefix_tokens(
    state: dict[str, torch.Tensor], model: VisionTransformer
) -> tuple[dict[str, torch.Tensor], set[str], list[str]]:
    """Fit a distilled checkpoint to a plain model or the reverse, through pos_embed's prefix positions.

    A DeiT checkpoint's pos_embed (1, 2 + N, D) has a cls and a dist position; a plain ViT's (1, 1 + N, D) only the
    cls one. The dist position is removed (dist_token and head_dist are then dropped as keys the model lacks), or,
    for a distilled model from a plain checkpoint, inserted as a copy of the cls position (dist_token is left at
    timm's init).

    Returns:
        The state (pos_embed replaced when needed), model keys the checkpoint may leave uninitialised, and notes.
    """
    has_dist, wants_dist = "dist_token" in state, isinstance(getattr(model, "dist_token", None), torch.nn.Parameter)
    if has_dist == wants_dist:
        return state, set(), []
    pos = state.get("pos_embed")  # (1, P + N, D)
    with_prefix = pos is not None and model.has_class_token and not model.no_embed_class
    state = dict(state)
    if has_dist:
        if not with_prefix:
            return state, set(), []
        state["pos_embed"] = torch.cat([pos[:, :1], pos[:, 2:]], dim=1)  # (1, 1 + N, D)
        return state, set(), ["pos_embed: distillation-token position removed, cls position kept"]
    notes = ["dist_token: not in the checkpoint, left at timm's init"]
    if with_prefix:
        state["pos_embed"] = torch.cat([pos[:, :1], pos[:, :1], pos[:, 1:]], dim=1)  # (1, 2 + N, D)
        notes.append("pos_embed: distillation-token position initialised from the cls position")
    return state, {"dist_token"}, notes


def read_json(path: Path) -> dict:
    """The file's JSON object, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _resolve(path: Path) -> tuple[Path, dict, dict]:
    """Weights file, config.json and mimpipe.json (empty dicts when absent) for a folder or a file."""
    if path.is_dir():
        weights_file = next((path / name for name in FOLDER_WEIGHTS if (path / name).is_file()), None)
        if weights_file is None:
            raise ValueError(f"checkpoint folder {path} has none of {', '.join(FOLDER_WEIGHTS)}")
        return weights_file, read_json(path / "config.json"), read_json(path / MANIFEST_NAME)
    if path.is_file():
        return path, {}, {}
    raise ValueError(f"checkpoint path {path} does not exist")


def _safetensors_shapes(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors as meta tensors of their shapes, from its header alone (no weights read)."""
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            names = f.keys()  # a safe_open handle is not iterable
            return {key: torch.empty(f.get_slice(key).get_shape(), device="meta") for key in names}
    except (safetensors.SafetensorError, OSError) as e:
        raise ValueError(f"{path} is not a readable safetensors file: {e}") from None


def _load_file(path: Path, trust: bool) -> tuple[object, list[str]]:
    """The file's contents: safetensors, or a weights-only unpickle; a full unpickle only when `trust` and only when
    needed (then said in the returned notes)."""
    if path.suffix == ".safetensors":
        try:
            return safetensors.torch.load_file(path, device="cpu"), []
        except (safetensors.SafetensorError, OSError) as e:
            raise ValueError(f"{path} is not a readable safetensors file: {e}") from None
    mmap = zipfile.is_zipfile(path)  # torch.save's zip format can be memory-mapped, the legacy format cannot
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap), []
    except pickle.UnpicklingError as e:
        blocked = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        if blocked is None:
            raise ValueError(f"{path} is not a readable PyTorch checkpoint ({_reason(e)})") from None
        if not trust:
            raise ValueError(
                f"{path} is a pickle that holds more than tensors ({blocked.group(1)}); refusing to unpickle it, "
                f"since a pickle can run arbitrary code. If you trust this file, pass {TRUST_HINT}."
            ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"{path} is not a readable PyTorch checkpoint ({e or type(e).__name__})") from None
    try:
        contents = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)  # trusted by the caller
    except Exception as e:  # an arbitrary pickle can fail in arbitrary ways (e.g. a class that no longer exists)
        raise ValueError(f"{path} could not be unpickled even as trusted: {e!r}") from e
    return contents, [f"unpickled in full (trust_checkpoint): the file holds {blocked.group(1)}"]


def _reason(error: Exception) -> str:
    """The WeightsUnpickler's own reason out of torch's long weights-only message."""
    match = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\n|$)", str(error), flags=re.DOTALL)
    return match.group(1) if match else str(error).splitlines()[0]


def _unwrap(obj: object, path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The state dict inside a training checkpoint, wrapper prefixes stripped, with notes on what was done."""
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a {type(obj).__name__}, not a state dict")
    notes = []
    wrapper = next((k for k in WRAPPER_KEYS if isinstance(obj.get(k), dict)), None)
    if wrapper is not None:
        others = ", ".join(sorted(str(k) for k in obj if k != wrapper)) or "nothing else"
        notes.append(f"weights from the checkpoint's {wrapper!r} entry (ignored: {others})")
        obj = obj[wrapper]
    not_tensors = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if not_tensors or not obj:
        raise ValueError(f"{path} is not a state dict of tensors (non-tensor entries: {not_tensors[:5] or 'none'})")
    state, prefixes = _strip_prefixes(obj)
    notes += [f"stripped the {p!r} prefix from every key" for p in prefixes]
    return state, notes


def _strip_prefixes(state: dict) -> tuple[dict, list[str]]:
    """Remove each wrapper prefix that every key carries (repeatedly: DDP around a compiled model)."""
    stripped = []
    while True:
        prefix = next((p for p in WRAPPER_PREFIXES if state and all(k.startswith(p) for k in state)), None)
        if prefix is None:
            return state, stripped
        state = {k[len(prefix) :]: v for k, v in state.items()}
        stripped.append(prefix)
