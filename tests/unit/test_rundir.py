"""A run_dir is one run (core/launch/rundir.py): which config differences a relaunch refuses and which it applies, when
a run counts as finished, that each launch's config is kept, and that a resumed run's logs hold each step once
(core/report/logging.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from core.launch.ckpt_files import write_marker
from core.launch.rundir import (
    ALLOW_FLAG,
    MAY_CHANGE,
    config_changes,
    keep_launch_config,
    mark_finished,
    relaunch,
)
from core.recipe.config import dump_config, load_config
from core.recipe.tree import flatten
from core.report.logging import MetricsLogger, cut_metrics


def base(run_dir: Path, *overrides: str):
    return load_config(None, [f"run_dir={run_dir}", "optim.base_lr=1.5e-4", "schedule.steps=1000", *overrides])


def checkpoint(run_dir: Path, cfg, step: int, *, complete: bool = True) -> None:
    """A checkpoint as core/engine/checkpoint.py leaves one, as far as a relaunch reads it: its files, its
    completeness marker (`complete=False`: none, a save that did not finish), then `latest` naming it."""
    tag_dir = run_dir / "checkpoints" / f"step_{step:08d}"
    tag_dir.mkdir(parents=True)
    (tag_dir / "config.yaml").write_text(dump_config(cfg))
    (tag_dir / "rank_00000.json").write_text(json.dumps({"world_size": 2, "train": {"step": step}}))
    if complete:
        write_marker(tag_dir, {p.name: p.stat().st_size for p in tag_dir.iterdir()})
    (run_dir / "checkpoints" / "latest").write_text(tag_dir.name)


def test_same_config_has_no_changes_and_run_dir_is_not_compared(tmp_path):
    saved = dump_config(base(tmp_path / "a"))
    assert config_changes(saved, base(tmp_path / "a")) == []
    assert config_changes(saved, base(tmp_path / "moved")) == []  # a copied or moved run is the same run


def test_changes_split_into_refused_and_applied(tmp_path):
    checkpoint(tmp_path, base(tmp_path), step=6)
    new = base(
        tmp_path,
        "optim.base_lr=3e-4",
        "model.init=other.safetensors",
        "schedule.steps=2000",
        "logging.every_steps=50",
        "checkpoint.keep_last=5",
        "data.num_workers=8",
        "engine.grad_accum_steps=2",
        "eval.knn.every_steps=7",
    )
    verdict = relaunch(new, total_steps=2000)
    assert [c.key for c in verdict.refused] == ["model.init", "optim.base_lr"]
    applied = {c.key: (c.old, c.new) for c in verdict.applied}
    assert applied == {
        "schedule.steps": (1000, 2000),
        "logging.every_steps": (10, 50),
        "checkpoint.keep_last": (2, 5),
        "data.num_workers": (2, 8),
        "engine.grad_accum_steps": (1, 2),
        "eval.knn.every_steps": (1000, 7),
    }
    line = verdict.refusal(tmp_path)
    assert line.startswith(f"{tmp_path} holds a run of another config (checkpoints/step_00000006; ")
    assert "model.init: null -> other.safetensors" in line and "optim.base_lr: 0.00015 -> 0.0003" in line
    assert "run_dir=NEW_DIR" in line and ALLOW_FLAG in line and "\n" not in line
    assert not verdict.finished


@pytest.mark.parametrize(
    "override",
    ["seed=1", "engine.zero_stage=2", "engine.precision=fp32", "data.global_batch_size=512", "schedule.warmup_steps=9"],
)
def test_what_a_step_computes_is_refused(tmp_path, override):
    checkpoint(tmp_path, base(tmp_path), step=6)
    verdict = relaunch(base(tmp_path, override), total_steps=1000)
    assert [c.key for c in verdict.refused] == [override.split("=")[0]] and verdict.applied == []


def test_allowed_change_resumes_and_says_so(tmp_path):
    checkpoint(tmp_path, base(tmp_path), step=6)
    verdict = relaunch(base(tmp_path, "optim.base_lr=3e-4", "schedule.steps=9"), total_steps=9, allow_change=True)
    assert verdict.refusal(tmp_path) is None
    assert verdict.notes(tmp_path) == [
        f"resuming {tmp_path} with changed settings: schedule.steps: 1000 -> 9",
        f"resuming {tmp_path} with another config ({ALLOW_FLAG}): optim.base_lr: 0.00015 -> 0.0003",
    ]


def test_a_key_added_since_the_checkpoint_counts_at_its_default(tmp_path):
    cfg = base(tmp_path)
    tree = yaml.safe_load(dump_config(cfg))
    del tree["checkpoint"]["keep_last"], tree["eval"]["knn"]  # as a config written before those keys existed
    assert config_changes(yaml.safe_dump(tree), cfg) == []
    tree["optim"]["no_such_key"] = 1
    (change,) = config_changes(yaml.safe_dump(tree), cfg)
    assert change.key == "(checkpoint config)" and "no_such_key" in change.old


def test_finished_needs_the_marker_of_the_latest_step_and_a_schedule_no_longer(tmp_path):
    cfg = base(tmp_path, "schedule.steps=6")
    checkpoint(tmp_path, cfg, step=6)
    assert not relaunch(cfg, total_steps=6).finished  # the last checkpoint, but no export yet: resume and export
    mark_finished(tmp_path, 6, "step_00000006")
    verdict = relaunch(cfg, total_steps=6)
    assert verdict.finished and verdict.refusal(tmp_path) is None
    assert "holds a finished run (step 6" in verdict.notes(tmp_path)[-1]
    assert relaunch(base(tmp_path, "schedule.steps=4"), total_steps=4).finished
    longer = relaunch(base(tmp_path, "schedule.steps=9"), total_steps=9)
    assert not longer.finished and [c.key for c in longer.applied] == ["schedule.steps"]
    mark_finished(tmp_path, 3, "step_00000003")  # finished once, lengthened, now at a later checkpoint
    assert not relaunch(cfg, total_steps=6).finished


def test_a_truncated_latest_is_judged_by_the_checkpoint_the_resume_falls_back_to(tmp_path):
    """`latest` cut short to `step_000` (not step 0): the relaunch reads the checkpoint a resume would load, the
    newest complete one, so a finished run is still found finished (before: step 0, not finished, and the ranks
    started, resumed at step 6 and exported again)."""
    cfg = base(tmp_path, "schedule.steps=6")
    checkpoint(tmp_path, cfg, step=3)
    checkpoint(tmp_path, cfg, step=6)
    mark_finished(tmp_path, 6, "step_00000006")
    (tmp_path / "checkpoints" / "latest").write_text("step_000")
    verdict = relaunch(cfg, total_steps=6)
    assert verdict.finished and (verdict.checkpoint.tag, verdict.checkpoint.step) == ("step_00000006", 6)
    assert verdict.notes(tmp_path) == [
        f"{tmp_path} holds a finished run (step 6, checkpoints/step_00000006, exported): nothing to do; lengthen the "
        "schedule (schedule.steps / schedule.epochs) to continue it, or pass run_dir=NEW_DIR to start a new run"
    ]
    longer = relaunch(base(tmp_path, "schedule.steps=9"), total_steps=9)  # resumes from step 6
    assert not longer.finished and longer.checkpoint.tag == "step_00000006"
    refused = relaunch(base(tmp_path, "schedule.steps=6", "seed=1"), total_steps=6)
    assert "(checkpoints/step_00000006; seed: 0 -> 1)" in refused.refusal(tmp_path)


@pytest.mark.parametrize("finished", [True, False])
def test_a_latest_naming_an_incomplete_checkpoint_is_judged_by_its_complete_predecessor(tmp_path, finished):
    """`latest` names step 8, whose save never completed (no marker; its config another one), after a complete step 6:
    the resume loads step 6, and the relaunch judges by it, config and step: finished when the run finished at 6
    (before: step 8 against finished.json's 6, not finished), else resumed from 6."""
    cfg = base(tmp_path, "schedule.steps=6")
    checkpoint(tmp_path, cfg, step=6)
    if finished:
        mark_finished(tmp_path, 6, "step_00000006")
    checkpoint(tmp_path, base(tmp_path, "schedule.steps=6", "seed=1"), step=8, complete=False)
    verdict = relaunch(cfg, total_steps=6)
    assert (verdict.checkpoint.tag, verdict.checkpoint.step) == ("step_00000006", 6)
    assert verdict.refused == [] and verdict.applied == []  # step 6's config, not the torn step 8's
    assert verdict.finished is finished
    assert not relaunch(base(tmp_path, "schedule.steps=8"), total_steps=8).finished


def test_nothing_complete_behind_a_torn_latest_is_a_fresh_run_as_its_resume_is(tmp_path):
    """No checkpoint a resume would load (it starts from scratch): no config to compare, nothing finished."""
    checkpoint(tmp_path, base(tmp_path, "seed=1"), step=6, complete=False)
    (tmp_path / "checkpoints" / "latest").write_text("step_0")
    verdict = relaunch(base(tmp_path), total_steps=6)
    assert verdict.checkpoint is None and verdict.refusal(tmp_path) is None and not verdict.finished


def test_fresh_run_dir(tmp_path):
    verdict = relaunch(base(tmp_path / "new"), total_steps=6)
    assert verdict.checkpoint is None and verdict.notes(tmp_path) == [] and verdict.refusal(tmp_path) is None


def test_every_launch_config_is_kept(tmp_path):
    assert keep_launch_config(tmp_path, "first: 1\n") == tmp_path / "config.yaml"
    assert keep_launch_config(tmp_path, "second: 2\n") == tmp_path / "configs" / "launch_0002.yaml"
    assert keep_launch_config(tmp_path, "third: 3\n") == tmp_path / "configs" / "launch_0003.yaml"
    assert (tmp_path / "config.yaml").read_text() == "first: 1\n"
    assert (tmp_path / "configs" / "launch_0002.yaml").read_text() == "second: 2\n"


def test_may_change_keys_are_recipe_keys():
    assert set(MAY_CHANGE) <= set(flatten(load_config(None).model_dump(mode="json")))


def test_cut_metrics_keeps_each_step_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "train/loss": float(s)}) for s in (1, 2, 3, 3, 4, 5)]
    path.write_text("\n".join(lines) + '\n{"step": 6, "train/lo')  # the last line cut short by a kill
    assert cut_metrics(path, 3) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 3]
    assert cut_metrics(path, 3) == 0 and cut_metrics(tmp_path / "none.jsonl", 3) == 0


def test_resumed_logger_holds_each_step_once_in_jsonl_and_tensorboard(tmp_path):
    first = MetricsLogger(tmp_path, enabled=True, tensorboard=True)
    for step in range(1, 7):
        first.scalars(step, {"train/loss": float(step)})
    first.close()  # interrupted after step 6; the checkpoint is step 4's
    resumed = MetricsLogger(tmp_path, enabled=True, tensorboard=True, resume_step=4)
    for step in (5, 6, 7):
        resumed.scalars(step, {"train/loss": 100.0 + step})
    resumed.close()
    expected = {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 105.0, 6: 106.0, 7: 107.0}
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {m["step"]: m["train/loss"] for m in logged} == expected and len(logged) == 7
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("train/loss")} == expected
    assert len(events.Scalars("train/loss")) == 7
