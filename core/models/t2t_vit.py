"""T2T-ViT (Yuan et al. 2021, "Tokens-to-Token ViT") as a timm-style model, registered with timm.

A Tokens-to-Token module replaces the ViT patch embedding: three overlapping soft splits (unfolds), with a small
transformer layer (token width 64) between them that models the local structure each split gathered, followed by
re-structurization of the tokens into an image grid. A deep-narrow backbone of timm `Block`s follows, with a class
token and a fixed sin-cos position embedding. Importing this module registers `t2t_vit_14/19/24` (Performer T2T
layers) and `t2t_vit_t_14/19/24` (transformer T2T layers) with timm, so `timm.create_model("t2t_vit_14",
pretrained=True, pretrained_cfg_overlay=dict(file="model.safetensors"))` rebuilds an exported model in plain timm.

The kernel / stride / padding per soft split, the Performer's kernel ratio, the attention scale of the T2T
transformer layer and the widths / depths / heads / MLP ratios follow the authors' code (yitu-opensource/T2T-ViT).

Shape legend:
    B: batch    C: image channels    H, W: image or token-grid sides    N: tokens    K: unfolded patch values
    d: T2T token width (64)    m: Performer random features    D: backbone width
"""

import math
from typing import Literal

import torch
import torch.nn.functional as F
from timm.layers import Mlp, to_2tuple, trunc_normal_
from timm.models import build_model_with_cfg
from timm.models.vision_transformer import Block
from torch import nn

from core.models.pos_embed import sincos_pos_embed_2d
from core.models.registry import imagenet_cfg, register_variants
from core.recipe.geometry import SOFT_SPLITS, soft_split_grid

T2TKind = Literal["performer", "transformer"]
PosEmbedKind = Literal["sincos_1d", "sincos_2d"]


def sincos_pos_embed_1d(embed_dim: int, num_positions: int) -> torch.Tensor:
    """The T2T-ViT authors' fixed table: position i (class token = 0), channel j: sin / cos (even / odd j) of
    i / 10000 ** (2 * (j // 2) / D). Returns (1, num_positions, D) float32."""
    positions = torch.arange(num_positions, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    freqs = 10000 ** (-2 * (torch.arange(embed_dim, dtype=torch.float64) // 2) / embed_dim)  # (D,)
    angles = positions * freqs  # (P, D)
    table = torch.where(torch.arange(embed_dim) % 2 == 0, angles.sin(), angles.cos())
    return table.float().unsqueeze(0)


class TokenTransformer(nn.Module):
    """T2T transformer layer: single-head attention from width `in_dim` to `token_dim`, then an MLP (ratio 1).

    The attention output changes width, so its residual is the attention's own value (as in the paper's code).
    """

    def __init__(self, in_dim: int, token_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(in_dim)
        self.qkv = nn.Linear(in_dim, 3 * token_dim, bias=False)
        self.proj = nn.Linear(token_dim, token_dim)
        # The authors scale logits by the input width (their head_dim = dim // num_heads with dim = in_dim).
        self.scale = in_dim**-0.5
        self.norm2 = nn.LayerNorm(token_dim)
        self.mlp = Mlp(token_dim, token_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, in_dim) -> (B, N, d)."""
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)  # (B, N, d) each
        x = v + self.proj(F.scaled_dot_product_attention(q, k, v, scale=self.scale))
        return x + self.mlp(self.norm2(x))


class TokenPerformer(nn.Module):
    """T2T Performer layer: linear attention with positive orthogonal random features, then an MLP (ratio 1).

    softmax(q k^T) is approximated by phi(q) phi(k)^T with phi(x) = exp(w x - |x|^2 / 2) / sqrt(m), w fixed random
    orthogonal rows scaled by sqrt(m) (a persistent buffer, so an exported model reproduces its outputs).
    """

    def __init__(self, in_dim: int, token_dim: int, kernel_ratio: float = 0.5, eps: float = 1e-8):
        super().__init__()
        self.norm1 = nn.LayerNorm(in_dim)
        self.kqv = nn.Linear(in_dim, 3 * token_dim)
        self.proj = nn.Linear(token_dim, token_dim)
        self.norm2 = nn.LayerNorm(token_dim)
        self.mlp = Mlp(token_dim, token_dim)
        self.eps = eps
        num_features = int(token_dim * kernel_ratio)
        features = nn.init.orthogonal_(torch.empty(num_features, token_dim)) * math.sqrt(num_features)
        self.register_buffer("w", features)  # (m, d)

    def random_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, d) -> (B, N, m) positive features of the softmax kernel, in float32 (exp overflows in half)."""
        x = x.float()
        half_norm = x.pow(2).sum(dim=-1, keepdim=True) / 2  # (B, N, 1)
        return torch.exp(x @ self.w.float().t() - half_norm) / math.sqrt(self.w.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, in_dim) -> (B, N, d)."""
        k, q, v = self.kqv(self.norm1(x)).chunk(3, dim=-1)  # (B, N, d) each
        phi_k, phi_q = self.random_features(k), self.random_features(q)  # (B, N, m)
        normaliser = phi_q @ phi_k.sum(dim=1).unsqueeze(-1)  # (B, N, 1)
        context = phi_k.transpose(1, 2) @ v.float()  # (B, m, d)
        attended = (phi_q @ context) / (normaliser + self.eps)  # (B, N, d)
        x = v + self.proj(attended.to(v.dtype))
        return x + self.mlp(self.norm2(x))


class TokensToToken(nn.Module):
    """Soft split -> [T2T layer -> re-structurization -> soft split] x 2 -> linear projection to the backbone width."""

    def __init__(self, in_chans: int, embed_dim: int, token_dim: int = 64, t2t_kind: T2TKind = "performer"):
        super().__init__()
        layer_cls = {"performer": TokenPerformer, "transformer": TokenTransformer}.get(t2t_kind)
        if layer_cls is None:
            raise ValueError(f"t2t_kind {t2t_kind!r} is not one of 'performer', 'transformer'")
        self.soft_splits = nn.ModuleList(nn.Unfold(k, stride=s, padding=p) for k, s, p in SOFT_SPLITS)
        widths = [in_chans * SOFT_SPLITS[0][0] ** 2] + [token_dim * k**2 for k, _, _ in SOFT_SPLITS[1:]]
        self.layers = nn.ModuleList(layer_cls(width, token_dim) for width in widths[:-1])
        self.project = nn.Linear(widths[-1], embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, N, D), N = product of `soft_split_grid((H, W))`."""
        grid = x.shape[-2:]
        x = self.soft_splits[0](x).transpose(1, 2)  # (B, N0, C * 7 * 7)
        steps = zip(SOFT_SPLITS[:-1], self.layers, self.soft_splits[1:], strict=True)
        for (kernel, stride, padding), layer, split in steps:
            grid = tuple((side + 2 * padding - kernel) // stride + 1 for side in grid)  # after the previous split
            x = layer(x)  # (B, N_i, d)
            x = x.transpose(1, 2).unflatten(2, grid)  # re-structurization: (B, d, H_i, W_i)
            x = split(x).transpose(1, 2)  # (B, N_{i+1}, d * 3 * 3)
        return self.project(x)


class T2TViT(nn.Module):
    """T2T-ViT: Tokens-to-Token module, class token + fixed sin-cos position embedding, `depth` timm Blocks, LN, head.

    The position embedding is a non-persistent buffer computed for `img_size`, so a checkpoint saved at one size
    loads at another (the table is rebuilt, not interpolated).
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "token",
        embed_dim: int = 384,
        depth: int = 14,
        num_heads: int = 6,
        mlp_ratio: float = 3.0,
        qkv_bias: bool = False,
        token_dim: int = 64,
        t2t_kind: T2TKind = "performer",
        pos_embed_kind: PosEmbedKind = "sincos_1d",
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
    ):
        """Builds the model.

        Args:
            img_size: Input resolution (int or (H, W)); fixes the token grid and the position table.
            in_chans: Input image channels.
            num_classes: Classifier outputs; 0 gives no head (`forward` returns pooled features).
            global_pool: "token" (class token) or "avg" (mean of the grid tokens) before the head.
            embed_dim: Backbone width D.
            depth: Backbone blocks.
            num_heads: Attention heads per block.
            mlp_ratio: Block MLP width relative to D.
            qkv_bias: Bias on the blocks' qkv projection (the authors use none).
            token_dim: Width of the T2T layers.
            t2t_kind: "performer" (T2T-ViT) or "transformer" (T2T-ViT_t) T2T layers.
            pos_embed_kind: "sincos_1d" (the authors' table over the token sequence) or "sincos_2d" (MAE's 2-D
                table over grid rows / columns, which keeps its meaning when the grid changes shape).
            drop_rate: Dropout after the position embedding and before the head.
            attn_drop_rate: Attention dropout in the blocks.
            drop_path_rate: Stochastic depth of the last block (linear from 0).
        """
        super().__init__()
        if global_pool not in ("token", "avg"):
            raise ValueError(f"global_pool {global_pool!r} is not one of 'token', 'avg'")
        if pos_embed_kind not in ("sincos_1d", "sincos_2d"):
            raise ValueError(f"pos_embed_kind {pos_embed_kind!r} is not one of 'sincos_1d', 'sincos_2d'")
        self.img_size = to_2tuple(img_size)
        self.grid_size = soft_split_grid(self.img_size)
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1
        self.pos_embed_kind = pos_embed_kind

        self.tokens_to_token = TokensToToken(in_chans, embed_dim, token_dim, t2t_kind)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.register_buffer("pos_embed", self._build_pos_embed(), persistent=False)  # (1, 1 + N, D)
        self.pos_drop = nn.Dropout(drop_rate)
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # linear, as torch.linspace
        self.blocks = nn.Sequential(
            *(
                Block(embed_dim, num_heads, mlp_ratio, qkv_bias=qkv_bias, attn_drop=attn_drop_rate, drop_path=rate)
                for rate in rates
            )
        )
        self.norm = nn.LayerNorm(embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        trunc_normal_(self.cls_token, std=0.02)
        self.apply(_init_weights)

    def _build_pos_embed(self) -> torch.Tensor:
        if self.pos_embed_kind == "sincos_2d":
            return sincos_pos_embed_2d(self.embed_dim, self.grid_size)
        return sincos_pos_embed_1d(self.embed_dim, 1 + self.grid_size[0] * self.grid_size[1])

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"cls_token"}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        """Layer groups for timm's layer decay: stem (T2T + class token) = 0, block i = i + 1, final norm last."""
        return dict(stem=r"^cls_token|^tokens_to_token", blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """Replaces the head with a fresh one of `num_classes` outputs (0: none); optionally changes the pooling."""
        if global_pool is not None:
            if global_pool not in ("token", "avg"):
                raise ValueError(f"global_pool {global_pool!r} is not one of 'token', 'avg'")
            self.global_pool = global_pool
        self.num_classes = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, 1 + N, D), normalised class token then grid tokens."""
        return self.norm(self.blocks(self._embed(x)))

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: list[int],
        *,
        norm: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = True,
    ) -> list[torch.Tensor]:
        """The grid tokens after each block of `indices` (0-based), (B, D, h, w) each, or (B, N, D) with
        `output_fmt` "NLC"; after the final norm with `norm`. The part of timm's ViT method that segmentation heads
        call (`intermediates_only` only)."""
        if not intermediates_only or output_fmt not in ("NCHW", "NLC"):
            raise ValueError("T2T-ViT's forward_intermediates gives the intermediates only, as NCHW or NLC")
        x, outs = self._embed(x), []
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i in indices:
                outs.append((self.norm(x) if norm else x)[:, self.num_prefix_tokens :])  # (B, N, D)
        if output_fmt == "NLC":
            return outs
        return [out.transpose(1, 2).unflatten(2, self.grid_size) for out in outs]  # (B, D, h, w)

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, 1 + N, D): T2T tokens after the class token, position embedding added."""
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(f"input size {tuple(x.shape[-2:])} does not match the model's img_size {self.img_size}")
        x = self.tokens_to_token(x)  # (B, N, D)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, 1 + N, D)
        return self.pos_drop(x + self.pos_embed.to(x.dtype))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """(B, 1 + N, D) -> (B, num_classes), or the pooled (B, D) with `pre_logits`."""
        x = x[:, 1:].mean(dim=1) if self.global_pool == "avg" else x[:, 0]
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def _drop_fixed_tables(state_dict: dict[str, torch.Tensor], model: T2TViT) -> dict[str, torch.Tensor]:
    """The position table is rebuilt for the model's img_size; a checkpoint that stored one (the authors' code
    saves it) must not overwrite it."""
    return {k: v for k, v in state_dict.items() if k != "pos_embed"}


def _cfg() -> dict:
    return imagenet_cfg(
        crop_pct=0.9,
        interpolation="bicubic",
        first_conv=None,  # the first layer is a Linear over unfolded patches, not a conv timm could adapt
        classifier="head",
    )


# Width, depth, heads, MLP ratio per variant (the T2T-ViT paper's Table 1 / the authors' code).
VARIANTS: dict[str, dict] = {
    "t2t_vit_14": dict(embed_dim=384, depth=14, num_heads=6, mlp_ratio=3.0, t2t_kind="performer"),
    "t2t_vit_19": dict(embed_dim=448, depth=19, num_heads=7, mlp_ratio=3.0, t2t_kind="performer"),
    "t2t_vit_24": dict(embed_dim=512, depth=24, num_heads=8, mlp_ratio=3.0, t2t_kind="performer"),
    "t2t_vit_t_14": dict(embed_dim=384, depth=14, num_heads=6, mlp_ratio=3.0, t2t_kind="transformer"),
    "t2t_vit_t_19": dict(embed_dim=448, depth=19, num_heads=7, mlp_ratio=3.0, t2t_kind="transformer"),
    "t2t_vit_t_24": dict(embed_dim=512, depth=24, num_heads=8, mlp_ratio=3.0, t2t_kind="transformer"),
}
default_cfgs = {name: _cfg() for name in VARIANTS}  # timm's register_model reads the module's `default_cfgs`


def _create(variant: str, pretrained: bool, **kwargs) -> T2TViT:
    """Builds a variant; explicit kwargs (e.g. depth for a tiny test model) override the variant's."""
    return build_model_with_cfg(
        T2TViT, variant, pretrained, pretrained_filter_fn=_drop_fixed_tables, **{**VARIANTS[variant], **kwargs}
    )


register_variants(__name__, VARIANTS, _create)
