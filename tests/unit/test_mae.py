"""Tests for pretrain/mae.py on a tiny ViT (tests/helpers/models.py `wide_vit`: 64 wide, 2 blocks, 28 px images in
4 px patches -> 7 x 7 grid)."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from core.models.pos_embed import sincos_pos_embed_2d
from core.report.pictures import title_height
from pretrain.mae import MAE, normalize_patches, patchify, reconstruction_grid, unpatchify
from tests.helpers.models import wide_vit

DECODER = dict(decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=4)
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


def tiny_mae(img_size=28, norm_pix_loss=True, **kwargs):
    """MAE around `wide_vit` (seed 0), decoder 32 wide."""
    return MAE(wide_vit(img_size=img_size), norm_pix_loss=norm_pix_loss, **DECODER, **kwargs)


def test_random_masking_keeps_exactly_the_budget_and_unshuffles():
    mae = tiny_mae()
    tokens = torch.randn(8, 49, 64)
    x_visible, mask, ids_restore = mae.random_masking(tokens, 0.75)
    num_keep = int(49 * 0.25)
    assert x_visible.shape == (8, num_keep, 64)
    assert mask.shape == (8, 49)
    assert mask.sum(dim=1).tolist() == [49 - num_keep] * 8
    # The shuffled sequence is [kept, dropped]; ids_restore puts it back in image order.
    ids_shuffle = torch.argsort(ids_restore, dim=1)
    shuffled = torch.gather(tokens, 1, ids_shuffle.unsqueeze(-1).expand(-1, -1, 64))
    assert torch.equal(shuffled[:, :num_keep], x_visible)
    assert torch.equal(torch.gather(shuffled, 1, ids_restore.unsqueeze(-1).expand(-1, -1, 64)), tokens)
    assert torch.equal(torch.gather(mask, 1, ids_shuffle[:, :num_keep]), torch.zeros(8, num_keep))
    assert len({tuple(row.tolist()) for row in mask}) == 8  # every sample has its own mask


def test_patchify_layout_and_round_trip_non_square():
    imgs = torch.randn(2, 3, 28, 32)
    patches = patchify(imgs, (4, 4))
    assert patches.shape == (2, 7 * 8, 48)
    row, col = 5, 6
    expected = imgs[1, :, row * 4 : row * 4 + 4, col * 4 : col * 4 + 4].permute(1, 2, 0).flatten()  # (ph, pw, C)
    assert torch.equal(patches[1, row * 8 + col], expected)
    assert torch.equal(unpatchify(patches, (4, 4), (7, 8)), imgs)
    mae = tiny_mae(img_size=(28, 32))
    assert torch.equal(mae.unpatchify(mae.patchify(imgs)), imgs)
    assert mae({"image": imgs})["pred"].shape == (2, 56, 48)


def test_norm_pix_target_by_hand():
    patch = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])  # (B=1, L=1, P=4)
    normalized, mean, std = normalize_patches(patch)
    var = (1.5**2 + 0.5**2 + 0.5**2 + 1.5**2) / 3  # unbiased, as MAE
    expected = (patch - 2.5) / (var + 1e-6) ** 0.5
    torch.testing.assert_close(normalized, expected)
    assert mean.item() == 2.5
    assert std.item() == pytest.approx((var + 1e-6) ** 0.5)


def test_loss_with_zero_prediction_is_the_normalised_target_power():
    mae = tiny_mae()
    imgs = torch.randn(2, 3, 28, 28)
    mask = torch.zeros(2, 49)
    mask[:, :10] = 1
    # Predicting 0 against a standardised patch costs mean(t^2) = (P - 1) / P * var / (var + eps) per patch.
    loss = mae.forward_loss(imgs, torch.zeros(2, 49, 48), mask)
    var = patchify(imgs, (4, 4)).var(dim=-1)[:, :10]
    expected = (47 / 48 * var / (var + 1e-6)).mean()
    torch.testing.assert_close(loss, expected)
    mae.norm_pix_loss = False
    raw = mae.forward_loss(imgs, torch.zeros(2, 49, 48), mask)
    torch.testing.assert_close(raw, patchify(imgs, (4, 4))[:, :10].pow(2).mean())


def test_loss_counts_masked_patches_only():
    mae = tiny_mae()
    imgs = torch.randn(2, 3, 28, 28)
    out = mae({"image": imgs})
    visible = out["mask"] == 0
    changed_visible = out["pred"].detach().clone()
    changed_visible[visible] += 5.0
    assert mae.forward_loss(imgs, changed_visible, out["mask"]) == out["loss"]
    changed_masked = out["pred"].detach().clone()
    changed_masked[~visible] += 5.0
    assert mae.forward_loss(imgs, changed_masked, out["mask"]) > out["loss"] + 1.0


def test_backward_reaches_every_trainable_parameter_through_the_masked_patches_only():
    mae = tiny_mae()
    out = mae({"image": torch.randn(2, 3, 28, 28)})
    assert out["loss"].dtype == torch.float32 and out["loss"].ndim == 0
    out["pred"].retain_grad()
    out["loss"].backward()
    assert not mae.encoder.pos_embed.requires_grad and mae.encoder.pos_embed.grad is None
    trainable = {name: p for name, p in mae.named_parameters() if p.requires_grad}
    assert len(trainable) == len(list(mae.parameters())) - 1
    encoder = [name for name in trainable if name.startswith("encoder.")]
    assert len(encoder) == len(list(mae.encoder.parameters())) - 1 and "encoder.blocks.1.mlp.fc2.weight" in encoder
    assert {"mask_token", "decoder_embed.weight", "decoder_pred.weight", "decoder_blocks.0.attn.qkv.weight"} <= set(
        trainable
    )
    for name, param in trainable.items():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all() and param.grad.abs().sum() > 0, name
    # The loss reads the prediction of every masked patch (37 of 49 per image) and of no visible one.
    pred_grad, masked = out["pred"].grad, out["mask"].bool()  # (B, L, P), (B, L)
    assert masked.sum(dim=1).tolist() == [37, 37]
    assert torch.count_nonzero(pred_grad[~masked]) == 0
    assert (pred_grad[masked].abs().sum(dim=-1) > 0).all()


def test_the_encoder_never_sees_the_masked_patches():
    """Same masks (same seed), the pixels under them shifted by 3: the encoder's output is unchanged, while the pixel
    loss, whose targets are exactly those pixels, grows."""
    mae = tiny_mae(norm_pix_loss=False)
    imgs = torch.randn(2, 3, 28, 28)
    torch.manual_seed(1)
    latent, mask, _ = mae.forward_encoder(imgs, 0.75)
    pixel_mask = mae.unpatchify(mask.unsqueeze(-1).expand(-1, -1, 48)).bool()  # (B, 3, 28, 28)
    shifted = torch.where(pixel_mask, imgs + 3.0, imgs)
    torch.manual_seed(1)
    latent_shifted, mask_shifted, _ = mae.forward_encoder(shifted, 0.75)
    assert torch.equal(mask_shifted, mask)
    torch.testing.assert_close(latent_shifted, latent, rtol=0, atol=0)
    losses = []
    for images in (imgs, shifted):
        torch.manual_seed(1)
        losses.append(mae({"image": images})["loss"])
    assert losses[1] > losses[0] + 5.0  # about 3^2 more per masked pixel


def test_bf16_autocast_gives_finite_float32_loss():
    mae = tiny_mae()
    imgs = torch.randn(2, 3, 28, 28)
    torch.manual_seed(1)
    reference = mae({"image": imgs})["loss"]
    torch.manual_seed(1)  # the same masks
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mae({"image": imgs})
    assert out["loss"].dtype == torch.float32 and torch.isfinite(out["loss"])
    assert out["pred"].dtype == torch.bfloat16
    torch.testing.assert_close(out["loss"], reference, rtol=0.05, atol=0)
    # bf16 gradients point where the float32 ones do: every parameter's, and all of them together.
    reference.backward()
    fp32 = {name: p.grad.clone() for name, p in mae.named_parameters() if p.grad is not None}
    mae.zero_grad(set_to_none=True)
    out["loss"].backward()
    bf16 = {name: p.grad for name, p in mae.named_parameters() if p.grad is not None}
    assert bf16.keys() == fp32.keys() and all(g.dtype == torch.float32 for g in bf16.values())
    cosine = {name: F.cosine_similarity(bf16[name].flatten(), fp32[name].flatten(), dim=0) for name in fp32}
    assert all(c > 0.95 for c in cosine.values()), cosine
    everything = [torch.cat([g[name].flatten() for name in fp32]) for g in (bf16, fp32)]
    assert F.cosine_similarity(*everything, dim=0) > 0.99


def _count_block_calls(mae: MAE) -> Counter:
    """Forward calls of every encoder and decoder block, counted from now on ("encoder.0", "decoder.1", ...); counted
    on entry, as a recomputation stops once it has rebuilt the saved tensors (torch's non-reentrant checkpoint)."""
    calls = Counter()
    for side, blocks in (("encoder", mae.encoder.blocks), ("decoder", mae.decoder_blocks)):
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda *_, key=f"{side}.{index}": calls.update([key]))
    return calls


def test_activation_checkpointing_recomputes_encoder_and_decoder_blocks_with_the_same_loss_and_gradients():
    """engine.activation_checkpointing (the encoder's timm switch) covers the decoder too: every block runs forward
    a second time in the backward pass, and the loss and every gradient are those of the run that stores them."""
    imgs = torch.randn(2, 3, 28, 28)
    runs = []
    for checkpointing in (False, True):
        mae = MAE(wide_vit(), **(DECODER | {"decoder_depth": 2}))
        mae.encoder.set_grad_checkpointing(checkpointing)
        calls = _count_block_calls(mae)
        torch.manual_seed(1)  # the same mask in both runs
        loss = mae({"image": imgs})["loss"]
        loss.backward()
        runs.append((mae, loss.detach(), calls))
    (plain, plain_loss, plain_calls), (checkpointed, loss, calls) = runs
    assert set(plain_calls) == {"encoder.0", "encoder.1", "decoder.0", "decoder.1"}
    assert all(count == 1 for count in plain_calls.values())
    assert calls == {key: 2 for key in plain_calls}  # recomputed in the backward pass
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
    for (name, p), q in zip(checkpointed.named_parameters(), plain.parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_init_and_no_weight_decay():
    mae = MAE(wide_vit(), **DECODER)
    torch.testing.assert_close(mae.encoder.pos_embed.data, sincos_pos_embed_2d(64, (7, 7)))
    torch.testing.assert_close(mae.decoder_pos_embed, sincos_pos_embed_2d(32, (7, 7)))
    assert "decoder_pos_embed" not in mae.state_dict()
    linears = [m for m in mae.modules() if isinstance(m, torch.nn.Linear)]
    assert all(torch.count_nonzero(m.bias) == 0 for m in linears)
    assert mae.no_weight_decay() == {"encoder.pos_embed", "encoder.cls_token", "mask_token"}


def test_encoder_still_loads_into_a_fresh_timm_model_and_matches_it():
    mae = tiny_mae()
    fresh = wide_vit()
    fresh.load_state_dict(mae.encoder.state_dict(), strict=True)
    imgs = torch.randn(2, 3, 28, 28)
    # With nothing masked the encoder sees every patch, shuffled; un-shuffled it must equal timm's own forward.
    latent, mask, ids_restore = mae.forward_encoder(imgs, 0.0)
    assert mask.sum() == 0
    patches = torch.gather(latent[:, 1:], 1, ids_restore.unsqueeze(-1).expand(-1, -1, 64))
    expected = fresh.eval().forward_features(imgs)
    torch.testing.assert_close(latent[:, 0], expected[:, 0])
    torch.testing.assert_close(patches, expected[:, 1:])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(global_pool="avg"), "global_pool"),
        (dict(num_classes=10), "num_classes"),
    ],
)
def test_unsupported_encoder_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MAE(wide_vit(**kwargs), **DECODER)


def test_mask_ratio_that_keeps_nothing_is_rejected():
    with pytest.raises(ValueError, match="mask_ratio 0.99"):
        MAE(wide_vit(), mask_ratio=0.99, **DECODER)


def _panel(grid, row, col, size=28, scale=4, pad=2):
    """Panel (row, col) of an `image_grid` with titles, sampled back to `size` px (every `scale`-th pixel)."""
    side = size * scale
    top, left = title_height() + pad + row * (side + pad), pad + col * (side + pad)
    return grid[:, top : top + side : scale, left : left + side : scale]


@pytest.mark.parametrize("norm_pix_loss", [False, True])
def test_reconstruction_grid(norm_pix_loss):
    mae = tiny_mae(norm_pix_loss=norm_pix_loss)
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    imgs = (torch.rand(3, 3, 28, 28) - mean) / std
    out = mae({"image": imgs})
    kwargs = dict(patch_size=4, mean=MEAN, std=STD, norm_pix_loss=norm_pix_loss)
    grid = reconstruction_grid(imgs, out["pred"], out["mask"], max_images=2, **kwargs)
    assert grid.shape == (3, title_height() + 2 * 114 + 2, 4 * 114 + 2)  # 28 px upscaled x4 to 112, 2 px padding
    assert grid.min() >= 0 and grid.max() <= 1
    pixel_mask = mae.unpatchify(out["mask"].unsqueeze(-1).expand(-1, -1, 48)).bool()
    for row in range(2):
        original, masked, recon, pasted = (_panel(grid, row, col) for col in range(4))
        visible = ~pixel_mask[row]
        torch.testing.assert_close(original, (imgs[row] * std[0] + mean[0]).clamp(0, 1))
        torch.testing.assert_close(pasted[visible], original[visible])
        torch.testing.assert_close(pasted[~visible], recon[~visible])
        torch.testing.assert_close(masked[~visible], torch.full_like(masked[~visible], 0.5))
    # A perfect prediction (in the loss's target units) reconstructs the original everywhere.
    target = mae.patchify(imgs)
    perfect = normalize_patches(target)[0] if norm_pix_loss else target
    grid = reconstruction_grid(imgs, perfect, out["mask"], **kwargs)
    for row in range(3):
        torch.testing.assert_close(_panel(grid, row, 2), _panel(grid, row, 0), atol=1e-5, rtol=0)
