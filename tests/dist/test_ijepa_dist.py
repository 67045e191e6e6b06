"""Recipe: tiny I-JEPA (`ijepa_recipe` below: a 2-block ViT of width 160 without a class token on 16 px synthetic
images, a 4x4 token grid with 3 target blocks per image and a context of more than 4 tokens, a 1-block predictor of
width 32, target-encoder decay 0.6 -> 0.9 over the 4 steps, fp32) through ./launch.sh with 2 gloo processes. The
target encoder (the EMA teacher) is the average of the context encoder's weights at ZeRO-0, 1 and 3 (ZeRO-3: on each
rank's own partition); a resume repeats the run, masks included (the data workers draw them per batch); a resume at
another world size reads the target encoder back; the export holds the target encoder, without a class token, and
fine-tuning starts from it.

As tests/dist/test_data2vec2_dist.py does for data2vec 2.0 (with its helpers, tests/helpers/teacher_runs.py): the
reference EMA is computed here from checkpoints saved after every step, starting from the context encoder before
step 1, a `model.init` file written here (the context encoder and the predictor; the target encoder copies the
context encoder at the start)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import timm
import yaml
from safetensors.torch import load_file

from tests.helpers.teacher_runs import (
    STUDENT,
    TEACHER,
    assert_same_tensors,
    assert_weights_equal,
    consolidated,
    copy_at_step,
    ema_step,
    max_diff,
    part,
    pretrain_export,
    write_init_file,
)
from tests.launching import TINY_MODEL, assert_resume_repeats, launch, losses, pretrain_recipe, write_recipe

pytestmark = pytest.mark.dist

# Width 160, as tests/dist/test_data2vec2_dist.py has it: each block's fc1 and fc2 are above ZeRO-3's persistence
# threshold, so ZeRO-3 releases them after use and the target encoder follows on the partitions alone.
MODEL = {**TINY_MODEL, "embed_dim": 160, "class_token": False}
EMA = {"start": 0.5, "end": 0.9, "steps": 4}  # decays 0.6, 0.7, 0.8, 0.9: the target encoder lags the context encoder
IJEPA = {
    "kind": "ijepa",
    "num_targets": 3,  # on the 4x4 grid: 3 blocks of 1-4 tokens, and a context of the 4x4 block less them
    "min_keep": 4,
    "predictor": {"depth": 1, "embed_dim": 32, "num_heads": 2},
    "ema": EMA,
}
STEPS, RESUME_AT = 4, 2


def ijepa_recipe(shards: dict[str, Path], run_dir: Path, *, model: dict = MODEL, **sections) -> dict:
    """`pretrain_recipe`'s tiny run with I-JEPA as its objective: 4 steps, a checkpoint after every one, fp32 (under
    bf16 autocast the target encoder's forward would not see an update far below bf16's rounding)."""
    recipe = pretrain_recipe(
        shards,
        run_dir,
        model=model,
        optim={"base_lr": 0.02},  # 2.5e-3 at the global batch of 32: every step moves the context encoder visibly
        schedule={"steps": STEPS, "warmup_steps": 1},
        engine={"precision": "fp32"},
        checkpoint={"every_steps": 1, "keep_last": STEPS},
    )
    recipe["objective"] = dict(IJEPA)
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value}
    return recipe


@pytest.fixture(scope="module")
def init_file(shards, tmp_path_factory) -> Path:
    """The context encoder and the predictor before step 1 of every run here (`model.init`: the encoder by timm's
    names, the predictor by the objective's), built with another seed than the runs', so that a run that ignored it
    would start elsewhere."""
    tmp = tmp_path_factory.mktemp("init")
    recipe = write_recipe(tmp / "ijepa.yaml", ijepa_recipe(shards, tmp / "unused"))
    return write_init_file(recipe, tmp / "context_encoder_before_step_1.safetensors")


@pytest.fixture(scope="module")
def run(shards, init_file, tmp_path_factory):
    """`run(stage)`: `ijepa_recipe` from `init_file` at that ZeRO stage, 2 processes, launched on first use: (run_dir,
    launch output)."""
    runs: dict[int, tuple[Path, str]] = {}

    def get(stage: int) -> tuple[Path, str]:
        if stage not in runs:
            run_dir = tmp_path_factory.mktemp(f"ijepa_z{stage}") / "run"
            model = {**MODEL, "init": str(init_file)}
            recipe = ijepa_recipe(shards, run_dir, model=model, engine={"zero_stage": stage})
            proc = launch(write_recipe(run_dir.with_name(f"tiny_ijepa_z{stage}.yaml"), recipe))
            assert proc.returncode == 0, proc.stdout[-4000:]
            runs[stage] = run_dir, proc.stdout
        return runs[stage]

    return get


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_target_encoder_is_the_ema_of_the_context_encoder_after_every_step(run, init_file, stage):
    """Recipe: `ijepa_recipe` at engine.zero_stage 0, 1 and 3 from `init_file`. The warm start loads the context
    encoder and the predictor from it (load_report.json: every predictor tensor, none fresh but the target encoder's).
    After step k the target encoder is lerp(target encoder after step k-1, context encoder after step k,
    1 - decay_at(k)), from the context encoder before step 1."""
    run_dir, output = run(stage)
    assert f"[mimpipe] warm start from {init_file}" in output
    assert "[mimpipe] EMA teacher: a copy of the student" in output
    init = load_file(str(init_file))
    report = json.loads((run_dir / "load_report.json").read_text())
    assert report["objective_loaded"] == sorted(k for k in init if k.startswith("predictor."))
    assert report["objective_fresh"] and all(k.startswith(TEACHER) for k in report["objective_fresh"])
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    reference = part(init, "")
    # No class token, and pretraining's layout: the final norm on every token (core/models/build.py `no_class_token`)
    assert "cls_token" not in reference and "norm.weight" in reference and "fc_norm.weight" not in reference
    for step in range(1, STEPS + 1):
        state = consolidated(run_dir, step)
        student, teacher = part(state, STUDENT), part(state, TEACHER)
        moved = max_diff(student, reference)
        reference = ema_step(reference, student, step, EMA)
        assert_weights_equal(teacher, reference, f"ZeRO-{stage} step {step} target encoder")
        # The check has teeth: the context encoder moved, and the target encoder lags it, each by far more than the
        # tolerance.
        assert moved > 1e-3 and max_diff(teacher, student) > 1e-3, (step, moved)


def test_losses_agree_across_zero_stages(run):
    """Recipe: `ijepa_recipe` at ZeRO-0, 1 and 3: the same masks (drawn in the data workers from the batch's place in
    its stream, not from the ZeRO stage) and the same weights give the same losses, to the sums' order."""
    zero0 = losses(run(0)[0])
    for stage in (1, 3):
        for step, loss in losses(run(stage)[0]).items():
            assert math.isfinite(loss) and math.isclose(loss, zero0[step], rel_tol=1e-4), (stage, step, zero0)


# ZeRO-3's resume of the target encoder is data2vec 2.0's (tests/dist/test_data2vec2_dist.py, in `make test`), and the
# masks do not depend on the stage: its I-JEPA case is left to `make test-faults`.
@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=pytest.mark.faults)])
def test_resume_repeats_losses_masks_and_target_encoder(run, tmp_path, stage):
    """Recipe: `ijepa_recipe` at ZeRO-1 and ZeRO-3: the finished run restarted from its step-2 checkpoint repeats
    steps 3-4 (losses as tests/launching.py `assert_resume_repeats` checks them: the same images and the same masks,
    which the data workers draw again for the restored data position), and its context encoder, predictor and target
    encoder after every resumed step, and its export, equal the uninterrupted run's bit for bit."""
    run_dir, _ = run(stage)
    resumed = tmp_path / "resumed"
    assert_resume_repeats(run_dir, resumed, from_step=RESUME_AT, last_step=STEPS)
    for step in range(RESUME_AT + 1, STEPS + 1):
        after = consolidated(resumed, step)
        assert any(k.startswith(TEACHER) for k in after) and any(k.startswith("predictor.") for k in after)
        assert_same_tensors(after, consolidated(run_dir, step))
    exported, again = (load_file(str(d / "export" / "model.safetensors")) for d in (run_dir, resumed))
    assert_same_tensors(again, exported)


@pytest.mark.faults  # a relaunch at another world size: `make test-faults`, as tests/dist/test_elastic_dist.py
def test_resume_by_one_process_reads_the_target_encoder_back(run, tmp_path):
    """Recipe: `ijepa_recipe` at ZeRO-3, its step-2 checkpoint (written by 2 processes) resumed by 1 through
    DeepSpeed's universal checkpoint, which restores only what the optimizer owns: the target encoder is read back
    from the 2 ranks' files (the console says so), and after each resumed step it is the EMA of the resumed context
    encoder from the target encoder those files hold, so it was that one when the resume began."""
    run_dir, _ = run(3)
    resumed = tmp_path / "resumed"
    proc = launch(copy_at_step(run_dir, resumed, RESUME_AT), nproc=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "world size changed from 2 to 1" in proc.stdout
    saved = consolidated(run_dir, RESUME_AT)
    frozen = [k for k in saved if k.startswith(TEACHER)] + [f"{STUDENT}pos_embed"]  # and the fixed positions
    tag_dir = resumed / "checkpoints" / f"step_{RESUME_AT:08d}"
    line = f"[mimpipe] EMA teacher: {len(frozen)} tensors read back from {tag_dir} at the new world size"
    assert line in proc.stdout, proc.stdout[-3000:]
    assert sorted(losses(resumed)) == list(range(RESUME_AT + 1, STEPS + 1))
    assert all(math.isfinite(loss) for loss in losses(resumed).values())
    teacher = part(saved, TEACHER)
    for step in range(RESUME_AT + 1, STEPS + 1):
        state = consolidated(resumed, step)
        teacher = ema_step(teacher, part(state, STUDENT), step, EMA)
        assert_weights_equal(part(state, TEACHER), teacher, f"resumed step {step} target encoder")


def test_export_is_the_target_encoder_without_a_class_token(run, tmp_path, monkeypatch):
    """Recipe: `ijepa_recipe` at ZeRO-3 (2 processes). The in-run export holds the target encoder (objective.export
    defaults to teacher for I-JEPA; mimpipe.json says so), equal to the consolidated last checkpoint's
    `teacher.encoder.*`, and loads in timm (strict) as a ViT without a class token that pools by average; the context
    encoder and the predictor are listed as left at pretraining. `python -m pretrain export RUN_DIR --encoder student`
    writes the context encoder instead."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_dir, _ = run(3)
    state = consolidated(run_dir, STEPS)
    teacher, student = part(state, TEACHER), part(state, STUDENT)
    export = run_dir / "export"
    exported = load_file(str(export / "model.safetensors"))
    assert_same_tensors(exported, teacher)
    manifest = json.loads((export / "mimpipe.json").read_text())
    assert (manifest["method"], manifest["encoder"], manifest["step"]) == ("ijepa", "teacher", STEPS)
    assert set(manifest["not_exported"]) == {STUDENT + k for k in student} | {
        k for k in state if k.startswith("predictor.")
    }
    model = timm.create_model(f"local-dir:{export}", pretrained=True)  # load_state_dict(strict=True)
    assert not model.has_class_token and model.num_prefix_tokens == 0 and model.global_pool == "avg"
    assert_same_tensors(model.state_dict(), exported)

    out = tmp_path / "student"
    assert_same_tensors(pretrain_export(run_dir, out, "--encoder", "student"), student)
    assert json.loads((out / "mimpipe.json").read_text())["encoder"] == "student"
    assert max_diff(teacher, student) > 1e-3  # two encoders, not one


def test_finetune_from_the_export_loads_every_encoder_tensor(run, shards, tmp_path):
    """Recipe: a 2-step fine-tuning run (1 process) from `ijepa_recipe`'s ZeRO-3 export that names only `model.init`:
    the architecture comes from the export (width, depth, heads, image and patch size, no class token, average
    pooling: core/export/architecture.py), every one of the export's tensors is loaded (load_report.json: the final
    norm moved after the pooling, `norm.*` -> `fc_norm.*` as from an MAE export; nothing resized or dropped; only the
    head is initialised), and it trains (finite losses)."""
    export = run(3)[0] / "export"
    run_dir = tmp_path / "ft"
    recipe = {
        "stage": "finetune",
        "run_dir": str(run_dir),
        "model": {"init": str(export)},
        "data": {"train": str(shards["train"]), "global_batch_size": 32, "num_workers": 1},
        "objective": {"kind": "classification"},
        "optim": {"base_lr": 1e-3},
        "schedule": {"steps": 2, "warmup_steps": 1},
        "engine": {"device": "cpu", "zero_stage": 1},
        "checkpoint": {"every_steps": 2},
        "logging": {"every_steps": 1},
    }
    proc = launch(write_recipe(tmp_path / "tiny_ijepa_ft.yaml", recipe), nproc=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    model = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]
    architecture = {k: model[k] for k in ("embed_dim", "depth", "num_heads", "img_size", "patch_size")}
    assert architecture == {k: MODEL[k] for k in architecture}
    assert (model["class_token"], model["global_pool"]) == (False, "avg")
    report = json.loads((run_dir / "load_report.json").read_text())
    mapped = dict(report["mapped"])
    assert mapped == {"norm.weight": "fc_norm.weight", "norm.bias": "fc_norm.bias"}
    exported = load_file(str(export / "model.safetensors"))
    assert sorted(report["loaded"]) == sorted(mapped.get(k, k) for k in exported)
    assert (report["resized"], report["dropped"]) == ([], [])
    assert sorted(report["initialised"]) == ["head.bias", "head.weight"]
    trained = losses(run_dir)
    assert sorted(trained) == [1, 2] and all(math.isfinite(loss) for loss in trained.values())
