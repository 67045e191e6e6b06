"""`make bench-seg`'s arms are valid recipes with the promised differences, and its table reads their results."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import bench_seg
from core.recipe.config import load_config

REPO = Path(__file__).resolve().parents[2]


def configs(scale: float) -> dict:
    root, scenes = Path("/tmp/bench_seg"), Path("/tmp/scenes")
    return {
        arm.name: load_config(REPO / "recipes" / arm.recipe, bench_seg.arm_overrides(arm, root, scenes, scale))
        for arm in bench_seg.ARMS
    }


def test_the_arms_compare_one_vit_and_one_budget():
    cfgs = configs(1.0)
    assert cfgs["mae"].stage == "pretrain" and cfgs["mae"].objective.norm_pix_loss is False
    assert str(cfgs["mae"].data.train) == "/tmp/scenes/train" and cfgs["mae"].schedule.steps == 1000
    assert not cfgs["mae"].eval.knn.enabled and not cfgs["mae"].eval.features.enabled  # no monitor on the scenes
    tuned = {name: cfg for name, cfg in cfgs.items() if name != "mae"}
    assert {cfg.schedule.steps for cfg in tuned.values()} == {600}
    assert {cfg.data.global_batch_size for cfg in tuned.values()} == {32}
    vits = {name: cfg for name, cfg in cfgs.items() if cfg.model.arch == "vit"}
    assert {(c.model.embed_dim, c.model.depth, c.model.patch_size, c.model.img_size) for c in vits.values()} == {
        (192, 6, 8, 64)
    }
    assert cfgs["upernet_mae"].model.init == "/tmp/bench_seg/mae/export" and cfgs["upernet_scratch"].model.init is None
    assert cfgs["linear_mae"].objective.freeze_encoder and cfgs["linear_random"].objective.freeze_encoder
    assert cfgs["upernet_frozen_mae"].objective.freeze_encoder and cfgs["upernet_frozen_random"].model.init is None
    assert cfgs["upernet_frozen_mae"].objective.head == "upernet"
    assert cfgs["linear_random"].model.init is None and cfgs["linear_mae"].objective.head == "linear"
    assert {cfgs[n].objective.head for n in ("fpn_r18", "vt_fpn_r18")} == {"fpn", "vt_fpn"}
    assert cfgs["fpn_r18"].model.arch == cfgs["vt_fpn_r18"].model.arch == "resnet"


def test_a_smoke_scale_shortens_every_schedule():
    cfgs = configs(0.05)
    assert cfgs["mae"].schedule.steps == 50 and cfgs["upernet_mae"].schedule.steps == 30
    assert cfgs["upernet_mae"].eval.every_steps == 15


def test_the_table_gives_each_pair_its_gap_in_points(monkeypatch):
    monkeypatch.setattr(bench_seg, "render_costs", lambda *args: ["(costs)"])

    def result(best, last):
        return {"wall_seconds": 60.0, "metrics": {"best_miou": best, "last_miou": last, "last_pixel_acc": 0.9}}

    results = {"upernet_mae": result(0.41, 0.40), "upernet_scratch": result(0.30, 0.30), "fpn_r18": result(0.2, 0.2)}
    text = bench_seg.render(results, ["header"])
    assert "| UperNet, fine-tuned | 0.4100 (0.4000) | 0.3000 (0.3000) | +11.0 |" in text
    assert "| linear head, encoder frozen | - (-) | - (-) | - |" in text
    assert "| mIoU | 0.2000 (0.2000) | - (-) | - |" in text


def test_a_fine_tuning_without_evaluations_is_named():
    with pytest.raises(ValueError, match="holds no val/miou"):
        bench_seg.summarise(bench_seg.ARMS[1], Path("/nonexistent"))
