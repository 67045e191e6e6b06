"""benchmarks/time_to_accuracy.py's arithmetic: CPU-seconds read off the sampled curve, the points compared at equal
time, the issue's goals decided from them, and which exports are fine-tuned."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.time_to_accuracy import (
    TreeCPU,
    finetune_encoders,
    finetune_lines,
    goal_lines,
    level_lines,
    time_to,
    value_at,
)


def _rows(*points):
    return [{"step": s, "cpu_s": c, "knn": k, "probe": p} for s, c, k, p in points]


MAE = _rows((100, 100.0, 0.50, 0.60), (200, 200.0, 0.60, 0.70), (300, 300.0, 0.64, 0.74))


def test_cpu_seconds_are_interpolated_between_the_samples_around_a_time():
    sampler = TreeCPU.__new__(TreeCPU)
    sampler.samples = [(10.0, 5.0), (12.0, 9.0), (20.0, 9.0)]
    assert sampler.at(11.0) == pytest.approx(7.0)
    assert sampler.at(12.0) == 9.0 and sampler.at(15.0) == 9.0
    assert sampler.at(5.0) == 5.0 and sampler.at(30.0) == 9.0  # outside: the nearest sample


def test_values_at_a_time_and_the_time_to_a_level():
    assert value_at(MAE, "probe", 150.0) == pytest.approx(0.65)
    assert value_at(MAE, "probe", 300.0) == pytest.approx(0.74)
    assert value_at(MAE, "probe", 350.0) is None and value_at(MAE, "probe", 50.0) is None
    assert time_to(MAE, "knn", 0.60) == 200.0 and time_to(MAE, "knn", 0.7) is None


def test_the_goals_met_and_not_met():
    fast = _rows((50, 80.0, 0.66, 0.77), (100, 160.0, 0.70, 0.80), (200, 320.0, 0.72, 0.82))
    met = goal_lines({"mae": MAE, "data2vec2": fast})
    assert "80 CPU-s = 0.27x" in met[0] and met[0].endswith("met)") and "not met" not in met[0]
    assert "0.8175 against MAE's 0.7400 (+7.8 points; goal >= +2: met)" in met[2]
    slow = _rows((50, 150.0, 0.40, 0.60), (100, 300.0, 0.62, 0.75))
    missed = goal_lines({"mae": MAE, "data2vec2": slow})
    assert "never, within its run" in missed[0] and "not met" in missed[0]
    assert "300 CPU-s = 1.00x" in missed[1] and "+1.0 points; goal >= +2: not met" in missed[2]
    assert goal_lines({"mae": MAE}) == ["- goals need both MAE and data2vec 2.0 rows"]


def test_data2vec2_is_fine_tuned_at_its_end_and_at_maes_time(tmp_path: Path):
    d2v = _rows((50, 150.0, 0.4, 0.6), (100, 290.0, 0.6, 0.7), (150, 450.0, 0.7, 0.8))
    chosen = finetune_encoders({"mae": MAE, "data2vec2": d2v}, tmp_path)
    assert chosen == {
        "mae": tmp_path / "exports" / "mae_step000300",
        "data2vec2": tmp_path / "exports" / "data2vec2_step000150",
        "data2vec2@mae_time": tmp_path / "exports" / "data2vec2_step000100",
    }
    tuned = {"mae": {"ft_1pct": 0.70}, "data2vec2": {"ft_1pct": 0.80}, "data2vec2@mae_time": {"ft_1pct": 0.69}}
    assert finetune_lines(tuned, {"mae": MAE, "data2vec2": d2v})[-1].endswith(
        "-1.0 points against MAE (goal >= 0: not met)"
    )
    within = _rows((50, 150.0, 0.4, 0.6), (100, 290.0, 0.6, 0.7))
    assert set(finetune_encoders({"mae": MAE, "data2vec2": within}, tmp_path)) == {"mae", "data2vec2"}
    tuned = {"mae": {"ft_1pct": 0.70}, "data2vec2": {"ft_1pct": 0.71}}
    assert "+1.0 points" in finetune_lines(tuned, {"mae": MAE, "data2vec2": within})[-1]


def test_the_time_to_reach_maes_value_at_each_of_its_points():
    d2v = _rows((50, 80.0, 0.55, 0.65), (100, 160.0, 0.58, 0.72), (200, 320.0, 0.62, 0.73))
    lines = level_lines({"mae": MAE, "data2vec2": d2v})
    assert lines[2] == "| kNN top-1 | 0.5000 | 100 | 80 (0.80x) |"
    assert lines[3] == "| kNN top-1 | 0.6000 | 200 | 320 (1.60x) |"
    assert lines[4] == "| kNN top-1 | 0.6400 | 300 | not reached |"
    assert lines[6] == "| probe (better pooling) | 0.7000 | 200 | 160 (0.80x) |"
    assert level_lines({"mae": MAE}) == []
