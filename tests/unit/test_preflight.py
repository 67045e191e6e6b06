"""Pre-flight (core/launch/preflight.py and the stages' preflight.py) through `python -m core.entry.launch_check`, the
check launch.sh runs before any process starts: each bad input is one line `launch.sh: KEY: ...` naming the file, exit
code 2, no traceback; good input passes and the plan says what was checked."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
import yaml

from core.engine.precision import resolve_precision
from core.entry.launch_check import main as launch_check
from core.export.folder import export_model
from core.launch.disk import checkpoint_room
from core.launch.lease import LEASE_FILE, Lease
from core.launch.rundir import mark_finished
from core.models.build import model_args
from core.recipe.config import dump_config, load_config
from data.__main__ import main as data_main
from finetune.preflight import resolve
from tests.helpers.models import tiny_vit
from tests.launching import TINY_MODEL, copy_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Synthetic 16 px, 4 classes, 64 samples in 4 shards of 16, with index.json."""
    out = tmp_path_factory.mktemp("shards") / "train"
    args = ["--num-samples", "64", "--image-size", "16", "--num-classes", "4", "--shard-size", "16"]
    data_main(["write", "--source", "synthetic", "--out", str(out), *args])
    return out


def finetune_recipe(tmp_path: Path, shards: Path, **model) -> Path:
    recipe = {
        "stage": "finetune",
        "run_dir": str(tmp_path / "run"),
        "model": {**TINY_MODEL, **model},
        "data": {"train": str(shards), "global_batch_size": 8},
        "objective": {"kind": "classification"},
        "schedule": {"steps": 4},
    }
    path = tmp_path / "finetune.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def check(capsys, recipe: Path, *overrides: str) -> tuple[int, list[str], str]:
    """(exit code, the `launch.sh:` lines, everything printed) of the pre-launch check for one process."""
    code = launch_check([str(recipe), *overrides, "--nproc-per-node", "1"])
    out = capsys.readouterr()
    printed = out.out + out.err
    return code, [line for line in out.err.splitlines() if line.startswith("launch.sh:")], printed


def test_good_recipe_passes_and_the_plan_says_what_was_checked(capsys, tmp_path, shards):
    init = tmp_path / "encoder.safetensors"
    # another patch size: the hand-off resamples it
    safetensors.torch.save_file(tiny_vit(patch_size=8).state_dict(), init)
    code, lines, printed = check(capsys, finetune_recipe(tmp_path, shards, init=str(init)), f"data.val={shards}")
    assert code == 0 and lines == [], printed
    assert (
        "[mimpipe] pre-flight: run_dir writable; data.train: first sample of train-000000.tar has .png and a label; "
        "data.val: first sample of train-000000.tar has .png and a label; model.init: timm, ViT 32 wide, 2 blocks, "
        "patch 8x8" in printed
    )
    assert not (tmp_path / "run").exists()  # nothing is created before the launch


def _mae_pickle(tmp_path: Path) -> Path:
    """An official-MAE-style checkpoint: the weights next to a pickled argparse.Namespace."""
    path = tmp_path / "mae_pretrain.pth"
    state = tiny_vit().state_dict() | {"mask_token": torch.zeros(1, 1, 32), "decoder_embed.weight": torch.zeros(16, 32)}
    torch.save({"model": state, "args": argparse.Namespace(model="mae_vit_tiny")}, path)
    return path


# Each bad input: (tmp_path, shards) -> (recipe overrides, the key and the file the line names, words it holds).


def missing_shard_dir(t: Path, s: Path):
    return [f"data.train={t}/nope"], "data.train", f"{t}/nope", "does not exist"


def shard_without_image(t: Path, s: Path):
    spec = copy_shards(s, t / "noimg", drop="png")
    return (
        [f"data.train={spec}"],
        "data.train",
        f"{spec}/train-000000.tar",
        "has no image field (jpg, jpeg, png, webp, bmp, any case)",
    )


def finetune_shard_without_label(t: Path, s: Path):
    spec = copy_shards(s, t / "nocls", drop="cls")
    return [f"data.val={spec}"], "data.val", f"{spec}/train-000000.tar", "has no .cls label"


def init_missing(t: Path, s: Path):
    return [f"model.init={t}/gone.pth"], "model.init", f"{t}/gone.pth", "does not exist"


def init_of_another_width(t: Path, s: Path):
    """The recipe's model.embed_dim against the file's: the key and both values (core/export/architecture.py)."""
    safetensors.torch.save_file(tiny_vit(embed_dim=64).state_dict(), t / "wide.safetensors")
    words = f"the recipe sets 32, {t}/wide.safetensors has 64 (the weights); leave it out to take the checkpoint's"
    return [f"model.init={t}/wide.safetensors"], "model.embed_dim", f"{t}/wide.safetensors", words


def init_of_another_structure(t: Path, s: Path):
    """What no recipe key says (attention without a qkv bias): the shapes that do not fit."""
    safetensors.torch.save_file(tiny_vit(qkv_bias=False).state_dict(), t / "nobias.safetensors")
    words = "ViT 32 wide, 2 blocks, patch 4x4 does not fit the recipe's model (ViT 32 wide, 2 blocks, patch 4x4)"
    return [f"model.init={t}/nobias.safetensors"], "model.init", f"{t}/nobias.safetensors", words


def pickle_without_trust(t: Path, s: Path):
    path = _mae_pickle(t)
    return [f"model.init={path}"], "model.init", str(path), "argparse.Namespace); refusing to unpickle it"


def run_dir_under_a_file(t: Path, s: Path):
    (t / "file").write_text("")
    return [f"run_dir={t}/file/run"], "run_dir", f"{t}/file/run", f"cannot be created: {t}/file is a file"


def epochs_without_index(t: Path, s: Path):
    spec = f"{copy_shards(s, t / 'foreign', drop='none', index=False)}/*.tar"
    overrides = [f"data.train={spec}", "schedule.steps=null", "schedule.epochs=2", "model.num_classes=4"]
    sentence = "schedule in epochs needs data.samples_per_epoch or an index.json beside the shards"
    words = (sentence, "python -m data index")
    return overrides, "schedule.epochs", spec, words


FAILURES = [
    missing_shard_dir,
    shard_without_image,
    finetune_shard_without_label,
    init_missing,
    init_of_another_width,
    init_of_another_structure,
    pickle_without_trust,
    run_dir_under_a_file,
    epochs_without_index,
]


@pytest.mark.parametrize("case", FAILURES, ids=[f.__name__ for f in FAILURES])
def test_each_bad_input_is_one_line_naming_key_and_file(capsys, tmp_path, shards, case):
    overrides, key, file, words = case(tmp_path, shards)
    code, lines, printed = check(capsys, finetune_recipe(tmp_path, shards), *overrides)
    assert code == 2, printed
    assert len(lines) == 1, printed
    assert lines[0].startswith(f"launch.sh: {key}: ") and file in lines[0], lines[0]
    assert all(w in lines[0] for w in ([words] if isinstance(words, str) else words)), lines[0]
    assert "Traceback" not in printed and "[mimpipe] plan" not in printed


def test_run_dir_where_nothing_can_be_written(capsys, tmp_path, shards):
    try:  # sysfs refuses new files, also to root (for whom permission bits do not count)
        tempfile.TemporaryFile(dir="/sys").close()
        pytest.skip("/sys accepts files here")
    except OSError:
        pass
    code, lines, printed = check(capsys, finetune_recipe(tmp_path, shards), "run_dir=/sys/mimpipe_run")
    assert code == 2 and len(lines) == 1, printed
    assert lines[0].startswith("launch.sh: run_dir: /sys/mimpipe_run: not writable: cannot write in /sys (")


def test_every_problem_gets_its_line(capsys, tmp_path, shards):
    (tmp_path / "file").write_text("")
    overrides = [f"run_dir={tmp_path}/file/run", f"data.val={tmp_path}/nope", f"model.init={tmp_path}/gone.pth"]
    code, lines, printed = check(capsys, finetune_recipe(tmp_path, shards), *overrides)
    assert code == 2
    assert [line.split(":")[1].strip() for line in lines] == ["run_dir", "data.val", "model.init"], printed


def test_trusted_pickle_and_json_labels_pass(capsys, tmp_path, shards):
    foreign = copy_shards(shards, tmp_path / "nocls", drop="cls")  # labels only in each sample's .json
    recipe = finetune_recipe(tmp_path, shards, init=str(_mae_pickle(tmp_path)), trust_checkpoint=True)
    code, lines, printed = check(capsys, recipe, f"data.train={foreign}", "data.label_field=label")
    assert code == 0 and lines == [], printed
    assert "model.init: mae-pretrain, ViT 32 wide, 2 blocks, patch 4x4" in printed
    # the recipe sets every key the file fixes; the heads, which no shape shows, are the recipe's
    init = tmp_path / "mae_pretrain.pth"
    assert f"[mimpipe] model from {init}: num_heads 2 from the recipe (the weights do not show heads)\n" in printed


def _export(tmp_path: Path) -> Path:
    """Our export of the recipes' tiny ViT (32 wide, 2 blocks of 2 heads, 16 px in 4 px patches), normalised its way."""
    vit = tiny_vit()
    manifest = {"method": "mae", "step": 3, "pooling_hint": "avg"}
    data = {"mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25)}
    return export_model(vit, tmp_path / "export", model_args=model_args(vit), manifest=manifest, data_config=data)


@pytest.mark.parametrize("stage", ["finetune", "pretrain"])
def test_model_init_completes_the_recipe_and_a_contradiction_is_one_line(capsys, tmp_path, shards, stage):
    """Fine-tuning and a warm-started pretraining: a recipe whose model names only `model.init` gets the export's
    architecture and normalisation, and the plan says which keys; a key the export contradicts is one line naming it
    and both values, exit 2 (core/export/architecture.py)."""
    export = _export(tmp_path)
    recipe = {
        "stage": stage,
        "run_dir": str(tmp_path / "run"),
        "model": {"init": str(export)},
        "data": {"train": str(shards), "global_batch_size": 8},
        "objective": {"kind": "classification"} if stage == "finetune" else {"kind": "mae", "decoder_num_heads": 2},
        "schedule": {"steps": 4},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code, lines, printed = check(capsys, path, "--dry-run")
    assert code == 0 and lines == [], printed
    assert (
        f"[mimpipe] model from {export}: size tiny, embed_dim 32, depth 2, num_heads 2, patch_size 4, img_size 16, "
        "mean/std (config.json)\n"
    ) in printed
    dumped = yaml.safe_load(printed[printed.index("stage:") :].split("[mimpipe] plan")[0])  # --dry-run's config
    assert {k: dumped["model"][k] for k in ("embed_dim", "depth", "num_heads", "img_size")} == {
        "embed_dim": 32, "depth": 2, "num_heads": 2, "img_size": 16
    }  # fmt: skip
    assert dumped["data"]["mean"] == [0.5, 0.5, 0.5]

    code, lines, printed = check(capsys, path, "model.embed_dim=64")
    assert code == 2 and lines == [
        f"launch.sh: model.embed_dim: the recipe sets 64, {export} has 32 (config.json); leave it out to take the "
        "checkpoint's"
    ], printed
    assert "[mimpipe] plan" not in printed


def test_pretraining_needs_images_only_and_leaves_remote_shards_closed(capsys, tmp_path, shards):
    recipe = finetune_recipe(tmp_path, shards)
    foreign = copy_shards(shards, tmp_path / "nocls", drop="cls")
    code, lines, printed = check(capsys, recipe, "stage=pretrain", "objective={kind: mae}", f"data.train={foreign}")
    assert code == 0 and lines == [], printed
    remote = "data.train=[http://127.0.0.1:9/a.tar, 'pipe:cat b.tar']"
    code, lines, printed = check(capsys, recipe, "stage=pretrain", "objective={kind: mae}", remote)
    assert code == 0 and "data.train: 2 remote shards, not opened" in printed, printed


def test_tokenizer_target_and_bare_teacher(capsys, tmp_path, shards):
    recipe = finetune_recipe(tmp_path, shards)
    beit = f"objective={{kind: beit, target: {{kind: tokenizer, path: {tmp_path}/tok}}}}"
    code, lines, printed = check(capsys, recipe, "stage=pretrain", beit)
    assert code == 2 and len(lines) == 1, printed
    assert lines[0].startswith("launch.sh: objective.target.path: cannot read tokenizer manifest ")
    assert f"{tmp_path}/tok/mimpipe.json" in lines[0]

    teacher = tmp_path / "teacher.safetensors"
    safetensors.torch.save_file(tiny_vit().state_dict(), teacher)
    code, lines, printed = check(capsys, recipe, "distill.kind=soft", f"distill.teacher={teacher}")
    assert code == 2 and lines == [
        f"launch.sh: distill.teacher: distill.teacher {teacher} is a bare checkpoint: set distill.teacher_arch "
        "(a timm name)"
    ], printed


def test_val_needs_a_shard_per_rank(capsys, tmp_path, shards):
    recipe = finetune_recipe(tmp_path, shards)
    code = launch_check([str(recipe), f"data.val={shards}", "data.global_batch_size=40", "--nproc-per-node", "5"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("launch.sh:")]
    assert code == 2 and lines == [
        f"launch.sh: data.val: {shards}: 4 shards for 5 ranks: evaluation gives every rank shards of its own (at least "
        "1 each); write the split in smaller shards (python -m data write --shard-size) or launch fewer processes"
    ]
    assert launch_check([str(recipe), f"data.val={shards}", "--nproc-per-node", "4"]) == 0


def test_labels_beyond_num_classes_from_index_or_first_samples(capsys, tmp_path, shards):
    recipe = finetune_recipe(tmp_path, shards)
    code, lines, printed = check(capsys, recipe, "model.num_classes=3")
    assert code == 2 and lines == [
        f"launch.sh: data.train: {shards}/index.json (classes) has label 3, but the classifier has 3 outputs "
        "(model.num_classes); labels must be 0..2: set model.num_classes to at least 4"
    ], printed
    foreign = copy_shards(shards, tmp_path / "foreign", drop="none", index=False)  # no index: read the samples
    code, lines, printed = check(capsys, recipe, "model.num_classes=3", f"data.val={foreign}/*.tar")
    assert code == 2 and [line.split(":")[1].strip() for line in lines] == ["data.train", "data.val"], printed
    assert f"the first 16 samples of {foreign}/train-000000.tar has label 3" in lines[1]
    code, lines, printed = check(capsys, recipe, "model.num_classes=4", f"data.val={foreign}/*.tar")
    assert code == 0 and lines == [], printed


def test_disk_too_small_for_the_checkpoints_kept(monkeypatch, tmp_path, shards):
    """Rank 0's check before its engine (core/engine/run.py check_room): the estimate from the objective, or the size
    of the latest checkpoint once there is one."""
    cfg = load_config(finetune_recipe(tmp_path, shards), ["checkpoint.keep_last=3"])
    model = tiny_vit(num_classes=4)
    problem, note = checkpoint_room(cfg, lambda: model)
    # The tiny ViT (2 blocks of 32 wide, 4 classes) has 27,748 parameters: 16 bytes each with AdamW (fp32 weights,
    # master copy and two moments), 444 kB.
    assert problem is None and "free for 4 checkpoints of about 444.0 kB each" in note
    monkeypatch.setattr("core.launch.disk.free_bytes", lambda path: (1_000_000, tmp_path))
    problem, _ = checkpoint_room(cfg, lambda: model)
    assert problem == (
        f"{tmp_path}/run: 1.0 MB free on the filesystem of {tmp_path}, the run needs room for 4 checkpoints of about "
        "444.0 kB each (estimated from 27,748 parameters): checkpoint.keep_last 3 + 1 while saving; free space or set "
        "run_dir elsewhere"
    )
    tag = tmp_path / "run" / "checkpoints" / "step_00000002"
    tag.mkdir(parents=True)
    (tag / "weights").write_bytes(bytes(300_000))
    (tag.parent / "latest").write_text("step_00000002")

    def unused():
        raise AssertionError("the latest checkpoint gives the size")

    problem, note = checkpoint_room(cfg, unused)  # 3 more of 300 kB fit in 1 MB
    assert (
        problem is None
        and note == "run_dir: 1.0 MB free for 3 checkpoints of about 300.0 kB each (as checkpoints/step_00000002)"
    )


def test_relaunch_into_a_run_of_another_config_or_a_finished_run(capsys, tmp_path, shards):
    recipe = finetune_recipe(tmp_path, shards)
    cfg = load_config(recipe)
    resolve(cfg)  # as the entry point saved it: model.global_pool resolved
    resolve_precision(cfg, torch.device("cpu"))  # and engine.precision (auto)
    tag_dir = tmp_path / "run" / "checkpoints" / "step_00000004"
    tag_dir.mkdir(parents=True)
    (tag_dir / "config.yaml").write_text(dump_config(cfg))
    (tag_dir.parent / "latest").write_text(tag_dir.name)

    code, lines, printed = check(capsys, recipe, "optim.base_lr=3e-4")
    assert code == 2 and lines == [
        f"launch.sh: run_dir: {tmp_path}/run holds a run of another config (checkpoints/step_00000004; "
        "optim.base_lr: 0.00015 -> 0.0003); pass run_dir=NEW_DIR to start a new run, or --allow-config-change to "
        "continue this one with the new config"
    ], printed
    code, lines, printed = check(capsys, recipe, "optim.base_lr=3e-4", "--allow-config-change")
    assert code == 0 and "with another config (--allow-config-change): optim.base_lr: 0.00015 -> 0.0003" in printed
    code, lines, printed = check(capsys, recipe, "schedule.steps=8", "logging.every_steps=2")
    assert code == 0 and "changed settings: schedule.steps: 4 -> 8, logging.every_steps: 10 -> 2" in printed

    mark_finished(tmp_path / "run", 4, tag_dir.name)
    assert launch_check([str(recipe), "--nproc-per-node", "1"]) == 0
    out = capsys.readouterr()
    assert out.out == ""  # no module: launch.sh starts nothing
    assert f"[mimpipe] {tmp_path}/run holds a finished run (step 4, checkpoints/step_00000004, exported)" in out.err
    code, lines, printed = check(capsys, recipe, "schedule.steps=8")  # a longer schedule continues it
    assert code == 0 and printed.startswith("finetune\n") and "finished run" not in printed, printed


def test_a_run_dir_another_live_launch_holds_is_refused_unless_taken_over(capsys, tmp_path, shards):
    recipe = finetune_recipe(tmp_path, shards)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    now = time.time()
    live = Lease("node-x", 4242, "777", now - 60, now - 3, 300.0, "finetune", "/r/ft.yaml", "a" * 32)
    (run_dir / LEASE_FILE).write_bytes(live.encode())
    code, lines, printed = check(capsys, recipe)
    assert code == 2 and lines == [
        f"launch.sh: run_dir: {run_dir} is in use by host node-x pid 4242 (SLURM job 777) since "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now - 60))}, last heartbeat 3 s ago; wait for it to end "
        "(a launch silent for 300 s is taken over), pass run_dir=NEW_DIR to start a new run, or --take-over-run-dir "
        "if you know it is gone"
    ], printed
    code, lines, printed = check(capsys, recipe, "--take-over-run-dir")
    assert code == 0 and lines == [], printed
    # Node 1 of two leaves it to node 0 (which refuses), and rank 0 decides at the stage's start
    assert launch_check([str(recipe), "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1"]) == 0
    assert launch_check([str(recipe), "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1"]) == 2
    capsys.readouterr()
    stale = Lease("node-x", 4242, "777", now - 900, now - 301, 300.0, "finetune", "/r/ft.yaml", "a" * 32)
    (run_dir / LEASE_FILE).write_bytes(stale.encode())
    code, lines, printed = check(capsys, recipe)  # the stage takes it over, with a warning
    assert code == 0 and lines == [], printed
