"""What a ViT learned, as the ViT paper's "Inspecting Vision Transformer" shows it (section 4.5, figures 7 and 14):
the principal components of the patch-embedding filters, the cosine similarity of every position embedding with every
other, the mean attention distance of every head in every layer, and attention rollout from the output token.

Attention weights are recomputed from each block's own qkv projection in an eager pass (`attention_weights`): the
fused SDPA kernel, a compiled block or a ZeRO-3 partition never expose them. Distances are in input pixels between
patch centres; attention to the prefix (class) tokens, which have no place in the image, is left out of the distance
and the rest renormalised. Rollout (Abnar & Zuidema 2020, as the ViT paper uses it): per layer the heads' mean
attention, half of it replaced by the identity for the residual connection, multiplied through the layers.

Shapes: B images, H heads, T tokens (P prefix + N patches), gh x gw the patch grid, D width, C input channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn


def filter_components(weight: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The principal components of the D patch-embedding filters.

    Args:
        weight: (D, C, p, p) the patch projection's kernels.
        count: How many components (at most min(D, C p p)).

    Returns:
        (count, C, p, p) unit-norm components, largest variance first, and (count,) the share of the filters' variance
        each explains.
    """
    flat = weight.detach().float().flatten(1)  # (D, C p p)
    centred = flat - flat.mean(dim=0, keepdim=True)
    _, singular, directions = torch.linalg.svd(centred, full_matrices=False)
    variance = singular**2
    count = min(count, directions.shape[0])
    return directions[:count].reshape(count, *weight.shape[1:]), variance[:count] / variance.sum()


def position_similarity(pos_embed: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """(1, P + N, D) or (1, N, D) position table -> (N, N) cosine similarity of the patches' embeddings."""
    patches = F.normalize(pos_embed.detach().float()[0, num_prefix:], dim=-1)  # (N, D)
    return patches @ patches.T


def block_attention(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The attention weights a timm ViT block computes on its input x (B, T, D): (B, H, T, T), each row summing
    to 1, from its own norm1, qkv, q_norm / k_norm and scale."""
    attn = block.attn
    b, t, _ = x.shape
    qkv = attn.qkv(block.norm1(x)).reshape(b, t, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])  # (B, H, T, hd)
    return ((q * attn.scale) @ k.transpose(-2, -1)).float().softmax(dim=-1)


@torch.no_grad()
def attention_weights(vit: VisionTransformer, images: torch.Tensor) -> list[torch.Tensor]:
    """Every block's attention (B, H, T, T) on normalised `images` (B, C, H, W), in an eager pass."""
    x = vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(images))))
    weights = []
    for block in vit.blocks:
        weights.append(block_attention(block, x))
        x = block(x)
    return weights


def patch_distances(grid: tuple[int, int], patch: int) -> torch.Tensor:
    """(N, N) Euclidean distances in pixels between the centres of an (gh, gw) grid's patches of side `patch`."""
    rows, cols = torch.meshgrid(torch.arange(grid[0]), torch.arange(grid[1]), indexing="ij")
    centres = torch.stack([rows.flatten(), cols.flatten()], dim=1).float() * patch  # (N, 2)
    return torch.cdist(centres, centres)


def mean_attention_distance(attention: torch.Tensor, distances: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """(B, H, T, T) attention, (N, N) patch distances -> (H,): per head, the attention-weighted distance from each
    patch query to the patch keys (prefix keys left out, the rest renormalised), averaged over queries and images."""
    patches = attention[:, :, num_prefix:, num_prefix:]  # (B, H, N, N)
    patches = patches / patches.sum(dim=-1, keepdim=True).clamp(min=1e-12)
    return (patches * distances).sum(dim=-1).mean(dim=(0, 2))


def attention_rollout(attentions: list[torch.Tensor]) -> torch.Tensor:
    """Layers' (B, H, T, T) -> (B, T, T): the heads' mean, (A + I) / 2 for the residual, multiplied from the first
    layer to the last (row t: how much each input token reaches output token t)."""
    rollout = None
    for attention in attentions:
        mixed = 0.5 * attention.mean(dim=1) + 0.5 * torch.eye(attention.shape[-1], device=attention.device)
        rollout = mixed if rollout is None else mixed @ rollout
    return rollout


def output_token_map(rollout: torch.Tensor, num_prefix: int, grid: tuple[int, int]) -> torch.Tensor:
    """(B, T, T) rollout -> (B, gh, gw) in [0, 1]: the class token's row over the patches (the patch rows' mean for
    an encoder without prefix tokens), scaled to its maximum per image."""
    rows = rollout[:, 0, num_prefix:] if num_prefix else rollout.mean(dim=1)  # (B, N)
    rows = rows / rows.amax(dim=1, keepdim=True).clamp(min=1e-12)
    return rows.reshape(-1, *grid)
