"""Mixup / CutMix on batches: mixed images, soft labels, smoothing, validation, the batch stream wrapper; drawn on the
host, applied on the device (`data.device.batch_to_device`) with timm's values.

Shapes: B batch size, K classes, H/W image height/width.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from timm.data import Mixup

from data.device import batch_to_device
from data.mixing import MixBatches, build_mix, mixed

NUM_CLASSES = 6


def _batch(batch_size: int = 4, height: int = 8, width: int = 12) -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "image": torch.randn(batch_size, 3, height, width, generator=generator),  # (B, 3, H, W), values all distinct
        "label": torch.arange(batch_size, dtype=torch.int64) % NUM_CLASSES,  # (B,): i and B - 1 - i differ
        "key": [f"sample-{i}" for i in range(batch_size)],
        "num_corrupt": torch.tensor(2),
    }


def _mixed(mix: MixBatches, batch: dict) -> dict:
    """What the model sees: the batch with its draw applied on the device (here the CPU)."""
    return batch_to_device(mix(batch), torch.device("cpu"))


def _fix_lam(monkeypatch, lam: float) -> None:
    """Makes timm's Beta draw (numpy's global RNG) return `lam`."""
    monkeypatch.setattr(np.random, "beta", lambda *args, **kwargs: lam)


def test_mixup_blends_each_sample_with_the_flipped_batch(monkeypatch):
    _fix_lam(monkeypatch, 0.3)
    batch = _batch()
    images, labels = batch["image"].clone(), batch["label"].clone()
    out = _mixed(MixBatches(num_classes=NUM_CLASSES, mixup=0.8, cutmix=0.0), batch)
    torch.testing.assert_close(out["image"], 0.3 * images + 0.7 * images.flip(0))
    one_hot = F.one_hot(labels, NUM_CLASSES).float()  # (B, K)
    torch.testing.assert_close(out["label"], 0.3 * one_hot + 0.7 * one_hot.flip(0))
    assert out["label"].dtype == torch.float32 and out["label"].shape == (4, NUM_CLASSES)
    assert torch.equal(batch["image"], images) and torch.equal(batch["label"], labels)  # the input is untouched


def test_cutmix_pastes_one_box_and_weights_labels_by_its_area(monkeypatch):
    _fix_lam(monkeypatch, 0.6)
    batch = _batch(batch_size=6, height=10, width=16)
    images = batch["image"]
    out = _mixed(MixBatches(num_classes=NUM_CLASSES, mixup=0.0, cutmix=1.0), batch)
    kept, pasted = out["image"] == images, out["image"] == images.flip(0)  # (B, 3, H, W)
    assert (kept ^ pasted).all()  # every pixel comes from exactly one of the two images
    box = pasted[0, 0]  # (H, W): one box for every sample and channel
    assert box.any() and (pasted == box).all()
    rows, cols = box.any(dim=1).nonzero()[:, 0], box.any(dim=0).nonzero()[:, 0]
    assert box[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1].all()  # a rectangle
    lam = 1 - box.float().mean()  # the unpasted area fraction (timm corrects lam for clipped boxes)
    one_hot = F.one_hot(batch["label"], NUM_CLASSES).float()  # (B, K)
    torch.testing.assert_close(out["label"], lam * one_hot + (1 - lam) * one_hot.flip(0))


def test_soft_labels_sum_to_one_with_both_mixes_and_smoothing():
    np.random.seed(0)
    mix = MixBatches(num_classes=NUM_CLASSES, mixup=0.8, cutmix=1.0, switch_prob=0.5, label_smoothing=0.1)
    for _ in range(10):
        out = _mixed(mix, _batch())
        assert out["image"].shape == (4, 3, 8, 12)
        torch.testing.assert_close(out["label"].sum(dim=1), torch.ones(4))
        assert (out["label"] >= 0.1 / NUM_CLASSES - 1e-6).all()


def test_label_smoothing_spreads_mass_over_the_other_classes():
    batch = _batch()
    out = _mixed(MixBatches(num_classes=NUM_CLASSES, mixup=0.8, cutmix=0.0, prob=0.0, label_smoothing=0.3), batch)
    assert torch.equal(out["image"], batch["image"])  # prob 0: never mixed
    on = F.one_hot(batch["label"], NUM_CLASSES).bool()  # (B, K)
    assert torch.allclose(out["label"][~on], torch.tensor(0.3 / NUM_CLASSES))
    assert torch.allclose(out["label"][on], torch.tensor(1 - 0.3 + 0.3 / NUM_CLASSES))


def test_mixing_follows_numpys_global_rng():
    mix = MixBatches(num_classes=NUM_CLASSES, mixup=0.8, cutmix=1.0)
    np.random.seed(3)
    first = _mixed(mix, _batch())
    np.random.seed(3)
    again = _mixed(mix, _batch())
    assert torch.equal(first["image"], again["image"]) and torch.equal(first["label"], again["label"])


def test_odd_batches_and_bad_arguments_are_rejected():
    mix = MixBatches(num_classes=NUM_CLASSES, mixup=0.8, cutmix=0.0)
    with pytest.raises(ValueError, match="batch size 5"):
        mix(_batch(batch_size=5))
    with pytest.raises(ValueError, match="class indices"):
        mix({**_batch(), "label": torch.full((4, NUM_CLASSES), 1 / NUM_CLASSES)})
    with pytest.raises(ValueError, match="labels must be in"):
        mix({**_batch(), "label": torch.tensor([0, 1, 2, NUM_CLASSES])})
    with pytest.raises(ValueError, match="not both 0"):
        MixBatches(num_classes=NUM_CLASSES, mixup=0.0, cutmix=0.0)
    with pytest.raises(ValueError, match="switch_prob"):
        MixBatches(num_classes=NUM_CLASSES, mixup=0.8, cutmix=1.0, switch_prob=1.5)
    with pytest.raises(ValueError, match="label_smoothing"):
        MixBatches(num_classes=NUM_CLASSES, mixup=0.8, cutmix=1.0, label_smoothing=1.0)


def test_build_mix_is_none_without_mixing():
    kwargs = {"num_classes": NUM_CLASSES, "prob": 1.0, "switch_prob": 0.5, "label_smoothing": 0.1}
    assert build_mix(mixup=0.0, cutmix=0.0, **kwargs) is None
    assert isinstance(build_mix(mixup=0.0, cutmix=1.0, **kwargs), MixBatches)
    assert isinstance(build_mix(mixup=0.8, cutmix=0.0, **kwargs), MixBatches)


def test_mixed_stream_keeps_the_other_fields():
    batches = [_batch(), _batch()]
    assert all(out is batch for out, batch in zip(mixed(iter(batches), None), batches, strict=True))  # identity
    for batch, out in zip(
        batches, mixed(iter(batches), MixBatches(num_classes=NUM_CLASSES, mixup=0.8, cutmix=1.0)), strict=True
    ):
        assert set(out) == {*batch, "mix"} and out["key"] == batch["key"] and out["num_corrupt"] is batch["num_corrupt"]
        assert out["image"] is batch["image"] and out["label"] is batch["label"]  # mixed later, on the device


@pytest.mark.parametrize(
    ("mixup", "cutmix", "prob", "smoothing"), [(0.8, 0.0, 1.0, 0.0), (0.0, 1.0, 1.0, 0.1), (0.8, 1.0, 0.7, 0.1)]
)
def test_device_mixing_equals_timms_mixup_on_the_same_batch_and_rng(mixup, cutmix, prob, smoothing):
    """Drawing on the host and mixing after the copy gives what timm's `Mixup` gave on the host batch, bit for bit,
    and leaves numpy's RNG where timm leaves it."""
    ours = MixBatches(num_classes=NUM_CLASSES, mixup=mixup, cutmix=cutmix, prob=prob, label_smoothing=smoothing)
    timm_mix = Mixup(
        mixup_alpha=mixup, cutmix_alpha=cutmix, prob=prob, switch_prob=0.5, mode="batch", correct_lam=True,
        label_smoothing=smoothing, num_classes=NUM_CLASSES,
    )  # fmt: skip
    kinds = set()
    for seed in range(12):
        batch = _batch(batch_size=6, height=10, width=16)
        np.random.seed(seed)
        images, labels = timm_mix(batch["image"].clone(), batch["label"])
        after_timm = np.random.rand()
        np.random.seed(seed)
        out = _mixed(ours, batch)
        assert np.random.rand() == after_timm, seed  # the same numpy draws, in the same order
        assert torch.equal(out["image"], images) and torch.equal(out["label"], labels.float()), seed
        kinds.add("unmixed" if torch.equal(out["image"], batch["image"]) else "mixed")
    assert "mixed" in kinds and (prob == 1 or "unmixed" in kinds)  # both branches compared (a CutMix box may be empty)
