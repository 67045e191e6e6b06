"""Tests for pretrain/data2vec2.py and pretrain/teacher.py on a tiny ViT built as pretrain/objectives.py builds it
(32 wide, 3 blocks of 2 heads, 16 px images in 4 px patches -> 4 x 4 grid, a class token; targets from the top 2
blocks; 3 masked copies per image, each with 8 of its 16 tokens visible; a decoder of 2 convolutions 16 wide), with
masks from the data workers' MaskStack(InverseBlockMaskGenerator); and the recipe checks of `objective.kind:
data2vec2`.

Shape legend:
    B: images    M: masked copies per image    N: B * M copies    L: patch tokens (16)    V: visible tokens (8)
    D: encoder width (32)    T: prefix tokens (the class token, then the register tokens)
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from core.engine.utilisation import CPU_ATTENTION_FLOPS, count_step_flops
from core.models.build import build_model
from core.recipe.config import ConfigError, load_config
from core.recipe.teacher_sections import ConvDecoderConfig, EMASchedule
from data.masking import MaskStack
from pretrain.data2vec2 import ConvDecoder, Data2Vec2, make_targets
from pretrain.export import exported_module
from pretrain.objectives import mask_generator, objective_builder
from pretrain.teacher import EMATeacher, TargetBlock
from tests.helpers.models import tiny_vit

TINY = [
    "objective.kind=data2vec2",
    "model.img_size=16",
    "model.patch_size=4",
    "model.embed_dim=32",
    "model.depth=3",
    "model.num_heads=2",
    "objective.num_masks=3",
    "objective.mask_ratio=0.5",
    "objective.mask_block=2",
    "objective.top_k_blocks=2",
    "objective.decoder.embed_dim=16",
    "objective.decoder.groups=4",
    "objective.decoder.num_layers=2",
]
B, M, L, V, D, K = 2, 3, 16, 8, 32, 2  # images, copies, tokens, visible tokens, width, target blocks


def build(*overrides: str, seed: int = 0) -> tuple[Data2Vec2, MaskStack]:
    """The objective of TINY (plus `overrides`) as the run builds it, in training mode, and its data workers' masks."""
    cfg = load_config(None, [*TINY, *overrides])
    torch.manual_seed(seed)
    objective = objective_builder(cfg)().train()
    return objective, MaskStack(mask_generator(cfg), cfg.objective.num_masks)


def make_batch(stack: MaskStack, seed: int = 0) -> dict[str, torch.Tensor]:
    """B images (B, 3, 16, 16) and their masks (B, M, 4, 4), as the data workers collate them."""
    rng = random.Random(seed)
    images = torch.randn(B, 3, 16, 16, generator=torch.Generator().manual_seed(seed))
    return {"image": images, "mask": torch.stack([stack(rng) for _ in range(B)])}


def count_flops(fn, *args) -> int:
    """FLOPs of `fn(*args)` as the run's meter counts them (torch's counter, CPU attention included)."""
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        fn(*args)
    return counter.get_total_flops()


def spy_targets(objective: Data2Vec2, monkeypatch) -> list[torch.Tensor]:
    """The targets the objective's forward hands its loss, one (B, L, D) per forward."""
    seen, forward_loss = [], objective.forward_loss

    def spy(pred, latent, target, ids):
        seen.append(target)
        return forward_loss(pred, latent, target, ids)

    monkeypatch.setattr(objective, "forward_loss", spy)
    return seen


@pytest.mark.parametrize("reg_tokens", [0, 2])
def test_every_trainable_parameter_gets_a_finite_gradient_and_the_teacher_none(reg_tokens):
    objective, stack = build(f"model.reg_tokens={reg_tokens}")
    assert objective.encoder.num_prefix_tokens == 1 + reg_tokens
    out = objective(make_batch(stack))
    assert all(torch.isfinite(value).all() for value in out.values())
    assert out["loss_tokens"] > 0 and out["loss_cls"] > 0
    out["loss"].backward()
    frozen = {name for name, p in objective.named_parameters() if not p.requires_grad}
    teacher = {f"teacher.encoder.{name}" for name, _ in objective.teacher.encoder.named_parameters()}
    assert frozen == teacher | {"encoder.pos_embed"}  # the sin-cos positions are fixed, as MAE's
    for name, p in objective.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, name
            assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def ffn_outputs_by_hand(teacher: VisionTransformer, images: torch.Tensor) -> list[torch.Tensor]:
    """Every block's FFN output (patch tokens, (B, L, D)): timm's own embedding, then each block's pre-norm formula
    written out."""
    x = teacher.norm_pre(teacher._pos_embed(teacher.patch_embed(images)))  # (B, T + L, D), timm's token order
    ffns = []
    for block in teacher.blocks:
        x = x + block.attn(block.norm1(x))
        ffn = block.mlp(block.norm2(x))
        x = x + ffn
        ffns.append(ffn[:, teacher.num_prefix_tokens :])  # (B, L, D)
    return ffns


def targets_by_hand(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Each (B, L, D) block instance-normalised over the tokens per image and channel, their mean layer-normalised over
    the channels; biased variances and eps 1e-5, as F.instance_norm and F.layer_norm, no affine."""
    normed = []
    for y in blocks:
        mean, var = y.mean(dim=1, keepdim=True), y.var(dim=1, unbiased=False, keepdim=True)
        normed.append((y - mean) / torch.sqrt(var + 1e-5))
    avg = torch.stack(normed).mean(dim=0)  # (B, L, D)
    mean, var = avg.mean(dim=-1, keepdim=True), avg.var(dim=-1, unbiased=False, keepdim=True)
    return (avg - mean) / torch.sqrt(var + 1e-5)


def test_make_targets_by_hand_with_channel_variances_around_eps():
    """The final layer norm cancels any scale shared by all channels, so channels whose variance straddles eps
    (1e-8 to 1e-4 against 1e-5) are what tell the instance norm's eps and biased variance apart."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.logspace(-4, -2, D)  # (D,) per-channel standard deviations
    blocks = [(torch.randn(B, L, D, generator=gen) + torch.randn(D, generator=gen)) * scales for _ in range(K)]
    want = targets_by_hand([y.double() for y in blocks]).float()
    torch.testing.assert_close(make_targets(blocks), want)
    assert make_targets([y.bfloat16() for y in blocks]).dtype == torch.float32


@pytest.mark.parametrize("reg_tokens", [0, 2])
def test_targets_are_the_teachers_top_ffn_outputs_normalised(reg_tokens, monkeypatch):
    objective, stack = build(f"model.reg_tokens={reg_tokens}")
    teacher = objective.teacher.encoder
    for block in teacher.blocks:  # the hand formula's block: no layer scale, no drop path
        assert isinstance(block, TargetBlock)
        assert all(isinstance(getattr(block, name), nn.Identity) for name in ("ls1", "ls2", "drop_path1", "drop_path2"))
    batch = make_batch(stack)
    with torch.no_grad():
        ffns = ffn_outputs_by_hand(teacher, batch["image"])
        blocks, _ = objective.teacher.forward_blocks(batch["image"], K)
    for got, want in zip(blocks, ffns[-K:], strict=True):  # the top K blocks, oldest first
        torch.testing.assert_close(got, want)
    want = targets_by_hand(ffns[-K:])
    torch.testing.assert_close(make_targets(blocks), want)
    seen = spy_targets(objective, monkeypatch)
    out = objective(batch)
    torch.testing.assert_close(seen[0], want)  # what the loss regresses: one target per image
    torch.testing.assert_close(out["target_var"], want.var(dim=1).mean())


def hand_loss(pred, latent, target, mask, cls_weight=0.01):
    """Masked tokens gathered by hand from the mask: squared error summed over D / sqrt(D), mean over every masked
    token; plus `cls_weight` x the class token against the image's mean target, mean over copies."""
    flat = mask.reshape(B * M, L)  # (N, L) True = masked
    token_errors, cls_errors = [], []
    for n in range(B * M):
        image = n // M  # copies of an image are consecutive rows
        token_errors.append((pred[n][flat[n]] - target[image][flat[n]]).pow(2).sum(dim=-1) / math.sqrt(D))
        cls_errors.append((latent[n, 0] - target[image].mean(dim=0)).pow(2).sum() / math.sqrt(D))
    loss_tokens, loss_cls = torch.cat(token_errors).mean(), torch.stack(cls_errors).mean()
    return loss_tokens + cls_weight * loss_cls, loss_tokens, loss_cls


def test_loss_by_hand_counts_the_masked_tokens_and_the_class_token_only():
    objective, stack = build()
    assert objective.cls_loss_weight == 0.01  # the recipe's default
    batch = make_batch(stack)
    _, ids = objective.forward_encoder(batch["image"], batch["mask"])
    gen = torch.Generator().manual_seed(1)
    pred, target = torch.randn(B * M, L, D, generator=gen), torch.randn(B, L, D, generator=gen)
    latent = torch.randn(B * M, 1 + V, D, generator=gen)
    out = objective.forward_loss(pred, latent, target, ids)
    want, want_tokens, want_cls = hand_loss(pred, latent, target, batch["mask"])
    torch.testing.assert_close(out["loss"], want)
    torch.testing.assert_close(out["loss_tokens"], want_tokens)
    torch.testing.assert_close(out["loss_cls"], want_cls)
    visible = ~batch["mask"].reshape(B * M, L)  # (N, L)
    changed = pred.clone()
    changed[visible] = torch.randn(int(visible.sum()), D, generator=gen)
    latent_changed = latent.clone()
    latent_changed[:, 1:] += 1.0  # the visible tokens' latents count only through the decoder
    assert torch.equal(objective.forward_loss(changed, latent_changed, target, ids)["loss"], out["loss"])
    changed[~visible] += 0.1  # every masked prediction moved
    assert not torch.allclose(objective.forward_loss(changed, latent, target, ids)["loss"], out["loss"])
    one = pred.clone()
    one[visible.logical_not().nonzero()[0].tolist()] += 0.1  # a single masked token
    assert not torch.allclose(objective.forward_loss(one, latent, target, ids)["loss"], out["loss"])


def test_each_copys_latent_is_the_students_timm_pass_over_its_visible_tokens():
    objective, stack = build("model.reg_tokens=2")
    batch = make_batch(stack)
    enc, num_prefix = objective.encoder, 3  # the class token and 2 registers
    with torch.no_grad():
        latent, _ = objective.forward_encoder(batch["image"], batch["mask"])
        tokens = enc._pos_embed(enc.patch_embed(batch["image"]))  # (B, T + L, D): timm's tokens and positions
        for n in range(B * M):
            visible = (~batch["mask"][n // M, n % M]).flatten().nonzero()[:, 0] + num_prefix  # (V,) in grid order
            keep = torch.cat([torch.arange(num_prefix), visible])
            want = enc.norm(enc.blocks(tokens[n // M, keep][None]))[0]  # (T + V, D)
            torch.testing.assert_close(latent[n], want, msg=f"copy {n % M} of image {n // M}")


def test_the_student_sees_only_visible_tokens_and_the_teacher_the_whole_image():
    objective, stack = build()
    objective.eval()
    batch = make_batch(stack)
    masks = batch["mask"][0]  # (M, 4, 4) image 0's copies
    hidden = (masks[0] & ~masks[1:].all(dim=0)).nonzero()  # masked in copy 0, visible in another copy
    assert len(hidden) > 0
    row, col = hidden[0].tolist()
    other = int((~masks[1:, row, col]).nonzero()[0]) + 1  # a copy where the patch is visible
    changed = batch["image"].clone()
    changed[0, :, row * 4 : row * 4 + 4, col * 4 : col * 4 + 4] += 1.0  # one patch of image 0
    with torch.no_grad():
        latent, ids = objective.forward_encoder(batch["image"], batch["mask"])
        latent_changed, ids_changed = objective.forward_encoder(changed, batch["mask"])
        target = make_targets(objective.teacher.forward_blocks(batch["image"], K)[0])
        target_changed = make_targets(objective.teacher.forward_blocks(changed, K)[0])
    assert latent.shape == (B * M, 1 + V, D) and torch.equal(ids, ids_changed)
    torch.testing.assert_close(latent_changed[0], latent[0])  # image 0, copy 0: the patch is masked there
    torch.testing.assert_close(latent_changed[M:], latent[M:])  # image 1's copies
    assert not torch.allclose(latent_changed[other], latent[other], atol=1e-4)  # the patch is visible there
    assert not torch.allclose(target_changed[0], target[0], atol=1e-4)  # the teacher sees every patch
    torch.testing.assert_close(target_changed[1], target[1])


def test_the_teacher_runs_once_per_image_and_its_target_serves_every_copy(monkeypatch):
    objective, stack = build()
    teacher_rows, student_rows = [], []
    objective.teacher.encoder.patch_embed.register_forward_pre_hook(lambda _, args: teacher_rows.append(len(args[0])))
    objective.encoder.patch_embed.register_forward_pre_hook(lambda _, args: student_rows.append(len(args[0])))
    seen = spy_targets(objective, monkeypatch)
    batch = make_batch(stack)
    torch.manual_seed(0)  # the decoder's noise in the masked slots
    loss = objective(batch)["loss"]
    assert teacher_rows == [B] and student_rows == [B]  # one teacher pass, one patch embedding per image
    assert seen[0].shape == (B, L, D)
    with torch.no_grad():
        latent, ids = objective.forward_encoder(batch["image"], batch["mask"])
        torch.manual_seed(0)  # the same noise
        pred = objective.forward_decoder(latent, ids)
    # the per-image target, repeated for its M copies, gives the loss
    torch.testing.assert_close(loss, hand_loss(pred, latent, seen[0], batch["mask"])[0])


@pytest.mark.parametrize("in_dim", [32, 16])
def test_conv_decoder_shape_residuals_and_layer_norm_without_affine(in_dim):
    cfg = ConvDecoderConfig(embed_dim=16, kernel_size=3, num_layers=3, groups=4)
    grid = (2, 3)  # not square: the tokens' row-major order matters
    torch.manual_seed(0)
    decoder = ConvDecoder(in_dim, grid, cfg)
    x = torch.randn(2, 6, in_dim)
    out = decoder(x)
    assert out.shape == (2, 6, in_dim)
    h = x.reshape(2, *grid, in_dim).permute(0, 3, 1, 2)  # (2, in_dim, gh, gw)
    residuals = []
    for conv in decoder.convs:
        assert (conv.groups, conv.kernel_size, conv.padding) == (4, (3, 3), (1, 1))
        y = conv(h)
        mean, var = y.mean(dim=1, keepdim=True), y.var(dim=1, unbiased=False, keepdim=True)  # over channels
        y = F.gelu((y - mean) / torch.sqrt(var + 1e-5))
        residuals.append(y.shape == h.shape)
        h = y + h if y.shape == h.shape else y  # a layer keeping its input's width adds its input
    want = decoder.proj(h.permute(0, 2, 3, 1).reshape(2, 6, 16))
    torch.testing.assert_close(out, want)
    assert residuals == [in_dim == 16, True, True]
    names = {name for name, _ in decoder.named_parameters()}  # the convolutions' and the projection's only
    assert names == {
        f"{layer}.{kind}" for layer in ("convs.0", "convs.1", "convs.2", "proj") for kind in ("weight", "bias")
    }
    assert not any(isinstance(m, nn.LayerNorm) for m in decoder.modules())


def test_the_teacher_stays_in_eval_mode_frozen_and_its_decay_follows_the_schedule():
    objective, _ = build()
    objective.train()
    assert objective.encoder.training and objective.decoder.training
    assert not any(m.training for m in objective.teacher.encoder.modules())
    assert not any(p.requires_grad for p in objective.teacher.parameters())
    teacher = EMATeacher(tiny_vit(0), EMASchedule(start=0.9, end=0.99, steps=10))
    assert teacher.decay.item() == pytest.approx(0.9)  # the decay logged before the first update
    steps = [0, 1, 5, 9, 10, 11, 1000]
    want = [0.9, 0.909, 0.945, 0.981, 0.99, 0.99, 0.99]  # linear over 10 steps, then held
    assert [teacher.decay_at(step) for step in steps] == pytest.approx(want)


def test_the_monitors_measure_the_exported_encoder_and_the_teacher_embeds_as_timm_does():
    objective, _ = build()
    assert exported_module(load_config(None, TINY), objective) is objective.encoder
    assert exported_module(load_config(None, [*TINY, "objective.export=teacher"]), objective) is objective.teacher
    with torch.no_grad():
        for p in objective.teacher.encoder.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # a teacher that is not the student
    plain = build_model(load_config(None, TINY))  # timm's own blocks and forward_features, the teacher's weights
    plain.load_state_dict(objective.teacher.encoder.state_dict())
    images = torch.randn(B, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    objective.eval()
    torch.testing.assert_close(objective.teacher.forward_features(images), plain.eval().forward_features(images))
    assert (objective.teacher.num_prefix_tokens, objective.teacher.embed_dim) == (1, D)


def test_pairs_matches_parameters_by_name_and_refuses_another_architecture():
    teacher = EMATeacher(tiny_vit(0), EMASchedule())
    student = tiny_vit(1)
    pairs = teacher.pairs(student)
    assert len(pairs) == len(list(student.parameters()))
    for (name, mine), (t, s) in zip(teacher.encoder.named_parameters(), pairs, strict=True):
        assert t is mine and s is student.get_parameter(name)
    with pytest.raises(ValueError, match=r"not the student's \(differ: blocks\.2\."):
        teacher.pairs(tiny_vit(1, depth=3))
    with pytest.raises(ValueError, match="reg_token"):
        teacher.pairs(tiny_vit(1, reg_tokens=2))


RECIPE = [  # a 7 x 7 grid, 3 blocks
    "objective.kind=data2vec2",
    "model.img_size=28",
    "model.patch_size=4",
    "model.embed_dim=32",
    "model.depth=3",
    "model.num_heads=2",
    "objective.top_k_blocks=2",
    "objective.decoder.embed_dim=32",
    "objective.decoder.groups=4",
]
REFUSED = {
    "no_visible_token": (["objective.mask_ratio=0.99"], r"objective\.mask_ratio 0\.99 masks 49 of 49 tokens"),
    "top_k_above_depth": (["objective.top_k_blocks=4"], r"objective\.top_k_blocks 4 is above the encoder's depth 3"),
    "ema_start_above_1": (["objective.ema.start=1.5"], r"objective\.ema\.start: Input should be less than or equal"),
    "ema_end_below_0": (["objective.ema.end=-0.1"], r"objective\.ema\.end: Input should be greater than or equal"),
    "groups": (["objective.decoder.groups=5"], r"objective\.decoder: .*groups 5 does not divide embed_dim 32"),
    "even_kernel": (["objective.decoder.kernel_size=4"], r"objective\.decoder: .*kernel_size must be odd"),
    "fp16": (["engine.precision=fp16"], r"objective\.kind data2vec2 does not fit engine\.precision fp16"),
    "t2t_vit": (
        ["model.arch=t2t_vit", "model.img_size=224"],
        r"objective\.kind data2vec2 needs model\.arch vit, got 't2t_vit'",
    ),
    "vit_hybrid": (
        ["model.arch=vit_hybrid", "model.img_size=128", "model.patch_size=1"],  # an 8 x 8 grid on the ResNet's map
        r"objective\.kind data2vec2 needs model\.arch vit, got 'vit_hybrid'",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_recipe_checks_name_the_key(case):
    cfg = load_config(None, RECIPE)  # the recipe itself is valid
    assert cfg.model.grid == (7, 7) and cfg.objective.kind == "data2vec2"
    overrides, message = REFUSED[case]
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*RECIPE, *overrides])


def test_one_forward_counts_the_teacher_once_per_image_and_the_student_on_the_visible_tokens():
    objective, stack = build()
    batch = make_batch(stack)
    forward = count_flops(objective, batch)
    enc = objective.encoder  # the teacher's architecture (the teacher's own blocks return two tensors, not timm's one)
    with torch.no_grad():
        teacher = count_flops(enc.forward_features, batch["image"])  # all L tokens of each of the B images
        student = count_flops(enc.patch_embed, batch["image"]) + count_flops(
            lambda x: enc.norm(enc.blocks(x)), torch.randn(B * M, 1 + V, D)
        )  # the patches embedded once per image, the blocks on N copies of T + V tokens
        decoder = count_flops(objective.decoder, torch.randn(B * M, L, D))
    # 2.83 + 4.27 + 0.43 MFLOP: a teacher run per copy would add 5.65, a student on all 16 tokens about 3.8
    assert forward == pytest.approx(teacher + student + decoder, rel=0.02)


def test_the_mfu_step_count_holds_one_teacher_forward_and_no_teacher_backward(monkeypatch):
    """`count_step_flops` is what `start_meter` counts perf/mfu from (forward and backward of the whole objective)."""
    objective, stack = build()
    batch = make_batch(stack)
    cpu = torch.device("cpu")
    step = count_step_flops(objective, batch, precision="fp32", device=cpu)
    with torch.no_grad():
        teacher = count_flops(objective.teacher.forward_blocks, batch["image"], K)

    def free_teacher(self, images, num_blocks):  # the same shapes and no FLOPs (zeros made in the counter's mode)
        return [images.new_zeros(B, L, D)] * num_blocks, images.new_zeros(B, 1 + L, D)

    monkeypatch.setattr(EMATeacher, "forward_blocks", free_teacher)
    without_teacher = count_step_flops(objective, batch, precision="fp32", device=cpu)
    assert step - without_teacher == teacher
