"""Learning-rate schedule values."""

import math

import pytest

from core.engine.schedule import lr_at


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
