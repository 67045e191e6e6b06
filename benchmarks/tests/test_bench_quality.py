"""benchmarks/bench_quality.py and quality_report.py: the arm plan, the resumable skip, and the table and plot
assembled from fake run outputs (no training here: `make bench-quality` runs the arms; tests/unit/test_bench_recipes.py
checks the protocol's recipes)."""

import json
from pathlib import Path

import pytest

from benchmarks import bench_quality as bq
from benchmarks import quality_report as qr
from core.recipe.config import load_config

BENCH = Path(__file__).resolve().parents[2] / "recipes" / "bench"


def test_scale_shrinks_every_step_count_and_the_knn_sets():
    assert bq.scale_overrides(BENCH / "mae.yaml", 1.0) == []
    cfg = load_config(BENCH / "mae.yaml", bq.scale_overrides(BENCH / "mae.yaml", 0.02))
    assert cfg.steps(None) == (35, 4)
    assert (cfg.checkpoint.every_steps, cfg.logging.every_steps, cfg.eval.knn.every_steps) == (9, 1, 4)
    assert (cfg.eval.knn.bank.max_samples, cfg.eval.knn.query.max_samples) == (1000, 500)
    small = load_config(BENCH / "finetune_1pct.yaml", bq.scale_overrides(BENCH / "finetune_1pct.yaml", 0.001))
    assert small.steps(None) == (2, 0)


def test_plan_chains_exports_tokenizer_and_subsets(tmp_path):
    arms = bq.plan(
        tmp_path, objectives=["beit"], seeds=[3], shards=Path("/s"), subsets=Path("/sub"), scale=1.0
    )  # fmt: skip
    names = [a.name for a in arms]
    assert names == [
        "seed3/scratch/ft_1pct", "seed3/scratch/ft_10pct", "seed3/scratch/ft_full", "seed3/scratch/probe",
        "seed3/beit/tokenizer", "seed3/beit/pretrain",
        "seed3/beit/ft_1pct", "seed3/beit/ft_10pct", "seed3/beit/ft_full", "seed3/beit/probe",
    ]  # fmt: skip
    by_name = {a.name: a for a in arms}
    export = tmp_path / "seed3/beit/pretrain/export"
    pretrain = by_name["seed3/beit/pretrain"]
    assert f"objective.target.path={tmp_path / 'seed3/beit/tokenizer/export'}" in pretrain.overrides
    assert pretrain.requires == tmp_path / "seed3/beit/tokenizer/export"
    one_pct = by_name["seed3/beit/ft_1pct"]
    assert {"data.train=/sub/train_60_per_class", "data.val=/s/test", f"model.init={export}", "seed=3"} <= set(
        one_pct.overrides
    )
    assert one_pct.requires == export and by_name["seed3/scratch/ft_full"].requires is None
    assert not any(o.startswith("model.init") for o in by_name["seed3/scratch/probe"].overrides)
    for arm in arms:  # every launched arm's overrides load over its recipe
        if arm.kind != "probe":
            load_config(arm.recipe, list(arm.overrides))


def test_an_arm_with_a_result_is_skipped_and_one_missing_its_export_is_blocked(tmp_path, monkeypatch):
    monkeypatch.setattr(bq, "launch", lambda *a, **k: pytest.fail("a finished or blocked arm must not launch"))
    done = bq.Arm("finetune", tmp_path / "seed0/mae/ft_full", BENCH / "finetune_full.yaml", ())
    done.run_dir.mkdir(parents=True)
    (done.run_dir / qr.RESULT_FILE).write_text("{}")
    blocked = bq.Arm("finetune", tmp_path / "seed0/mae/ft_1pct", BENCH / "finetune_1pct.yaml", (), tmp_path / "nope")
    assert bq.run_arm(done, timeout=1) == "done" and bq.run_arm(blocked, timeout=1) == "blocked"


def _fake_arm(root: Path, seed: int, encoder: str, arm: str, kind: str, wall: float, records=None, probe=None):
    """An arm folder as a finished run leaves it, summarised as run_arm does."""
    run_dir = root / f"seed{seed}" / encoder / arm
    run_dir.mkdir(parents=True)
    if records is not None:
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if probe is not None:
        (run_dir / "probe.json").write_text(json.dumps(probe))
    result = {"arm": arm, "wall_seconds": wall, "others_load": 0.1, "metrics": qr.summarise_run(kind, run_dir)}
    (run_dir / qr.RESULT_FILE).write_text(json.dumps(result))


def _fake_results(root: Path) -> None:
    for seed, shift in ((0, 0.0), (1, 0.01)):
        pretrain = [
            {"step": 10, "train/loss": 0.9},
            {"step": 10, "knn/top1": 0.5 + shift},
            {"step": 20, "train/loss": 0.7},
            {"step": 20, "knn/top1": 0.6 + shift},
        ]
        _fake_arm(root, seed, "mae", "pretrain", "pretrain", 600.0, records=pretrain)
        for arm, top1 in (("ft_1pct", 0.8), ("ft_10pct", 0.85), ("ft_full", 0.88)):
            records = [
                {"step": 5, "train/loss": 1.0},
                {"step": 9, "val/top1": 0.1},
                {"step": 10, "val/top1": top1 + shift},
            ]
            _fake_arm(root, seed, "mae", arm, "finetune", 60.0, records=records)
        probe = {"cls": {"top1": 0.7 + shift}, "mean": {"top1": 0.75 + shift}, "train_samples": 60000}
        _fake_arm(root, seed, "mae", "probe", "probe", 120.0, probe=probe)
    _fake_arm(root, 0, "scratch", "ft_1pct", "finetune", 30.0, records=[{"step": 10, "val/top1": 0.6}])
    _fake_arm(root, 0, "beit", "tokenizer", "tokenizer", 90.0, records=[{"step": 5, "train/loss": 1.0}])


def test_table_holds_the_reference_the_last_evaluation_means_over_seeds_and_wall_times(tmp_path):
    _fake_results(tmp_path)
    results = qr.collect(tmp_path)
    assert results[(1, "mae", "pretrain")]["metrics"] == {"knn": [[10, 0.51], [20, 0.61]], "loss": 0.7}
    text = qr.render(results, header=["- machine line"], plot_note="PLOT")
    lines = text.splitlines()

    assert (
        "| official MAE code (the issue's reference, not run here) | 0.795 | 0.809 | 0.826 | - | 0.864 | - |" in lines
    )
    mae = next(line for line in lines if line.startswith("| MAE |"))
    assert mae == (
        "| MAE | 0.8050 (0.8000, 0.8100) | 0.8550 (0.8500, 0.8600) | 0.8850 (0.8800, 0.8900) | "
        "0.7050 (0.7000, 0.7100) | 0.7550 (0.7500, 0.7600) | 0.6050 (0.6000, 0.6100) |"
    )
    assert "| scratch (no pretraining) | 0.6000 | - | - | - | - | - |" in lines
    assert not any(line.startswith("| SimMIM") for line in lines)  # not run: no row
    times = lines[
        lines.index(
            "## Wall time (minutes, mean over seeds; other processes took up to 10% of the CPU during an arm)"
        ) :
    ]
    assert "| MAE | - | 10.0 | 1.0 | 1.0 | 1.0 | 2.0 | 15.0 |" in times
    assert "| BEiT-style (tokenizer codes) | 1.5 | - | - | - | - | - | 1.5 |" in times
    assert "- machine line" in lines and lines[-1] == "PLOT"


def test_plot_is_written_as_a_png(tmp_path):
    _fake_results(tmp_path)
    results = qr.collect(tmp_path)
    note = qr.plot(results, tmp_path / "out" / "quality.png")
    assert note == "![accuracy vs labels, kNN during pretraining](quality.png)"
    assert (tmp_path / "out" / "quality.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_finetune_run_without_evaluation_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 1.0}) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl holds no val/top1"):
        qr.summarise_run("finetune", tmp_path)


def test_a_variant_is_its_own_encoder_pretrained_from_its_recipe(tmp_path):
    arms = bq.plan(tmp_path, objectives=["mae_crop08"], seeds=[0], shards=Path("/s"), subsets=Path("/sub"), scale=1.0)
    by_name = {a.name: a for a in arms}
    pretrain = by_name["seed0/mae_crop08/pretrain"]
    assert pretrain.recipe == BENCH / "mae_crop08.yaml" and "seed0/mae_crop08/tokenizer" not in by_name
    assert load_config(pretrain.recipe, list(pretrain.overrides)).data.crop_scale == (0.8, 1.0)
    assert (
        f"model.init={tmp_path / 'seed0/mae_crop08/pretrain/export'}" in by_name["seed0/mae_crop08/ft_1pct"].overrides
    )
    assert bq.variant_lines(["mae", "mae_crop08", "scratch"]) == [
        "- `mae_crop08`: recipes/bench/mae_crop08.yaml, mae.yaml with data.crop_scale=[0.8, 1.0]"
    ]
    with pytest.raises(SystemExit):  # neither an objective nor a variant recipe of one
        bq.main(["--objectives", "mae_nope", "--root", str(tmp_path)])


def test_a_variants_row_follows_its_objectives(tmp_path):
    _fake_results(tmp_path)
    _fake_arm(tmp_path, 0, "mae_crop08", "ft_1pct", "finetune", 30.0, records=[{"step": 10, "val/top1": 0.83}])
    results = qr.collect(tmp_path)
    assert qr.encoders_in(results) == ["mae", "mae_crop08", "beit", "scratch"]
    rows = [line.split(" | ")[0] for line in qr.accuracy_table(results)[3:]]
    assert rows == ["| MAE", "| MAE, variant `mae_crop08`", "| scratch (no pretraining)"]
    assert "| MAE, variant `mae_crop08` | 0.8300 | - | - | - | - | - |" in qr.accuracy_table(results)
