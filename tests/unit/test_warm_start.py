"""Warm-started pretraining: an official-layout MAE state dict (encoder and decoder) gives our MAE the same loss as
the model that wrote it, a trained encoder starts well below a fresh one, and a plain encoder leaves the decoder
fresh; a BEiT-style and a SimMIM objective take their heads and mask tokens from a file that holds them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from core.export.architecture import InitMismatch
from core.export.folder import export_model
from core.models.build import model_args
from core.recipe.config import load_config
from pretrain.objectives import objective_builder
from pretrain.warm_start import resolve_warm_start, warm_start
from tests.helpers.models import tiny_vit

VIT = ["model.embed_dim=32", "model.depth=2", "model.num_heads=2", "model.img_size=16", "model.patch_size=4"]
TINY = [*VIT, "objective.decoder_embed_dim=16", "objective.decoder_depth=1", "objective.decoder_num_heads=2"]
BEIT = [*VIT, "objective.kind=beit", "objective.target.kind=mean_color_3bit", "objective.mask.num_masked=6"]
SIMMIM = [*VIT, "objective.kind=simmim"]


def fake_run(tmp_path, init, recipe=TINY):
    cfg = load_config(None, [*recipe, f"model.init={init}"])
    lines = []
    logger = SimpleNamespace(console=lines.append)
    return SimpleNamespace(cfg=cfg, logger=logger, dist=SimpleNamespace(is_main=True), run_dir=tmp_path), lines


def build(seed: int, recipe=TINY):
    torch.manual_seed(seed)
    return objective_builder(load_config(None, recipe))()


def loss_on(objective, images) -> float:
    """The loss on `images` with the same mask every call: MAE's drawn from a fixed seed, BEiT-style and SimMIM's
    (the data workers' there) every third patch of the 4x4 grid."""
    torch.manual_seed(123)
    mask = (torch.arange(16) % 3 == 0).reshape(1, 4, 4).expand(len(images), 4, 4)
    with torch.no_grad():
        return float(objective({"image": images, "mask": mask})["loss"])


def official_layout(objective) -> dict:
    """models_mae.py's checkpoint: encoder keys at the top level beside the decoder's, under "model"."""
    state = {k.removeprefix("encoder."): v for k, v in objective.state_dict().items()}
    state["decoder_pos_embed"] = objective.decoder_pos_embed  # a parameter there, a buffer here
    return {"model": state, "epoch": 799}


def test_an_official_layout_checkpoint_gives_the_same_loss_as_the_model_that_wrote_it(tmp_path):
    source = build(seed=1)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # weights no fresh model has
    torch.save(official_layout(source), tmp_path / "mae_official.pth")
    images = torch.randn(4, 3, 16, 16)
    target = build(seed=2)
    run, lines = fake_run(tmp_path, tmp_path / "mae_official.pth")
    report = warm_start(target, run)
    assert loss_on(target, images) == loss_on(source, images)
    assert "decoder_pred.weight" in report["objective_loaded"] and report["objective_fresh"] == []
    assert "decoder_embed.weight" not in report["dropped"]  # taken by the objective, not left behind
    assert lines[0].startswith("[mimpipe] warm start from") and "0 fresh" in lines[0]
    assert json.loads((tmp_path / "load_report.json").read_text())["objective_loaded"] == report["objective_loaded"]


def test_a_trained_encoder_starts_clearly_lower_and_a_bare_encoder_leaves_the_decoder_fresh(tmp_path):
    torch.manual_seed(0)
    images = torch.randn(16, 1, 16, 16).repeat(1, 3, 1, 1).cumsum(-1) / 4  # smooth, grey: something to learn
    trained = build(seed=3)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=3e-3)
    for _ in range(150):
        optimizer.zero_grad()
        trained({"image": images})["loss"].backward()
        optimizer.step()
    torch.save(official_layout(trained), tmp_path / "trained.pth")
    fresh, warm = build(seed=4), build(seed=4)
    run, _ = fake_run(tmp_path, tmp_path / "trained.pth")
    warm_start(warm, run)
    assert loss_on(warm, images) == loss_on(trained, images) < 0.7 * loss_on(fresh, images)

    encoder_only = {k: v for k, v in official_layout(trained)["model"].items() if not k.startswith(("decoder", "mask"))}
    torch.save(encoder_only, tmp_path / "encoder.pth")
    bare = build(seed=4)
    run, lines = fake_run(tmp_path, tmp_path / "encoder.pth")
    report = warm_start(bare, run)
    assert report["objective_loaded"] == [] and "mask_token" in report["objective_fresh"]
    assert torch.equal(bare.encoder.blocks[1].mlp.fc2.weight, trained.encoder.blocks[1].mlp.fc2.weight)
    assert torch.equal(bare.decoder_pred.weight, fresh.decoder_pred.weight)  # the fresh init of seed 4


@pytest.mark.parametrize("recipe", [BEIT, SIMMIM], ids=["beit", "simmim"])
def test_beit_style_and_simmim_objectives_take_their_heads_and_mask_tokens_from_the_file(recipe, tmp_path):
    """The encoder's keys at the top level as timm names them, the objective's own beside them (its names): the warm
    objective's loss on a batch with a fixed mask is the writer's, with nothing left fresh."""
    source = build(seed=1, recipe=recipe)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    state = {k.removeprefix("encoder."): v for k, v in source.state_dict().items()}
    torch.save(state, tmp_path / "objective.pth")
    target = build(seed=2, recipe=recipe)
    images = torch.randn(4, 3, 16, 16)
    assert loss_on(target, images) != loss_on(source, images)
    run, _ = fake_run(tmp_path, tmp_path / "objective.pth", recipe)
    report = warm_start(target, run)
    assert loss_on(target, images) == loss_on(source, images)
    own = [k for k in source.state_dict() if not k.startswith("encoder.")]
    assert report["objective_fresh"] == [] and report["objective_loaded"] == sorted(own) and own


def test_a_recipe_that_names_only_the_export_warm_starts_its_architecture(tmp_path):
    """A pretraining recipe whose model names only `model.init`: the export's ViT and normalisation (the stage's
    `resolve`), its encoder loaded, and the load report says which keys came from the export; a contradicting key is
    refused in one line."""
    vit = tiny_vit(5)
    data = {"mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25)}
    export = export_model(vit, tmp_path / "export", model_args=model_args(vit), manifest={"step": 1}, data_config=data)
    decoder = TINY[len(VIT) :]
    cfg = load_config(None, [*decoder, f"model.init={export}"])
    line = (
        f"model from {export}: size tiny, embed_dim 32, depth 2, num_heads 2, patch_size 4, img_size 16, mean/std "
        "(config.json)"
    )
    assert resolve_warm_start(cfg).line() == line
    assert (cfg.model.embed_dim, cfg.model.img_size, cfg.data.std) == (32, 16, (0.25, 0.25, 0.25))
    run, _ = fake_run(tmp_path, export, decoder)
    run.cfg = cfg
    objective = objective_builder(cfg)()
    report = warm_start(objective, run)
    assert report["notes"][0] == line and report["loaded"]
    assert torch.equal(objective.encoder.blocks[1].mlp.fc2.weight, vit.blocks[1].mlp.fc2.weight)
    with pytest.raises(InitMismatch, match=rf"^model.depth: the recipe sets 3, {export} has 2 \(config.json\);"):
        resolve_warm_start(load_config(None, [*decoder, f"model.init={export}", "model.depth=3"]))
