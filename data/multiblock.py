"""I-JEPA's multi-block masks, drawn per batch inside the DataLoader workers (the data side of `objective.kind: ijepa`).

Each sample gets K target blocks, the tokens the predictor must predict, and one context block, the tokens the
encoder sees. The rules, as in I-JEPA (facebookresearch/ijepa `src/masks/multiblock.py`, `MaskCollator`):

- Sizes, once per batch: one uniform u in [0, 1) per block kind sets both the scale and the aspect ratio (height /
  width), each linear in u (so large target blocks are also the tall ones). The block's area budget is
  `int(L * scale)` (floor), its sides `round(sqrt(area * aspect))` x `round(sqrt(area / aspect))`, each clamped to
  the grid. Every sample of the batch shares the two sizes. I-JEPA's recipe: K = 4 targets of scale 0.15-0.2 and
  aspect 0.75-1.5, a context of scale 0.85-1.0 and aspect 1.0, `min_keep` 10.
- Placement, per sample: each target block's top-left corner is uniform over the positions where it fits (targets
  may overlap each other). The context block is placed the same way and loses the tokens of every target block; a
  placement is accepted when more than `min_keep` tokens remain (I-JEPA's test is strict).
- Trimming, per batch: every sample keeps the first Nc (smallest, i.e. top rows first) of its ascending context
  indices, Nc the smallest count in the batch, so the masks stack. Target blocks all have the batch's size, so
  they are never trimmed.

Where we differ from I-JEPA, on purpose:

- Edges: I-JEPA clamps a side to grid - 1 and draws the corner from [0, grid - side), so no block ever covers the
  last row or column (ijepa pull requests #40 and #59; on 14x14 its context is always the top-left 13x13).
  We clamp to the grid and draw from [0, grid - side]; `ijepa_edges=True` restores I-JEPA's behaviour.
- Retries: after each 20 failed context placements I-JEPA stops excluding one more target block (the last first), so
  its context can overlap the targets. We place the context `tries` times, then place the target blocks afresh and
  try again: with `allow_overlap=False` no context token is ever in one of its sample's target blocks. The
  constructor rejects settings under which no placement at all keeps more than `min_keep` tokens.
- Randomness: everything (sizes and placements) comes from the one `random.Random` given per batch; I-JEPA seeds
  the sizes from a shared batch counter and draws the placements from the global torch RNG. Seeded from the batch's
  place in its stream (its first sample's index), the masks are reproduced on resume.

Why per batch, in the workers: the sizes are shared by the whole batch so that the masks stack (I-JEPA draws them in
its collator), and the Python placement loop stays off the training step, as for BEiT's masks (data/masking.py).

Token indices are row-major over the grid: token (row, col) is `row * w + col`.

Shape legend: B = batch size; h, w = patch-grid height and width; L = h * w; K = target blocks per sample;
Nt = tokens per target block; Nc = context tokens per sample (after trimming).
"""

import dataclasses
import itertools
import math
import random
from typing import Any

import numpy as np
import torch

from data.device_decode import DeviceCrops
from data.masking import Block

Size = tuple[int, int]  # (height, width) in tokens

_MAX_ROUNDS = 100  # target placements per sample before giving up (each with `tries` context placements)


@dataclasses.dataclass(frozen=True)
class BatchBlocks:
    """One batch's blocks before trimming (`MultiBlockMasks.draw_blocks`)."""

    grid: Size
    """The token grid (h, w)."""
    target_size: Size
    """Every target block's (height, width) in this batch."""
    context_size: Size
    """Every context block's (height, width) in this batch."""
    targets: list[list[Block]]
    """[B][K] target blocks (top, left, height, width)."""
    contexts: list[Block]
    """[B] context blocks (top, left, height, width), before the target tokens are taken out."""
    context_ids: list[np.ndarray]
    """[B] untrimmed context token indices, (n_b,) int64 ascending: the context block less the target blocks."""
    num_context_tries: list[int]
    """[B] context placements each sample took (1: the first was accepted)."""

    def ids(self) -> dict[str, torch.Tensor]:
        """The trimmed, stacked indices: "context_ids" (B, Nc) and "target_ids" (B, K, Nt), int64, each row
        ascending; Nc is the smallest untrimmed context count of the batch, and each sample keeps its first Nc."""
        num_context = min(len(ids) for ids in self.context_ids)
        context = np.stack([ids[:num_context] for ids in self.context_ids])  # (B, Nc)
        target = np.stack([[block_ids(block, self.grid[1]) for block in blocks] for blocks in self.targets])
        assert target.shape[2] == self.target_size[0] * self.target_size[1], target.shape  # (B, K, Nt)
        return {"context_ids": torch.from_numpy(context), "target_ids": torch.from_numpy(target)}


def block_ids(block: Block, width: int) -> np.ndarray:
    """The row-major token indices of `block` on a grid `width` tokens wide: (height * width,) int64 ascending."""
    top, left, height, block_width = block
    rows = np.arange(top, top + height, dtype=np.int64)[:, None] * width  # (height, 1)
    return (rows + np.arange(left, left + block_width, dtype=np.int64)).reshape(-1)


class MultiBlockMasks:
    """I-JEPA's multi-block masks over a token grid: block sizes drawn once per batch, placements per sample.

    Args:
        grid: Token grid (height, width), e.g. (14, 14) for 224 px images and 16 px patches.
        num_targets: K, target blocks per sample, >= 1.
        target_scale: (low, high) fraction of the grid a target block's area budget takes, 0 < low <= high <= 1.
        target_aspect: (low, high) target block height / width, 0 < low <= high.
        context_scale: (low, high) fraction of the grid the context block's area budget takes.
        context_aspect: (low, high) context block height / width.
        min_keep: A context placement is accepted only with more than `min_keep` tokens left, >= 0.
        allow_overlap: Keep the target blocks' tokens in the context (I-JEPA's default recipe: False).
        tries: Context placements per placement of the target blocks, >= 1 (I-JEPA's 20).
        ijepa_edges: Reproduce I-JEPA's edges: sides at most grid - 1, and no block in the last row or column.

    Raises:
        ValueError: For an argument out of range, a block size that rounds to zero tokens on a side, or settings
            under which some pair of possible sizes (`target_sizes`, `context_sizes`) has no placement that keeps
            more than `min_keep` context tokens; the message names the argument.
    """

    def __init__(
        self,
        grid: tuple[int, int],
        *,
        num_targets: int = 4,
        target_scale: tuple[float, float] = (0.15, 0.2),
        target_aspect: tuple[float, float] = (0.75, 1.5),
        context_scale: tuple[float, float] = (0.85, 1.0),
        context_aspect: tuple[float, float] = (1.0, 1.0),
        min_keep: int = 10,
        allow_overlap: bool = False,
        tries: int = 20,
        ijepa_edges: bool = False,
    ):
        self.height, self.width = int(grid[0]), int(grid[1])
        edge = int(ijepa_edges)
        if min(self.height, self.width) < 1 + edge:
            raise ValueError(f"grid must be (height, width) with both >= {1 + edge}, got {grid}")
        for name, pair in [("target_scale", target_scale), ("context_scale", context_scale)]:
            if not 0 < pair[0] <= pair[1] <= 1:
                raise ValueError(f"{name} must be (low, high) with 0 < low <= high <= 1, got {pair}")
        for name, pair in [("target_aspect", target_aspect), ("context_aspect", context_aspect)]:
            if not 0 < pair[0] <= pair[1] < math.inf:
                raise ValueError(f"{name} must be (low, high) with 0 < low <= high, got {pair}")
        for name, value, low in [("num_targets", num_targets, 1), ("min_keep", min_keep, 0), ("tries", tries, 1)]:
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        self.num_targets, self.min_keep, self.allow_overlap, self.tries = num_targets, min_keep, allow_overlap, tries
        self.target_scale, self.target_aspect = tuple(target_scale), tuple(target_aspect)
        self.context_scale, self.context_aspect = tuple(context_scale), tuple(context_aspect)
        self.ijepa_edges = ijepa_edges
        self.span = (self.height - edge, self.width - edge)  # the rows and columns a block may cover
        # every (height, width) a batch's blocks can have
        self.target_sizes = self._sizes(self.target_scale, self.target_aspect)
        self.context_sizes = self._sizes(self.context_scale, self.context_aspect)
        self._check_sizes()

    def __repr__(self) -> str:
        return (
            f"MultiBlockMasks(grid=({self.height}, {self.width}), num_targets={self.num_targets}, "
            f"target_scale={self.target_scale}, target_aspect={self.target_aspect}, "
            f"context_scale={self.context_scale}, context_aspect={self.context_aspect}, min_keep={self.min_keep}, "
            f"allow_overlap={self.allow_overlap}, tries={self.tries}, ijepa_edges={self.ijepa_edges})"
        )

    def draw(self, batch_size: int, rng: random.Random) -> dict[str, torch.Tensor]:
        """One batch's masks: "context_ids" (B, Nc) and "target_ids" (B, K, Nt), int64 token indices, each row
        ascending. With `allow_overlap=False`, no context index of a sample is in any of its target blocks.

        Raises:
            RuntimeError: A sample found no context placement that keeps more than `min_keep` tokens in
                `_MAX_ROUNDS` placements of its target blocks (possible, but too unlikely, for these settings).
        """
        return self.draw_blocks(batch_size, rng).ids()

    def add_to_batch(self, batch: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        """Adds `draw`'s "context_ids" and "target_ids" to a collated batch, for as many samples as its "image"
        holds (a (B, ...) tensor, or a `DeviceCrops`); returns the same dict."""
        images = batch["image"]
        batch_size = len(images.on_device) if isinstance(images, DeviceCrops) else len(images)
        batch.update(self.draw(batch_size, rng))
        return batch

    def draw_blocks(self, batch_size: int, rng: random.Random) -> BatchBlocks:
        """One batch's blocks before trimming: what `draw` stacks, with the rectangles that made it.

        The first two draws of `rng` are the batch's target and context sizes (in that order, as I-JEPA), then
        each sample's placements follow in turn.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        target_size = self._block_size(rng.random(), self.target_scale, self.target_aspect)
        context_size = self._block_size(rng.random(), self.context_scale, self.context_aspect)
        samples = [self._place_sample(target_size, context_size, rng) for _ in range(batch_size)]
        targets, contexts, context_ids, num_tries = (list(column) for column in zip(*samples, strict=True))
        return BatchBlocks(
            (self.height, self.width), target_size, context_size, targets, contexts, context_ids, num_tries
        )

    def _block_size(self, u: float, scale: tuple[float, float], aspect: tuple[float, float]) -> Size:
        """The (height, width) that the uniform draw `u` gives: scale and aspect both linear in `u`."""
        area = int(self.height * self.width * (scale[0] + u * (scale[1] - scale[0])))
        ratio = aspect[0] + u * (aspect[1] - aspect[0])
        height = min(round(math.sqrt(area * ratio)), self.span[0])
        width = min(round(math.sqrt(area / ratio)), self.span[1])
        return height, width

    def _place_sample(
        self, target_size: Size, context_size: Size, rng: random.Random
    ) -> tuple[list[Block], Block, np.ndarray, int]:
        """One sample's target blocks, context block, context ids (block less targets) and context placements."""
        num_tries = 0
        for _ in range(_MAX_ROUNDS):
            targets = [self._place(target_size, rng) for _ in range(self.num_targets)]
            free = np.ones((self.height, self.width), dtype=bool)  # (h, w): tokens a context may keep
            if not self.allow_overlap:
                for top, left, height, width in targets:
                    free[top : top + height, left : left + width] = False
            for _ in range(self.tries):
                num_tries += 1
                context = self._place(context_size, rng)
                top, left, height, width = context
                keep = free[top : top + height, left : left + width].reshape(-1)  # (height * width,)
                if int(keep.sum()) > self.min_keep:
                    return targets, context, block_ids(context, self.width)[keep], num_tries
        raise RuntimeError(
            f"no {context_size[0]}x{context_size[1]} context block kept more than min_keep={self.min_keep} tokens "
            f"beside {self.num_targets} {target_size[0]}x{target_size[1]} target blocks in {num_tries} placements "
            f"on the {self.height}x{self.width} grid; lower min_keep or target_scale, or raise context_scale"
        )

    def _place(self, size: Size, rng: random.Random) -> Block:
        """A block of `size` at a uniform random position inside `span`."""
        top = rng.randint(0, self.span[0] - size[0])
        left = rng.randint(0, self.span[1] - size[1])
        return top, left, size[0], size[1]

    def _sizes(self, scale: tuple[float, float], aspect: tuple[float, float]) -> set[Size]:
        """Every (height, width) `_block_size` can give over u in [0, 1].

        The size is constant between the u where floor(L * scale) steps or a rounded side steps (sqrt(area * ratio)
        or sqrt(area / ratio) crosses n + 1/2); it is read at each such u and halfway between neighbours.
        """
        num_tokens = self.height * self.width
        areas = range(int(num_tokens * scale[0]), int(num_tokens * scale[1]) + 1)
        cuts = {0.0, 1.0}
        if scale[1] > scale[0]:
            cuts |= {(area / num_tokens - scale[0]) / (scale[1] - scale[0]) for area in areas}
        if aspect[1] > aspect[0]:
            for area in (area for area in areas if area > 0):
                shortest = math.sqrt(area * min(aspect[0], 1 / aspect[1]))
                longest = math.sqrt(area * max(aspect[1], 1 / aspect[0]))
                sides = range(max(math.floor(shortest) - 1, 0), math.ceil(longest) + 1)
                ratios = [(side + 0.5) ** 2 / area for side in sides] + [area / (side + 0.5) ** 2 for side in sides]
                cuts |= {(ratio - aspect[0]) / (aspect[1] - aspect[0]) for ratio in ratios}
        points = sorted(u for u in cuts if 0.0 <= u <= 1.0)
        points += [(a + b) / 2 for a, b in itertools.pairwise(points)]
        return {self._block_size(u, scale, aspect) for u in points}

    def _check_sizes(self) -> None:
        """Raises ValueError for an empty block size, or for a context that no placement lets keep `min_keep`."""
        for name, sizes in [("target_scale", self.target_sizes), ("context_scale", self.context_sizes)]:
            empty = sorted(size for size in sizes if min(size) < 1)
            if empty:
                aspect = name.replace("scale", "aspect")
                raise ValueError(
                    f"{name}={getattr(self, name)} with {aspect}={getattr(self, aspect)} gives a "
                    f"{empty[0][0]}x{empty[0][1]} block on the {self.height}x{self.width} grid; raise {name} or bring "
                    f"{aspect} closer to 1"
                )
        for context in sorted(self.context_sizes):
            for target in sorted(self.target_sizes):
                kept = self._most_kept(target, context)
                if kept <= self.min_keep:
                    raise ValueError(
                        f"min_keep={self.min_keep} cannot be met: a {context[0]}x{context[1]} context block "
                        f"(context_scale {self.context_scale}) keeps at most {kept} tokens beside "
                        f"{target[0]}x{target[1]} target blocks (target_scale {self.target_scale}) on the "
                        f"{self.height}x{self.width} grid; lower min_keep or target_scale, or raise context_scale"
                    )

    def _most_kept(self, target: Size, context: Size) -> int:
        """The most context tokens any placement keeps: all target blocks on one spot, in the corner facing the
        context's, overlap it by the least the span allows."""
        if self.allow_overlap:
            return context[0] * context[1]
        rows = max(0, target[0] + context[0] - self.span[0])
        cols = max(0, target[1] + context[1] - self.span[1])
        return context[0] * context[1] - rows * cols


class WithBatchMasks:
    """A per-sample transform whose batches also get I-JEPA's masks: the pipeline (data/pipeline.py) calls
    `batch_masks.add_to_batch` on each training batch it collates in the data workers, with a `random.Random` seeded by
    the batch's place in its stream (so a resumed run draws the same masks).

    Args:
        transform: The per-sample image transform (its `decode` and `normalisation`, if any, are passed on).
        batch_masks: The batch's mask sampler.
    """

    def __init__(self, transform, batch_masks: MultiBlockMasks):
        self.transform, self.batch_masks = transform, batch_masks
        for name in ("decode", "normalisation"):
            if hasattr(transform, name):
                setattr(self, name, getattr(transform, name))

    def __call__(self, image):
        return self.transform(image)
