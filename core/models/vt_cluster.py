"""VT's clustering-based tokenizer (Wu et al. 2020): each image's own concepts, found by k-means, as the filters.

The filter-based tokenizer attends with the same learned filters W_A for every image. The clustering tokenizer takes
them from the image instead: its feature-map pixels, normalised to unit vectors, are clustered by spherical k-means
into L centres, and the centres stand where W_A stood:

    A = softmax_HW(X K^T),   T = A^T X W_V        (K: the L unit centres (L, C); X the pixels (HW, C))

The centres start from the feature map downsampled (area average) to a rows x cols grid of L positions, each
normalised (`centre_grid`: 4 x 4 for L = 16, the squarest factorisation otherwise, e.g. 2 x 4 for 8); then
`iterations` Lloyd steps: each pixel joins the centre of largest cosine similarity (the first on a tie), each centre
becomes its pixels' mean, normalised again; a centre no pixel joined stays where it was. k-means is not
differentiable: the centres carry no gradient, which flows through X in A and in the weighted sum. Every image of a
batch is clustered at once by batched tensor operations (no Python loop over images), and the centres are a
deterministic function of the input.

Shapes: B batch, C feature channels, h/w the feature map, HW its pixels, L tokens (centres), T token width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

KMEANS_ITERATIONS = 3
"""Lloyd steps after the initialisation ("a few": the assignments of a small map settle within them)."""


def centre_grid(num_tokens: int) -> tuple[int, int]:
    """The (rows, cols) grid the centres are initialised on: rows the largest divisor of L not above sqrt(L)."""
    rows = max(d for d in range(1, math.isqrt(num_tokens) + 1) if num_tokens % d == 0)
    return rows, num_tokens // rows


@torch.no_grad()
def kmeans_centres(x: torch.Tensor, grid: tuple[int, int], num_tokens: int, iterations: int) -> torch.Tensor:
    """Spherical k-means of each image's pixels.

    Args:
        x: (B, HW, C) pixels of (h, w) = `grid` feature maps.
        grid: The map's (h, w).
        num_tokens: L centres.
        iterations: Lloyd steps after the initialisation (0: the downsampled map's positions).

    Returns:
        (B, L, C) unit centres in x's dtype, row-major over `centre_grid(L)` before the Lloyd steps move them.
    """
    b, _, c = x.shape
    rows, cols = centre_grid(num_tokens)
    unit = F.normalize(x.float(), dim=-1)  # (B, HW, C)
    pooled = F.adaptive_avg_pool2d(x.float().transpose(1, 2).reshape(b, c, *grid), (rows, cols))  # (B, C, rows, cols)
    centres = F.normalize(pooled.flatten(2).transpose(1, 2), dim=-1)  # (B, L, C)
    for _ in range(iterations):
        nearest = (unit @ centres.transpose(1, 2)).argmax(dim=-1)  # (B, HW): cosine similarity of unit vectors
        members = F.one_hot(nearest, num_tokens).to(unit.dtype)  # (B, HW, L)
        sums = members.transpose(1, 2) @ unit  # (B, L, C)
        joined = members.sum(dim=1)[..., None] > 0  # (B, L, 1)
        centres = torch.where(joined, F.normalize(sums, dim=-1), centres)
    return centres.to(x.dtype)


class ClusterTokenizer(nn.Module):
    """Spatial attention from the pixels to L token slots whose filters are the image's own k-means centres.

    Args:
        channels: C.
        token_dim: T (W_V maps C to T; none when they agree).
        num_tokens: L.
        iterations: Lloyd steps.
    """

    def __init__(self, channels: int, token_dim: int, num_tokens: int, iterations: int = KMEANS_ITERATIONS):
        super().__init__()
        self.num_tokens, self.iterations = num_tokens, iterations
        self.value = nn.Linear(channels, token_dim, bias=False) if channels != token_dim else nn.Identity()

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """x (B, HW, C) of an (h, w) = `grid` map -> tokens (B, L, T)."""
        centres = kmeans_centres(x, grid, self.num_tokens, self.iterations)  # (B, L, C), no gradient
        attention = (x @ centres.transpose(1, 2)).softmax(dim=1)  # (B, HW, L), over the pixels
        return self.value(attention.transpose(1, 2) @ x)  # (B, L, C) -> (B, L, T)
