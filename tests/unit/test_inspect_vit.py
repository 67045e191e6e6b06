"""`python -m finetune inspect`: the four pictures and their numbers from an export, and a clear refusal of an
encoder without a ViT's patch and position embeddings."""

from __future__ import annotations

import json

import numpy as np
import pytest
import timm
import torch
from PIL import Image

from core.export.folder import export_model
from core.models.build import model_args
from core.models.vit import build_vit
from finetune.inspect_vit import main as inspect_main


@pytest.fixture
def images(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (40, 30, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
    return folder


def test_an_export_gets_its_four_pictures_and_numbers(tmp_path, images):
    torch.manual_seed(0)
    vit = build_vit("tiny", img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=4, num_classes=0)
    manifest = {"method": "test", "config": {"data": {"mean": [0.5] * 3, "std": [0.25] * 3}}}
    export = export_model(vit, tmp_path / "export", model_args=model_args(vit), manifest=manifest)
    assert inspect_main([str(export), "--images", str(images), "--out", str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    for name in ("filters", "position_similarity", "attention_distance", "attention_rollout"):
        with Image.open(out / f"{name}.png") as picture:
            assert picture.mode == "RGB" and min(picture.size) > 20
    numbers = json.loads((out / "inspection.json").read_text())
    assert numbers["grid"] == [4, 4] and numbers["patch"] == 8 and numbers["images"] == 3
    distances = torch.tensor(numbers["mean_attention_distance_px"])
    assert distances.shape == (3, 4) and torch.all((distances >= 0) & (distances <= 8 * 3 * 2**0.5))
    similarity = torch.tensor(numbers["position_similarity"])
    assert similarity.shape == (16, 16) and torch.allclose(similarity.diagonal(), torch.ones(16), atol=1e-5)
    assert len(numbers["filter_variance_share"]) == 28 and abs(sum(numbers["filter_variance_share"]) - 1) < 0.05


def test_an_encoder_without_patch_and_position_embeddings_is_refused(tmp_path, images, capsys):
    import core.models.vt  # noqa: F401  (registers vt_resnet18)

    vt = timm.create_model("vt_resnet18", num_classes=0, token_dim=64)
    export = export_model(vt, tmp_path / "export", model_args=model_args(vt), manifest={})
    assert inspect_main([str(export), "--images", str(images), "--out", str(tmp_path / "out")]) == 2
    assert "holds a VTResNet; inspection needs a plain ViT" in capsys.readouterr().err
    assert inspect_main([str(tmp_path / "none.pth"), "--images", str(images), "--out", str(tmp_path / "out")]) == 2
    assert "none.pth" in capsys.readouterr().err


def test_a_checkpoint_in_another_layout_is_rebuilt_as_convert_does(tmp_path, images):
    torch.manual_seed(0)
    vit = build_vit("tiny", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=0)
    torch.save({"model": vit.state_dict()}, tmp_path / "checkpoint.pth")  # the official MAE / DeiT wrapping
    out = tmp_path / "out"
    assert inspect_main([str(tmp_path / "checkpoint.pth"), "--images", str(images), "--out", str(out),
                         "--num-heads", "4"]) == 0  # fmt: skip
    numbers = json.loads((out / "inspection.json").read_text())
    assert numbers["grid"] == [4, 4] and torch.tensor(numbers["mean_attention_distance_px"]).shape == (2, 4)
