"""core/compat/timm.py: every patch's check passes on the installed timm, and fails loudly, naming the patch, what
changed and the installed version, when the internal it relies on is missing or behaves otherwise (monkeypatch on
the installed modules: a timm release that differs in exactly that internal). The patches themselves: Posterize
keeps one bit at the top magnitude, and the export twin carries the given tensors and nothing else of the model."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import safetensors.torch
import timm
import timm.models
import torch
from PIL import Image
from timm.data import auto_augment

from core.compat import timm as timm_compat
from core.compat.timm import PATCHES, TimmCompatError
from tests.compat_checks import assert_check_fails

HPARAMS = {"translate_const": 10, "img_mean": (124, 116, 104)}


def _fails(patch: str, *phrases: str) -> None:
    """Asserts the patch's check raises an error naming the patch, the installed version and each phrase."""
    named = (f"timm patch '{patch}'", f"installed timm {timm.__version__}")
    assert_check_fails(lambda: timm_compat.check(patch), TimmCompatError, *named, *phrases)


@pytest.mark.parametrize("name", sorted(PATCHES))
def test_every_check_passes_on_the_installed_timm(name):
    timm_compat.check(name)


@pytest.mark.parametrize("attribute", ["posterize", "AugmentOp", "rand_augment_transform"])
def test_a_missing_augmentation_internal_fails(monkeypatch, attribute):
    monkeypatch.delattr(auto_augment, attribute)
    _fails("posterize_min_bits", f"timm.data.auto_augment.{attribute} is missing")


def test_policies_that_hold_their_ops_elsewhere_fail(monkeypatch):
    """A RandAugment keeping its ops under another name: the patch would find no op and change nothing."""
    build = auto_augment.rand_augment_transform

    def rand_augment_transform(config_str, hparams, transforms=None):
        policy = build(config_str, hparams, transforms)
        policy._ops = policy.__dict__.pop("ops")
        return policy

    monkeypatch.setattr(auto_augment, "rand_augment_transform", rand_augment_transform)
    _fails("posterize_min_bits", "no Posterize op is found in policy 'rand-m9-mstd0.5-inc1' (its ops: [])")


def test_an_op_that_ignores_its_aug_fn_fails(monkeypatch):
    def call(self, img):  # applies the op named at construction, whatever aug_fn holds now
        return self.fixed_fn(img, *self.level_fn(self.magnitude, self.hparams), **self.kwargs)

    monkeypatch.setattr(auto_augment.AugmentOp, "fixed_fn", lambda self, img, *args, **kwargs: img, raising=False)
    monkeypatch.setattr(auto_augment.AugmentOp, "__call__", call)
    _fails("posterize_min_bits", "AugmentOp no longer calls the aug_fn assigned to it")


def test_posterize_at_the_top_magnitude_keeps_one_bit_in_every_policy_kind():
    image = Image.fromarray(np.tile(np.arange(0, 256, 16, dtype=np.uint8), (16, 1))).convert("RGB")  # a ramp
    for spec in ("rand-m9-mstd0.5-inc1", "original", "augmix-m5-w4-d2"):
        builder = {"rand": auto_augment.rand_augment_transform, "augmix": auto_augment.augment_and_mix_transform}
        policy = builder.get(spec.split("-")[0], auto_augment.auto_augment_transform)(spec, dict(HPARAMS))
        op = next(op for op in timm_compat.policy_ops(policy) if op.name.startswith("Posterize"))
        op.magnitude, op.magnitude_std, op.prob, op.level_fn = 10, 0, 1.0, lambda magnitude, hparams: (0,)
        with pytest.raises(ValueError, match="bits"):  # what timm's own op does: Pillow refuses 0 bits
            op(image)
        timm_compat.posterize_at_least_1_bit(policy)
        assert set(np.asarray(op(image)).flatten().tolist()) == {0, 128}, spec  # one bit per channel


def test_save_for_hf_without_huggingface_hub_fails(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "huggingface_hub" else find_spec(name, *a)
    )
    _fails("save_for_hf", "huggingface_hub, which save_for_hf asserts is installed, cannot be imported")


def test_a_missing_or_changed_save_for_hf_fails(monkeypatch):
    monkeypatch.delattr(timm.models, "save_for_hf")
    _fails("save_for_hf", "timm.models.save_for_hf is missing")
    monkeypatch.setattr(
        timm.models, "save_for_hf", lambda model, save_directory, model_config=None: None, raising=False
    )
    _fails("save_for_hf", "takes (model, save_directory, model_config), without model_args, safe_serialization")


def test_a_save_for_hf_that_no_longer_saves_the_state_dict_fails(monkeypatch):
    """A twin's state is all the export hands timm: a save_for_hf that reads the weights some other way (here from
    the parameters' storages) would write what the twin does not replace."""

    def save_for_hf(model, save_directory, model_config=None, model_args=None, safe_serialization=False):
        safetensors.torch.save_file(dict(model.named_parameters()), f"{save_directory}/model.safetensors")

    monkeypatch.setattr(timm.models, "save_for_hf", save_for_hf)
    _fails("save_for_hf", "no longer writes model.state_dict()")


def test_save_for_hf_writes_the_given_tensors_and_a_rebuilding_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = dict(img_size=16, patch_size=4, embed_dim=32, depth=1, num_heads=2, num_classes=0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **args)
    tensors = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    timm_compat.save_for_hf(model, tmp_path, tensors, model_config={"pretrained_cfg": {"tag": "t"}}, model_args=args)

    written = safetensors.torch.load_file(tmp_path / timm_compat.HF_WEIGHTS_NAME)
    assert sorted(written) == sorted(tensors) and all(torch.equal(written[k], v) for k, v in tensors.items())
    assert all(not torch.equal(v, torch.full_like(v, 0.5)) for k, v in model.state_dict().items() if "weight" in k)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architecture"] == "vit_tiny_patch16_224" and config["model_args"]["embed_dim"] == 32
    assert config["pretrained_cfg"]["tag"] == "t"


def test_save_for_hf_that_writes_no_weights_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(timm.models, "save_for_hf", lambda model, save_directory, **kw: None)
    monkeypatch.setattr(timm_compat, "check", lambda *names: None)  # the signature check aside
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, depth=1)
    with pytest.raises(TimmCompatError, match="did not write model.safetensors"):
        timm_compat.save_for_hf(model, tmp_path, model.state_dict(), model_config={}, model_args={})
