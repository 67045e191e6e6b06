"""`model.init` carries the architecture (core/export/architecture.py): a recipe that names only the checkpoint is
completed from it (our export's config.json; an official or timm state dict's shapes, with the heads from the recipe
or timm's standard), a recipe key that contradicts it is one line naming the key and both values, and a real
fine-tuning launch from a recipe with only `model.init` and data trains the export's encoder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from core.export.architecture import InitMismatch, init_architecture, resolve_architecture
from core.export.folder import export_model
from core.export.handoff import fit_problems
from core.export.read import read_checkpoint
from core.models.build import build_model, model_args
from core.recipe.config import IMAGENET_MEAN, load_config
from finetune.handoff import resolve_init
from tests.helpers.models import tiny_vit
from tests.launching import launch, write_recipe

MEAN, STD = (0.4, 0.45, 0.5), (0.25, 0.2, 0.3)
# tiny_vit: 16 px images in 4 px patches, 32 wide, 2 blocks of 2 heads; the export below has 4 heads
EXPORT_LINE = "size tiny, embed_dim 32, depth 2, num_heads 4, patch_size 4, img_size 16, mean/std (config.json)"


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """Our export of a 4-head tiny ViT pretrained on images normalised with MEAN / STD."""
    vit = tiny_vit(num_heads=4)
    out = tmp_path_factory.mktemp("init") / "export"
    manifest = {"method": "mae", "step": 7, "pooling_hint": "avg"}
    return export_model(vit, out, model_args=model_args(vit), manifest=manifest, data_config={"mean": MEAN, "std": STD})


def official_mae(path: Path, **shape) -> Path:
    """models_mae.py's layout: a timm ViT's state dict beside MAE's mask token and decoder, under "model"."""
    vit = tiny_vit(**shape)
    width = vit.embed_dim
    decoder = {"mask_token": torch.zeros(1, 1, width), "decoder_embed.weight": torch.zeros(16, width)}
    torch.save({"model": vit.state_dict() | decoder, "epoch": 399}, path)
    return path


def finetune(init, *overrides: str):
    return load_config(None, ["stage=finetune", f"model.init={init}", *overrides])


def test_the_recipes_keys_are_what_its_file_base_and_overrides_set(tmp_path):
    """`model_fields_set` survives the `base:` merge and the overrides: the rule's "set by the recipe"."""
    (tmp_path / "parent.yaml").write_text("stage: finetune\nmodel: {drop_path_rate: 0.1}\ndata: {mean: [0, 0, 0]}\n")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\nmodel: {init: x}\n")
    cfg = load_config(tmp_path / "child.yaml", ["model.img_size=20"])
    assert cfg.model.model_fields_set == {"drop_path_rate", "init", "img_size"}
    assert cfg.data.model_fields_set == {"mean"}
    assert cfg.model_copy(deep=True).model.model_fields_set == cfg.model.model_fields_set  # check_relaunch's copy


def test_a_recipe_that_names_only_the_export_gets_its_architecture_and_normalisation(export):
    cfg = finetune(export)
    assert (cfg.model.size, cfg.model.embed_dim, cfg.model.img_size) == ("base", None, 224)  # as loaded
    found = resolve_init(cfg)
    assert found.line() == f"model from {export}: {EXPORT_LINE}"
    m = cfg.model
    shape = (m.arch, m.size, m.embed_dim, m.depth, m.num_heads, m.patch_size, m.img_size)
    assert shape == ("vit", "tiny", 32, 2, 4, 4, 16)
    assert (cfg.data.mean, cfg.data.std, m.global_pool) == (MEAN, STD, "avg")  # pooling: the manifest's hint
    # the recipe's keys stay the recipe's: resolving again takes (and says) the same
    assert m.model_fields_set == {"init", "global_pool"} and cfg.data.model_fields_set == set()
    assert init_architecture(cfg).line() == found.line()
    with torch.device("meta"):
        assert fit_problems(build_model(cfg, plain=True), read_checkpoint(export, shapes_only=True)) == []


def test_what_the_recipe_changes_wins(export):
    """img_size (20: not a multiple of the default patch 16, so the check waits for the export's 4), patch size,
    normalisation, drop path: the recipe's; the rest the export's."""
    changes = ["model.img_size=20", "model.patch_size=2", "data.mean=[0.5,0.5,0.5]", "model.drop_path_rate=0.1"]
    cfg = finetune(export, *changes)
    found = resolve_init(cfg)
    assert found.line() == f"model from {export}: size tiny, embed_dim 32, depth 2, num_heads 4, std (config.json)"
    m = cfg.model
    assert (m.img_size, m.patch_size, m.drop_path_rate, m.num_heads) == (20, 2, 0.1, 4)
    assert (cfg.data.mean, cfg.data.std) == ((0.5, 0.5, 0.5), STD)
    agreeing = finetune(export, "model.embed_dim=32", "model.depth=2", "model.num_heads=4", "model.size=tiny")
    assert resolve_init(agreeing).line() == f"model from {export}: patch_size 4, img_size 16, mean/std (config.json)"


CONTRADICTIONS = {
    "model.embed_dim=64": ("model.embed_dim", "the recipe sets 64, {init} has 32 (config.json)"),
    "model.num_heads=2": ("model.num_heads", "the recipe sets 2, {init} has 4 (config.json)"),
    "model.reg_tokens=1": ("model.reg_tokens", "the recipe sets 1, {init} has 0 (config.json)"),
    "model.arch=t2t_vit": ("model.arch", "the recipe sets t2t_vit, {init} has vit (config.json)"),
    "model.size=small": ("model.size", "the recipe sets small (embed_dim 384), {init} has embed_dim 32 (config.json)"),
}


@pytest.mark.parametrize("override", CONTRADICTIONS)
def test_a_recipe_key_the_export_contradicts_is_one_line_naming_the_key_and_both_values(export, override):
    key, words = CONTRADICTIONS[override]
    cfg = finetune(export, override)
    with pytest.raises(InitMismatch) as caught:
        resolve_init(cfg)
    leave = "leave model.size out" if key == "model.size" else "leave it out"
    assert caught.value.key == key
    assert str(caught.value) == f"{key}: {words.format(init=export)}; {leave} to take the checkpoint's"


def test_an_official_state_dict_gives_its_shapes_and_the_heads_come_from_the_recipe_or_timm(tmp_path):
    # 32 wide (no standard width): the heads are the recipe's, and the plan says so
    small = official_mae(tmp_path / "mae_small.pth", embed_dim=32, num_heads=2)
    cfg = finetune(small, "model.num_heads=2")
    found = resolve_architecture(cfg)
    assert found.line() == (
        f"model from {small}: embed_dim 32, depth 2, patch_size 4, img_size 16 (the weights); num_heads 2 from the "
        "recipe (the weights do not show heads)"
    )
    assert (cfg.model.embed_dim, cfg.model.depth, cfg.model.num_heads, cfg.model.patch_size) == (32, 2, 2, 4)
    assert cfg.data.mean == IMAGENET_MEAN  # a state dict has no normalisation: the recipe's (here the default)
    with torch.device("meta"):
        assert fit_problems(build_model(cfg, plain=True), read_checkpoint(small, shapes_only=True)) == []
    with pytest.raises(InitMismatch) as caught:
        resolve_architecture(finetune(small))
    assert str(caught.value) == (
        f"model.num_heads: not set, and {small} is 32 wide, not one of timm's standard widths (192, 384, 768, 1024, "
        "1280); its weights do not show the heads: set model.num_heads (e.g. 1)"
    )

    # 192 wide: timm's ViT-Tiny, 3 heads, unless the recipe's size says otherwise
    tiny = official_mae(tmp_path / "mae_tiny.pth", embed_dim=192, depth=1, num_heads=3)
    cfg = finetune(tiny)
    assert resolve_architecture(cfg).line() == (
        f"model from {tiny}: embed_dim 192, depth 1, patch_size 4, img_size 16 (the weights); size tiny, num_heads 3 "
        "(timm's standard for width 192)"
    )
    assert (cfg.model.size, cfg.model.num_heads) == ("tiny", 3)
    cfg = finetune(tiny, "model.size=tiny", "model.depth=1")  # the size's 12 blocks would contradict the file's 1
    assert resolve_architecture(cfg).line() == (
        f"model from {tiny}: embed_dim 192, patch_size 4, img_size 16 (the weights); num_heads 3 from model.size tiny "
        "(the weights do not show heads)"
    )
    with pytest.raises(InitMismatch, match=r"^model.size: the recipe sets base \(embed_dim 768\), \S+ has embed_dim"):
        resolve_architecture(finetune(tiny, "model.size=base"))


def test_a_completed_recipe_that_fails_the_schema_names_the_init(export):
    with pytest.raises(InitMismatch) as caught:
        resolve_architecture(finetune(export, "model.img_size=18"))  # 18 px in the export's 4 px patches
    assert str(caught.value) == (
        f"model.init: {export} completes the recipe to an invalid one: model.img_size 18 is not divisible by "
        "model.patch_size (4)"
    )


def test_a_finetuning_recipe_with_only_model_init_and_data_fine_tunes_the_exports_encoder(shards, export, tmp_path):
    """One real ./launch.sh run of 2 steps in 1 process: the plan and the load report name the keys the export gave,
    config.yaml holds them, and the fine-tuned export is the same encoder; a contradicting key stops the launch in one
    line before any process starts."""
    recipe = write_recipe(
        tmp_path / "ft.yaml",
        {
            "stage": "finetune",
            "run_dir": str(tmp_path / "run"),
            "model": {"init": str(export)},
            "data": {
                "train": str(shards["train"]),
                "val": str(shards["val"]),
                "global_batch_size": 8,
                "num_workers": 0,
                "eval_batch_size_per_device": 32,
            },
            "schedule": {"steps": 2, "warmup_steps": 1},
            "engine": {"device": "cpu", "zero_stage": 0},
            "checkpoint": {"every_steps": 2},
            "logging": {"every_steps": 1, "image_every_steps": 0},
            "eval": {"every_steps": 2, "per_class": False},
        },
    )
    refused = launch(recipe, "model.embed_dim=64", nproc=1)
    lines = [line for line in refused.stdout.splitlines() if line.startswith("launch.sh:")]
    assert refused.returncode == 2 and lines == [
        f"launch.sh: model.embed_dim: the recipe sets 64, {export} has 32 (config.json); leave it out to take the "
        "checkpoint's"
    ], refused.stdout[-3000:]
    assert not (tmp_path / "run").exists()  # no process started

    proc = launch(recipe, nproc=1)
    assert proc.returncode == 0, proc.stdout[-4000:]
    line = f"model from {export}: {EXPORT_LINE}"
    assert f"[mimpipe] {line}\n" in proc.stdout  # the plan
    report = json.loads((tmp_path / "run" / "load_report.json").read_text())
    assert report["notes"][0] == line and report["initialised"] == ["head.weight", "head.bias"]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    model = {k: saved["model"][k] for k in ("size", "embed_dim", "depth", "num_heads", "patch_size", "img_size")}
    assert model == {"size": "tiny", "embed_dim": 32, "depth": 2, "num_heads": 4, "patch_size": 4, "img_size": 16}
    assert (tuple(saved["data"]["mean"]), tuple(saved["data"]["std"])) == (MEAN, STD)
    assert saved["model"]["global_pool"] == "avg"
    args = json.loads((tmp_path / "run" / "export" / "config.json").read_text())["model_args"]
    assert (args["embed_dim"], args["depth"], args["num_heads"], args["img_size"]) == (32, 2, 4, [16, 16])
