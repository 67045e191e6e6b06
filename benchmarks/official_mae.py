"""The official MAE training step (facebookresearch/mae) as a bench_engine runner, imported from a checkout whose path
is given on the command line (`--official-mae PATH`); nothing of it is kept in this tree.

The official code targets timm 0.3.2 and torch 1.8 on CUDA. Run in this process on CPU against timm 1.0 and
torch 2, it needs these shims, each applied in the benchmark's worker process only:

- `Block(..., qk_scale=None, ...)`: timm 1.0's Block has no `qk_scale`. `Timm032Block` takes timm 0.3.2's arguments
  and builds timm 1.0's Block (same parameter names and maths) with the explicit q @ k^T, softmax, @ v attention
  that timm 0.3.2 ran, instead of timm 1.0's default `F.scaled_dot_product_attention` (which our engine also avoids
  on CPU: 2.3x slower in bf16 there). The "official-sdpa" runner keeps timm 1.0's SDPA: the official code as it
  runs when installed beside today's timm, which is how issue 15's reference figures were taken.
- `util/pos_embed.py` uses `np.float` (removed in NumPy 1.24) and `util/misc.py` imports `torch._six.inf` (removed
  in torch 2.0): `np.float = float` and a `torch._six` module holding `inf`, only where they are missing.
- `engine_pretrain.train_one_epoch` enters `torch.cuda.amp.autocast()` (fp16 on a GPU, nothing on CPU tensors) and
  calls `torch.cuda.synchronize()`: they become `torch.autocast("cpu", dtype=torch.bfloat16)` and a no-op.
- `main_pretrain.py`'s `timm.optim.optim_factory.add_weight_decay` is `timm.optim.param_groups_weight_decay` in timm
  1.0 (same rule: no decay for 1-D parameters and biases, frozen parameters left out).

The step is then `engine_pretrain.train_one_epoch` itself on a sized iterable that yields the same batch, with the
official `NativeScalerWithGradNormCount` (its GradScaler disables itself without CUDA; it still takes the gradient
norm every step), `torch.optim.AdamW(groups, lr, betas=(0.9, 0.95))` as main_pretrain.py builds it (torch's default
kernel on CPU, the for-loop one) and the per-iteration lr schedule of `util/lr_sched.py`.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import math
import sys
import types
from functools import partial
from pathlib import Path

import numpy as np
import torch
from timm.models.vision_transformer import Block
from torch import nn

OFFICIAL_FILES = ("models_mae.py", "engine_pretrain.py", "util/misc.py", "util/lr_sched.py", "util/pos_embed.py")


class Timm032Block(Block):
    """timm 0.3.2's `Block` signature over timm 1.0's Block, attention computed as timm 0.3.2 did (no SDPA) unless
    `fused_attn`."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        qk_scale: float | None = None,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        act_layer: type[nn.Module] = nn.GELU,
        norm_layer: type[nn.Module] = nn.LayerNorm,
        *,
        fused_attn: bool = False,
    ) -> None:
        super().__init__(
            dim,
            num_heads,
            mlp_ratio=mlp_ratio,
            qkv_bias=qkv_bias,
            proj_drop=drop,
            attn_drop=attn_drop,
            drop_path=drop_path,
            act_layer=act_layer,
            norm_layer=norm_layer,
        )
        if qk_scale is not None:  # timm 0.3.2: scale = qk_scale or head_dim ** -0.5
            self.attn.scale = qk_scale
        self.attn.fused_attn = fused_attn


def install_import_shims() -> list[str]:
    """Restores the two names the official code imports that NumPy and torch have since removed, where missing.

    Returns:
        What was shimmed, for the result file.
    """
    applied = []
    if "float" not in np.__dict__:
        np.float = float  # util/pos_embed.py: np.arange(..., dtype=np.float)
        applied.append("np.float = float")
    try:
        importlib.import_module("torch._six")
    except ImportError:
        sys.modules["torch._six"] = types.SimpleNamespace(inf=math.inf)  # util/misc.py: from torch._six import inf
        applied.append("torch._six.inf = math.inf")
    return applied


def cpu_autocast_for_cuda_amp() -> None:
    """`torch.cuda.amp.autocast()` -> bf16 CPU autocast and `torch.cuda.synchronize()` -> no-op, in this process."""
    torch.cuda.amp.autocast = lambda *args, **kwargs: torch.autocast("cpu", dtype=torch.bfloat16)
    torch.cuda.synchronize = lambda *args, **kwargs: None


def load_official(path: str | Path, sdpa: bool = False) -> types.SimpleNamespace:
    """Imports models_mae, engine_pretrain (it imports util.lr_sched) and util.misc from the checkout at `path`; its
    blocks compute attention as timm 0.3.2 did, or through timm 1.0's `F.scaled_dot_product_attention` if `sdpa`.

    Raises:
        FileNotFoundError: `path` lacks one of the files the runner uses, named in the message.
    """
    root = Path(path).resolve()
    missing = [name for name in OFFICIAL_FILES if not (root / name).is_file()]
    if missing:
        raise FileNotFoundError(f"--official-mae {root}: not a facebookresearch/mae checkout, missing {missing}")
    shims = install_import_shims()
    # The checkout's own imports (`import util.misc`, `from util.pos_embed import ...`) find its util/ folder
    util = importlib.util.module_from_spec(importlib.machinery.ModuleSpec("util", None, is_package=True))
    util.__path__ = [str(root / "util")]
    sys.modules["util"] = util
    modules = {name: _import_file(name, root / f"{name}.py") for name in ("models_mae", "engine_pretrain")}
    modules["misc"] = importlib.import_module("util.misc")
    # looked up when the model is built, not at import
    modules["models_mae"].Block = partial(Timm032Block, fused_attn=sdpa)
    return types.SimpleNamespace(**modules, shims=shims)


def _import_file(name: str, path: Path) -> types.ModuleType:
    """The module at `path`, imported under `name` (and kept in sys.modules, as an import would)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class RepeatedBatch:
    """The data loader train_one_epoch iterates: `(images, None)` `length` times, calling `on_draw` before each draw
    and once after the last, as bench_engine's engine runner reads its clock."""

    def __init__(self, images: torch.Tensor, length: int, on_draw) -> None:
        self.images, self.length, self.on_draw = images, length, on_draw

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        for _ in range(self.length):
            self.on_draw()
            yield self.images, None
        self.on_draw()


def run_official(spec: dict, images: torch.Tensor, clock) -> float:
    """Builds mae_vit_base_patch16 (norm_pix_loss) as main_pretrain.py does and times train_one_epoch on `images`.

    Args:
        spec: The worker's spec: `official_mae` (checkout path), `kind` ("official-sdpa": timm 1.0's SDPA attention),
            `model` (a core.models.vit.VIT_SIZES key), `warmup`, `steps`.
        images: (B, 3, H, W) one batch, drawn every step.
        clock: engine_step's Clock: marked at every batch draw; backward, step phase and AdamW.step timed.

    Returns:
        Model FLOPs of one training step (forward + backward, FlopCounterMode), counted after the timed steps when
        spec["flops"] says so (the first round), else None.
    """
    from timm.optim import param_groups_weight_decay

    official = load_official(spec["official_mae"], sdpa=spec["kind"] == "official-sdpa")
    cpu_autocast_for_cuda_amp()
    torch.manual_seed(0)
    model = build_official_model(official.models_mae, spec["model"], images.shape[-1])
    groups = param_groups_weight_decay(model, weight_decay=0.05)  # main_pretrain: add_weight_decay(model, 0.05)
    optimizer = torch.optim.AdamW(groups, lr=1.5e-4 * images.shape[0] / 256, betas=(0.9, 0.95))
    optimizer.step = clock.timed("step_phase", clock.timed("optimizer", optimizer.step))
    optimizer.zero_grad = clock.timed("step_phase", optimizer.zero_grad)
    official.misc.get_grad_norm_ = clock.timed("step_phase", official.misc.get_grad_norm_)
    torch.Tensor.backward = clock.timed("backward", torch.Tensor.backward)  # the scaler calls loss.backward()
    steps = spec["warmup"] + spec["steps"]
    args = types.SimpleNamespace(accum_iter=1, mask_ratio=0.75, lr=optimizer.defaults["lr"], min_lr=0.0)
    args.warmup_epochs, args.epochs = 40, 800  # main_pretrain.py's defaults / PRETRAIN.md's schedule
    loader = RepeatedBatch(images, steps, clock.mark)
    scaler = official.misc.NativeScalerWithGradNormCount()
    official.engine_pretrain.train_one_epoch(model, loader, optimizer, torch.device("cpu"), 0, scaler, args=args)
    return official_step_flops(model, images) if spec["flops"] else None


def build_official_model(models_mae: types.ModuleType, size: str, img_size: int) -> nn.Module:
    """`mae_vit_base_patch16` / `mae_vit_large_patch16` with norm_pix_loss, as main_pretrain.py builds them; other
    sizes (--quick's tiny) through its MaskedAutoencoderViT with the same patch 16 and 512-wide 8-block decoder."""
    if size in ("base", "large"):
        return getattr(models_mae, f"mae_vit_{size}_patch16")(img_size=img_size, norm_pix_loss=True)
    from core.models.vit import VIT_SIZES

    return models_mae.MaskedAutoencoderViT(
        img_size=img_size,
        patch_size=16,
        **VIT_SIZES[size],
        decoder_embed_dim=512,
        decoder_depth=8,
        decoder_num_heads=16,
        mlp_ratio=4,
        norm_layer=partial(nn.LayerNorm, eps=1e-6),
        norm_pix_loss=True,
    )


def official_step_flops(model: nn.Module, images: torch.Tensor) -> int:
    """FLOPs of one forward (bf16 autocast) + backward of the official model on `images`, by FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _, _ = model(images, mask_ratio=0.75)
        loss.backward()
    return counter.get_total_flops()
