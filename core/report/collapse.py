"""Label-free signals of representation quality: RankMe's effective rank (Garrido et al. 2023) and the spread of
normalised features (SimSiam's collapse check), computed from features alone.

    effective rank   exp(entropy of p), p_k = s_k / sum(s) + eps over the singular values s of the (N, D) features:
                     1 when every image maps to one direction, min(N, D) when the features use every direction alike
    feature std      per dimension, the standard deviation over the images of the L2-normalised features, averaged
                     over the dimensions: 0 for a collapsed encoder, about 1 / sqrt(D) for features spread evenly on
                     the sphere (reported times sqrt(D), so that 1 means that)

Shapes: N images, D feature width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

EPS = 1e-7  # RankMe's epsilon in p_k


def effective_rank(features: torch.Tensor) -> float:
    """RankMe of (N, D) features."""
    singular = torch.linalg.svdvals(features.double())
    p = singular / singular.sum().clamp(min=1e-300) + EPS
    return float(torch.exp(-(p * p.log()).sum()))


def normalised_std(features: torch.Tensor) -> float:
    """Mean over dimensions of the per-dimension std of the L2-normalised (N, D) features, times sqrt(D)."""
    unit = F.normalize(features.double(), dim=-1)
    return float(unit.std(dim=0, unbiased=False).mean()) * math.sqrt(features.shape[1])
