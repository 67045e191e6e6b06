"""Patch-mask generators for masked-patch prediction, run per sample inside the DataLoader workers.

Four generators (`MaskGenerator`s), each returning an (h, w) bool tensor over the patch grid, True = masked:

- `BlockwiseMaskGenerator`: BEiT's blockwise masking. Rectangular blocks (at least `min_patches`
  patches each, area drawn uniformly, aspect ratio log-uniform) are added until the budget is met
  or a block makes no progress. BEiT can end a few patches short of its budget; we then top up
  with single patches next to the masked ones, so every mask has exactly `num_masked` patches and
  a batch of masks stacks into a fixed number of masked tokens per sample.
- `RandomMaskGenerator`: exactly `round(ratio * h * w)` patches chosen uniformly (the ViT paper's
  masked-patch prediction).
- `UnitMaskGenerator`: SimMIM's: `ceil(ratio * units)` random squares of `unit` x `unit` patches.
- `InverseBlockMaskGenerator`: data2vec 2.0's inverse block masking. Random `block_size` x `block_size` blocks are
  the visible part and everything else is masked; random tokens are then added or removed to an exact count.

`MaskStack` draws M independent masks from one generator, (M, h, w): data2vec 2.0 sees each image M times.

Why in the workers: masks for MAE are drawn inside the objective, on the device, but blockwise
masks are a sequential Python loop per sample. Making them in the workers keeps that loop off the
training step and lets the mask travel with its image in the batch, as BEiT and DINOv2
(`data/masking.py`, `collate.py`) do.

Randomness comes from the global `random` RNG unless an explicit `random.Random` is passed. The
data pipeline seeds `random` (and numpy, torch) per sample, so masks are reproduced on resume.

Shape legend: h, w = patch-grid height and width; M = masks per image (`MaskStack`).
"""

import abc
import math
import random

import numpy as np
import torch

Block = tuple[int, int, int, int]  # (top, left, height, width) in patches


class MaskGenerator(abc.ABC):
    """What the generators share: called, one draws one mask over its `height` x `width` patch grid."""

    height: int
    width: int

    def __call__(self, rng: random.Random | None = None) -> torch.Tensor:
        """Draws one mask: (h, w) bool, True = masked (how many: the generator's `draw`).

        Args:
            rng: Source of randomness; None means the global `random` RNG.
        """
        return self.draw(random if rng is None else rng)

    @abc.abstractmethod
    def draw(self, rng: random.Random) -> torch.Tensor:
        """One (h, w) bool mask drawn from `rng`."""


def _check_grid(grid: tuple[int, int]) -> tuple[int, int]:
    height, width = grid
    if height < 1 or width < 1:
        raise ValueError(f"grid must be (height, width) with both >= 1, got {grid}")
    return int(height), int(width)


def _frontier(mask: np.ndarray) -> np.ndarray:
    """Unmasked patches with a masked 4-neighbour. (h, w) bool -> (h, w) bool."""
    near = np.zeros_like(mask)
    near[1:] |= mask[:-1]
    near[:-1] |= mask[1:]
    near[:, 1:] |= mask[:, :-1]
    near[:, :-1] |= mask[:, 1:]
    return near & ~mask


class BlockwiseMaskGenerator(MaskGenerator):
    """BEiT blockwise masking with an exact masked count.

    Each block takes up to `tries` attempts. An attempt draws a target area uniformly in
    [min_patches, min(max_patches, remaining budget)] and an aspect ratio (height / width)
    log-uniformly in `aspect_ratio`, rounds the rectangle's sides, and places it at a uniform random
    position if it fits. It is accepted only if it masks between 1 and `remaining budget` new
    patches. Rounding can take a rectangle outside [min_patches, max_patches]; such attempts are
    rejected, so every placed block really has at least `min_patches` patches. The block loop stops
    when the budget is met, when the remaining budget is below `min_patches`, or when all attempts
    of a block fail; the rest is then topped up one patch at a time (see `sample_blocks`).

    Args:
        grid: Patch grid (height, width).
        num_masked: Exact number of patches masked in every mask, in [0, height * width].
        min_patches: Smallest block, in patches. May exceed `num_masked`: then no block is placed
            and the whole mask comes from the top-up.
        max_patches: Largest block, in patches; None means the whole grid.
        aspect_ratio: (low, high) range of block height / width, 0 < low <= high.
        tries: Attempts per block before the block loop gives up.
    """

    def __init__(
        self,
        grid: tuple[int, int],
        num_masked: int,
        *,
        min_patches: int = 16,
        max_patches: int | None = None,
        aspect_ratio: tuple[float, float] = (0.3, 1 / 0.3),
        tries: int = 10,
    ):
        self.height, self.width = _check_grid(grid)
        num_patches = self.height * self.width
        if not 0 <= num_masked <= num_patches:
            raise ValueError(f"num_masked must be in [0, {num_patches}] for grid {grid}, got {num_masked}")
        if min_patches < 1:
            raise ValueError(f"min_patches must be >= 1, got {min_patches}")
        if max_patches is not None and max_patches < min_patches:
            raise ValueError(f"max_patches ({max_patches}) must be >= min_patches ({min_patches})")
        low, high = aspect_ratio
        if not 0 < low <= high:
            raise ValueError(f"aspect_ratio must be (low, high) with 0 < low <= high, got {aspect_ratio}")
        if tries < 1:
            raise ValueError(f"tries must be >= 1, got {tries}")
        self.num_masked = num_masked
        self.min_patches = min_patches
        self.max_patches = num_patches if max_patches is None else max_patches
        self.log_aspect = (math.log(low), math.log(high))
        self.tries = tries

    def __repr__(self) -> str:
        return (
            f"BlockwiseMaskGenerator(grid=({self.height}, {self.width}), num_masked={self.num_masked}, "
            f"min_patches={self.min_patches}, max_patches={self.max_patches}, tries={self.tries})"
        )

    def draw(self, rng: random.Random) -> torch.Tensor:
        """(h, w) bool, exactly `num_masked` True."""
        return self.sample_blocks(rng)[0]

    def sample_blocks(self, rng: random.Random | None = None) -> tuple[torch.Tensor, list[Block]]:
        """Draws one mask and the rectangles that made it.

        Args:
            rng: Source of randomness; None means the global `random` RNG.

        Returns:
            The (h, w) bool mask and the blocks (top, left, height, width) in the order placed. Blocks
            may overlap; their union is the mask. The top-up patches come last, each as a 1x1 block.
        """
        rng = random if rng is None else rng
        mask = np.zeros((self.height, self.width), dtype=bool)  # (h, w)
        blocks: list[Block] = []
        num_done = 0
        while num_done < self.num_masked:
            placed = self._place_block(mask, self.num_masked - num_done, rng)
            if placed is None:
                break
            block, num_new = placed
            blocks.append(block)
            num_done += num_new
        blocks += self._top_up(mask, self.num_masked - num_done, rng)
        assert int(mask.sum()) == self.num_masked, (int(mask.sum()), self.num_masked)
        return torch.from_numpy(mask), blocks

    def _place_block(self, mask: np.ndarray, budget: int, rng: random.Random) -> tuple[Block, int] | None:
        """Masks one block in place; returns it and its number of newly masked patches, or None if all tries fail."""
        max_area = min(self.max_patches, budget)
        if max_area < self.min_patches:
            return None
        for _ in range(self.tries):
            area = rng.uniform(self.min_patches, max_area)
            aspect = math.exp(rng.uniform(*self.log_aspect))
            height = round(math.sqrt(area * aspect))
            width = round(math.sqrt(area / aspect))
            if not self.min_patches <= height * width <= self.max_patches:
                continue
            if height > self.height or width > self.width:
                continue
            top = rng.randint(0, self.height - height)
            left = rng.randint(0, self.width - width)
            window = mask[top : top + height, left : left + width]  # (height, width) view into mask
            num_new = height * width - int(window.sum())
            if 0 < num_new <= budget:
                window[...] = True
                return (top, left, height, width), num_new
        return None

    def _top_up(self, mask: np.ndarray, num_missing: int, rng: random.Random) -> list[Block]:
        """Masks `num_missing` more patches in place, each a random unmasked 4-neighbour of the mask.

        Growing from the mask's border keeps the added patches attached to the blocks; a random
        unmasked patch is used only when nothing is masked yet.
        """
        added: list[Block] = []
        for _ in range(num_missing):
            candidates = np.flatnonzero(_frontier(mask))  # flat indices into (h, w)
            if candidates.size == 0:
                candidates = np.flatnonzero(~mask)
            top, left = divmod(int(candidates[rng.randrange(candidates.size)]), self.width)
            mask[top, left] = True
            added.append((top, left, 1, 1))
        return added


class RandomMaskGenerator(MaskGenerator):
    """Uniform random masking of exactly `round(ratio * h * w)` patches.

    Args:
        grid: Patch grid (height, width).
        ratio: Fraction of patches to mask, in [0, 1]; the count is `round(ratio * height * width)`.
    """

    def __init__(self, grid: tuple[int, int], ratio: float):
        self.height, self.width = _check_grid(grid)
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {ratio}")
        self.ratio = ratio
        self.num_masked = round(ratio * self.height * self.width)

    def __repr__(self) -> str:
        return f"RandomMaskGenerator(grid=({self.height}, {self.width}), ratio={self.ratio})"

    def draw(self, rng: random.Random) -> torch.Tensor:
        """(h, w) bool, exactly `num_masked` True."""
        num_patches = self.height * self.width
        chosen = torch.tensor(rng.sample(range(num_patches), self.num_masked), dtype=torch.long)
        mask = torch.zeros(num_patches, dtype=torch.bool)  # (h * w,)
        mask[chosen] = True
        return mask.view(self.height, self.width)


class UnitMaskGenerator(MaskGenerator):
    """SimMIM's masking: the patch grid is cut into `unit` x `unit` squares of patches, and `ceil(ratio * units)` of
    them, drawn uniformly, are masked (SimMIM: 32 px units over 16 px patches, 60% of them).

    Args:
        grid: Patch grid (height, width); both divisible by `unit`.
        unit: Side of a mask unit in patches.
        ratio: Fraction of units to mask, in (0, 1).
    """

    def __init__(self, grid: tuple[int, int], unit: int, ratio: float):
        self.height, self.width = _check_grid(grid)
        if unit < 1 or self.height % unit or self.width % unit:
            raise ValueError(f"mask unit {unit} does not divide the grid {grid}")
        if not 0.0 < ratio < 1.0:
            raise ValueError(f"ratio must be in (0, 1), got {ratio}")
        self.unit, self.ratio = unit, ratio
        self.num_units = (self.height // unit) * (self.width // unit)
        self.num_masked = math.ceil(ratio * self.num_units)

    def __repr__(self) -> str:
        return f"UnitMaskGenerator(grid=({self.height}, {self.width}), unit={self.unit}, ratio={self.ratio})"

    def draw(self, rng: random.Random) -> torch.Tensor:
        """(h, w) bool, exactly `num_masked * unit**2` True."""
        units = torch.zeros(self.num_units, dtype=torch.bool)  # (h / unit * w / unit,)
        units[torch.tensor(rng.sample(range(self.num_units), self.num_masked), dtype=torch.long)] = True
        units = units.view(self.height // self.unit, self.width // self.unit)
        return units.repeat_interleave(self.unit, dim=0).repeat_interleave(self.unit, dim=1)  # (h, w)


class InverseBlockMaskGenerator(MaskGenerator):
    """data2vec 2.0's inverse block masking (fairseq `compute_block_mask_2d` with `inverse_mask=True`,
    `require_same_masks=True`), on any h x w grid.

    The blocks are what stays visible. `num_centres` centres are drawn uniformly with replacement (a repeat adds
    nothing); each makes the `block_size` x `block_size` block from `centre - block_size // 2` visible, clipped at the
    grid's border. Random visible tokens are then hidden, or random masked ones revealed, until exactly
    `num_visible` are visible. Counts, with keep = 1 - mask_ratio in float64 and int() truncating as fairseq does:

        num_visible = int(h * w * keep)        num_masked = h * w - num_visible
        num_centres = int(h * w * ((keep + adjust) / block_size**2))

    `adjust` is fairseq's `mask_prob_adjust`: extra centres that make up for blocks overlapping and clipped, so that
    the blocks alone come close to `num_visible` (data2vec 2.0: mask_ratio 0.8 and adjust 0.07 for ViT-B, 0.75 and
    0.1 for ViT-L/H, block_size 3). The truncation is in floating point: 14x14 at 0.8 keeps 39 (196 * 0.2 = 39.2)
    and 5x5 at 0.8 keeps 4, since 25 * (1 - 0.8) is 4.999... there.

    Args:
        grid: Patch grid (height, width).
        mask_ratio: Fraction of tokens to mask, in (0, 1); must leave at least one token visible and mask one.
        block_size: Side of a visible block in tokens, in [1, min(height, width)].
        adjust: Added to the keep fraction when counting centres, >= 0.
    """

    def __init__(self, grid: tuple[int, int], mask_ratio: float, block_size: int = 3, adjust: float = 0.07):
        self.height, self.width = _check_grid(grid)
        num_patches = self.height * self.width
        if not 1 <= block_size <= min(self.height, self.width):
            raise ValueError(
                f"block_size must be in [1, {min(self.height, self.width)}] for grid {grid}, got {block_size}"
            )
        if not 0.0 < mask_ratio < 1.0:
            raise ValueError(f"mask_ratio must be in (0, 1), got {mask_ratio}")
        if not adjust >= 0.0:
            raise ValueError(f"adjust must be >= 0, got {adjust}")
        keep = 1 - mask_ratio
        self.num_visible = int(num_patches * keep)
        if not 0 < self.num_visible < num_patches:
            raise ValueError(
                f"mask_ratio {mask_ratio} on grid {grid} leaves {self.num_visible} of {num_patches} tokens visible; "
                "it must leave at least one visible and mask at least one"
            )
        self.mask_ratio, self.block_size, self.adjust = mask_ratio, block_size, adjust
        self.num_masked = num_patches - self.num_visible
        self.num_centres = int(num_patches * ((keep + adjust) / block_size**2))

    def __repr__(self) -> str:
        return (
            f"InverseBlockMaskGenerator(grid=({self.height}, {self.width}), mask_ratio={self.mask_ratio}, "
            f"block_size={self.block_size}, adjust={self.adjust})"
        )

    def draw(self, rng: random.Random) -> torch.Tensor:
        """(h, w) bool, exactly `num_masked` True."""
        visible = self._visible_blocks(rng)
        self._fix_count(visible, rng)
        assert int(visible.sum()) == self.num_visible, (int(visible.sum()), self.num_visible)
        return torch.from_numpy(~visible)

    def draw_unadjusted(self, rng: random.Random | None = None) -> torch.Tensor:
        """One mask before the count is fixed: (h, w) bool, True = masked, everything outside the blocks.

        Args:
            rng: Source of randomness; None means the global `random` RNG.
        """
        return torch.from_numpy(~self._visible_blocks(random if rng is None else rng))

    def _visible_blocks(self, rng: random.Random) -> np.ndarray:
        """The union of the blocks around `num_centres` random centres: (h, w) bool, True = visible."""
        visible = np.zeros((self.height, self.width), dtype=bool)
        offset = self.block_size // 2
        for _ in range(self.num_centres):
            row, col = divmod(rng.randrange(self.height * self.width), self.width)
            top, left = row - offset, col - offset  # may be < 0: clipped below, numpy clips the far side
            visible[max(top, 0) : top + self.block_size, max(left, 0) : left + self.block_size] = True
        return visible

    def _fix_count(self, visible: np.ndarray, rng: random.Random) -> None:
        """Hides random visible tokens, or reveals random masked ones, in place until `num_visible` are visible."""
        flat = visible.reshape(-1)  # (h * w,) view into visible
        num_extra = int(flat.sum()) - self.num_visible
        if num_extra > 0:
            flat[rng.sample(np.flatnonzero(flat).tolist(), num_extra)] = False
        elif num_extra < 0:
            flat[rng.sample(np.flatnonzero(~flat).tolist(), -num_extra)] = True


class MaskStack:
    """M independent masks per image from one generator (data2vec 2.0 encodes each image M times, each with its own
    mask; fairseq's `clone_batch`, 16 for images). Called like a generator.

    Args:
        generator: Draws each (h, w) mask.
        num_masks: M, masks per image, >= 1.
    """

    def __init__(self, generator: MaskGenerator, num_masks: int):
        if num_masks < 1:
            raise ValueError(f"num_masks must be >= 1, got {num_masks}")
        self.generator, self.num_masks = generator, num_masks
        self.height, self.width = generator.height, generator.width

    @property
    def num_masked(self) -> int:
        """The generator's `num_masked`."""
        return self.generator.num_masked

    def __repr__(self) -> str:
        return f"MaskStack({self.generator!r}, num_masks={self.num_masks})"

    def __call__(self, rng: random.Random | None = None) -> torch.Tensor:
        """Draws M masks one after another from `rng`: (M, h, w) bool, True = masked.

        Args:
            rng: Source of randomness; None means the global `random` RNG.
        """
        rng = random if rng is None else rng
        return torch.stack([self.generator(rng) for _ in range(self.num_masks)])  # (M, h, w)
