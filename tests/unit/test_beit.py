"""The masked-patch prediction objective on a tiny timm ViT: corruption, loss on selected patches, gradients."""

import copy
import random

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from data.masking import RandomMaskGenerator
from pretrain.beit import MaskedPatchPrediction
from pretrain.targets import Color3Bit4x4, MeanColor3Bit, PixelsL2
from tests.helpers.models import tiny_vit

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
    objective = MaskedPatchPrediction(
        tiny_vit(init_values=0.1), TARGETS[kind](), num_masked=6, corruption=corruption, head="mlp"
    )
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
    objective = MaskedPatchPrediction(tiny_vit(), MeanColor3Bit((4, 4), **NORM), num_masked=6)
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


def _scattered_batch(batch_size: int = 5) -> dict[str, torch.Tensor]:
    """Random masks of 7 patches each, scattered differently in every image."""
    rng = random.Random(3)
    masks = torch.stack([RandomMaskGenerator(GRID, 7 / 16)(rng) for _ in range(batch_size)])  # (B, 4, 4)
    return {"image": torch.randn(batch_size, 3, 16, 16, generator=torch.Generator().manual_seed(2)), "mask": masks}


@pytest.mark.parametrize("kind", sorted(TARGETS))
def test_gathered_patches_are_boolean_indexings_rows_in_order(kind):
    """The fixed-size gather takes exactly the rows `x[mask]` took: same order, same loss and gradients."""
    objective = MaskedPatchPrediction(tiny_vit(init_values=0.1), TARGETS[kind](), num_masked=7, head="mlp")
    reference = copy.deepcopy(objective)
    batch = _scattered_batch()
    out = objective(batch)
    out["loss"].backward()
    mask = batch["mask"].flatten(1)  # (B, L)
    with torch.no_grad():
        target = reference.target(batch)[mask]  # (N, ...) as boolean indexing lists them
    pred = reference.head(reference.forward_encoder(batch["image"], mask)[:, 1:][mask])
    loss, accuracy = reference.forward_loss(pred, target)
    loss.backward()
    assert torch.equal(out["target"], target)
    torch.testing.assert_close(out["pred"], pred)
    torch.testing.assert_close(out["loss"], loss)
    if accuracy is not None:
        assert torch.equal(out["mlm_acc"], accuracy)
    for (name, p), q in zip(objective.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("corruption", ["mask_token", "mixed"])
def test_forward_and_backward_have_no_data_dependent_shapes(corruption):
    """Nothing in the step waits for the device: an op whose output shape or Python value depends on tensor data
    (boolean-mask indexing, nonzero, .item()) would sync on a GPU. Fake tensors carry no data, so such an op raises."""
    objective = MaskedPatchPrediction(tiny_vit(), TARGETS["color_3bit_4x4"](), num_masked=7, corruption=corruption)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    batch = {key: mode.from_tensor(value) for key, value in _scattered_batch().items()}
    with mode:
        out = objective(batch)
        out["loss"].backward()
    assert out["pred"].shape == (5 * 7, 16 * 512) and out["target"].shape == (5 * 7, 16)


def test_a_mask_with_another_count_is_refused():
    objective = MaskedPatchPrediction(tiny_vit(), MeanColor3Bit((4, 4), **NORM), num_masked=7)
    batch = _scattered_batch()
    batch["mask"][2, 0, 0] = ~batch["mask"][2, 0, 0]
    with pytest.raises(RuntimeError, match="a mask does not select 7 patches"):
        objective(batch)
    with pytest.raises(ValueError, match=r"num_masked must be in \[1, 16\]"):
        MaskedPatchPrediction(tiny_vit(), MeanColor3Bit((4, 4), **NORM), num_masked=0)


def test_mask_token_corruption_replaces_exactly_the_selected_patches():
    objective = MaskedPatchPrediction(tiny_vit(), MeanColor3Bit((4, 4), **NORM), num_masked=6)
    x = torch.randn(2, 16, 32)
    mask = torch.rand(2, 16) < 0.5
    out = objective.corrupt(x, mask)
    assert torch.equal(out[mask], objective.mask_token.detach()[0].expand(int(mask.sum()), -1))
    assert torch.equal(out[~mask], x[~mask])


def test_mixed_corruption_splits_80_10_10():
    objective = MaskedPatchPrediction(tiny_vit(), MeanColor3Bit((4, 4), **NORM), num_masked=6, corruption="mixed")
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
    objective = MaskedPatchPrediction(encoder, MeanColor3Bit((4, 4), **NORM), num_masked=6)
    assert {k.removeprefix("encoder.") for k in objective.state_dict() if k.startswith("encoder.")} == names
    assert "mask_token" in objective.no_weight_decay() and "encoder.pos_embed" in objective.no_weight_decay()


def test_rejects_an_encoder_with_a_head():
    with pytest.raises(ValueError, match="num_classes must be 0"):
        MaskedPatchPrediction(tiny_vit(num_classes=3), MeanColor3Bit((4, 4), **NORM), num_masked=6)
