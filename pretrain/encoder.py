"""What the masked-image objectives share about their encoder (a timm ViT, hybrid included, or a T2T-ViT): the
layout they rely on, the token grid before the position embedding, and the pass from tokens the objective has
already changed (MAE drops the masked ones, BEiT-style prediction and SimMIM corrupt them) to the encoder's output.

The encoder's prefix tokens (P: the class token, then timm's register tokens, `model.reg_tokens`) go in front of
the patch tokens with their own positions, as timm's `_pos_embed` puts them: never masked, and the objectives decode
only the patch tokens after them.

Shape legend:
    B: batch    L': patch tokens the objective passes (all L patches, or the visible ones)    D: encoder width
    P: prefix tokens (1 + register tokens)
"""

import torch
from timm.models import checkpoint_seq
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from core.models.pos_embed import sincos_pos_embed_2d
from core.models.t2t_vit import T2TViT


def check_encoder(
    encoder: VisionTransformer | T2TViT, objective: str, *, token_pool: bool = False, class_token: bool = True
) -> None:
    """Raises ValueError, naming `objective` and every problem, unless the encoder has a class token (none, with
    `class_token` False), no head and a fixed-size position embedding that covers the prefix tokens (class and
    register tokens: `forward_encoder` relies on all of them); with `token_pool`, global_pool must also be 'token'. A
    T2T-ViT always has that layout."""
    if isinstance(encoder, T2TViT):
        if encoder.num_classes:
            raise ValueError(f"{objective} encoder: num_classes must be 0, got {encoder.num_classes}")
        return
    if not isinstance(encoder, VisionTransformer):
        raise ValueError(f"{objective} needs a timm VisionTransformer or T2TViT encoder, got {type(encoder).__name__}")
    problems = []
    if encoder.has_class_token != class_token:
        problems.append(f"class_token must be {class_token}")
    if token_pool and encoder.global_pool != "token":
        problems.append(f"global_pool must be 'token', got {encoder.global_pool!r}")
    if encoder.num_classes:
        problems.append(f"num_classes must be 0, got {encoder.num_classes}")
    if encoder.pos_embed is None or (encoder.no_embed_class and encoder.num_prefix_tokens):
        problems.append(
            "needs a learnable pos_embed that covers the prefix tokens (pos_embed='learn', no_embed_class False)"
        )
    if encoder.dynamic_img_size:
        problems.append("dynamic_img_size must be False")
    if problems:
        raise ValueError(f"{objective} encoder: " + "; ".join(problems))


def embed_tokens(encoder: VisionTransformer | T2TViT, imgs: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) images -> (B, L, D) grid tokens before the position embedding: the patch embedding (a hybrid's
    ResNet + projection included) or T2T's tokens-to-token module."""
    if isinstance(encoder, T2TViT):
        return encoder.tokens_to_token(imgs)
    return encoder.patch_embed(imgs)


def token_grid(encoder: VisionTransformer | T2TViT) -> tuple[int, int]:
    """(gh, gw): the grid `embed_tokens` returns, row-major."""
    return tuple(encoder.grid_size if isinstance(encoder, T2TViT) else encoder.patch_embed.grid_size)


def patch_positions(encoder: VisionTransformer) -> torch.Tensor:
    """(1, L, D) position embedding of the patches (the prefix tokens' left out)."""
    return encoder.pos_embed[:, encoder.num_prefix_tokens :]


def prefix_tokens(encoder: VisionTransformer | T2TViT) -> torch.Tensor:
    """(1, P, D) the class token, then the register tokens, each with its position added (timm's order); (1, 0, D)
    for an encoder with neither (I-JEPA's)."""
    registers = getattr(encoder, "reg_token", None)  # (1, R, D); None without registers, and on T2T-ViT
    tokens = [t for t in (encoder.cls_token, registers) if t is not None]
    if not tokens:
        return encoder.pos_embed[:, :0]
    tokens = tokens[0] if len(tokens) == 1 else torch.cat(tokens, dim=1)
    return tokens + encoder.pos_embed[:, : encoder.num_prefix_tokens]


def forward_encoder(encoder: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """Runs the timm encoder's own modules on the prefix tokens (class, registers) plus the given patch tokens.

    Args:
        encoder: A ViT that passed `check_encoder`.
        x: (B, L', D) patch tokens, position embedding (`patch_positions`) added.

    Returns:
        (B, P + L', D) the final norm's output, class token first, then the registers, then the patches.
    """
    prefix = prefix_tokens(encoder)  # (1, P, D)
    x = torch.cat([prefix.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)  # (B, P + L', D)
    x = encoder.pos_drop(x)
    if isinstance(encoder, VisionTransformer):  # T2T-ViT has no pre-norm and no gradient checkpointing
        x = encoder.norm_pre(x)
    x = checkpoint_seq(encoder.blocks, x) if getattr(encoder, "grad_checkpointing", False) else encoder.blocks(x)
    return encoder.norm(x)


@torch.no_grad()
def init_layer(module: nn.Module) -> None:
    """MAE's initialisation of one module's own weights: xavier-uniform Linear with a zero bias, unit LayerNorm. An
    `apply` function, as every objective's init is: under ZeRO-3, zero.Init lends each module its full weights in
    turn (core/engine/zero_init.py)."""
    if isinstance(module, nn.Linear):
        nn.init.xavier_uniform_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


@torch.no_grad()
def init_embedding(module: nn.Module, encoder: VisionTransformer, grid: tuple[int, int]) -> None:
    """MAE's initialisation of `encoder`'s embedding, for `module` its patch projection or the encoder itself (an
    `apply` function): the projection xavier-uniform as a (D, C*ph*pw) Linear; fixed 2-D sin-cos positions on `grid`;
    N(0, 0.02) class token, then register tokens (drawn after the class token: an encoder without registers draws as
    before). Other modules are left alone."""
    if module is encoder.patch_embed.proj:  # (D, C, ph, pw)
        nn.init.xavier_uniform_(module.weight.view(module.weight.shape[0], -1))
    elif module is encoder:
        encoder.pos_embed.copy_(sincos_pos_embed_2d(encoder.pos_embed.shape[-1], grid, encoder.num_prefix_tokens))
        if encoder.cls_token is not None:
            nn.init.normal_(encoder.cls_token, std=0.02)
        if encoder.reg_token is not None:
            nn.init.normal_(encoder.reg_token, std=0.02)
