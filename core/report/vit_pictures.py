"""The ViT paper's four inspection pictures (core/report/vit_inspection.py computes what they show), each a
(3, H, W) float picture in [0, 1] for TensorBoard or a PNG.

Shapes: B images, L layers, H heads, gh x gw the patch grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torchvision
from timm.layers import PatchEmbed
from timm.models.vision_transformer import VisionTransformer

from core.report.pictures import image_grid, labelled_matrix, upscale_nearest
from core.report.vit_inspection import (
    attention_rollout,
    attention_weights,
    filter_components,
    mean_attention_distance,
    output_token_map,
    patch_distances,
    position_similarity,
)

LOW = torch.tensor([0.07, 0.04, 0.35])  # dark blue: the low end of every colour ramp here
HIGH = torch.tensor([0.99, 0.91, 0.15])  # yellow: the high end
FILTERS_PER_ROW = 7  # the ViT paper's figure shows 28 components in 4 rows of 7
NUM_COMPONENTS = 28  # its figure 7 (left)


def ramp(values: torch.Tensor) -> torch.Tensor:
    """(...) values in [0, 1] -> (..., 3) colours from `LOW` to `HIGH`."""
    v = values.clamp(0, 1)[..., None]
    return LOW + (HIGH - LOW) * v


def filters_picture(components: torch.Tensor) -> torch.Tensor:
    """(K, 3, p, p) principal components -> a grid of them, each stretched to its own range (they are directions:
    their sign and scale carry no meaning)."""
    flat = components.flatten(1)
    low, high = flat.amin(dim=1), flat.amax(dim=1)
    scaled = (flat - low[:, None]) / (high - low).clamp(min=1e-12)[:, None]
    tiles = upscale_nearest(scaled.view_as(components), min_side=28)
    return torchvision.utils.make_grid(tiles, nrow=FILTERS_PER_ROW, padding=2, pad_value=1.0)


def similarity_picture(similarity: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """(N, N) position-embedding cosine similarity -> a gh x gw grid of tiles, tile (r, c) showing patch (r, c)'s
    similarity with every patch as a gh x gw map: the ViT paper's figure 7 (centre). Colours run from the lowest
    similarity in the matrix (dark blue) to the highest (yellow, 1 on the diagonal): a fixed sin-cos table's
    similarities all lie near 1, which a -1..1 scale would paint one colour."""
    low = similarity.min()
    tiles = ramp((similarity - low) / (similarity.max() - low).clamp(min=1e-12))
    tiles = tiles.view(-1, *grid, 3).permute(0, 3, 1, 2)  # (N, 3, gh, gw)
    tiles = upscale_nearest(tiles, min_side=16)
    return torchvision.utils.make_grid(tiles, nrow=grid[1], padding=1, pad_value=1.0)


def distance_picture(distances: torch.Tensor, patch: int) -> torch.Tensor:
    """(L, H) mean attention distances in pixels -> a layers x heads chart, each cell coloured by its distance and
    labelled with it (the ViT paper's figure 7, right, as a table)."""
    top = float(distances.max()) or 1.0
    layers, heads = distances.shape
    text = [[f"{d:.0f}" for d in row] for row in distances.tolist()]
    return labelled_matrix(
        ramp(distances / top), text, row_labels=[f"block {i + 1}" for i in range(layers)],
        col_labels=[f"head {j + 1}" for j in range(heads)], row_title="block", col_title="head",
        title=f"mean attention distance (px; patch {patch} px)", scale=(LOW, HIGH),
    )  # fmt: skip


def rollout_picture(images: torch.Tensor, heat: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) images in [0, 1] and (B, gh, gw) rollout maps in [0, 1] -> image | the image weighted by what
    reaches the output token (the ViT paper's figure 6)."""
    weight = F.interpolate(heat[:, None], size=images.shape[-2:], mode="bilinear", align_corners=False)
    return image_grid([images, images * weight.clamp(0, 1)], ["image", "attention rollout"])


@torch.no_grad()
def inspection(vit: VisionTransformer, images: torch.Tensor, mean, std) -> tuple[dict[str, torch.Tensor], dict]:
    """The four pictures of a plain ViT on normalised `images` (B, 3, H, W), and the numbers behind them.

    Returns:
        ({name: (3, H, W) picture} for filters, position_similarity, attention_distance, attention_rollout, and
        {"grid", "patch", "images", "filter_variance_share", "mean_attention_distance_px" [block][head],
        "position_similarity" N x N}).
    """
    grid, patch = tuple(vit.patch_embed.grid_size), vit.patch_embed.patch_size[0]
    num_prefix = vit.num_prefix_tokens
    attentions = attention_weights(vit, images.to(vit.patch_embed.proj.weight.dtype))
    distances = patch_distances(grid, patch).to(images.device)
    per_block = torch.stack([mean_attention_distance(a, distances, num_prefix) for a in attentions]).cpu()  # (L, H)
    components, shares = filter_components(vit.patch_embed.proj.weight, NUM_COMPONENTS)
    similarity = position_similarity(vit.pos_embed, 0 if vit.no_embed_class else num_prefix).cpu()
    heat = output_token_map(attention_rollout(attentions), num_prefix, grid).cpu()
    shown = images.float().cpu() * torch.tensor(std)[:, None, None] + torch.tensor(mean)[:, None, None]
    pictures = {
        "filters": filters_picture(components.cpu()),
        "position_similarity": similarity_picture(similarity, grid),
        "attention_distance": distance_picture(per_block, patch),
        "attention_rollout": rollout_picture(shown.clamp(0, 1), heat),
    }
    numbers = {
        "grid": list(grid), "patch": patch, "images": len(images), "filter_variance_share": shares.tolist(),
        "mean_attention_distance_px": per_block.tolist(), "position_similarity": similarity.tolist(),
    }  # fmt: skip
    return pictures, numbers


def inspectable(module: torch.nn.Module) -> bool:
    """Whether `module` is a plain ViT with patch and position embeddings (what `inspection` reads)."""
    return (
        isinstance(module, VisionTransformer)
        and isinstance(module.patch_embed, PatchEmbed)
        and module.pos_embed is not None
    )
