"""Export a trained encoder as a timm-loadable folder: `timm.create_model('local-dir:DIR', pretrained=True)`.

The folder holds timm's Hugging Face layout plus our manifest:

    config.json        architecture, model_args, pretrained_cfg (mean/std/input_size/interpolation), num_classes
    model.safetensors  the encoder state dict, tensors only (never pickled)
    mimpipe.json       how it was made: the caller's manifest + created time, tensor count, library versions
    README.md          the model card in the Hugging Face Hub's format (core/export/card.py)

The export is written into a temporary folder beside `out_dir` and renamed into place only once complete and
verified, so a crash leaves either the previous export or the new one, never a half-written mix. Every file in it gets
the mode a new file gets under the process's umask (0644 under umask 022): safetensors writes its file through a
private temporary file (0600), which on a shared file system nobody else could load.

config.json's `pretrained_cfg` describes these weights only: timm copies the registry's entry for the architecture,
whose `license` (and paper, notes) are those of timm's own released weights, so they are dropped; `license` is written
only when the caller sets one, and the card (core/export/card.py) reads it from there, so the two never disagree.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import safetensors
import safetensors.torch
import timm
import torch
from timm.layers import Attention
from timm.models import VisionTransformer

from core.compat import timm as timm_compat
from core.export.card import write_card
from core.export.card_facts import RunFacts, run_facts
from core.export.manifest import MANIFEST_NAME
from core.launch.ckpt_files import fsync_path
from core.models.build import build_model, model_args
from core.recipe.config import Config
from data.specs import is_synthetic

_ADDED_MANIFEST_KEYS = ("created", "num_tensors", "num_params", "versions", "synthetic_data")
_DATA_CONFIG_KEYS = ("mean", "std", "interpolation", "crop_pct", "crop_mode")
SOURCE_WEIGHTS_KEYS = ("license", "description", "origin_url", "paper_ids", "paper_name", "notes")
"""pretrained_cfg keys of timm's registry entry that describe timm's released weights, not ours (config.json leaves
them out; `license` comes back when the export is given one)."""


def export_model(
    model: VisionTransformer,
    out_dir: str | Path,
    *,
    model_args: dict,
    manifest: dict,
    data_config: dict | None = None,
    extra_files: dict[str, Callable[[Path], None]] | None = None,
    facts: RunFacts | None = None,
    license_id: str | None = None,
) -> Path:
    """Write `model` as a timm `local-dir` folder with a manifest and a model card, atomically replacing any
    previous export.

    Args:
        model: A materialised CPU timm ViT (built by `timm.create_model`, so it carries its `pretrained_cfg`).
        out_dir: Export folder; created, or replaced if it already holds a mimpipe export.
        model_args: Arguments that rebuild the architecture (img_size, patch_size, embed_dim, depth, num_heads,
            mlp_ratio, global_pool, ...). Drop rates are left out: regularisation is the fine-tuner's choice.
        manifest: JSON-serialisable facts about the run (method, step, recipe, data, pooling hint, ...).
        data_config: Preprocessing the encoder was trained with (mean, std, interpolation, crop_pct, crop_mode),
            written into config.json's `pretrained_cfg`; the model's own defaults otherwise.
        extra_files: More files of the export, by name: each function writes its file at the path it is given
            (inside the folder before it is swapped in, so they are part of the same atomic replacement).
        facts: What the card says of the run beyond the manifest (data, schedule, monitors: `run_facts`); None for
            an export without a run (`python -m finetune convert`).
        license_id: The weights' license, a Hub identifier (`apache-2.0`, `mit`, `cc-by-nc-4.0`, `other`): written as
            config.json's `pretrained_cfg.license` and the card's `license:`; None: neither claims one.

    Returns:
        The export folder.

    Raises:
        ValueError: `out_dir` exists and is not a mimpipe export, the manifest is not JSON-serialisable or uses a
            reserved key, a data_config key is unknown, the license is not an identifier, or the written config does
            not rebuild `model`.
    """
    if license_id is not None and not re.fullmatch(r"[A-Za-z0-9][\w.+-]*", str(license_id)):
        raise ValueError(f"license {license_id!r}: expected a Hub license identifier such as apache-2.0 or mit")
    out_dir = Path(out_dir)
    check_replaceable(out_dir)
    tensors = _detached_state_dict(model)
    full_manifest = _complete_manifest(manifest, tensors)
    overlay = _pretrained_cfg_overlay(data_config)
    arch_args = {k: v for k, v in model_args.items() if not k.endswith("drop_rate") and k != "drop_path_rate"}

    with atomic_folder(out_dir) as tmp_dir:
        # timm's save_for_hf writes `model.state_dict()` as it is, which safetensors refuses when tensors share
        # storage (views into a flat optimizer buffer, tied weights): it is given the detached copies instead.
        timm_compat.save_for_hf(model, tmp_dir, tensors, model_config={"pretrained_cfg": overlay}, model_args=arch_args)
        _own_pretrained_cfg(tmp_dir / "config.json", license_id)
        (tmp_dir / MANIFEST_NAME).write_text(json.dumps(full_manifest, indent=2) + "\n")
        for name, write in (extra_files or {}).items():
            write(tmp_dir / name)
        write_card(tmp_dir, location=f"local-dir:{out_dir}", facts=facts)
        _check_rebuilds(model, tmp_dir, tensors)
    return out_dir


def export_state_dict(
    cfg: Config,
    state_dict: dict,
    out_dir: Path,
    *,
    num_classes: int,
    manifest: dict,
    extra_files: dict[str, Callable[[Path], None]] | None = None,
    run_dir: Path | None = None,
    license_id: str | None = None,
) -> Path:
    """Rebuild the plain timm model on CPU, load `state_dict` strictly and export it (timm HF layout), with
    `extra_files` and `license_id` (see `export_model`) and a card that describes the run: its data and schedule, what
    `model.init` was (`run_facts`), and from `run_dir`'s metrics.jsonl the monitors' last values at the manifest's
    `step`."""
    model = build_model(cfg, num_classes=num_classes)
    model.load_state_dict(state_dict, strict=True)
    data_config = {
        "mean": cfg.data.mean,
        "std": cfg.data.std,
        "interpolation": "bicubic",
        "crop_pct": cfg.data.eval_crop_pct,
    }
    facts = run_facts(cfg, run_dir=run_dir, step=manifest.get("step"))
    return export_model(
        model, out_dir, model_args=model_args(model), manifest=manifest, data_config=data_config,
        extra_files=extra_files, facts=facts, license_id=license_id,
    )  # fmt: skip


@contextlib.contextmanager
def atomic_folder(out_dir: Path):
    """Yields an empty temporary folder beside `out_dir`; when the block succeeds its files are fsynced and it
    replaces `out_dir` in one rename (an earlier export is moved aside first); on failure it is removed and
    `out_dir` is untouched. So a crash never leaves a half-written export. Every file written in it is given the
    mode of a new file under the umask (`normal_file_mode`), whatever its writer used."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{secrets.token_hex(4)}"
    tmp_dir.mkdir()  # the usual umask permissions, unlike tempfile.mkdtemp's 0o700
    try:
        yield tmp_dir
        mode = normal_file_mode(tmp_dir)
        for path in tmp_dir.rglob("*"):
            if path.is_file() and not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) != mode:
                os.chmod(path, mode)  # e.g. safetensors' 0600 (it writes a private temporary file and renames it)
        for path in sorted(tmp_dir.iterdir()):
            fsync_path(path)
        fsync_path(tmp_dir)
        swap_in(tmp_dir, out_dir)
    finally:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir)


def normal_file_mode(folder: Path) -> int:
    """The permission bits a new file gets in `folder` (0o644 under umask 022; a default ACL of the folder counts
    too), read from a file created there and removed: the umask cannot be read without setting it, which would race
    with other threads creating files."""
    probe = folder / f".mode-{secrets.token_hex(4)}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
        probe.unlink()


def check_replaceable(out_dir: Path) -> None:
    """Refuse to replace anything but an empty folder or an earlier export (a run dir passed by mistake)."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ValueError(f"export path {out_dir} exists and is not a folder")
    if any(out_dir.iterdir()) and not (out_dir / MANIFEST_NAME).is_file():
        raise ValueError(f"export path {out_dir} is a non-empty folder without {MANIFEST_NAME}; refusing to replace it")


def _detached_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """CPU copies with their own contiguous storage: safetensors refuses shared or strided tensors (e.g. views
    into a flat optimizer buffer); dtypes (fp32 / bf16) are kept as given."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}


def _complete_manifest(manifest: dict, tensors: dict[str, torch.Tensor]) -> dict:
    reserved = sorted(set(manifest) & set(_ADDED_MANIFEST_KEYS))
    if reserved:
        raise ValueError(f"manifest keys {reserved} are reserved: export_model writes them itself")
    full = {
        **manifest,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "num_tensors": len(tensors),
        "num_params": sum(t.numel() for t in tensors.values()),
        "versions": {"torch": torch.__version__, "timm": timm.__version__, "safetensors": safetensors.__version__},
    }
    train = ((manifest.get("config") or {}).get("data") or {}).get("train")
    if train:  # the run's recipe: say whether it trained on synthetic images (the quickstart's fallback)
        full["synthetic_data"] = is_synthetic(train)
    try:
        json.dumps(full)
    except (TypeError, ValueError) as e:
        raise ValueError(f"manifest is not JSON-serialisable: {e}") from e
    return full


def _pretrained_cfg_overlay(data_config: dict | None) -> dict:
    data_config = dict(data_config or {})
    unknown = sorted(set(data_config) - set(_DATA_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"data_config keys {unknown} are not preprocessing keys {list(_DATA_CONFIG_KEYS)}")
    for key in ("mean", "std"):
        if key in data_config:
            data_config[key] = tuple(float(v) for v in data_config[key])
    # The source tag of the registry's default weights (e.g. 'augreg_in21k_ft_in1k') does not describe ours.
    return {"tag": "mimpipe", **data_config}


def _own_pretrained_cfg(config_path: Path, license_id: str | None) -> None:
    """config.json without what describes timm's released weights (`SOURCE_WEIGHTS_KEYS`), with `license_id` as
    `pretrained_cfg.license` when there is one."""
    config = json.loads(config_path.read_text())
    cfg = {k: v for k, v in config.get("pretrained_cfg", {}).items() if k not in SOURCE_WEIGHTS_KEYS}
    config["pretrained_cfg"] = cfg | ({"license": license_id} if license_id is not None else {})
    config_path.write_text(json.dumps(config, indent=2))


def _check_rebuilds(model: VisionTransformer, export_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Build the architecture from the written config on the meta device and compare it with `model`."""
    with torch.device("meta"):
        rebuilt = timm.create_model(f"local-dir:{export_dir}", pretrained=False)
    shapes = {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()}
    problems = [
        f"{k}: config builds {shapes.get(k)} vs model {tuple(t.shape)}"
        for k, t in tensors.items()
        if shapes.get(k) != tuple(t.shape)
    ]
    problems += [f"{k}: config builds it, model has no such tensor" for k in shapes if k not in tensors]
    heads = _num_heads(model), _num_heads(rebuilt)
    if heads[0] != heads[1]:
        built, have = (", ".join(map(str, sorted(set(h)))) for h in (heads[1], heads[0]))
        problems.append(f"num_heads: config builds {built} vs model {have}")
    if problems:
        raise ValueError("model_args do not rebuild the exported model:\n  " + "\n  ".join(problems))


def _num_heads(model: torch.nn.Module) -> list[int]:
    """Heads of every timm attention layer (weights do not show them); [] for a model without any."""
    return [m.num_heads for m in model.modules() if isinstance(m, Attention)]


def swap_in(tmp_dir: Path, out_dir: Path) -> None:
    """Rename the finished export into place; an existing export is moved aside first and removed after."""
    if not out_dir.exists():
        os.replace(tmp_dir, out_dir)
    else:
        old_dir = out_dir.parent / f".{out_dir.name}.old-{secrets.token_hex(4)}"
        os.replace(out_dir, old_dir)
        try:
            os.replace(tmp_dir, out_dir)
        except BaseException:
            os.replace(old_dir, out_dir)
            raise
        shutil.rmtree(old_dir)
    fsync_path(out_dir.parent)
