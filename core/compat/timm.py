"""Every place the pipeline relies on timm internals, each a named check that runs before the patch is applied.

timm's augmentation policies and its Hugging Face export are used through their public functions, but two uses
reach further: a policy's ops are patched in place, and the export hands timm a stand-in of the model. A release
that renamed or reshaped what they rely on would make the patch silently do nothing (an op no longer found, an
assignment no longer read) or write an export without weights. So each patch runs its check before it is applied,
`parallelize` runs them all at start-up, and a changed internal stops the run with a `TimmCompatError`
naming the patch, what changed and `timm.__version__`.

Patches (`PATCHES`, by name):
    posterize_min_bits  timm's Posterize ops (RandAugment, AutoAugment, AugMix) asked to keep at least one bit:
                        their `aug_fn` is replaced on the ops a policy object holds in `ops` / `policy`
    save_for_hf         `timm.models.save_for_hf` writes `model.state_dict()` and config.json: it is given a twin
                        of the model whose state is detached, contiguous, unshared copies, which safetensors accepts
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import timm
import timm.models
import torch
from PIL import Image
from timm.data import auto_augment
from torch import nn

from core.compat.checks import CompatError, Library, run_checks

WRITTEN_FOR = "1.0"
"""The timm release series the patches were written against (checked on 1.0.31; pyproject's pin covers exactly it)."""

HF_WEIGHTS_NAME = "model.safetensors"
"""The weights file `save_for_hf` writes with safe serialization, which `timm.create_model('local-dir:...')` reads."""

_SAVE_FOR_HF_PARAMS = ("model", "save_directory", "model_config", "model_args", "safe_serialization")
_PROBE_HPARAMS = {"translate_const": 10, "img_mean": (124, 116, 104), "translate_pct": 0.3}
_PROBE_POLICIES = ("rand-m9-mstd0.5-inc1", "v0", "augmix-m5-w4-d2")


class TimmCompatError(CompatError):
    """The installed timm no longer has an internal that a patch in this module relies on."""


TIMM = Library("timm", "timm", __name__, WRITTEN_FOR, "timm>=1.0.20,<1.1", TimmCompatError)


def check(*names: str) -> None:
    """Run the checks of the named patches (default: all); raises TimmCompatError at the first that fails."""
    run_checks(PATCHES, names)


# posterize_min_bits


def policy_ops(policy: Callable) -> list:
    """The `AugmentOp`s of a timm RandAugment / AugMix (`ops`) or AutoAugment (`policy`, a list of sub-policies)."""
    return list(getattr(policy, "ops", [])) + [op for sub in getattr(policy, "policy", []) for op in sub]


def posterize_at_least_1_bit(policy: Callable) -> Callable:
    """`policy` with its Posterize ops keeping at least one bit.

    timm's posterize asks for 0 bits at the top magnitude (`PosterizeIncreasing` at m10, reached by m9 with
    mstd0.5), which Pillow >= 11 rejects; one bit is the same picture at the extreme of the range.
    """
    check("posterize_min_bits")
    for op in policy_ops(policy):
        if op.name.startswith("Posterize"):
            op.aug_fn = _posterize_at_least_1_bit
    return policy


def _posterize_at_least_1_bit(img: Image.Image, bits_to_keep: int, **kwargs) -> Image.Image:
    return auto_augment.posterize(img, max(1, bits_to_keep), **kwargs)


def _policy(patch: str, spec: str) -> Callable:
    builders = {"rand": "rand_augment_transform", "augmix": "augment_and_mix_transform"}
    build = TIMM.attr(patch, auto_augment, builders.get(spec.split("-")[0], "auto_augment_transform"))
    return build(spec, dict(_PROBE_HPARAMS))


def _check_posterize_min_bits(patch: str) -> None:
    TIMM.attr(patch, auto_augment, "posterize")
    op_class = TIMM.attr(patch, auto_augment, "AugmentOp")
    for spec in _PROBE_POLICIES:
        try:
            names = [getattr(op, "name", None) for op in policy_ops(_policy(patch, spec))]
        except TimmCompatError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure means the policy builders changed
            TIMM.fail(patch, f"building policy {spec!r} failed ({err!r})")
        if not any(str(name).startswith("Posterize") for name in names):
            TIMM.fail(patch, f"no Posterize op is found in policy {spec!r} (its ops: {names})")
    asked = []
    op = op_class("PosterizeIncreasing", prob=1.0, magnitude=10)
    op.aug_fn = lambda img, *args, **kwargs: asked.append(args) or img
    try:
        op(Image.new("RGB", (2, 2)))
    except Exception as err:  # noqa: BLE001 - the replaced aug_fn cannot fail
        TIMM.fail(patch, f"an AugmentOp whose aug_fn is replaced failed ({err!r})")
    if len(asked) != 1:
        TIMM.fail(patch, "AugmentOp no longer calls the aug_fn assigned to it")


# save_for_hf


def save_for_hf(
    model: nn.Module, directory: Path, tensors: dict[str, torch.Tensor], *, model_config: dict, model_args: dict
) -> None:
    """Write `tensors` as `model`'s weights (`HF_WEIGHTS_NAME`) and its config.json with timm's `save_for_hf`.

    Args:
        model: A timm model (it carries its `pretrained_cfg` and the arguments it was built with).
        directory: The folder to write into.
        tensors: `model`'s state dict as it is to be written: tensors safetensors accepts (no shared storage).
        model_config: Passed to timm (e.g. {"pretrained_cfg": overrides}).
        model_args: Arguments that rebuild the architecture, written into config.json.
    """
    check("save_for_hf")
    twin = _twin(model, tensors)
    timm.models.save_for_hf(twin, directory, model_config=model_config, model_args=model_args, safe_serialization=True)
    if not (Path(directory) / HF_WEIGHTS_NAME).is_file():
        TIMM.fail("save_for_hf", f"save_for_hf(safe_serialization=True) did not write {HF_WEIGHTS_NAME}")


def _twin(model: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of `model` whose parameters and buffers are `tensors` (by state-dict key), everything else (recorded
    model args, pretrained_cfg) copied. Its parameters are first copied to the meta device, so no memory is spent
    on values about to be replaced."""
    state = model.state_dict(keep_vars=True)
    memo: dict[int, Any] = {}
    for value in state.values():
        meta = torch.empty_like(value, device="meta")
        memo[id(value)] = nn.Parameter(meta, value.requires_grad) if isinstance(value, nn.Parameter) else meta
    twin = copy.deepcopy(model, memo)
    twin.load_state_dict(tensors, assign=True)  # tied entries become separate tensors, as `tensors` holds them
    return twin


def _check_save_for_hf(patch: str) -> None:
    if importlib.util.find_spec("huggingface_hub") is None:
        TIMM.fail(patch, "huggingface_hub, which save_for_hf asserts is installed, cannot be imported")
    fn = inspect.unwrap(TIMM.attr(patch, timm.models, "save_for_hf"))
    params = tuple(inspect.signature(fn).parameters)
    missing = [p for p in _SAVE_FOR_HF_PARAMS if p not in params]
    if missing:
        TIMM.fail(patch, f"timm.models.save_for_hf takes ({', '.join(params)}), without {', '.join(missing)}")
    if "state_dict" not in fn.__code__.co_names:
        TIMM.fail(patch, "timm.models.save_for_hf no longer writes model.state_dict(), which the twin model replaces")


PATCHES: dict[str, Callable[[str], None]] = {
    "posterize_min_bits": _check_posterize_min_bits,
    "save_for_hf": _check_save_for_hf,
}
