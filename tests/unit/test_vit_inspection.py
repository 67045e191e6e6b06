"""The ViT paper's inspection numbers against hand computations: uniform attention spans the mean pairwise patch
distance, attention to self spans none, rollout of identity attention is the identity, a sin-cos table's similarity
grid is symmetric with ones on its diagonal; the recomputed attention is the one the block applies."""

from __future__ import annotations

import torch

from core.models.pos_embed import sincos_pos_embed_2d
from core.models.vit import build_vit
from core.report.vit_inspection import (
    attention_rollout,
    attention_weights,
    block_attention,
    filter_components,
    mean_attention_distance,
    output_token_map,
    patch_distances,
    position_similarity,
)


def test_patch_distances_are_between_patch_centres_in_pixels():
    d = patch_distances((2, 3), 16)
    assert d.shape == (6, 6) and d[0, 1] == 16 and d[0, 3] == 16 and d[0, 4] == torch.tensor(2.0).sqrt() * 16
    assert torch.equal(d, d.T) and torch.all(d.diagonal() == 0)


def test_uniform_attention_spans_the_mean_pairwise_distance_and_self_attention_none():
    distances = patch_distances((3, 3), 8)
    num_prefix, tokens = 1, 1 + 9
    uniform = torch.full((2, 4, tokens, tokens), 1 / tokens)  # the class key's share is left out, the rest renormalised
    assert torch.allclose(mean_attention_distance(uniform, distances, num_prefix), distances.mean().expand(4))
    to_self = torch.eye(tokens).expand(2, 4, tokens, tokens)
    assert torch.all(mean_attention_distance(to_self, distances, num_prefix) == 0)


def test_rollout_of_identity_attention_is_the_identity_and_of_uniform_attention_uniform():
    eye = torch.eye(5).expand(1, 3, 5, 5)
    assert torch.equal(attention_rollout([eye, eye, eye]), torch.eye(5)[None])
    uniform = torch.full((1, 3, 5, 5), 0.2)
    rollout = attention_rollout([uniform, uniform])  # ((U + I) / 2)^2 = 3/4 U + 1/4 I (U U = U)
    assert torch.allclose(rollout[0], 0.75 * uniform[0, 0] + 0.25 * torch.eye(5))
    assert torch.allclose(rollout.sum(dim=-1), torch.ones(1, 5))  # rows stay distributions
    heat = output_token_map(rollout, 1, (2, 2))
    assert heat.shape == (1, 2, 2) and torch.allclose(heat, torch.ones(1, 2, 2))  # every patch reached alike


def test_a_sincos_table_is_most_similar_to_itself_and_symmetric():
    table = sincos_pos_embed_2d(64, (6, 6), 1)  # (1, 1 + 36, 64), the class position first
    sim = position_similarity(table, num_prefix=1)
    assert sim.shape == (36, 36) and torch.allclose(sim, sim.T)
    assert torch.allclose(sim.diagonal(), torch.ones(36)) and torch.all(sim <= 1 + 1e-6)
    assert sim[0, 1] > sim[0, 5]  # a neighbour is more alike than the far end of the row


def test_the_first_filter_component_is_the_one_direction_the_filters_vary_in():
    torch.manual_seed(0)
    direction = torch.randn(3, 4, 4)
    weight = torch.randn(3, 4, 4) + torch.randn(32)[:, None, None, None] * direction  # (32, 3, 4, 4)
    components, share = filter_components(weight, 5)
    assert components.shape == (5, 3, 4, 4) and share[0] > 0.999
    cosine = (components[0].flatten() @ direction.flatten()) / direction.norm()
    assert abs(cosine) > 0.999


def test_the_recomputed_attention_is_what_each_block_applies():
    torch.manual_seed(0)
    vit = build_vit("tiny", img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=4, num_classes=0).eval()
    images = torch.randn(2, 3, 32, 32)
    weights = attention_weights(vit, images)
    assert len(weights) == 3 and weights[0].shape == (2, 4, 17, 17)
    assert torch.allclose(weights[1].sum(dim=-1), torch.ones(2, 4, 17))
    x = vit.norm_pre(vit._pos_embed(vit.patch_embed(images)))
    block = vit.blocks[0]
    y = block.norm1(x)
    v = block.attn.qkv(y).reshape(2, 17, 3, 4, 8).permute(2, 0, 3, 1, 4)[2]  # (B, H, T, hd)
    mixed = (block_attention(block, x) @ v).transpose(1, 2).reshape(2, 17, 32)
    assert torch.allclose(block.attn.proj(mixed), block.attn(y), atol=1e-5)
