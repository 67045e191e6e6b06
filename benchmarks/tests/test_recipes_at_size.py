"""Recipes at their real size (benchmarks/smoke_recipes.py): recipes/mae_vitb.yaml -> finetune_vitb.yaml (`CI_CHAINS`,
marked long: CI runs it in `make test-long`), and, marked slow (`pytest -m slow`; `make smoke-recipes` runs it too),
tokenizer_in1k.yaml (VQ-VAE on the 112 px view) -> beit_vitb.yaml (LayerScale) -> finetune_vitb.yaml. Each stage runs
2 steps at global batch 2 through ./launch.sh with one process, on 224 px JPEG shards of ImageNet-like sizes, at the
recipe's own ViT-B/16, 14x14 grid, ZeRO stage and precision."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from benchmarks.smoke_measure import read_metrics
from benchmarks.smoke_recipes import (
    CHAINS,
    CI_CHAINS,
    RECIPES,
    Options,
    run_chain,
    stage_overrides,
    write_jpeg_shards,
)
from core.models.pos_embed import sincos_pos_embed_2d
from core.recipe.config import load_config
from core.recipe.tree import flatten

pytestmark = pytest.mark.dist

VIT_B_POS_EMBED = [1, 197, 768]  # cls token + 14x14 patches of 16 px at 224 px
VIT_B_PATCH_KERNEL = [768, 3, 16, 16]
# Per stage (about a minute on 2 idle cores); no memory kept back for others: CI runs alone. On the CPU, as CI runs
# it, also on a GPU host (the published recipes leave engine.device at auto).
OPTIONS = Options(timeout=900, memory_margin_gib=0.0, extra=("engine.device=cpu",))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes_at_size")
    yield root
    shutil.rmtree(root, ignore_errors=True)  # ~5 GB of ViT-B checkpoints and exports


@pytest.fixture(scope="module")
def jpeg_shards(work) -> dict[str, Path]:
    return write_jpeg_shards(work / "shards")


def _run(name: str, jpeg_shards, work: Path) -> dict:
    results = run_chain(name, work, jpeg_shards, OPTIONS, CI_CHAINS.get(name, CHAINS[name]))
    for result in results:
        log = (result.run_dir / "launch.log").read_text() if (result.run_dir / "launch.log").is_file() else ""
        assert result.ok, f"{name} / {result.stage.recipe}: {result.error}\n{log[-4000:]}"
    return {result.stage.recipe: result for result in results}


@pytest.fixture(scope="module")
def mae_chain(jpeg_shards, work) -> dict:
    return _run("mae_vitb", jpeg_shards, work)


@pytest.fixture(scope="module")
def beit_chain(jpeg_shards, work) -> dict:
    return _run("beit_vitb", jpeg_shards, work)


def _losses(run_dir: Path) -> list[float]:
    return [m["train/loss"] for m in read_metrics(run_dir) if "train/loss" in m]


def _export_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(run_dir / "export" / "model.safetensors")


def _load_report(run_dir: Path) -> dict:
    return json.loads((run_dir / "load_report.json").read_text())


def test_every_published_recipe_runs_in_some_chain():
    published = {path.stem for path in RECIPES.glob("*.yaml") if not path.stem.startswith("quickstart")}
    chained = {stage.recipe for stages in CHAINS.values() for stage in stages}
    assert chained == published
    assert all(stages == CHAINS[name][: len(stages)] for name, stages in CI_CHAINS.items())


@pytest.mark.parametrize("name", CHAINS)
def test_each_stage_overrides_only_data_length_batch_workers_logging_and_its_hand_off(name, tmp_path):
    shards = {split: tmp_path / split for split in ("train", "val", "seg_train", "seg_val")}
    exports = {stage.recipe: tmp_path / stage.recipe / "export" for stage in CHAINS[name]}
    allowed = {"run_dir", "data.train", "data.val", "data.global_batch_size", "data.num_workers", "logging.every_steps"}
    for stage in CHAINS[name]:
        recipe = RECIPES / f"{stage.recipe}.yaml"
        own = load_config(recipe)
        cfg = load_config(recipe, stage_overrides(stage, own, tmp_path / stage.recipe, shards, exports, batch=2))
        assert cfg.steps(samples_per_epoch=None) == (2, 1) and cfg.data.global_batch_size == 2
        hand_off = {key for key, _ in stage.takes} | {s.split("=")[0] for s in stage.settings}
        before, after = flatten(own.model_dump(mode="json")), flatten(cfg.model_dump(mode="json"))
        changed = {key for key in before if before[key] != after[key] and not key.startswith("schedule.")}
        assert changed <= allowed | hand_off, (stage.recipe, changed - allowed - hand_off)
        for key, source in stage.takes:
            assert after[key] == str(exports[source])


@pytest.mark.long
def test_mae_vitb_pretrains_at_size_and_exports_its_sincos_grid(mae_chain):
    result = mae_chain["mae_vitb"]
    assert result.cfg.engine.zero_stage == 1 and result.cfg.engine.precision == "auto"
    losses = _losses(result.run_dir)
    assert len(losses) == 2 and all(math.isfinite(v) and v > 0 for v in losses)
    assert result.export["shapes"] == {"pos_embed": VIT_B_POS_EMBED, "patch_embed.proj.weight": VIT_B_PATCH_KERNEL}
    assert result.export["problems"] == [] and "strict=True" in result.export["loader"]
    assert result.num_params == 85_798_656  # ViT-B/16 without a head
    tensors = _export_tensors(result.run_dir)
    assert len([k for k in tensors if k.startswith("blocks.") and k.endswith("attn.qkv.weight")]) == 12
    # MAE keeps fixed 2-D sin-cos position embeddings for its 14x14 grid: unchanged by training
    torch.testing.assert_close(tensors["pos_embed"], sincos_pos_embed_2d(768, (14, 14)))


@pytest.mark.long
def test_finetune_vitb_takes_the_mae_export_on_the_same_grid(mae_chain):
    result = mae_chain["finetune_vitb"]
    assert all(math.isfinite(v) for v in _losses(result.run_dir)) and len(_losses(result.run_dir)) == 2
    report = _load_report(result.run_dir)
    assert report["source"].startswith(str(mae_chain["mae_vitb"].run_dir / "export"))
    assert "pos_embed" in report["loaded"] and report["resized"] == []  # 14x14 -> 14x14: kept as pretrained
    assert ["norm.weight", "fc_norm.weight"] in report["mapped"]  # MAE fine-tunes with average pooling
    assert report["initialised"] == ["head.weight", "head.bias"] and report["head_init"] == "zero weight and bias"
    assert any(k.startswith("decoder_") for k in report["manifest"]["not_exported"])
    want = {"pos_embed": VIT_B_POS_EMBED, "patch_embed.proj.weight": VIT_B_PATCH_KERNEL, "head.weight": [1000, 768]}
    assert result.export["shapes"] == want and result.export["problems"] == []
    assert result.num_params == 86_567_656  # ViT-B/16 with ImageNet's 1000-class head: the published 86.6M
    evaluated = [m for m in read_metrics(result.run_dir) if "val/top1" in m]
    assert evaluated and evaluated[-1]["val/samples"] == 16  # every held-out JPEG once


@pytest.mark.slow
def test_tokenizer_in1k_codes_the_112px_view_on_the_vitb_grid(beit_chain):
    result = beit_chain["tokenizer_in1k"]
    manifest = json.loads((result.run_dir / "export" / "mimpipe.json").read_text())
    assert manifest["tokenizer"]["img_size"] == [112, 112] and manifest["grid"] == [14, 14]
    assert manifest["vocab_size"] == 8192
    assert result.export["shapes"] == {"grid": [14, 14]} and result.export["problems"] == []
    recon = [m["train/recon_loss"] for m in read_metrics(result.run_dir) if "train/recon_loss" in m]
    assert len(recon) == 2 and all(math.isfinite(v) for v in recon)


@pytest.mark.slow
def test_beit_vitb_predicts_codes_with_layer_scale_and_exports_it(beit_chain):
    result = beit_chain["beit_vitb"]
    metrics = [m for m in read_metrics(result.run_dir) if "train/loss" in m]
    assert len(metrics) == 2 and all(math.isfinite(m["train/loss"]) for m in metrics)
    assert metrics[0]["train/loss"] == pytest.approx(math.log(8192), rel=0.25)  # cross-entropy over 8192 codes
    assert all(0 <= m["train/mlm_acc"] <= 1 for m in metrics)
    tensors = _export_tensors(result.run_dir)
    assert list(tensors["pos_embed"].shape) == VIT_B_POS_EMBED
    gammas = [tensors[f"blocks.{i}.ls{j}.gamma"] for i in range(12) for j in (1, 2)]
    assert all(list(g.shape) == [768] for g in gammas)
    assert all(torch.allclose(g, torch.full_like(g, 0.1), atol=0.01) for g in gammas)  # 0.1 after 2 tiny steps
    manifest = json.loads((result.run_dir / "export" / "mimpipe.json").read_text())
    assert "mask_token" in manifest["not_exported"]
    assert result.export["problems"] == []


@pytest.mark.slow
def test_finetune_vitb_takes_the_beit_export_with_its_layer_scale(beit_chain):
    result = beit_chain["finetune_vitb"]
    assert result.cfg.model.layer_scale_init == 0.1
    assert all(math.isfinite(v) for v in _losses(result.run_dir)) and len(_losses(result.run_dir)) == 2
    report = _load_report(result.run_dir)
    assert {f"blocks.{i}.ls{j}.gamma" for i in range(12) for j in (1, 2)} <= set(report["loaded"])
    assert "pos_embed" in report["loaded"] and report["resized"] == []
    assert report["initialised"] == ["head.weight", "head.bias"]
    assert result.export["shapes"]["pos_embed"] == VIT_B_POS_EMBED and result.export["problems"] == []
    assert "blocks.11.ls2.gamma" in _export_tensors(result.run_dir)
