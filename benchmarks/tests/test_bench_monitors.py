"""`make bench-monitors`: its runs are the bench-quality and quickstart recipes with exactly the promised monitor
settings, and its tables read what the runs log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_monitors
from core.recipe.config import load_config
from pretrain.feature_monitor import features_are_knn_bank

SHARDS = Path(__file__).resolve().parents[2] / "shards" / "quickstart"


def configs(arms) -> dict:
    return {arm.name: load_config(arm.recipe, list(arm.overrides)) for arm in arms}


@pytest.mark.parametrize("scale", [1.0, 0.05])
def test_the_quality_runs_add_the_new_monitors_on_the_knn_bank_and_nothing_else(scale, tmp_path):
    arms = bench_monitors.quality_arms(tmp_path, ["mae", "simmim"], SHARDS, scale)
    for arm in arms:
        cfg = load_config(arm.recipe, list(arm.overrides))
        plain = [o for o in arm.overrides if not o.startswith(("eval.features", "eval.knn.fewshot"))]
        reference = load_config(arm.recipe, plain)
        assert cfg.eval.knn.fewshot == [1, 5, 10, 25] and cfg.eval.features.enabled
        assert cfg.eval.features.every_steps == cfg.eval.knn.every_steps == reference.eval.knn.every_steps
        assert features_are_knn_bank(cfg)  # the label-free monitor reuses the bank's features
        assert cfg.model_dump(exclude={"eval"}) == reference.model_dump(exclude={"eval"})
        assert cfg.schedule.steps == (1760 if scale == 1 else 88) and str(cfg.run_dir).startswith(str(tmp_path))
    assert [cfg.objective.kind for cfg in configs(arms).values()] == ["mae", "simmim"]


@pytest.mark.parametrize("scale", [1.0, 0.05])
def test_the_overhead_runs_differ_only_in_the_new_monitors(scale, tmp_path):
    cfgs = configs(bench_monitors.overhead_arms(tmp_path, 2, SHARDS, scale))
    assert list(cfgs) == [f"{tmp_path.name}/overhead/{run}" for run in ("off0", "on0", "off1", "on1")]  # alternating
    off, on = cfgs[f"{tmp_path.name}/overhead/off0"], cfgs[f"{tmp_path.name}/overhead/on0"]
    assert (
        on.eval.knn.enabled
        and off.eval.knn.enabled
        and on.schedule.steps == off.schedule.steps == (700 if scale == 1 else 35)
    )
    assert not off.eval.features.enabled and off.eval.knn.fewshot == []
    assert on.eval.features.enabled and on.eval.knn.fewshot and features_are_knn_bank(on)
    dump = {"exclude": {"eval": {"features", "knn"}, "run_dir": True}}
    assert on.model_dump(**dump) == off.model_dump(**dump)


def test_spearman_matches_hand_ranks():
    assert bench_monitors.spearman([1, 2, 3, 4], [10, 20, 30, 45]) == pytest.approx(1.0)
    assert bench_monitors.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    # ties take their average rank: x ranks 1, 2.5, 2.5, 4 against y ranks 1, 2, 3, 4 -> r = 4.5 / sqrt(4.5 * 5)
    assert bench_monitors.spearman([0.1, 0.5, 0.5, 0.9], [1, 2, 3, 4]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    assert bench_monitors.spearman([1, 2], [1, 2]) is None and bench_monitors.spearman([1, 2, 3], [5, 5, 5]) is None


def test_the_tables_read_the_logged_monitors(tmp_path):
    run = tmp_path / "quality" / "mae"
    run.mkdir(parents=True)
    records = [{"step": 10, "train/loss": 1.0}]
    for step, (knn, rank) in zip((100, 200, 300), ((0.5, 10.0), (0.6, 12.0), (0.7, 11.0)), strict=True):
        shots = {f"fewshot/top1_{n}shot": knn - 0.1 + n / 1000 for n in bench_monitors.SHOTS}
        records += [{"step": step, "knn/top1": knn, **shots}, {"step": step, "features/effective_rank": rank,
                                                                "features/std": 0.5}]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = "\n".join(bench_monitors.quality_section(tmp_path, ["mae"]))
    assert "| 200 | 0.6000 | 0.5010 | 0.5050 | 0.5100 | 0.5250 | 12.0 | 0.500 |" in text
    # few-shot rises with kNN (+1 each); the rank goes 10, 12, 11 (+0.50); the std is constant (no correlation)
    assert "| MAE | 3 | +1.00 | +1.00 | +1.00 | +1.00 | +0.50 | - |" in text
    assert text.endswith("| MAE | 0.7000 | 0.6010 | 0.6050 | 0.6100 | 0.6250 | 11.0 | 0.500 |")  # the last step

    for name, wall, seconds in (("off0", 100.0, {}), ("on0", 102.0, {"features/seconds": 0.5, "fewshot/seconds": 1.5})):
        out = tmp_path / "overhead" / name
        out.mkdir(parents=True)
        (out / "bench_result.json").write_text(json.dumps({"wall_seconds": wall}))
        (out / "metrics.jsonl").write_text(json.dumps({"step": 700, "knn/seconds": 3.0, **seconds}) + "\n")
    text = "\n".join(bench_monitors.overhead_section(tmp_path, 1))
    assert "| on0 | 102.0 | 3.0 | 0.5 | 1.5 | 1.96% |" in text and "| off0 | 100.0 | 3.0 | 0.0 | 0.0 | 0.00% |" in text
    assert "**1.020**" in text
