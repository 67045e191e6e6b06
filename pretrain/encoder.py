"""What the masked-image objectives share about their timm ViT encoder: the layout they rely on, and the pass from
patch tokens the objective has already changed (MAE drops the masked ones, BEiT-style prediction corrupts them) to
the encoder's output.

Shape legend:
    B: batch    L': patch tokens the objective passes (all L patches, or the visible ones)    D: encoder width
"""

import torch
from timm.models import checkpoint_seq
from timm.models.vision_transformer import VisionTransformer


def check_encoder(encoder: VisionTransformer, objective: str, *, token_pool: bool = False) -> None:
    """Raises ValueError, naming `objective` and every problem, unless the encoder has a class token, no register
    tokens, no head and a fixed-size learnable position embedding that covers the class token (`forward_encoder`
    relies on all of them); with `token_pool`, global_pool must also be 'token'."""
    problems = []
    if not encoder.has_class_token:
        problems.append("class_token must be True")
    if encoder.num_reg_tokens:
        problems.append(f"reg_tokens must be 0, got {encoder.num_reg_tokens}")
    if token_pool and encoder.global_pool != "token":
        problems.append(f"global_pool must be 'token', got {encoder.global_pool!r}")
    if encoder.num_classes:
        problems.append(f"num_classes must be 0, got {encoder.num_classes}")
    if encoder.pos_embed is None or encoder.no_embed_class:
        problems.append("needs a learnable pos_embed that covers the class token (pos_embed='learn', no_embed_class)")
    if encoder.dynamic_img_size:
        problems.append("dynamic_img_size must be False")
    if problems:
        raise ValueError(f"{objective} encoder: " + "; ".join(problems))


def patch_positions(encoder: VisionTransformer) -> torch.Tensor:
    """(1, L, D) position embedding of the patches (the class token's left out)."""
    return encoder.pos_embed[:, encoder.num_prefix_tokens :]


def forward_encoder(encoder: VisionTransformer, x: torch.Tensor) -> torch.Tensor:
    """Runs the timm encoder's own modules on the class token plus the given patch tokens.

    Args:
        encoder: A ViT that passed `check_encoder`.
        x: (B, L', D) patch tokens, position embedding (`patch_positions`) added.

    Returns:
        (B, 1 + L', D) the final norm's output, class token first.
    """
    cls_token = encoder.cls_token + encoder.pos_embed[:, : encoder.num_prefix_tokens]  # (1, 1, D)
    x = torch.cat([cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)  # (B, 1 + L', D)
    x = encoder.norm_pre(encoder.pos_drop(x))
    x = checkpoint_seq(encoder.blocks, x) if encoder.grad_checkpointing else encoder.blocks(x)
    return encoder.norm(x)
