"""Discrete image tokenizer: a VQ-VAE whose code indices are the targets of BEiT-style masked image modelling.

BEiT predicts, for each masked patch, the index of the code a frozen tokenizer gives that patch; with `downsample`
equal to the ViT patch size, `encode(images)` is directly the (B, h, w) target tensor.

Why a VQ-VAE with EMA codebook updates and dead-code restarts rather than BEiT's dVAE: codes are a deterministic
argmin, so there is no Gumbel temperature to anneal and no KL weight to schedule (a dVAE needs both); the codebook
follows an exponential moving average of the encoder vectors assigned to each code (k-means style) instead of the
optimizer, which is stable and needs no codebook loss; and codes whose EMA usage drops below `dead_code_threshold`
are re-seeded next to the most-used codes, which keeps codebook usage (the information in the targets) high.

Distributed training: the entry point sets `quantizer.reduce` to a sum over data-parallel ranks; each training
forward passes its per-code statistics through it, so every rank applies the same EMA update and the same restarts
(their noise is seeded by the update counter) and the codebooks stay identical with no other communication.

Shape legend:
    B: batch    H, W: image height, width    h, w: code grid (H / downsample, W / downsample)
    D: code dim    K: codebook size    N: B * h * w encoder vectors
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import safetensors.torch
import torch
import torch.nn.functional as F
from timm.layers import to_2tuple
from torch import nn

from core.export.manifest import MANIFEST_NAME
from core.report.pictures import image_grid

WEIGHTS_NAME = "tokenizer.safetensors"
KIND = "vqvae"

_INIT_SEED = 0  # the initial codebook is the same on every rank whatever the global RNG state
_INIT_STD = 0.1  # small next to the encoder's output scale, so first assignments follow the direction of z
_RESTART_SEED = 1_000_003  # restart noise generator seed = this + update counter
_RESTART_NOISE = 0.01  # restart jitter, in units of the batch's per-dimension std of z
_RESTART_COUNT_FACTOR = 2.0  # a restarted code's EMA count, in units of dead_code_threshold


class VectorQuantizerEMA(nn.Module):
    """Nearest-code vector quantizer with EMA codebook updates and deterministic dead-code restarts.

    Buffers (all fp32 except the counter; casting the module to bf16/fp16 leaves them fp32, see `_apply`):
        codebook (K, D), ema_count (K,) EMA of per-code assignment counts (starts at 1), ema_sum (K, D) EMA of
        per-code sums of assigned vectors (starts at codebook * ema_count), num_updates () int64 update counter.

    Args:
        codebook_size: Number of codes K (the tokenizer's vocabulary).
        code_dim: Code vector dimension D.
        decay: EMA decay of the per-code statistics, in [0, 1).
        eps: Laplace smoothing of the EMA counts (keeps a code with a vanishing count finite).
        dead_code_threshold: A code whose EMA count (assignments per global batch) falls below this is restarted;
            0 disables restarts.

    Attributes:
        reduce: None, or a function that sums a tensor over all data-parallel ranks in place and returns it. Set by
            the training entry point; each training forward calls it once on the (K, D + 2) batch statistics.
    """

    def __init__(
        self,
        codebook_size: int,
        code_dim: int,
        *,
        decay: float = 0.99,
        eps: float = 1e-5,
        dead_code_threshold: float = 1.0,
    ):
        super().__init__()
        if codebook_size < 2 or code_dim < 1 or not 0.0 <= decay < 1.0:
            raise ValueError(
                f"need codebook_size >= 2, code_dim >= 1, 0 <= decay < 1: got {codebook_size, code_dim, decay}"
            )
        self.codebook_size, self.code_dim = codebook_size, code_dim
        self.decay, self.eps, self.dead_code_threshold = decay, eps, dead_code_threshold
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        generator = torch.Generator().manual_seed(_INIT_SEED)
        codebook = torch.randn(codebook_size, code_dim, generator=generator) * _INIT_STD  # (K, D)
        self.register_buffer("codebook", codebook)
        self.register_buffer("ema_count", torch.ones(codebook_size))
        self.register_buffer("ema_sum", codebook.clone())
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.long))
        self._host_updates: int | None = 0
        """`num_updates` as the host knows it (None: read it once, after a state dict was loaded into the buffer), so
        that seeding a restart's noise reads nothing back from the device."""
        self.register_load_state_dict_post_hook(lambda module, keys: setattr(module, "_host_updates", None))

    def _apply(self, fn, recurse=True):
        # A cast of the whole module (`module.bfloat16()`, `.half()`) must leave the EMA statistics fp32 (a 1% EMA
        # step is below bf16 resolution), so floating buffers only follow device moves.
        kept = {name: buf for name, buf in self._buffers.items() if buf is not None and buf.is_floating_point()}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            if self._buffers[name].dtype != old.dtype:
                self._buffers[name] = old.to(device=self._buffers[name].device)
        return self

    def _nearest(self, flat: torch.Tensor) -> torch.Tensor:
        """(N, D) fp32 -> (N,) index of the nearest code in squared Euclidean distance."""
        codebook = self.codebook.float()
        # ||z - c||^2 = ||z||^2 - 2 z.c + ||c||^2; ||z||^2 is the same for every code, so it is left out.
        return torch.addmm(codebook.pow(2).sum(dim=1), flat, codebook.t(), alpha=-2.0).argmin(dim=1)  # (N, K) -> (N,)

    def quantize(self, z: torch.Tensor) -> torch.Tensor:
        """Codes only: (B, D, h, w) -> (B, h, w) long. No gradient, no update, whatever `self.training` is."""
        b, d, h, w = z.shape
        with torch.no_grad(), torch.autocast(device_type=z.device.type, enabled=False):
            flat = z.float().permute(0, 2, 3, 1).reshape(-1, d)  # (N, D)
            return self._nearest(flat).view(b, h, w)

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, h, w) code indices -> (B, D, h, w) fp32 code vectors."""
        return self.codebook.float()[codes].permute(0, 3, 1, 2)

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Quantize `z`; in training mode also update the codebook (EMA, then dead-code restarts).

        Args:
            z: (B, D, h, w) encoder output, any float dtype.

        Returns:
            z_q: (B, D, h, w) in z's dtype: codes from before this step's update, straight-through (identity grad).
            codes: (B, h, w) long code indices.
            stats: "commit_loss" fp32 MSE(z, sg(z_q)) with gradient; "perplexity" and "codes_used" (fraction of the
                codebook hit) of the batch's code histogram, summed over ranks when training.
        """
        (b, d, h, w), in_dtype = z.shape, z.dtype
        with torch.autocast(device_type=z.device.type, enabled=False):
            z = z.float()
            flat = z.detach().permute(0, 2, 3, 1).reshape(-1, d)  # (N, D)
            codes = self._nearest(flat)  # (N,)
            z_q = self.codebook.float()[codes].view(b, h, w, d).permute(0, 3, 1, 2)  # (B, D, h, w), a copy
            commit_loss = F.mse_loss(z, z_q)
            batch_stats = self._batch_stats(flat, codes)  # (K, D + 2)
            if self.training:
                if self.reduce is not None:
                    batch_stats = self.reduce(batch_stats)
                self._update(batch_stats)
            z_q = (z + (z_q - z).detach()).to(in_dtype)  # a bf16 module (DeepSpeed bf16) decodes bf16
        counts = batch_stats[:, d]  # (K,) this batch's code histogram, over all ranks when training
        probs = counts / counts.sum()
        perplexity = torch.special.xlogy(probs, probs).sum().neg().exp()  # exp(entropy)
        stats = {"commit_loss": commit_loss, "perplexity": perplexity, "codes_used": (counts > 0).float().mean()}
        return z_q, codes.view(b, h, w), stats

    def _batch_stats(self, flat: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Per-code [sum of assigned z (D), count, sum of ||z||^2] packed in one (K, D + 2) tensor (one reduce)."""
        rows = torch.cat([flat, torch.ones_like(flat[:, :1]), flat.pow(2).sum(dim=1, keepdim=True)], dim=1)  # (N, D+2)
        return rows.new_zeros(self.codebook_size, self.code_dim + 2).index_add_(0, codes, rows)

    @torch.no_grad()
    def _update(self, batch_stats: torch.Tensor) -> None:
        """EMA step from the (reduced) batch statistics, then dead-code restarts; identical on every rank."""
        d = self.code_dim
        sums, counts = batch_stats[:, :d], batch_stats[:, d]  # (K, D), (K,)
        self.ema_count.mul_(self.decay).add_(counts, alpha=1.0 - self.decay)
        self.ema_sum.mul_(self.decay).add_(sums, alpha=1.0 - self.decay)
        total = self.ema_count.sum()
        smoothed = (self.ema_count + self.eps) / (total + self.codebook_size * self.eps) * total  # (K,)
        self.codebook.copy_(self.ema_sum / smoothed[:, None])
        if self.dead_code_threshold > 0:
            self._restart_dead_codes(batch_stats)
        self.num_updates.add_(1)
        self._host_updates = None if self._host_updates is None else self._host_updates + 1

    def _restart_dead_codes(self, batch_stats: torch.Tensor) -> None:
        """Move every code with EMA count < threshold next to a most-used code (no host sync).

        The i-th dead code copies the (i mod num_live)-th most-used live code plus Gaussian noise (std 0.01 x the
        batch's per-dimension std of z). Its EMA count becomes 2 x threshold (ema_sum = code * count): unused, it is
        dead again after ln(2) / (1 - decay) updates; used, the small count lets it move quickly off its source.
        """
        d = self.code_dim
        sums, counts = batch_stats[:, :d], batch_stats[:, d]  # (K, D), (K,)
        num_vectors = counts.sum().clamp_min(1.0)
        data_var = batch_stats[:, d + 1].sum() / num_vectors - (sums.sum(dim=0) / num_vectors).pow(2).sum()
        noise_std = _RESTART_NOISE * (data_var.clamp_min(0.0) / d).sqrt()
        dead = self.ema_count < self.dead_code_threshold  # (K,)
        order = torch.argsort(self.ema_count, descending=True, stable=True)  # (K,) live codes come first
        num_live = (~dead).sum().clamp_min(1)
        dead_rank = (torch.cumsum(dead, dim=0) - 1).clamp_min(0)  # (K,) position of each dead code among them
        source = order[dead_rank % num_live]  # (K,) the code each dead code copies
        # Same seed on every rank: the counter is identical everywhere. Read from the device once after a load only.
        if self._host_updates is None:
            self._host_updates = int(self.num_updates)
        generator = torch.Generator(device=self.codebook.device).manual_seed(_RESTART_SEED + self._host_updates)
        noise = torch.randn(self.codebook.shape, generator=generator, device=self.codebook.device)  # (K, D)
        restarted = self.codebook[source] + noise_std * noise  # (K, D)
        self.codebook.copy_(torch.where(dead[:, None], restarted, self.codebook))
        self.ema_count.masked_fill_(dead, _RESTART_COUNT_FACTOR * self.dead_code_threshold)
        self.ema_sum.copy_(torch.where(dead[:, None], self.codebook * self.ema_count[:, None], self.ema_sum))


class _ResBlock(nn.Module):
    """x + conv1x1(relu(conv3x3(relu(x)))), as in the VQ-VAE paper."""

    def __init__(self, dim: int):
        super().__init__()
        self.conv1 = nn.Conv2d(dim, dim, 3, padding=1)
        self.conv2 = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.relu(self.conv1(F.relu(x))))


def _conv_encoder(num_halvings: int, hidden_dim: int, code_dim: int) -> nn.Sequential:
    """(B, 3, H, W) -> (B, D, h, w): k4 s2 convs halving the resolution, two residual blocks, 1x1 to code_dim."""
    down = [nn.Conv2d(3 if i == 0 else hidden_dim, hidden_dim, 4, stride=2, padding=1) for i in range(num_halvings)]
    return nn.Sequential(
        *[layer for conv in down for layer in (conv, nn.ReLU())],
        *[_ResBlock(hidden_dim) for _ in range(2)],
        nn.ReLU(),
        nn.Conv2d(hidden_dim, code_dim, 1),
    )


def _conv_decoder(num_halvings: int, hidden_dim: int, code_dim: int) -> nn.Sequential:
    """(B, D, h, w) -> (B, 3, H, W): the encoder mirrored with k4 s2 transposed convs; no output activation."""
    up = [nn.ConvTranspose2d(hidden_dim, hidden_dim, 4, stride=2, padding=1) for _ in range(num_halvings - 1)]
    return nn.Sequential(
        nn.Conv2d(code_dim, hidden_dim, 3, padding=1),
        *[_ResBlock(hidden_dim) for _ in range(2)],
        nn.ReLU(),
        *[layer for conv in up for layer in (conv, nn.ReLU())],
        nn.ConvTranspose2d(hidden_dim, 3, 4, stride=2, padding=1),
    )


class VQVAE(nn.Module):
    """Convolutional VQ-VAE tokenizer: (B, 3, H, W) normalised images <-> (B, h, w) codes.

    Args:
        img_size: Image side, or (H, W); both divisible by `downsample`.
        downsample: Image pixels per code along each side; a power of two >= 2 (the ViT patch size for BEiT).
        codebook_size: Number of codes (the BEiT target vocabulary).
        code_dim: Code vector dimension.
        hidden_dim: Channels of the convolutional encoder and decoder.
        commitment: Weight of the commitment loss MSE(z, sg(z_q)).
        ema_decay: EMA decay of the codebook statistics.
        dead_code_threshold: EMA count below which a code is restarted.

    Attributes:
        grid: (h, w) code grid.
        config: The constructor's keyword arguments (JSON-serialisable), enough to rebuild the model.
        encoder, quantizer, decoder: The three stages; `quantizer.reduce` is the distributed hook.
    """

    def __init__(
        self,
        *,
        img_size: int | Sequence[int],
        downsample: int,
        codebook_size: int,
        code_dim: int = 32,
        hidden_dim: int = 64,
        commitment: float = 0.25,
        ema_decay: float = 0.99,
        dead_code_threshold: float = 1.0,
    ):
        super().__init__()
        height, width = to_2tuple(img_size)
        if not isinstance(downsample, int) or downsample < 2 or downsample & (downsample - 1):
            raise ValueError(f"downsample must be a power of two >= 2, got {downsample}")
        if height % downsample or width % downsample:
            raise ValueError(f"img_size {(height, width)} is not divisible by downsample {downsample}")
        self.img_size, self.grid = (height, width), (height // downsample, width // downsample)
        self.commitment = commitment
        self.config = dict(
            img_size=[height, width],
            downsample=downsample,
            codebook_size=codebook_size,
            code_dim=code_dim,
            hidden_dim=hidden_dim,
            commitment=commitment,
            ema_decay=ema_decay,
            dead_code_threshold=dead_code_threshold,
        )
        num_halvings = downsample.bit_length() - 1  # log2
        self.encoder = _conv_encoder(num_halvings, hidden_dim, code_dim)
        self.quantizer = VectorQuantizerEMA(
            codebook_size, code_dim, decay=ema_decay, dead_code_threshold=dead_code_threshold
        )
        self.decoder = _conv_decoder(num_halvings, hidden_dim, code_dim)

    def _check_images(self, images: torch.Tensor) -> None:
        height, width = self.img_size
        if images.ndim != 4 or tuple(images.shape[1:]) != (3, height, width):
            raise ValueError(f"tokenizer expects images of shape (B, 3, {height}, {width}), got {tuple(images.shape)}")

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) normalised images -> (B, h, w) long codes; never updates the codebook."""
        self._check_images(images)
        return self.quantizer.quantize(self.encoder(images))

    def decode_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, h, w) codes -> (B, 3, H, W) reconstruction in normalised-image space."""
        return self.decoder(self.quantizer.embed(codes).to(self.decoder[0].weight.dtype))

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Reconstruction objective; in training mode the quantizer also updates its codebook.

        Args:
            batch: "image" (B, 3, H, W) normalised images.

        Returns:
            "loss" = recon_loss + commitment * commit_loss (fp32), "recon_loss", "commit_loss", "perplexity",
            "codes_used", and "recon" (B, 3, H, W) the detached fp32 reconstruction.
        """
        images = batch["image"]
        self._check_images(images)
        z = self.encoder(images)  # (B, D, h, w)
        z_q, _, stats = self.quantizer(z)
        recon = self.decoder(z_q).float()  # (B, 3, H, W)
        recon_loss = F.mse_loss(recon, images.float())
        loss = recon_loss + self.commitment * stats["commit_loss"]
        return {"loss": loss, "recon_loss": recon_loss, **stats, "recon": recon.detach()}


def load_tokenizer(path: str | Path) -> VQVAE:
    """Rebuild an exported tokenizer on CPU, frozen (requires_grad False) and in eval mode.

    Args:
        path: Folder written by `export_tokenizer` (pretrain/train_tokenizer.py).

    Raises:
        ValueError: The folder has no readable mimpipe.json, or it is not a "vqvae" export.
    """
    manifest_path = Path(path) / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read tokenizer manifest {manifest_path}: {e}") from e
    kind = manifest.get("kind") if isinstance(manifest, dict) else None
    if kind != KIND:
        raise ValueError(f"{manifest_path} describes kind {kind!r}, not a {KIND!r} tokenizer")
    model = VQVAE(**manifest["tokenizer"])
    model.load_state_dict(safetensors.torch.load_file(Path(path) / WEIGHTS_NAME), strict=True)
    model.requires_grad_(False)
    return model.eval()


def tokenizer_grid(
    images: torch.Tensor, recon: torch.Tensor, mean: Sequence[float], std: Sequence[float], max_images: int = 8
) -> torch.Tensor:
    """Picture for TensorBoard's `add_image`: one row per image, the original beside its reconstruction from codes.

    Args:
        images: (B, 3, H, W) images normalised with `mean`/`std`.
        recon: (B, 3, H, W) reconstructions, same space.
        mean, std: Per-channel normalisation mean and std.
        max_images: Rows to draw at most.

    Returns:
        (3, H', W') float CPU tensor in [0, 1]: `core.report.pictures.image_grid` with titles "original" and "from
        codes", small images upscaled (nearest) to at least 112 px.
    """
    n = min(max_images, images.shape[0])
    mean_t, std_t = (torch.tensor(v, dtype=torch.float32).view(1, 3, 1, 1) for v in (mean, std))
    columns = [(x[:n].detach().float().cpu() * std_t + mean_t).clamp(0.0, 1.0) for x in (images, recon)]
    return image_grid(columns, ("original", "from codes"))
