"""Recipe: tiny data2vec 2.0 (`data2vec2_recipe` below: a 2-block ViT of width 160 on 16 px synthetic images, 2
masked copies per image, EMA decay 0.6 -> 0.9 over the first 4 steps, fp32) through ./launch.sh with 2 gloo processes.
The EMA teacher is the average of the student's weights at every ZeRO stage (ZeRO-3: on each rank's own partition);
a resume repeats the run; a resume at another world size reads the teacher back; the export holds the student, or
the teacher where the recipe says so; a checkpoint without a teacher is refused.

The reference EMA is computed here from checkpoints saved after every step (consolidated as `pretrain export` does,
core/engine/gather.py), starting from the student before step 1: a `model.init` file written here (the student and
the decoder; the teacher copies the student at the start)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import load_file

from tests.helpers.teacher_runs import (
    STUDENT,
    TEACHER,
    assert_weights_equal,
    consolidated,
    copy_at_step,
    ema_step,
    max_diff,
    part,
    pretrain_export,
    write_init_file,
)
from tests.launching import (
    TINY_MODEL,
    assert_resume_repeats,
    launch,
    losses,
    pretrain_recipe,
    torchrun,
    write_recipe,
)

pytestmark = pytest.mark.dist

# Width 160: each block's fc1 and fc2 (160 x 640 = 102,400 elements) are above ZeRO-3's persistence threshold
# (core/engine/setup.py: 100,000), so ZeRO-3 releases them after use and the teacher follows the student on the
# partitions alone; the smaller parameters stay gathered and are followed in both forms.
MODEL = {**TINY_MODEL, "embed_dim": 160}
PERSISTENCE_THRESHOLD = 100_000
EMA = {"start": 0.5, "end": 0.9, "steps": 4}  # decays 0.6, 0.7, 0.8, 0.9, 0.9, 0.9: the teacher lags the student
DATA2VEC2 = {
    "kind": "data2vec2",
    "num_masks": 2,
    "top_k_blocks": 2,
    "decoder": {"embed_dim": 32, "num_layers": 1, "groups": 4},
    "ema": EMA,
}
STEPS = 6


def data2vec2_recipe(shards: dict[str, Path], run_dir: Path, *, model: dict = MODEL, **sections) -> dict:
    """`pretrain_recipe`'s tiny run with data2vec 2.0 as its objective: 6 steps, a checkpoint after every one, fp32
    (under bf16 autocast the teacher's forward would not see an update far below bf16's rounding)."""
    recipe = pretrain_recipe(
        shards,
        run_dir,
        model=model,
        optim={"base_lr": 0.02},  # 2.5e-3 at the global batch of 32: every step moves the student visibly
        schedule={"steps": STEPS, "warmup_steps": 1},
        engine={"precision": "fp32"},
        checkpoint={"every_steps": 1, "keep_last": STEPS},
    )
    recipe["objective"] = dict(DATA2VEC2)
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value}
    return recipe


@pytest.fixture(scope="module")
def init_file(shards, tmp_path_factory) -> Path:
    """The student and decoder before step 1 of every run here (`model.init`: the encoder by timm's names, the
    decoder by the objective's), built with another seed than the runs', so that a run that ignored it would start
    elsewhere."""
    tmp = tmp_path_factory.mktemp("init")
    recipe = write_recipe(tmp / "d2v.yaml", data2vec2_recipe(shards, tmp / "unused"))
    return write_init_file(recipe, tmp / "student_before_step_1.safetensors")


def launch_data2vec2(shards, init_file: Path, run_dir: Path, name: str, **sections) -> str:
    recipe = data2vec2_recipe(shards, run_dir, model={**MODEL, "init": str(init_file)}, **sections)
    proc = launch(write_recipe(run_dir.with_name(name), recipe))
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def runs(shards, init_file, tmp_path_factory) -> dict[int, tuple[Path, str]]:
    """Per ZeRO stage 0-3: `data2vec2_recipe` from `init_file`, 2 processes: (run_dir, launch output)."""
    tmp = tmp_path_factory.mktemp("d2v")
    out = {}
    for stage in (0, 1, 2, 3):
        run_dir = tmp / f"z{stage}"
        out[stage] = (
            run_dir,
            launch_data2vec2(shards, init_file, run_dir, f"tiny_d2v_z{stage}.yaml", engine={"zero_stage": stage}),
        )
    return out


@pytest.fixture(scope="module")
def teacher_run(shards, init_file, tmp_path_factory) -> Path:
    """`data2vec2_recipe` at ZeRO-3 with objective.export=teacher and a checkpoint every 3 steps, 2 processes."""
    run_dir = tmp_path_factory.mktemp("d2v_teacher") / "run"
    launch_data2vec2(
        shards,
        init_file,
        run_dir,
        "tiny_d2v_z3_teacher.yaml",
        engine={"zero_stage": 3},
        objective={"export": "teacher"},
        checkpoint={"every_steps": 3},
    )
    return run_dir


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_teacher_is_the_ema_of_the_student_after_every_step(runs, init_file, stage):
    """Recipe: `data2vec2_recipe` at engine.zero_stage 0-3 from `init_file`. After step k the teacher is
    lerp(teacher after step k-1, student after step k, 1 - decay_at(k)), from the student before step 1."""
    run_dir, output = runs[stage]
    assert f"[mimpipe] warm start from {init_file}" in output
    assert "[mimpipe] EMA teacher: a copy of the student" in output
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    reference = part(load_file(str(init_file)), "")
    for step in range(1, STEPS + 1):
        state = consolidated(run_dir, step)
        student, teacher = part(state, STUDENT), part(state, TEACHER)
        moved = max_diff(student, reference)
        reference = ema_step(reference, student, step, EMA)
        assert_weights_equal(teacher, reference, f"ZeRO-{stage} step {step} teacher")
        # The check has teeth: the student moved, and the teacher lags it, each by far more than the tolerance (a
        # decay off by one step misses by 2.5e-4 or more).
        assert moved > 1e-3 and max_diff(teacher, student) > 1e-3, (step, moved)


def test_zero3_teacher_is_partitioned_on_each_rank(runs):
    """Recipe: `data2vec2_recipe` at ZeRO-3. Each rank's checkpoint holds its own partition of every teacher
    parameter (DeepSpeed saves the rank's `ds_tensor`): half of it, with the padding; and the console reports that
    each rank holds about half of the objective's parameters, teacher included."""
    run_dir, output = runs[3]
    tag_dir = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    files = [
        torch.load(tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        for rank in (0, 1)
    ]
    shapes = files[0]["frozen_param_shapes"]
    teacher = [name for name in shapes if name.startswith(TEACHER)]
    assert len(teacher) == len(load_file(str(run_dir / "export" / "model.safetensors")))  # all of the encoder
    assert any(torch.Size(shapes[name]).numel() > PERSISTENCE_THRESHOLD for name in teacher)  # released ones too
    for name in teacher:
        numel = torch.Size(shapes[name]).numel()
        for f in files:
            assert f["frozen_param_fragments"][name].numel() == math.ceil(numel / 2), name
    held = re.search(r"ZeRO-3 partitioned parameters: this rank holds ([\d,]+) of ([\d,]+)", output)
    assert held, output[-3000:]
    assert 0.45 < int(held[1].replace(",", "")) / int(held[2].replace(",", "")) < 0.55


def test_teacher_forward_sees_every_update(runs, teacher_run):
    """Recipe: `data2vec2_recipe` at ZeRO-3 with a checkpoint every 3 steps (`teacher_run`) against the same with one
    every step. Saving a ZeRO-3 checkpoint gathers the parameters ZeRO-3 keeps gathered again from the partitions;
    between checkpoints only the teacher's update keeps their gathered copy, which its forward uses, in step with
    its partition (a copy one update behind changes the loss from step 2 by ~1e-3). The losses are the same, and
    agree with ZeRO-0's."""
    every_step = losses(runs[3][0])
    assert losses(teacher_run) == every_step
    zero0 = losses(runs[0][0])
    for stage in (1, 2, 3):
        for step, loss in losses(runs[stage][0]).items():
            assert math.isclose(loss, zero0[step], rel_tol=1e-4), (stage, step, loss, zero0[step])


@pytest.mark.parametrize("stage", [1, 3])
def test_resume_repeats_losses_and_teacher(runs, tmp_path, stage):
    """Recipe: `data2vec2_recipe` at ZeRO-1 and ZeRO-3: the finished run restarted from its step-3 checkpoint repeats
    steps 4-6 (losses as tests/launching.py `assert_resume_repeats` checks them), and its teacher and student after
    every resumed step, and its export, equal the uninterrupted run's bit for bit."""
    run_dir, _ = runs[stage]
    resumed = tmp_path / "resumed"
    assert_resume_repeats(run_dir, resumed, from_step=3, last_step=STEPS)
    for step in range(4, STEPS + 1):
        before, after = consolidated(run_dir, step), consolidated(resumed, step)
        assert set(before) == set(after) and any(k.startswith(TEACHER) for k in after)
        for name, value in before.items():
            assert torch.equal(after[name], value), (step, name)
    exported, again = (load_file(str(d / "export" / "model.safetensors")) for d in (run_dir, resumed))
    assert set(exported) == set(again) and all(torch.equal(again[k], v) for k, v in exported.items())


@pytest.mark.faults  # a relaunch at another world size: `make test-faults`, as tests/dist/test_elastic_dist.py
@pytest.mark.parametrize("stage", [1, 3])
def test_resume_by_one_process_reads_the_teacher_back(runs, tmp_path, stage):
    """Recipe: `data2vec2_recipe` at ZeRO-1 and ZeRO-3, its step-3 checkpoint (written by 2 processes) resumed by 1
    through DeepSpeed's universal checkpoint, which restores only what the optimizer owns: the teacher is read back
    from the 2 ranks' files (the console says so), and after each resumed step it is the EMA of the resumed
    student from the teacher those files hold, so it was that teacher when the resume began."""
    run_dir, _ = runs[stage]
    resumed = tmp_path / "resumed"
    proc = launch(copy_at_step(run_dir, resumed, 3), nproc=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    tag_dir = resumed / "checkpoints" / "step_00000003"
    assert "world size changed from 2 to 1" in proc.stdout
    saved = consolidated(run_dir, 3)
    frozen = [k for k in saved if k.startswith(TEACHER)] + [f"{STUDENT}pos_embed"]  # the student's fixed positions
    line = f"[mimpipe] EMA teacher: {len(frozen)} tensors read back from {tag_dir} at the new world size"
    assert line in proc.stdout, proc.stdout[-3000:]
    assert sorted(losses(resumed)) == [4, 5, 6]
    teacher = part(saved, TEACHER)
    for step in range(4, STEPS + 1):
        state = consolidated(resumed, step)
        teacher = ema_step(teacher, part(state, STUDENT), step, EMA)
        assert_weights_equal(part(state, TEACHER), teacher, f"ZeRO-{stage} resumed step {step} teacher")


@pytest.mark.faults  # a relaunch at another world size: `make test-faults`, as tests/dist/test_elastic_dist.py
def test_resume_by_two_processes_gives_the_teacher_forward_its_values(shards, init_file, tmp_path):
    """Recipe: `data2vec2_recipe` at ZeRO-3 run by 1 process for 3 steps, then started again by 2 (schedule.steps=6)
    in tests/dist/data2vec2_resume_worker.py, which runs the stage's start (pretrain/stage.py) and reads the teacher
    as its next forward would: every parameter, those ZeRO-3 keeps gathered as they are, equals the checkpoint's on
    both ranks. (At 1 process a kept parameter's gathered copy is its partition; at 2 it is a copy of its own.)"""
    run_dir = tmp_path / "run"
    recipe = data2vec2_recipe(
        shards, run_dir, model={**MODEL, "init": str(init_file)}, engine={"zero_stage": 3}, schedule={"steps": 3}
    )
    recipe_path = write_recipe(tmp_path / "tiny_d2v_z3_one_rank.yaml", recipe)
    proc = launch(recipe_path, nproc=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    out = tmp_path / "teacher_seen.json"
    proc = torchrun("data2vec2_resume_worker.py", out, recipe_path, "schedule.steps=6", nproc=2)
    # 30 teacher tensors and the student's fixed positions
    assert "world size changed from 1 to 2" in proc.stdout and "EMA teacher: 31 tensors read back" in proc.stdout
    for rank in json.loads(out.read_text()):
        assert "cls_token" in rank["kept_gathered"] and "blocks.0.mlp.fc1.weight" not in rank["kept_gathered"]
        assert rank["differ"] == [], rank["differ"]


def test_export_holds_the_student_or_the_teacher(runs, teacher_run, tmp_path, monkeypatch):
    """Recipe: `data2vec2_recipe` at ZeRO-3 (2 processes), exporting the student (the default) and, in
    `teacher_run`, the teacher (objective.export=teacher). `python -m pretrain export RUN_DIR --step N` writes the
    encoder the run's recipe names (the checkpoint's config.yaml), or `--encoder`'s: its weights are the consolidated
    checkpoint's under `encoder.` or `teacher.encoder.`, the in-run export's at the last step, and load in timm
    (strict)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    student_run = runs[3][0]
    cases = [(student_run, STUDENT, "student"), (teacher_run, TEACHER, "teacher")]
    exported = {}
    for run_dir, prefix, encoder in cases:
        for step in (3, STEPS):
            out = tmp_path / f"{encoder}_{step}"
            weights = pretrain_export(run_dir, out, "--step", str(step))
            expected = part(consolidated(run_dir, step), prefix)
            assert set(weights) == set(expected) and all(torch.equal(weights[k], v) for k, v in expected.items())
            assert json.loads((out / "mimpipe.json").read_text())["encoder"] == encoder
            model = timm.create_model(f"local-dir:{out}", pretrained=True)  # load_state_dict(strict=True)
            assert set(model.state_dict()) == set(weights)
            assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
            exported[encoder, step] = weights
        in_run = load_file(str(run_dir / "export" / "model.safetensors"))
        assert all(torch.equal(in_run[k], v) for k, v in exported[encoder, STEPS].items())
        assert json.loads((run_dir / "export" / "mimpipe.json").read_text())["encoder"] == encoder
    # Same recipe, same steps: the two exports are the student and the teacher of the same run.
    assert max_diff(exported["teacher", STEPS], exported["student", STEPS]) > 1e-3
    # --encoder overrides the recipe's choice: the student run's teacher, the teacher run's student.
    for run_dir, prefix, encoder in ((student_run, TEACHER, "teacher"), (teacher_run, STUDENT, "student")):
        out = tmp_path / f"{encoder}_flag"
        weights = pretrain_export(run_dir, out, "--step", "3", "--encoder", encoder)
        expected = part(consolidated(run_dir, 3), prefix)
        assert set(weights) == set(expected) and all(torch.equal(weights[k], v) for k, v in expected.items())
        assert json.loads((out / "mimpipe.json").read_text())["encoder"] == encoder


@pytest.mark.faults  # a relaunch into a used run_dir: `make test-faults`, as tests/dist/test_rundir_dist.py
def test_checkpoint_without_teacher_is_refused(shards, tmp_path):
    """Recipe: `pretrain_recipe` (tiny MAE, ZeRO-2, 2 steps), then `data2vec2_recipe` on the same model and run_dir
    with --allow-config-change: refused before anything loads, in one line naming the checkpoint (rank 0's:
    core/engine/run.py `refuse_without_teacher`); every rank exits 2, and so does launch.sh (torchrun's agent exits as
    its refused ranks, core/launch/torchrun.py); no traceback, no step, no checkpoint."""
    run_dir = tmp_path / "run"
    mae = pretrain_recipe(shards, run_dir, schedule={"steps": 2, "warmup_steps": 1}, checkpoint={"every_steps": 2})
    proc = launch(write_recipe(tmp_path / "tiny_mae.yaml", mae))
    assert proc.returncode == 0, proc.stdout[-4000:]
    recipe = write_recipe(tmp_path / "tiny_d2v.yaml", data2vec2_recipe(shards, run_dir, model=TINY_MODEL))
    proc = launch(recipe, "--allow-config-change")
    assert proc.returncode == 2, proc.stdout[-4000:]
    assert "[mimpipe] torchrun:" not in proc.stdout  # no failure report: the refusal says it
    tag_dir = run_dir / "checkpoints" / "step_00000002"
    refused = [line for line in proc.stdout.splitlines() if "refused" in line]
    assert refused == [
        f"[mimpipe] refused: checkpoint {tag_dir} has no EMA teacher (30 tensors missing, e.g. "
        "teacher.encoder.cls_token): it was written by an objective without one; start a new run_dir, or warm-start "
        "from its export with model.init"
    ], proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout and "step 1/" not in proc.stdout and "step 3/" not in proc.stdout
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000002"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000002"]
