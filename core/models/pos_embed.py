"""The fixed 2-D sin-cos position embedding (MAE's layout), shared by the ViT objectives, T2T-ViT and the hand-off.

Shape legend:
    D: embedding width    gh, gw: patch grid rows, columns    N: gh * gw patches    P: prefix (cls) tokens
"""

from __future__ import annotations

import torch


def sincos_pos_embed_2d(embed_dim: int, grid_size: tuple[int, int], num_prefix_tokens: int = 1) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding with MAE's layout.

    Patches are numbered row-major. The first half of the channels encodes the column index, the second half the
    row index; each half is [sin(pos * w_k) for k] followed by [cos(pos * w_k) for k], with
    w_k = 10000 ** (-k / (embed_dim / 4)), k = 0 .. embed_dim / 4 - 1. Prefix tokens get zeros.

    Args:
        embed_dim: Channels D; must be divisible by 4.
        grid_size: (gh, gw) patch grid.
        num_prefix_tokens: Leading zero rows for cls/register tokens.

    Returns:
        (1, P + gh * gw, D) float32 tensor.
    """
    if embed_dim % 4:
        raise ValueError(f"embed_dim {embed_dim} must be divisible by 4 for a 2-D sin-cos position embedding")
    num_freqs = embed_dim // 4
    freqs = 1.0 / 10000 ** (torch.arange(num_freqs, dtype=torch.float64) / num_freqs)  # (D/4,)
    rows, cols = torch.meshgrid(
        torch.arange(grid_size[0], dtype=torch.float64), torch.arange(grid_size[1], dtype=torch.float64), indexing="ij"
    )  # (gh, gw) each

    def encode(positions: torch.Tensor) -> torch.Tensor:
        angles = positions.reshape(-1, 1) * freqs  # (N, D/4)
        return torch.cat([angles.sin(), angles.cos()], dim=1)  # (N, D/2)

    patches = torch.cat([encode(cols), encode(rows)], dim=1)  # (N, D)
    prefix = torch.zeros(num_prefix_tokens, embed_dim, dtype=torch.float64)  # (P, D)
    return torch.cat([prefix, patches], dim=0).float().unsqueeze(0)  # (1, P + N, D)
