"""VT-ResNet (Wu et al. 2020, "Visual Transformers: Token-based Image Representation and Processing for Computer
Vision") as a timm-style model, registered with timm.

A ResNet keeps its stem and its first three residual stages (timm's blocks, timm's parameter names, so an ImageNet
ResNet's weights load into them); the last stage is replaced by VT modules. Each module turns the 14 x 14 feature
map (at 224 px) into L = 16 visual tokens by spatial attention (a tokenizer), relates the tokens with a transformer
(token width 1024), and, except in the last module, projects them back onto the feature map as a residual. The
classifier averages the final tokens. Importing this module registers `vt_resnet18/34/50/101`.

Equations (X: pixels (HW, C), T: tokens (L, C_T)), as in the paper, with the changes noted:
    filter-based tokenizer (first module):  A = softmax_HW(X W_A),  T = A^T X W_V
    clustering tokenizer (first module, `tokenizer="cluster"`): W_A replaced by the image's own k-means centres
                                            (core/models/vt_cluster.py)
    recurrent tokenizer (later modules):    W_R = T_in W_TR,  A = softmax_HW(X W_R^T),  T = A^T X W_V
    transformer:   T' = T + softmax_L((T K)(T Q)^T / sqrt(C_T / 2)) T,   T_out = T' + relu(T' F1) F2
    projector:     X_out = X + softmax_L((X W_Q)(T W_K)^T / sqrt(C)) T W_V'
W_V and W_V' map between the feature and token widths and are identities when they are equal (the paper's
equations have none). Changes: LayerNorm before the transformer's attention and MLP, and the 1/sqrt(d) logit scales,
which keep a from-scratch run stable; the last module has no projector since its feature map is never used.

Shape legend:
    B: batch    C: feature channels    H, W: feature-map sides    L: visual tokens (16)    T: token width C_T
"""

from typing import Literal

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from timm.models import build_model_with_cfg
from timm.models.resnet import BasicBlock, Bottleneck, make_blocks
from torch import nn

from core.models.registry import imagenet_cfg, register_variants
from core.models.vt_cluster import ClusterTokenizer


def _projection(in_dim: int, out_dim: int) -> nn.Module:
    """A bias-free linear map between widths, or nothing when they agree."""
    return nn.Linear(in_dim, out_dim, bias=False) if in_dim != out_dim else nn.Identity()


class Tokenizer(nn.Module):
    """Spatial attention from the pixels to L token slots: filter-based (fixed W_A) or recurrent (W_R from the
    previous module's tokens)."""

    def __init__(self, channels: int, token_dim: int, num_tokens: int, recurrent: bool):
        super().__init__()
        self.recurrent = recurrent
        if recurrent:
            self.token_to_filter = nn.Linear(token_dim, channels, bias=False)  # W_TR: (C_T -> C)
        else:
            self.filters = nn.Linear(channels, num_tokens, bias=False)  # W_A: (C -> L)
        self.value = _projection(channels, token_dim)  # W_V: (C -> C_T)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None) -> torch.Tensor:
        """x (B, HW, C), previous tokens (B, L, C_T) or None -> tokens (B, L, C_T)."""
        logits = x @ self.token_to_filter(tokens).transpose(1, 2) if self.recurrent else self.filters(x)  # (B, HW, L)
        attention = logits.softmax(dim=1)  # over pixels: each token is a weighted average of the map
        return self.value(attention.transpose(1, 2) @ x)  # (B, L, C) -> (B, L, C_T)


class TokenTransformer(nn.Module):
    """The paper's token transformer: single-head attention whose values are the tokens themselves, then an MLP."""

    def __init__(self, token_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(token_dim)
        self.key = nn.Linear(token_dim, token_dim // 2, bias=False)
        self.query = nn.Linear(token_dim, token_dim // 2, bias=False)
        self.norm2 = nn.LayerNorm(token_dim)
        self.fc1 = nn.Linear(token_dim, token_dim)
        self.fc2 = nn.Linear(token_dim, token_dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, L, C_T) -> (B, L, C_T)."""
        t = self.norm1(tokens)
        tokens = tokens + F.scaled_dot_product_attention(self.query(t), self.key(t), t)
        return tokens + self.fc2(F.relu(self.fc1(self.norm2(tokens))))


class Projector(nn.Module):
    """Each pixel attends over the tokens and adds what it reads to its features (residual).

    The logits (X W_Q)(T W_K)^T are computed as X ((T W_K) W_Q^T)^T: W_Q is folded into the L keys instead of being
    applied to the HW pixels. Same parameters and the same values up to rounding, but at 224 px and C = 1024
    (VT-R50/101) it is 2 x 16 x C^2 = 34M multiply-adds per projector instead of 196 x C^2 = 206M."""

    def __init__(self, channels: int, token_dim: int):
        super().__init__()
        self.query = nn.Linear(channels, channels, bias=False)  # W_Q
        self.key = nn.Linear(token_dim, channels, bias=False)  # W_K
        self.value = _projection(token_dim, channels)  # W_V'

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """x (B, HW, C), tokens (B, L, C_T) -> (B, HW, C)."""
        keys = self.key(tokens) @ self.query.weight  # (B, L, C): (T W_K) W_Q^T, as nn.Linear stores W_Q^T
        return x + F.scaled_dot_product_attention(x, keys, self.value(tokens))


class VTModule(nn.Module):
    """Tokenizer -> transformer -> projector (the projector is left out in the last module). The first module's
    tokenizer is filter-based, or with `cluster` the clustering-based one (core/models/vt_cluster.py)."""

    def __init__(
        self, channels: int, token_dim: int, num_tokens: int, recurrent: bool, project: bool, cluster: bool = False
    ):
        super().__init__()
        if cluster:
            self.tokenizer = ClusterTokenizer(channels, token_dim, num_tokens)
        else:
            self.tokenizer = Tokenizer(channels, token_dim, num_tokens, recurrent)
        self.transformer = TokenTransformer(token_dim)
        self.projector = Projector(channels, token_dim) if project else None

    def forward(
        self, x: torch.Tensor, tokens: torch.Tensor | None, grid: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, HW, C) of an (h, w) = `grid` map, previous tokens or None -> (new x (B, HW, C), tokens (B, L, C_T))."""
        clustered = isinstance(self.tokenizer, ClusterTokenizer)  # its filters come from x on `grid`, not from tokens
        tokens = self.transformer(self.tokenizer(x, grid) if clustered else self.tokenizer(x, tokens))
        return (self.projector(x, tokens) if self.projector is not None else x), tokens


class VTResNet(nn.Module):
    """ResNet stem + stages 1-3 (timm names: conv1, bn1, layer1-3), VT modules as `layer4`, token average -> fc."""

    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: tuple[int, int, int],
        num_vt_modules: int,
        img_size: int | tuple[int, int] = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: Literal["avg"] = "avg",
        num_tokens: int = 16,
        token_dim: int = 1024,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        zero_init_last: bool = True,
        tokenizer: Literal["filter", "cluster"] = "filter",
    ):
        """Builds the model.

        Args:
            block: timm's BasicBlock (ResNet-18/34) or Bottleneck (ResNet-50/101).
            layers: Residual blocks in stages 1-3.
            num_vt_modules: VT modules replacing stage 4 (the paper's "stage 5").
            img_size: Nominal input size (recorded for timm; the model has no position table and takes any size
                whose stride-16 map is at least 1 x 1).
            in_chans: Input image channels.
            num_classes: Classifier outputs; 0 gives no classifier.
            global_pool: Only "avg" (the paper averages the visual tokens).
            num_tokens: Visual tokens L.
            token_dim: Token width C_T.
            drop_rate: Dropout before the classifier.
            drop_path_rate: Stochastic depth of the last residual block (linear from 0).
            zero_init_last: Zero the last BatchNorm of each residual branch (timm's ResNet default).
            tokenizer: The first VT module's: "filter" (learned filters W_A) or "cluster" (each image's k-means
                centres, core/models/vt_cluster.py); later modules are recurrent either way.
        """
        super().__init__()
        if global_pool != "avg":
            raise ValueError(f"global_pool {global_pool!r}: VT-ResNet only averages its visual tokens ('avg')")
        if tokenizer not in ("filter", "cluster"):
            raise ValueError(f"tokenizer {tokenizer!r}: 'filter' or 'cluster'")
        self.img_size = img_size
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = token_dim
        self.conv1 = nn.Conv2d(in_chans, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.act1 = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        stages, feature_info = make_blocks((block,) * 3, (64, 128, 256), layers, 64, drop_path_rate=drop_path_rate)
        for name, stage in stages:
            self.add_module(name, stage)
        self.feature_channels = feature_info[-1]["num_chs"]  # 256 (BasicBlock) or 1024 (Bottleneck), stride 16
        self.layer4 = nn.ModuleList(
            VTModule(
                self.feature_channels,
                token_dim,
                num_tokens,
                recurrent=i > 0,
                project=i < num_vt_modules - 1,
                cluster=i == 0 and tokenizer == "cluster",
            )  # fmt: skip
            for i in range(num_vt_modules)
        )
        self.head_drop = nn.Dropout(drop_rate)
        self.fc = nn.Linear(token_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights(zero_init_last)

    def init_weights(self, zero_init_last: bool = True) -> None:
        """Kaiming-normal convolutions, truncated-normal Linear weights with zero biases and, with `zero_init_last`,
        a zero scale on the last BatchNorm of each residual branch (timm's ResNet init).

        Module by module through `apply`, each call touching only that module's own parameters: inside ZeRO-3's
        `deepspeed.zero.Init` the sub-modules are already partitioned here, and DeepSpeed gathers exactly those
        around each call (core/engine/zero_init.py), so the partitioned model starts from these values too."""
        self.apply(init_module)
        if zero_init_last:
            for block in self.modules():
                if isinstance(block, (BasicBlock, Bottleneck)):
                    (block.bn3 if isinstance(block, Bottleneck) else block.bn2).apply(_zero_scale)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return set()

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        """Layer groups for timm's layer decay: stem = 0, then each residual block and VT module in order (by
        stage with `coarse`), the classifier last."""
        return dict(stem=r"^conv1|^bn1|^maxpool", blocks=r"^layer(\d+)" if coarse else r"^layer(\d+)\.(\d+)")

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.fc

    def reset_classifier(self, num_classes: int, global_pool: Literal["avg"] | None = None) -> None:
        """Replaces the classifier with a fresh one of `num_classes` outputs (0: none)."""
        if global_pool not in (None, "avg"):
            raise ValueError(f"global_pool {global_pool!r}: VT-ResNet only averages its visual tokens ('avg')")
        self.num_classes = num_classes
        self.fc = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> visual tokens (B, L, C_T) of the last VT module."""
        x = self.maxpool(self.act1(self.bn1(self.conv1(x))))
        x = self.layer3(self.layer2(self.layer1(x)))  # (B, C, H / 16, W / 16)
        grid = tuple(x.shape[-2:])
        x = x.flatten(2).transpose(1, 2)  # (B, HW, C)
        tokens = None
        for module in self.layer4:
            x, tokens = module(x, tokens, grid)
        return tokens

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """(B, L, C_T) -> (B, num_classes), or the token average (B, C_T) with `pre_logits`."""
        x = self.head_drop(x.mean(dim=1))
        return x if pre_logits else self.fc(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def init_module(module: nn.Module) -> None:
    """Kaiming-normal convolutions (fan out), truncated-normal (0.02) Linear weights with zero biases."""
    if isinstance(module, nn.Conv2d):
        nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    elif isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def _zero_scale(module: nn.Module) -> None:
    if isinstance(module, nn.BatchNorm2d):
        nn.init.zeros_(module.weight)


def _cfg() -> dict:
    return imagenet_cfg(
        crop_pct=0.875,
        interpolation="bilinear",
        first_conv="conv1",
        classifier="fc",
    )


# ResNet blocks of stages 1-3 and VT modules replacing stage 4 (as many as the ResNet's stage-4 blocks: 2/3/3/3).
VARIANTS: dict[str, dict] = {
    "vt_resnet18": dict(block=BasicBlock, layers=(2, 2, 2), num_vt_modules=2),
    "vt_resnet34": dict(block=BasicBlock, layers=(3, 4, 6), num_vt_modules=3),
    "vt_resnet50": dict(block=Bottleneck, layers=(3, 4, 6), num_vt_modules=3),
    "vt_resnet101": dict(block=Bottleneck, layers=(3, 4, 23), num_vt_modules=3),
}
default_cfgs = {name: _cfg() for name in VARIANTS}  # timm's register_model reads the module's `default_cfgs`


def _create(variant: str, pretrained: bool, **kwargs) -> VTResNet:
    """Builds a variant; explicit kwargs (e.g. token_dim for a tiny test model) override the variant's."""
    return build_model_with_cfg(VTResNet, variant, pretrained, **{**VARIANTS[variant], **kwargs})


register_variants(__name__, VARIANTS, _create)
