"""Recipe: the tiny MAE of tests/dist (`pretrain_recipe`) with `eval.knn` on, 2 gloo processes: the monitor's figures
(every query counted once, above chance on the class-separable synthetic shards) and identical training losses with
and without it, at ZeRO-2 bf16 (through ./launch.sh), ZeRO-3 and fp16."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from tests.launching import launch, losses, pretrain_recipe, read_metrics, torchrun, write_recipe

pytestmark = pytest.mark.dist

NUM_VAL = 203  # the `shards` fixture's val set: 4 classes, chance 0.25
BANK = 300


def knn_section(shards, **extra) -> dict:
    query = {"shards": str(shards["val"])}
    return {"knn": {"enabled": True, "every_steps": 2, "bank": {"max_samples": BANK}, "query": query, **extra}}


def knn_metrics(run_dir) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(run_dir) if "knn/top1" in m}


def assert_knn_figures(run_dir, *, num_queries: int = NUM_VAL) -> None:
    found = knn_metrics(run_dir)
    assert sorted(found) == [2, 4, 6]  # every 2 steps, the last step included
    for metrics in found.values():
        assert metrics["knn/query_samples"] == num_queries  # each query on exactly one rank, counted once
        assert metrics["knn/bank_samples"] == BANK
        assert 0.5 < metrics["knn/top1"] <= metrics["knn/top5"] <= 1.0  # chance is 0.25
        assert metrics["knn/seconds"] > 0


def test_zero3_mean_pooling_leaves_training_identical(shards, tmp_path):
    """ZeRO-3 with accumulation: the encoder's forwards are collective. A query limit of 100 of the 203 in batches of
    16: rank 0's shards give 66 queries (5 batches), rank 1's 34 (3 batches), so rank 1 forwards 2 stand-ins."""
    engine = {"zero_stage": 3, "grad_accum_steps": 2}
    plain = pretrain_recipe(shards, tmp_path / "plain", engine=engine)
    proc = launch(write_recipe(tmp_path / "tiny_mae_z3.yaml", plain))
    assert proc.returncode == 0, proc.stdout[-4000:]
    section = knn_section(shards, pooling="mean", batch_size_per_device=16)
    section["knn"]["query"]["max_samples"] = 100
    monitored = pretrain_recipe(shards, tmp_path / "knn", engine=engine, eval=section)
    proc = launch(write_recipe(tmp_path / "tiny_mae_z3_knn.yaml", monitored))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert losses(tmp_path / "knn") == losses(tmp_path / "plain")
    assert_knn_figures(tmp_path / "knn", num_queries=100)


def test_fp16_monitor_leaves_training_identical(shards, tmp_path):
    """DeepSpeed fp16 (half weights, dynamic loss scaling) at ZeRO-1, fp16 allowed on this CPU by cpu_fp16.py."""
    runs = {}
    for name, sections in (("plain", {}), ("knn", {"eval": knn_section(shards)})):
        recipe = pretrain_recipe(shards, tmp_path / name, engine={"precision": "fp16", "zero_stage": 1}, **sections)
        torchrun("cpu_fp16.py", "pretrain", write_recipe(tmp_path / f"tiny_mae_fp16_{name}.yaml", recipe))
        runs[name] = losses(tmp_path / name)
    assert runs["knn"] == runs["plain"] and sorted(runs["plain"]) == [1, 2, 3, 4, 5, 6]
    assert_knn_figures(tmp_path / "knn")


def test_zero2_bf16_monitors_log_and_leave_training_identical(zero2_run, shards, tmp_path):
    """The `zero2_run` fixture's recipe plus (a) eval.knn every 2 steps with few-shot and eval.features every 3 on the
    bank's images, (b) eval.features alone: every step's loss is identical to the plain run's; at step 6, where both
    monitors of (a) run, the label-free numbers come from the kNN bank's features and equal (b)'s own pass."""
    plain_dir, _ = zero2_run
    features = {"enabled": True, "every_steps": 3, "max_samples": BANK}
    both = pretrain_recipe(shards, tmp_path / "both", eval=knn_section(shards, fewshot=[1, 5]) | {"features": features})
    proc = launch(write_recipe(tmp_path / "tiny_mae_knn.yaml", both))
    assert proc.returncode == 0, proc.stdout[-4000:]
    alone = pretrain_recipe(shards, tmp_path / "alone", eval={"features": features})
    proc_alone = launch(write_recipe(tmp_path / "tiny_mae_features.yaml", alone))
    assert proc_alone.returncode == 0, proc_alone.stdout[-4000:]
    assert losses(tmp_path / "both") == losses(tmp_path / "alone") == losses(plain_dir)
    assert sorted(losses(plain_dir)) == [1, 2, 3, 4, 5, 6]

    assert_knn_figures(tmp_path / "both")
    for metrics in knn_metrics(tmp_path / "both").values():  # few-shot: 3 draws, every query counted once
        for n in (1, 5):
            correct = metrics[f"fewshot/top1_{n}shot"] * NUM_VAL * 3
            assert 0 <= correct <= NUM_VAL * 3 and abs(correct - round(correct)) < 1e-6
    assert f"[mimpipe] step 4 knn: top1 {knn_metrics(tmp_path / 'both')[4]['knn/top1']:.4f}" in proc.stdout
    events = next((tmp_path / "both" / "tb").glob("events.out.tfevents.*"))
    tags = [value.tag for event in EventFileLoader(str(events)).Load() for value in event.summary.value]
    assert tags.count("knn/top1") == 3 and tags.count("knn/top5") == 3 and tags.count("knn/seconds") == 3
    assert tags.count("features/effective_rank") == 2

    def label_free(run_dir) -> dict[int, dict]:
        return {m["step"]: m for m in read_metrics(run_dir) if "features/effective_rank" in m}

    reused, own = label_free(tmp_path / "both"), label_free(tmp_path / "alone")
    assert sorted(reused) == sorted(own) == [3, 6]
    assert not any("knn/top1" in m for m in read_metrics(tmp_path / "alone"))
    assert [reused[s]["features/reused_knn_bank"] for s in (3, 6)] == [0.0, 1.0]  # step 3: no kNN pass to reuse
    assert not any(m["features/reused_knn_bank"] for m in own.values())
    for step in (3, 6):
        assert reused[step]["features/samples"] == own[step]["features/samples"] == BANK  # each image once
        for key in ("features/effective_rank", "features/std"):
            assert reused[step][key] == pytest.approx(own[step][key], rel=1e-4)
        assert 1.0 < own[step]["features/effective_rank"] <= 32 and 0.0 < own[step]["features/std"] <= 1.5  # D = 32
    assert "[mimpipe] step 6 features: effective rank" in proc_alone.stdout
    assert "the kNN bank's features" in proc.stdout
