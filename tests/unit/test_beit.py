"""The masked-patch prediction objective on a tiny timm ViT: corruption, loss on selected patches, gradients."""

import pytest
import torch

from pretrain.beit import MaskedPatchPrediction
from pretrain.targets import Color3Bit4x4, MeanColor3Bit, PixelsL2
from tests.unit.conftest import tiny_vit

GRID = (4, 4)
NORM = dict(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))


def _batch(batch_size: int = 4, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch_size, *GRID, dtype=torch.bool)
    mask.view(batch_size, -1)[:, ::3] = True  # 6 of 16 patches selected per image
    return {"image": torch.randn(batch_size, 3, 16, 16, generator=g), "mask": mask}


TARGETS = {
    "mean_color_3bit": lambda: MeanColor3Bit((4, 4), **NORM),
    "color_3bit_4x4": lambda: Color3Bit4x4((4, 4), **NORM),
    "pixels_l2": lambda: PixelsL2((4, 4), norm_pix=True),
}


@pytest.mark.parametrize("corruption", ["mask_token", "mixed"])
@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_every_trainable_parameter_gets_a_gradient(kind, corruption):
    objective = MaskedPatchPrediction(tiny_vit(init_values=0.1), TARGETS[kind](), corruption=corruption, head="mlp")
    batch = _batch()
    out = objective(batch)
    assert torch.isfinite(out["loss"]) and out["loss"].dtype == torch.float32
    assert out["pred"].shape[0] == batch["mask"].sum()  # the head ran on the selected patches only
    assert ("mlm_acc" in out) == (kind != "pixels_l2")
    out["loss"].backward()
    for name, param in objective.named_parameters():
        if param.requires_grad:
            assert param.grad is not None and torch.isfinite(param.grad).all(), name
            assert param.grad.abs().sum() > 0, name


def test_loss_and_accuracy_cover_selected_patches_only():
    objective = MaskedPatchPrediction(tiny_vit(), MeanColor3Bit((4, 4), **NORM))
    batch = _batch()
    with torch.no_grad():
        out = objective(batch)
        latent = objective.forward_encoder(batch["image"], batch["mask"].flatten(1))
        logits = objective.head(latent[:, 1:]).float()  # (B, L, 512) for every patch
        labels = objective.target(batch)  # (B, L)
    selected = batch["mask"].flatten(1)
    expected = torch.nn.functional.cross_entropy(logits[selected], labels[selected])
    torch.testing.assert_close(out["loss"], expected)
    torch.testing.assert_close(out["mlm_acc"], (logits[selected].argmax(-1) == labels[selected]).float().mean())


def test_mask_token_corruption_replaces_exactly_the_selected_patches():
    objective = MaskedPatchPrediction(tiny_vit(), MeanColor3Bit((4, 4), **NORM))
    x = torch.randn(2, 16, 32)
    mask = torch.rand(2, 16) < 0.5
    out = objective.corrupt(x, mask)
    assert torch.equal(out[mask], objective.mask_token.detach()[0].expand(int(mask.sum()), -1))
    assert torch.equal(out[~mask], x[~mask])


def test_mixed_corruption_splits_80_10_10():
    objective = MaskedPatchPrediction(tiny_vit(), MeanColor3Bit((4, 4), **NORM), corruption="mixed")
    torch.manual_seed(0)
    x = torch.randn(64, 256, 32)  # distinct rows, so every outcome is identifiable
    mask = torch.ones(64, 256, dtype=torch.bool)
    out = objective.corrupt(x, mask)
    token = (out == objective.mask_token.detach()).all(-1).float().mean().item()
    unchanged = (out == x).all(-1).float().mean().item()
    assert abs(token - 0.8) < 0.01 and abs(unchanged - 0.1) < 0.01
    assert abs(1 - token - unchanged - 0.1) < 0.01  # the rest took another patch's embedding
    assert torch.equal(objective.corrupt(x, ~mask), x)  # nothing selected, nothing changed


def test_encoder_state_dict_is_plain_timm():
    encoder = tiny_vit()
    names = set(encoder.state_dict())
    objective = MaskedPatchPrediction(encoder, MeanColor3Bit((4, 4), **NORM))
    assert {k.removeprefix("encoder.") for k in objective.state_dict() if k.startswith("encoder.")} == names
    assert "mask_token" in objective.no_weight_decay() and "encoder.pos_embed" in objective.no_weight_decay()


def test_rejects_an_encoder_with_a_head():
    with pytest.raises(ValueError, match="num_classes must be 0"):
        MaskedPatchPrediction(tiny_vit(num_classes=3), MeanColor3Bit((4, 4), **NORM))
