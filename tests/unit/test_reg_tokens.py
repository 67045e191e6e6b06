"""`model.reg_tokens` (timm's register tokens, "Vision Transformers Need Registers") from pretraining to evaluation:
prefix tokens like the class token, never masked, pooled or reconstructed, exported with the encoder, handed to
fine-tuning with their positions kept, left out of `mimpipe evaluate`'s pooled features.

Model: the tests' tiny ViT (16 px in 4 px patches: a 4x4 grid, 32 wide, 2 blocks) with 4 registers: 5 prefix tokens.
"""

from __future__ import annotations

import pytest
import timm
import torch
from safetensors.torch import load_file

from core.engine.distributed import DistInfo
from core.export.folder import export_state_dict
from core.export.handoff import load_encoder
from core.models.build import build_model
from core.recipe.config import ConfigError, load_config
from finetune.lbfgs_probe import extract_features
from finetune.report_encoders import EncoderFlags, resolve_encoder
from pretrain.objectives import mask_generator, objective_builder

REGISTERS = 4
TINY = ["model.img_size=16", "model.patch_size=4", "model.embed_dim=32", "model.depth=2", "model.num_heads=2"]
OBJECTIVES = {
    "mae": ["objective.decoder_embed_dim=32", "objective.decoder_depth=1", "objective.decoder_num_heads=2"],
    "beit": ["objective.kind=beit", "objective.mask.kind=random", "objective.target.kind=mean_color_3bit"],
    "simmim": ["objective.kind=simmim"],
}
TIMM_ARGS = dict(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=0)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def pretrain_cfg(kind: str, registers: int = REGISTERS):
    return load_config(None, [*TINY, *OBJECTIVES[kind], f"model.reg_tokens={registers}"])


def batch_for(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    batch = {"image": torch.randn(2, 3, 16, 16)}
    if cfg.objective.kind != "mae":
        generator = mask_generator(cfg)
        batch["mask"] = torch.stack([torch.as_tensor(generator()) for _ in range(2)])  # (2, 4, 4)
    return batch


def run_step(kind: str, registers: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    cfg = pretrain_cfg(kind, registers)
    torch.manual_seed(0)
    objective = objective_builder(cfg)()
    out = objective(batch_for(cfg))
    out["loss"].backward()
    return objective, out


@pytest.mark.parametrize("kind", sorted(OBJECTIVES))
def test_each_objective_trains_a_step_with_registers_every_parameter_getting_a_gradient(kind):
    objective, out = run_step(kind, REGISTERS)
    assert objective.encoder.num_reg_tokens == REGISTERS and objective.encoder.num_prefix_tokens == 1 + REGISTERS
    assert torch.isfinite(out["loss"]) and out["loss"].dtype == torch.float32
    missing = [
        n
        for n, p in objective.named_parameters()
        if p.requires_grad and not (p.grad is not None and p.grad.abs().sum() > 0)
    ]
    assert missing == []
    assert objective.encoder.reg_token.grad is not None
    # The loss and what the pictures read have the shapes they have without registers: nothing of them is predicted
    _, plain = run_step(kind, 0)
    for key in ("pred", "mask", "target"):
        if key in plain:
            assert out[key].shape == plain[key].shape, key


def test_mae_never_masks_the_registers_and_decodes_only_the_patches():
    cfg = pretrain_cfg("mae")
    torch.manual_seed(0)
    mae = objective_builder(cfg)()
    latent, mask, ids_restore = mae.forward_encoder(torch.randn(3, 3, 16, 16), mae.mask_ratio)
    num_visible = int(16 * (1 - mae.mask_ratio))  # 4 of the 16 patches
    assert latent.shape == (3, 1 + REGISTERS + num_visible, 32)  # every prefix token, the visible patches
    assert mask.shape == (3, 16) and mask.sum(1).tolist() == [16 - num_visible] * 3  # the mask covers patches only
    assert mae.forward_decoder(latent, ids_restore).shape == (3, 16, 4 * 4 * 3)
    assert mae.decoder_pos_embed.shape == (1, 1 + REGISTERS + 16, 32)
    assert not mae.decoder_pos_embed[:, : 1 + REGISTERS].any()  # prefix positions zero, as the class token's
    # MAE draws the registers as it draws the class token; the fixed sin-cos pos_embed leaves their positions zero
    assert 0.005 < mae.encoder.reg_token.std() < 0.05
    assert not mae.encoder.pos_embed[:, : 1 + REGISTERS].any()


def export_with_registers(tmp_path, *, random_positions: bool = True):
    """A pretraining encoder with 4 registers exported as `pretrain export` does; its prefix positions random, so
    that a hand-off that moved them would show."""
    cfg = pretrain_cfg("mae")
    torch.manual_seed(0)
    encoder = build_model(cfg)
    with torch.no_grad():
        encoder.reg_token.normal_()
        if random_positions:
            encoder.pos_embed.normal_()
    state = {k: v.clone() for k, v in encoder.state_dict().items()}
    export_state_dict(cfg, state, tmp_path / "export", num_classes=0, manifest={"method": "mae", "step": 1})
    return tmp_path / "export", state


def test_the_export_loads_strictly_into_timm_with_reg_tokens(tmp_path):
    export, state = export_with_registers(tmp_path)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **TIMM_ARGS, reg_tokens=REGISTERS)
    model.load_state_dict(load_file(str(export / "model.safetensors")), strict=True)
    assert torch.equal(model.reg_token, state["reg_token"])
    rebuilt = timm.create_model(f"local-dir:{export}", pretrained=True)  # config.json says reg_tokens
    assert rebuilt.num_reg_tokens == REGISTERS and torch.equal(rebuilt.pos_embed, state["pos_embed"])


def test_handoff_at_another_resolution_keeps_the_registers_and_resizes_only_the_patch_grid(tmp_path):
    export, state = export_with_registers(tmp_path)
    cfg = load_config(None, ["stage=finetune", *TINY, "model.img_size=20", f"model.reg_tokens={REGISTERS}"])
    model = build_model(cfg, num_classes=4)
    report = load_encoder(model, export)
    assert report.resized == [("pos_embed", (4, 4), (5, 5))]
    assert "reg_token" in report.loaded and torch.equal(model.reg_token, state["reg_token"])
    assert model.pos_embed.shape == (1, 1 + REGISTERS + 25, 32)
    # The class token's and the registers' positions are kept as they are; only the grid's are interpolated
    assert torch.equal(model.pos_embed[:, : 1 + REGISTERS], state["pos_embed"][:, : 1 + REGISTERS])
    corners = model.pos_embed[0, 1 + REGISTERS :].view(5, 5, 32)[[0, 0, -1, -1], [0, -1, 0, -1]]
    source = state["pos_embed"][0, 1 + REGISTERS :].view(4, 4, 32)[[0, 0, -1, -1], [0, -1, 0, -1]]
    assert not torch.allclose(corners, source)  # interpolated, not copied over
    with torch.no_grad():
        assert model(torch.randn(2, 3, 20, 20)).shape == (2, 4)

    plain = build_model(load_config(None, ["stage=finetune", *TINY]), num_classes=4)
    with pytest.raises(
        ValueError,
        match=r"reg_token: the checkpoint has 4 register tokens, the model 0; build the "
        r"model with model\.reg_tokens=4",
    ):
        load_encoder(plain, export)


def test_evaluate_rebuilds_the_registers_and_pools_without_them(tmp_path):
    export, _ = export_with_registers(tmp_path)
    dist = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    encoder = resolve_encoder(str(export), EncoderFlags(), scratch=tmp_path / "scratch", dist=dist)
    assert encoder.model_args["reg_tokens"] == REGISTERS
    model, _ = encoder.build()
    images = torch.randn(3, 3, 16, 16)
    features, _ = extract_features(model, [{"image": images, "label": torch.zeros(3, dtype=torch.int64)}], "fp32")
    with torch.no_grad():
        tokens = model.forward_features(images)  # (3, 1 + 4 + 16, 32)
    torch.testing.assert_close(features["cls"], tokens[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(features["mean"], tokens[:, 1 + REGISTERS :].mean(1), rtol=0, atol=0)
    assert not torch.allclose(features["mean"], tokens[:, 1:].mean(1))  # the registers are left out


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["stage=finetune", "model.arch=vt_resnet"], "model.reg_tokens needs model.arch vit or vit_hybrid"),
        (["stage=finetune", "distill.kind=hard", "distill.teacher=x"], "model.reg_tokens does not fit distill"),
    ],
)
def test_recipes_registers_cannot_go_with_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [*TINY, "model.reg_tokens=4", *overrides])
