"""Tests for pretrain/ijepa.py on a tiny ViT built as pretrain/objectives.py builds it (32 wide, 3 blocks of 2 heads,
16 px images in 4 px patches -> 4 x 4 grid, no class token; 2 target blocks of 2 x 2 tokens per image; a predictor of
2 blocks 16 wide with 2 heads), with masks from the data workers' sampler (`train_transform(cfg).batch_masks`); the
pipeline's masks and their resume; the export; and the recipe checks of `objective.kind: ijepa`.

Shape legend:
    B: images    K: target blocks (2)    Nc: context tokens    Nt: tokens per target block (4)    L: patch tokens (16)
    D: encoder width (32)    Dp: predictor width (16)    T: prefix tokens (register tokens; no class token)
"""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import pretrain.ijepa as ijepa_module
from core.engine.utilisation import CPU_ATTENTION_FLOPS, count_step_flops
from core.models.build import build_model
from core.recipe.config import ConfigError, load_config
from data.multiblock import MultiBlockMasks, WithBatchMasks
from data.pipeline import make_train_loader
from data.specs import resolve_shards
from pretrain.export import exported_encoder, exported_module
from pretrain.ijepa import IJEPA
from pretrain.objectives import objective_builder, train_transform
from pretrain.teacher import EMATeacher
from tests.launching import position_after, write_synthetic

TINY = [
    "objective.kind=ijepa",
    "model.img_size=16",
    "model.patch_size=4",
    "model.embed_dim=32",
    "model.depth=3",
    "model.num_heads=2",
    "model.class_token=false",
    "objective.num_targets=2",
    "objective.target_scale=[0.25,0.25]",  # int(16 x 0.25) = 4 tokens at aspect 1: every target block is 2 x 2
    "objective.target_aspect=[1.0,1.0]",
    "objective.min_keep=4",  # the 4 x 4 context keeps at least 16 - 2 x 4 = 8 tokens beside the two targets
    "objective.predictor.depth=2",
    "objective.predictor.embed_dim=16",
    "objective.predictor.num_heads=2",
]
B, K, NT, L, D, DP = 2, 2, 4, 16, 32, 16  # images, target blocks, tokens per block, patch tokens, widths
GRID = (4, 4)


def build(*overrides: str, seed: int = 0) -> tuple[IJEPA, MultiBlockMasks]:
    """The objective of TINY (plus `overrides`) as the run builds it, in training mode, and its data workers' masks."""
    cfg = load_config(None, [*TINY, *overrides])
    torch.manual_seed(seed)
    objective = objective_builder(cfg)().train()
    return objective, train_transform(cfg).batch_masks


def make_batch(masks: MultiBlockMasks, seed: int = 0) -> dict[str, torch.Tensor]:
    """B images (B, 3, 16, 16) and one batch's masks, as the data workers add them."""
    images = torch.randn(B, 3, 16, 16, generator=torch.Generator().manual_seed(seed))
    return {"image": images, **masks.draw(B, random.Random(seed))}


def count_flops(fn, *args) -> int:
    """FLOPs of `fn(*args)` as the run's meter counts them (torch's counter, CPU attention included)."""
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        fn(*args)
    return counter.get_total_flops()


def spy_loss(objective: IJEPA, monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What the objective's forward hands its loss, one (predictions (B, K, Nt, D), targets (B, K, Nt, D)) per
    forward."""
    seen, loss = [], ijepa_module.LOSSES[objective.loss]

    def spy(pred, target):
        seen.append((pred.detach(), target))
        return loss(pred, target)

    monkeypatch.setitem(ijepa_module.LOSSES, objective.loss, spy)
    return seen


def sincos_by_hand(dim: int) -> torch.Tensor:
    """(L, dim) MAE's 2-D sin-cos positions written out: token (row, col) -> [sin(col w), cos(col w), sin(row w),
    cos(row w)], w_k = 10000 ** (-k / (dim / 4)), k < dim / 4."""
    freqs = [10000 ** (-k / (dim // 4)) for k in range(dim // 4)]
    rows = []
    for row, col in itertools.product(range(GRID[0]), range(GRID[1])):  # row-major
        rows.append([f(p * w) for p in (col, row) for f in (math.sin, math.cos) for w in freqs])
    return torch.tensor(rows)


def layer_norm_by_hand(x: torch.Tensor, eps: float, weight=None, bias=None) -> torch.Tensor:
    """Over the last dim with the biased variance (F.layer_norm's); no affine unless given."""
    mean, var = x.mean(dim=-1, keepdim=True), x.var(dim=-1, unbiased=False, keepdim=True)
    out = (x - mean) / torch.sqrt(var + eps)
    return out if weight is None else out * weight + bias


def block_by_hand(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm's pre-norm block on (N, C) tokens written out: multi-head softmax attention over every token, then the
    GELU MLP, each with a residual."""
    assert all(isinstance(getattr(block, name), nn.Identity) for name in ("ls1", "ls2", "drop_path1", "drop_path2"))
    n, c = x.shape
    heads = block.attn.num_heads
    h = layer_norm_by_hand(x, 1e-6, block.norm1.weight, block.norm1.bias)
    q, k, v = (h @ block.attn.qkv.weight.T + block.attn.qkv.bias).reshape(n, 3, heads, c // heads).permute(1, 2, 0, 3)
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(c // heads), dim=-1)  # (heads, N, N)
    x = x + block.attn.proj((weights @ v).transpose(0, 1).reshape(n, c))
    h = layer_norm_by_hand(x, 1e-6, block.norm2.weight, block.norm2.bias)
    return x + block.mlp.fc2(F.gelu(block.mlp.fc1(h)))


def context_by_hand(objective: IJEPA, image: torch.Tensor, context_ids: torch.Tensor) -> torch.Tensor:
    """One image's context encoder output (Nc, D): timm's patch embedding and positions at the context tokens, the
    register tokens in front, timm's blocks and final norm; the registers dropped."""
    enc = objective.encoder
    num_prefix = enc.num_prefix_tokens
    tokens = (enc.patch_embed(image[None]) + enc.pos_embed[:, num_prefix:])[0, context_ids]  # (Nc, D)
    if num_prefix:
        tokens = torch.cat([enc.reg_token[0] + enc.pos_embed[0, :num_prefix], tokens])  # (T + Nc, D)
    return enc.norm(enc.blocks(tokens[None]))[0, num_prefix:]


@pytest.mark.parametrize("reg_tokens", [0, 2])
def test_every_trainable_parameter_gets_a_finite_gradient_and_the_teacher_none(reg_tokens):
    objective, masks = build(f"model.reg_tokens={reg_tokens}")
    assert objective.encoder.num_prefix_tokens == reg_tokens and not objective.encoder.has_class_token
    out = objective(make_batch(masks))
    assert all(torch.isfinite(value).all() for value in out.values())
    assert out["loss"] > 0 and out["target_var"] > 0 and out["ema_decay"] == pytest.approx(0.996)
    out["loss"].backward()
    frozen = {name for name, p in objective.named_parameters() if not p.requires_grad}
    teacher = {f"teacher.encoder.{name}" for name, _ in objective.teacher.encoder.named_parameters()}
    assert frozen == teacher | {"encoder.pos_embed"}  # the sin-cos positions are fixed, as MAE's
    # the final norm stays on every token (fc_norm off, core/models/build.py no_class_token): the predictor reads the
    # context encoder's normalised tokens, as in I-JEPA, and every trainable parameter gets a gradient
    assert isinstance(objective.encoder.norm, nn.LayerNorm) and isinstance(objective.encoder.fc_norm, nn.Identity)
    for name, p in objective.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, name
            assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name
    assert "predictor.mask_token" in objective.no_weight_decay()
    assert ("encoder.reg_token" in objective.no_weight_decay()) == (reg_tokens > 0)


def test_the_context_encoder_sees_only_the_context_and_the_target_encoder_the_whole_image(monkeypatch):
    objective, masks = build()
    objective.eval()
    batch = make_batch(masks)
    context_ids, target_ids = batch["context_ids"], batch["target_ids"]
    hidden = int(target_ids[0, 0, 0])  # a token of image 0's first target block: never in its context
    seen = int(context_ids[0, 0])  # a token of image 0's context
    assert hidden not in context_ids[0].tolist()

    def change_patch(token: int) -> torch.Tensor:
        images = batch["image"].clone()
        row, col = divmod(token, GRID[1])
        images[0, :, row * 4 : row * 4 + 4, col * 4 : col * 4 + 4] += 1.0  # one patch of image 0
        return images

    changed = change_patch(hidden)
    with torch.no_grad():
        context = objective.forward_encoder(batch["image"], context_ids)
        target = objective.teacher_targets(batch["image"])
        context_changed = objective.forward_encoder(changed, context_ids)
        target_changed = objective.teacher_targets(changed)
        context_seen = objective.forward_encoder(change_patch(seen), context_ids)
    assert context.shape == (B, context_ids.shape[1], D) and target.shape == (B, L, D)
    torch.testing.assert_close(context_changed, context)  # both images: the patch is not in image 0's context
    assert not torch.allclose(context_seen[0], context[0], atol=1e-4)  # a context patch does count
    torch.testing.assert_close(context_seen[1], context[1])
    assert not torch.allclose(target_changed[0, target_ids[0, 0]], target[0, target_ids[0, 0]], atol=1e-4)
    torch.testing.assert_close(target_changed[1], target[1])  # image 1 is unchanged
    seen_losses = spy_loss(objective, monkeypatch)
    objective(batch)
    objective({**batch, "image": changed})
    (pred, wanted), (pred_changed, wanted_changed) = seen_losses
    torch.testing.assert_close(pred_changed, pred)  # the predictor only sees the context
    assert not torch.allclose(wanted_changed[0, 0], wanted[0, 0], atol=1e-4)  # the hidden patch's own target moved


def test_the_predictor_by_hand_at_the_positions_of_one_block(monkeypatch):
    objective, masks = build("model.reg_tokens=2")  # the context encoder's registers: dropped before the predictor
    predictor = objective.predictor
    batch = make_batch(masks)
    context_ids, target_ids = batch["context_ids"], batch["target_ids"]
    seen = spy_loss(objective, monkeypatch)
    objective(batch)
    pred = seen[0][0]  # (B, K, Nt, D): IJEPA's predictions
    pos = sincos_by_hand(DP)  # (L, Dp)
    torch.testing.assert_close(predictor.pos_embed[0], pos)
    with torch.no_grad():
        for b, k in [(0, 0), (1, 1)]:
            context = context_by_hand(objective, batch["image"][b], context_ids[b])  # (Nc, D)
            x = torch.cat(
                [
                    context @ predictor.embed.weight.T + predictor.embed.bias + pos[context_ids[b]],  # (Nc, Dp)
                    predictor.mask_token[0, 0] + pos[target_ids[b, k]],  # (Nt, Dp): the block's queries
                ]
            )
            for block in predictor.blocks:
                x = block_by_hand(block, x)
            norm = layer_norm_by_hand(x[-NT:], 1e-6, predictor.norm.weight, predictor.norm.bias)
            want = norm @ predictor.proj.weight.T + predictor.proj.bias  # (Nt, D)
            torch.testing.assert_close(pred[b, k], want, msg=f"image {b}, block {k}")
        context = objective.forward_encoder(batch["image"], context_ids)  # (B, Nc, D)
        swapped = target_ids.clone()
        swapped[0, 0, [0, 3]] = target_ids[0, 0, [3, 0]]  # two positions of image 0's first block trade slots
        got = predictor(context, context_ids, swapped)
        moved = target_ids.clone()
        moved[:, 1] = (target_ids[:, 1] + 1) % L  # every image's second block elsewhere
        got_moved = predictor(context, context_ids, moved)
        order = torch.randperm(context_ids.shape[1], generator=torch.Generator().manual_seed(0))
        got_shuffled = predictor(context[:, order], context_ids[:, order], target_ids)  # tokens with their ids
        got_wrong = predictor(context, context_ids[:, order], target_ids)  # the tokens at other positions
    torch.testing.assert_close(got[0, 0, [0, 3]], pred[0, 0, [3, 0]])  # each prediction follows its position
    torch.testing.assert_close(got[0, 0, 1:3], pred[0, 0, 1:3])
    assert not torch.allclose(pred[0, 0, 0], pred[0, 0, 3], atol=1e-3)  # the two predictions differ
    torch.testing.assert_close(got_moved[:, 0], pred[:, 0])  # the blocks are predicted independently
    assert not torch.allclose(got_moved[:, 1], pred[:, 1], atol=1e-3)
    torch.testing.assert_close(got_shuffled, pred)  # the context is a set of (token, position) pairs
    assert not torch.allclose(got_wrong, pred, atol=1e-3)


@pytest.mark.parametrize("loss", ["smooth_l1", "l2"])
def test_targets_are_the_teachers_output_layer_normalised_and_the_loss_by_hand(loss, monkeypatch):
    objective, masks = build("model.reg_tokens=2", f"objective.loss={loss}")
    batch = make_batch(masks)
    target_ids = batch["target_ids"]
    plain = build_model(load_config(None, [*TINY, "model.reg_tokens=2"]))  # timm's forward_features
    plain.load_state_dict(objective.teacher.encoder.state_dict())
    with torch.no_grad():
        features = plain.eval().forward_features(batch["image"])[:, 2:]  # (B, L, D): the registers dropped
    normed = layer_norm_by_hand(features, 1e-5)
    want = torch.stack([torch.stack([normed[b, target_ids[b, k]] for k in range(K)]) for b in range(B)])
    seen = spy_loss(objective, monkeypatch)
    out = objective(batch)
    pred, target = seen[0]
    assert pred.shape == target.shape == (B, K, NT, D)
    torch.testing.assert_close(target, want)
    torch.testing.assert_close(out["target_var"], normed.var(dim=1).mean())
    error = (pred - want).abs()
    if loss == "smooth_l1":  # beta 1: quadratic below 1, linear above; both sides occur here
        assert (error < 1).any() and (error > 1).any()
        per_channel = torch.where(error < 1, 0.5 * error**2, error - 0.5)
    else:
        per_channel = error**2
    torch.testing.assert_close(out["loss"], per_channel.mean())  # every target token and channel of every block


def test_the_export_holds_the_teacher_which_embeds_as_timm_does():
    objective, _ = build("model.reg_tokens=2")
    cfg = load_config(None, [*TINY, "model.reg_tokens=2"])
    assert cfg.objective.export == "teacher" and exported_module(cfg, objective) is objective.teacher
    student = load_config(None, [*TINY, "model.reg_tokens=2", "objective.export=student"])
    assert exported_module(student, objective) is objective.encoder
    with torch.no_grad():
        for p in objective.teacher.encoder.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # a teacher that is not the student
    plain = build_model(cfg)  # timm's own blocks and forward_features, loaded with the export's tensors
    assert plain.cls_token is None and plain.global_pool == "avg" and plain.num_prefix_tokens == 2
    plain.load_state_dict(exported_encoder(cfg, objective.state_dict()))  # strict: the export is the teacher
    images = torch.randn(B, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    objective.eval()
    with torch.no_grad():
        torch.testing.assert_close(objective.teacher.forward_features(images), plain.eval().forward_features(images))
    assert (objective.teacher.num_prefix_tokens, objective.teacher.embed_dim) == (2, D)


REFUSED = {
    "class_token": (["model.class_token=true"], r"objective\.kind ijepa needs model\.class_token false"),
    "wide_predictor": (
        ["objective.predictor.embed_dim=64"],
        r"objective\.predictor\.embed_dim 64 is wider than the encoder \(32\)",
    ),
    "predictor_heads": (["objective.predictor.num_heads=3"], r"objective\.predictor: .*num_heads 3 does not divide"),
    "target_scale": (
        ["objective.target_scale=[0.001,0.002]"],
        r"objective\.target_scale=\(0\.001, 0\.002\) .*gives a 0x0 block on the 4x4 grid",
    ),
    "min_keep": (
        ["objective.min_keep=12"],
        r"objective\.min_keep=12 cannot be met: a 4x4 context block .*keeps at most 12 tokens beside 2x2 target",
    ),
    "loss": (["objective.loss=l1"], r"objective\.loss: Input should be 'smooth_l1' or 'l2'"),
    "t2t_vit": (
        ["model.arch=t2t_vit", "model.img_size=224"],
        r"model: .*class_token false needs arch vit or vit_hybrid .*got 't2t_vit'",
    ),
    "t2t_vit_class_token": (
        ["model.arch=t2t_vit", "model.img_size=224", "model.class_token=true"],
        r"objective\.kind ijepa needs model\.arch vit, got 't2t_vit'",
    ),
    "vit_hybrid": (
        ["model.arch=vit_hybrid", "model.img_size=128", "model.patch_size=1"],  # an 8 x 8 grid on the ResNet's map
        r"objective\.kind ijepa needs model\.arch vit, got 'vit_hybrid'",
    ),
    "fp16": (["engine.precision=fp16"], r"objective\.kind ijepa does not fit engine\.precision fp16"),
    "token_pool": (["model.global_pool=token"], r"model: .*global_pool token needs a class token"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_recipe_checks_name_the_key(case):
    cfg = load_config(None, TINY)  # the recipe itself is valid
    assert cfg.model.grid == GRID and cfg.objective.kind == "ijepa"
    overrides, message = REFUSED[case]
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*TINY, *overrides])


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    """4 shards of 12 synthetic 16 px images."""
    return resolve_shards(str(write_synthetic(tmp_path_factory.mktemp("shards"), "train", 48, 12, seed=0)))


def _loader(shards: list[str], **overrides) -> torch.utils.data.DataLoader:
    transform = train_transform(load_config(None, TINY))
    assert isinstance(transform, WithBatchMasks)
    args = dict(
        transform=transform, batch_size=4, seed=3, rank=0, world_size=1, num_workers=0, shuffle_buffer=8,
        resampled=False, labels=False, num_open_shards=2,
    )  # fmt: skip
    return make_train_loader(shards, **(args | overrides))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_pipeline_draws_masks_per_batch_and_a_resumed_loader_draws_the_same(shards, num_workers):
    fresh = list(itertools.islice(iter(_loader(shards, num_workers=num_workers)), 6))
    for batch in fresh:
        context_ids, target_ids = batch["context_ids"], batch["target_ids"]
        assert batch["image"].shape == (4, 3, 16, 16)
        assert context_ids.dtype == target_ids.dtype == torch.int64
        assert context_ids.shape[0] == 4 and 8 <= context_ids.shape[1] <= 12 and target_ids.shape == (4, K, NT)
        for ctx, targets in zip(context_ids.tolist(), target_ids.tolist(), strict=True):
            assert ctx == sorted(ctx) and not set(ctx) & set(itertools.chain(*targets))  # disjoint from the targets
    assert len({batch["target_ids"].numpy().tobytes() for batch in fresh}) == 6  # new masks every batch
    position = json.loads(
        json.dumps(position_after(fresh, 3))
    )  # through a checkpoint's JSON; with 2 workers, worker 1 is next
    resumed = list(itertools.islice(iter(_loader(shards, num_workers=num_workers, positions=[position])), 3))
    for got, want in zip(resumed, fresh[3:], strict=True):
        assert got["key"] == want["key"]
        assert torch.equal(got["context_ids"], want["context_ids"])
        assert torch.equal(got["target_ids"], want["target_ids"])


def test_one_forward_counts_the_teacher_once_per_image_the_encoder_on_the_context_and_the_predictor_per_block():
    objective, masks = build()
    batch = make_batch(masks)
    num_context = batch["context_ids"].shape[1]
    assert num_context == 8  # the two 2 x 2 target blocks of some image do not overlap
    forward = count_flops(objective, batch)
    enc, predictor = objective.encoder, objective.predictor
    with torch.no_grad():
        teacher = count_flops(enc.forward_features, batch["image"])  # all L tokens of each of the B images
        context = count_flops(enc.patch_embed, batch["image"]) + count_flops(
            lambda x: enc.norm(enc.blocks(x)), torch.randn(B, num_context, D)
        )  # the patches embedded once per image, the blocks on the B x Nc context tokens
        blocks = count_flops(predictor.blocks, torch.randn(B * K, num_context + NT, DP))  # context once per block
        ends = count_flops(predictor.embed, torch.randn(B, num_context, D)) + count_flops(
            lambda x: predictor.proj(predictor.norm(x)), torch.randn(B * K, NT, DP)
        )
        all_tokens = count_flops(lambda x: enc.norm(enc.blocks(x)), torch.randn(B, L, D))
        one_pass = count_flops(predictor.blocks, torch.randn(B, num_context + K * NT, DP))
    # 2.65 + 1.33 + 0.70 MFLOP (Nc 8): the encoder on all 16 tokens would add 1.33, one predictor pass over
    # [context; all K blocks' queries] would take 0.20 less
    assert forward == pytest.approx(teacher + context + blocks + ends, rel=0.01)
    assert all_tokens - (context - count_flops(enc.patch_embed, batch["image"])) > 0.2 * forward
    assert blocks - one_pass > 0.03 * forward


def test_the_mfu_step_count_holds_one_teacher_forward_and_no_teacher_backward(monkeypatch):
    """`count_step_flops` is what `start_meter` counts perf/mfu from (forward and backward of the whole objective)."""
    objective, masks = build()
    batch = make_batch(masks)
    cpu = torch.device("cpu")
    step = count_step_flops(objective, batch, precision="fp32", device=cpu)
    with torch.no_grad():
        teacher = count_flops(objective.teacher.forward_features, batch["image"])

    def free_teacher(self, images, num_blocks):  # the same shapes and no FLOPs (zeros made in the counter's mode)
        return [], images.new_zeros(B, L, D)

    monkeypatch.setattr(EMATeacher, "forward_blocks", free_teacher)
    without_teacher = count_step_flops(objective, batch, precision="fp32", device=cpu)
    assert step - without_teacher == teacher
