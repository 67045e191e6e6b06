"""Learning-rate schedule values."""

import math

import pytest

from core.engine.schedule import lr_at, weight_decay_at


def test_warmup_is_linear_from_zero_to_peak():
    lrs = [lr_at(s, peak_lr=1.0, min_lr=0.0, warmup_steps=4, total_steps=10) for s in range(1, 5)]
    assert lrs == [0.25, 0.5, 0.75, 1.0]


def test_cosine_reaches_min_at_the_end_and_half_way_is_the_mean():
    kw = dict(peak_lr=2.0, min_lr=0.5, warmup_steps=0, total_steps=100)
    assert lr_at(100, **kw) == pytest.approx(0.5)
    assert lr_at(50, **kw) == pytest.approx(1.25)
    assert lr_at(25, **kw) == pytest.approx(0.5 + 1.5 * 0.5 * (1 + math.cos(math.pi / 4)))


def test_monotone_after_warmup():
    lrs = [lr_at(s, peak_lr=1e-3, min_lr=1e-6, warmup_steps=5, total_steps=50) for s in range(5, 51)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_warmup_starts_at_start_lr_and_reaches_the_peak():
    kwargs = dict(peak_lr=1e-3, min_lr=1e-6, warmup_steps=10, total_steps=100, start_lr=2e-4)
    assert lr_at(1, **kwargs) == pytest.approx(2e-4 + 8e-4 / 10)
    assert lr_at(5, **kwargs) == pytest.approx(6e-4)
    assert lr_at(10, **kwargs) == pytest.approx(1e-3)
    assert lr_at(100, **kwargs) == pytest.approx(1e-6)
    assert lr_at(5, **{**kwargs, "start_lr": 0.0}) == pytest.approx(5e-4)  # MAE's warmup from 0, as before


def test_weight_decay_rises_by_a_half_cosine_to_its_end_or_stays():
    cosine = [weight_decay_at(s, start=0.04, end=0.4, total_steps=100) for s in (0, 50, 100, 150)]
    assert cosine == pytest.approx([0.04, 0.22, 0.4, 0.4])
    assert weight_decay_at(25, start=0.04, end=0.4, total_steps=100) == pytest.approx(0.4 - 0.36 * (1 + 2**-0.5) / 2)
    assert weight_decay_at(70, start=0.05, end=None, total_steps=100) == 0.05
