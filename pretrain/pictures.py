"""What the pretraining stages show in TensorBoard: each objective's output on one fixed batch (the same images and
masks at every picture step, so pictures compare across steps) and the tokenizer's code usage.

    MAE         train/reconstruction     original | masked | reconstruction | reconstruction + visible patches
    SimMIM      train/reconstruction     original | masked | reconstruction | reconstruction + visible patches
    BEiT-style  train/masked_patches     input | masked | target | predicted (target and predicted where the target is
                                         an image: 3-bit colours, 4x4 colours, pixels; tokenizer codes show the mask)

Shape legend: B batch, n rows drawn, H/W image size, ph/pw patch size, gh/gw patch grid, L = gh * gw patches,
M masked patches among the n rows, O predictions per patch, K classes, P = ph * pw * 3 pixel values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from core.engine.precision import autocast_context
from core.engine.stream import FIXED_BATCH_SIZE, fixed_batch
from core.recipe.config import Config
from core.report.pictures import bar_chart, image_grid, upscale_nearest
from data.transforms import CentreCrop, WithMask, eval_transform
from pretrain.mae import normalize_patches, patchify, reconstruction_grid
from pretrain.objectives import mask_generator, tokenizer_manifest
from pretrain.targets import class_colors

MASKED_GREY = 0.5  # masked patches of the input, as in MAE's pictures
OUTLINE = (1.0, 0.4, 0.0)  # orange border around the masked region


def picture_hook(run, engine) -> Callable[[int], None] | None:
    """The `log_images(step)` of a pretraining run: forwards the fixed batch and logs the objective's picture.

    Every rank must call it and the hook (a ZeRO-3 forward is collective); only rank 0 writes. Returns None when the
    objective has no picture or `logging.image_every_steps` is 0 (then no batch is read).
    """
    cfg, device = run.cfg, run.dist.device
    picture = PICTURES.get(cfg.objective.kind)
    if picture is None or not cfg.logging.image_every_steps:
        return None
    tag, draw, transform = picture
    batch = fixed_batch(cfg, transform(cfg), device)
    devices = [device] if device.type == "cuda" else []  # fork the RNG that torch.manual_seed below also resets

    def log_images(step: int) -> None:
        with torch.no_grad(), torch.random.fork_rng(devices=devices), autocast_context(cfg.engine.precision, device):
            torch.manual_seed(0)  # the same MAE mask and BEiT corruption at every picture step
            out = engine(batch)
        if run.logger.enabled:
            run.logger.image(tag, step, draw(cfg, batch, out))

    return log_images


def _view(cfg: Config):
    return eval_transform(cfg.model.img_size, cfg.data.mean, cfg.data.std, crop_pct=1.0)


def _beit_view(cfg: Config):
    """The whole image, as the encoder sees it, with a mask from the recipe's generator (and the tokenizer's view)."""
    view = _view(cfg)
    if cfg.objective.target.kind == "tokenizer":
        manifest = tokenizer_manifest(cfg.objective.target.path)
        second = eval_transform(manifest["tokenizer"]["img_size"], manifest["mean"], manifest["std"], crop_pct=1.0)
        view = _TwoViews(view, second)
    return WithMask(view, mask_generator(cfg))


class _TwoViews:
    """The encoder's view and the tokenizer's, both of the whole image (the fixed batch has no random crop)."""

    def __init__(self, view: CentreCrop, tokenizer_view: CentreCrop):
        self.view, self.tokenizer_view = view, tokenizer_view
        self.normalisation = {  # each view with its own mean and std, on the device
            "image": view.normalisation["image"],
            "tokenizer_image": tokenizer_view.normalisation["image"],
        }

    def __call__(self, image) -> dict[str, torch.Tensor]:
        return {"image": self.view(image), "tokenizer_image": self.tokenizer_view(image)}


def _picture_mae(cfg: Config, batch: dict, out: dict) -> torch.Tensor:
    return reconstruction_grid(
        batch["image"].float(),
        out["pred"].float(),
        out["mask"],
        patch_size=cfg.model.patch_size,
        mean=cfg.data.mean,
        std=cfg.data.std,
        norm_pix_loss=cfg.objective.norm_pix_loss,
    )


def _picture_beit(cfg: Config, batch: dict, out: dict) -> torch.Tensor:
    target = cfg.objective.target
    return masked_patch_grid(
        batch["image"].float().cpu(),
        out["mask"].cpu(),
        out["pred"].float().cpu(),
        out["target"].cpu(),
        target_kind=target.kind,
        patch_size=(cfg.model.pixel_stride, cfg.model.pixel_stride),
        mean=cfg.data.mean,
        std=cfg.data.std,
        norm_pix=target.kind == "pixels_l2" and target.norm_pix,
    )


def _simmim_view(cfg: Config):
    return WithMask(_view(cfg), mask_generator(cfg))


def _picture_simmim(cfg: Config, batch: dict, out: dict) -> torch.Tensor:
    stride = (cfg.model.pixel_stride, cfg.model.pixel_stride)
    return reconstruction_grid(
        batch["image"].float(),
        patchify(out["pred"].float(), stride),  # (B, L, P) as MAE's predictions
        out["mask"],
        patch_size=stride,
        mean=cfg.data.mean,
        std=cfg.data.std,
        norm_pix_loss=False,
    )


PICTURES = {
    "mae": ("train/reconstruction", _picture_mae, _view),
    "beit": ("train/masked_patches", _picture_beit, _beit_view),
    "simmim": ("train/reconstruction", _picture_simmim, _simmim_view),
}
"""objective.kind -> (TensorBoard tag, picture of the fixed batch's output, the fixed batch's transform)."""


def masked_patch_grid(
    images: torch.Tensor,
    mask: torch.Tensor,
    pred: torch.Tensor,
    target: torch.Tensor,
    *,
    target_kind: str,
    patch_size: tuple[int, int],
    mean: Sequence[float],
    std: Sequence[float],
    norm_pix: bool = False,
    max_images: int = FIXED_BATCH_SIZE,
) -> torch.Tensor:
    """Picture of BEiT-style masked-patch prediction: one row per image, the masked region outlined.

    Columns: the input; the input with its masked patches grey; then, for targets that are pictures, the targets
    and the predictions painted into the masked patches (3-bit colours at their bins' centres; 4x4 colours; pixels,
    de-standardised with each true patch's mean and std under norm_pix). Tokenizer codes are not pictures: their
    rows stop after the mask.

    Args:
        images: (B, 3, H, W) images normalised with `mean`/`std`.
        mask: (B, L) bool, True = masked, row-major over the patch grid.
        pred: (N, O * K) logits, or (N, P) pixels, of the N masked patches of the batch in row-major order.
        target: (N,) / (N, O) classes, or (N, P) pixels: what `pred` was scored against.
        target_kind: objective.target.kind.
        patch_size: (ph, pw).
        mean, std: The dataset normalisation.
        norm_pix: pixels_l2 with per-patch standardised targets.
        max_images: Rows to draw at most.

    Returns:
        (3, H', W') float in [0, 1] (`core.report.pictures.image_grid`, upscaled to at least 112 px per panel).
    """
    n = min(max_images, images.shape[0])
    mask = mask[:n].bool()
    num_masked = int(mask.sum())  # the first rows' patches come first in pred / target
    mean_t, std_t = (torch.tensor(v, dtype=torch.float32).view(1, 3, 1, 1) for v in (mean, std))
    original = (images[:n].float() * std_t + mean_t).clamp(0, 1)  # (n, 3, H, W)
    grid = (images.shape[2] // patch_size[0], images.shape[3] // patch_size[1])
    columns = [original, paste_patches(original, mask, torch.full((num_masked, 3, *patch_size), MASKED_GREY))]
    titles = ["input", "masked"]
    if target_kind != "tokenizer":
        originals = patchify(images[:n].float(), patch_size)[mask]  # (M, P) in normalised units
        drawn = {"target": target[:num_masked], "predicted": pred[:num_masked]}
        if target_kind == "pixels_l2":
            del drawn["target"]  # the target is the input itself
        for title, values in drawn.items():
            patches = target_patches(target_kind, values, patch_size, originals, mean_t, std_t, norm_pix)
            columns.append(paste_patches(original, mask, patches))
            titles.append(title)
    upscaled = [upscale_nearest(column) for column in columns]
    masks = mask.view(n, *grid)
    outlined = [upscaled[0], *(outline_masked(column, masks) for column in upscaled[1:])]
    return image_grid(outlined, titles)


def target_patches(
    kind: str,
    values: torch.Tensor,
    patch_size: tuple[int, int],
    originals: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor,
    norm_pix: bool,
) -> torch.Tensor:
    """(M, 3, ph, pw) pictures in [0, 1] of M masked patches' targets or predictions.

    Args:
        kind: "mean_color_3bit", "color_3bit_4x4" or "pixels_l2".
        values: Classes (M,) / (M, 16), or logits (M, O * 512) (their argmax is drawn), or pixels (M, P).
        patch_size: (ph, pw).
        originals: (M, P) the true patches in normalised units (for norm_pix).
        mean, std: (1, 3, 1, 1) dataset normalisation.
        norm_pix: Pixels are per-patch standardised.
    """
    num = values.shape[0]
    if kind == "pixels_l2":
        pixels = values.float()
        if norm_pix:
            _, patch_mean, patch_std = normalize_patches(originals)  # (M, 1) each
            pixels = pixels * patch_std + patch_mean
        pixels = pixels.view(num, *patch_size, 3).permute(0, 3, 1, 2)  # (M, 3, ph, pw), patchify's (ph, pw, C) order
        return (pixels * std + mean).clamp(0, 1)
    cells = 1 if kind == "mean_color_3bit" else 16
    classes = values if not values.is_floating_point() else values.view(num, cells, -1).argmax(-1)
    colors = class_colors(classes.view(num, cells))  # (M, cells, 3)
    side = int(cells**0.5)
    colors = colors.transpose(1, 2).reshape(num, 3, side, side)  # cells row-major, as Color3Bit4x4 orders them
    return F.interpolate(colors, size=patch_size, mode="nearest")


def paste_patches(images: torch.Tensor, mask: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
    """`images` (n, 3, H, W) with its masked patches (mask (n, L) bool) replaced by `patches` (M, 3, ph, pw), taken
    in row-major order of (image, patch)."""
    n, c, h, w = images.shape
    ph, pw = patches.shape[-2:]
    gh, gw = h // ph, w // pw
    tiles = images.reshape(n, c, gh, ph, gw, pw).permute(0, 2, 4, 1, 3, 5).reshape(n, gh * gw, c, ph, pw).clone()
    tiles[mask] = patches.to(tiles.dtype)
    return tiles.view(n, gh, gw, c, ph, pw).permute(0, 3, 1, 4, 2, 5).reshape(n, c, h, w)


def outline_masked(images: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`images` (n, 3, H, W) with the border of the masked region (mask (n, gh, gw) bool) drawn in OUTLINE, inside
    the masked patches: each masked patch gets a line along every side whose neighbour is unmasked or outside."""
    n, _, h, w = images.shape
    gh, gw = mask.shape[1:]
    ph, pw = h // gh, w // gw
    width = max(1, min(ph, pw) // 16)
    padded = F.pad(mask.float(), (1, 1, 1, 1)).bool()  # (n, gh + 2, gw + 2), outside = unmasked
    open_sides = [mask & ~padded[:, :-2, 1:-1], mask & ~padded[:, 2:, 1:-1]]  # above, below: (n, gh, gw)
    open_sides += [mask & ~padded[:, 1:-1, :-2], mask & ~padded[:, 1:-1, 2:]]  # left, right
    rows, cols = torch.arange(ph), torch.arange(pw)
    bands = [rows < width, rows >= ph - width, cols < width, cols >= pw - width]
    edge = torch.zeros(n, gh, gw, ph, pw, dtype=torch.bool)
    for side, (opened, band) in enumerate(zip(open_sides, bands, strict=True)):
        band = band[:, None] if side < 2 else band[None, :]  # (ph, 1) or (1, pw)
        edge |= opened[..., None, None] & band
    edge = edge.permute(0, 1, 3, 2, 4).reshape(n, 1, h, w)
    return torch.where(edge, torch.tensor(OUTLINE).view(1, 3, 1, 1), images)


def code_usage(codes: torch.Tensor, codebook_size: int) -> torch.Tensor:
    """(K,) int64: how many positions of `codes` (any shape of code indices) hold each code."""
    return torch.bincount(codes.flatten().long().cpu(), minlength=codebook_size)


def code_usage_picture(counts: torch.Tensor) -> torch.Tensor:
    """Bar chart of `counts` (K,) sorted from the most used code down, titled with the codes used and perplexity."""
    total = max(int(counts.sum()), 1)
    p = counts.double() / total
    perplexity = float(torch.exp(-(p[p > 0] * p[p > 0].log()).sum()))
    used = int((counts > 0).sum())
    return bar_chart(
        counts.sort(descending=True).values,
        title=f"fixed batch: {used} of {len(counts)} codes used, perplexity {perplexity:.1f}",
        x_label=f"codes, most used first ({total} positions)",
    )
