"""I-JEPA multi-block masks: the block sizes I-JEPA's rules give, sizes shared by a batch and within their scale and
aspect ranges (up to rounding), rectangles placed inside the grid, contexts disjoint from their targets and keeping more
than min_keep tokens, trimming to equal counts, seeding, I-JEPA's edges, the batch hook and the argument checks."""

import math
import random

import numpy as np
import pytest
import torch

from data.device_decode import DeviceCrops
from data.multiblock import MultiBlockMasks, block_ids

# (grid, extra arguments): I-JEPA's recipe on ViT-B/16 and ViT-H/14 grids at 224 px, and a small grid that needs a
# smaller min_keep to fit
GRIDS = [((14, 14), {}), ((16, 16), {}), ((7, 7), {"min_keep": 5})]


def _bounding_box(ids: torch.Tensor, width: int) -> tuple[int, int, int, int]:
    """(top, left, height, width) of the smallest rectangle holding the row-major token indices `ids`."""
    rows, cols = ids // width, ids % width
    top, left = int(rows.min()), int(cols.min())
    return top, left, int(rows.max()) - top + 1, int(cols.max()) - left + 1


def _rounding_allows(size: tuple[int, int], num_tokens: int, scale: tuple, aspect: tuple) -> tuple[bool, bool]:
    """Whether a (height, width) block can come from an area budget floor(L * s), s in `scale`, and a ratio a in
    `aspect`: sides round(sqrt(area * a)) and round(sqrt(area / a)) are each within 1/2 of the exact x and y (x * y =
    area, x / y = a), so height * width is within (x + y) / 2 + 1/4 <= (height + width) / 2 + 3/4 of the budget and
    a lies in [(height - 1/2) / (width + 1/2), (height + 1/2) / (width - 1/2)]."""
    height, width = size
    slack = (height + width) / 2 + 0.75
    area_ok = math.floor(num_tokens * scale[0]) - slack <= height * width <= math.floor(num_tokens * scale[1]) + slack
    aspect_ok = (height - 0.5) / (width + 0.5) <= aspect[1] and (height + 0.5) / max(width - 0.5, 1e-9) >= aspect[0]
    return area_ok, aspect_ok


@pytest.mark.parametrize(
    ("grid", "kwargs", "target_sizes", "context_sizes"),
    [
        # u = 0: int(196 * 0.15) = 29 tokens at 0.75 -> round(4.66) x round(6.22); u = 1: 39 at 1.5 -> 8 x 5
        ((14, 14), {}, {(5, 6), (6, 5), (6, 6), (7, 5), (8, 5)}, {(13, 13), (14, 14)}),  # 166 -> 13, 196 -> 14
        ((16, 16), {}, {(5, 7), (6, 6), (6, 7), (7, 6), (8, 6), (9, 6)}, {(15, 15), (16, 16)}),  # 217 -> 15
        ((14, 14), {"ijepa_edges": True}, {(5, 6), (6, 5), (6, 6), (7, 5), (8, 5)}, {(13, 13)}),  # 14 clamped to 13
        ((7, 7), {"min_keep": 5}, {(2, 3), (3, 3), (4, 2), (4, 3)}, {(6, 6), (7, 7)}),  # int(7.35) = 7 -> 2 x 3
    ],
)
def test_possible_block_sizes_follow_ijepa_rounding(grid, kwargs, target_sizes, context_sizes):
    masks = MultiBlockMasks(grid, **kwargs)
    assert masks.target_sizes == target_sizes
    assert masks.context_sizes == context_sizes
    rng, seen = random.Random(0), set()
    for _ in range(200):
        blocks = masks.draw_blocks(1, rng)
        seen.add(blocks.target_size)
        assert blocks.context_size in context_sizes
    assert seen == target_sizes  # 200 batches draw every possible target size


@pytest.mark.parametrize(("grid", "kwargs"), GRIDS)
def test_every_sample_of_a_batch_has_the_batch_sizes_within_scale_and_aspect(grid, kwargs):
    masks = MultiBlockMasks(grid, **kwargs)
    num_tokens, width = grid[0] * grid[1], grid[1]
    rng = random.Random(1)
    target_fractions, target_aspects, context_fractions = [], [], []
    for _ in range(200):
        blocks = masks.draw_blocks(4, rng)
        ids = blocks.ids()
        for sample_targets, sample_ids in zip(blocks.targets, ids["target_ids"], strict=True):
            for block, target_ids in zip(sample_targets, sample_ids, strict=True):
                box = _bounding_box(target_ids, width)
                assert box == block and box[2:] == blocks.target_size  # a full rectangle of the batch's size
                assert torch.equal(target_ids, torch.from_numpy(block_ids(block, width)))
        assert {block[2:] for block in blocks.contexts} == {blocks.context_size}
        height, block_width = blocks.target_size
        target_ok = _rounding_allows(blocks.target_size, num_tokens, masks.target_scale, masks.target_aspect)
        context_ok = _rounding_allows(blocks.context_size, num_tokens, masks.context_scale, masks.context_aspect)
        assert target_ok == context_ok == (True, True), (blocks.target_size, blocks.context_size)
        assert blocks.context_size[0] == blocks.context_size[1]  # aspect 1.0 on a square grid
        target_fractions.append(height * block_width / num_tokens)
        target_aspects.append(height / block_width)
        context_fractions.append(blocks.context_size[0] * blocks.context_size[1] / num_tokens)
    # the rounded sizes sit near the ranges: scales 0.15-0.2 and 0.85-1.0, aspect 0.75-1.5 (7 x 7 rounds widest)
    assert min(target_fractions) >= 0.12 and max(target_fractions) <= 0.25
    assert min(target_aspects) >= 0.5 and min(target_aspects) < 1 < max(target_aspects) <= 2.0
    assert min(context_fractions) >= 0.73 and max(context_fractions) == 1.0


@pytest.mark.parametrize(("grid", "kwargs"), [*GRIDS, ((7, 7), {"min_keep": 16})])
def test_context_is_its_block_less_the_targets_and_keeps_more_than_min_keep(grid, kwargs):
    masks = MultiBlockMasks(grid, **kwargs)
    rng, num_tries = random.Random(2), []
    for _ in range(200):
        blocks = masks.draw_blocks(4, rng)
        for targets, context, context_ids in zip(blocks.targets, blocks.contexts, blocks.context_ids, strict=True):
            covered = set(np.concatenate([block_ids(block, grid[1]) for block in targets]).tolist())
            expected = [i for i in block_ids(context, grid[1]).tolist() if i not in covered]
            assert context_ids.tolist() == expected  # ascending, the block less every target token
            assert len(context_ids) > masks.min_keep
        num_tries += blocks.num_context_tries
    if masks.min_keep == 16:  # a crowded 7 x 7 grid: contexts retried, and target blocks placed afresh
        assert max(num_tries) > masks.tries
    else:
        assert np.mean(num_tries) < 1.05


@pytest.mark.parametrize(("grid", "kwargs"), [*GRIDS, ((7, 7), {"min_keep": 16})])
def test_drawn_ids_stack_with_equal_counts_and_never_overlap(grid, kwargs):
    masks = MultiBlockMasks(grid, **kwargs)
    rng = random.Random(3)
    for _ in range(200):
        out = masks.draw(8, rng)
        context, target = out["context_ids"], out["target_ids"]
        assert context.dtype == target.dtype == torch.int64
        assert context.shape[0] == 8 and context.shape[1] > masks.min_keep
        assert target.shape[:2] == (8, 4)
        assert min(int(context.min()), int(target.min())) >= 0
        assert max(int(context.max()), int(target.max())) < grid[0] * grid[1]
        assert bool((context[:, 1:] > context[:, :-1]).all()) and bool((target[..., 1:] > target[..., :-1]).all())
        for sample_context, sample_targets in zip(context, target, strict=True):
            assert not set(sample_context.tolist()) & set(sample_targets.flatten().tolist())


def test_trimming_keeps_each_context_first_indices():
    masks = MultiBlockMasks((14, 14))
    num_trimmed = 0
    for seed in range(20):
        blocks = masks.draw_blocks(8, random.Random(seed))
        out = masks.draw(8, random.Random(seed))  # the same draws
        counts = [len(ids) for ids in blocks.context_ids]
        assert out["context_ids"].shape == (8, min(counts))
        for row, ids in zip(out["context_ids"], blocks.context_ids, strict=True):
            assert row.tolist() == ids[: min(counts)].tolist()
            num_trimmed += len(ids) > min(counts)
    assert num_trimmed > 100  # of 160 contexts: the untrimmed counts do differ


def _five_batches(masks: MultiBlockMasks, seed: int) -> list[dict[str, torch.Tensor]]:
    rng = random.Random(seed)
    return [masks.draw(8, rng) for _ in range(5)]


def test_seeded_rng_gives_the_same_masks_and_seeds_differ():
    masks = MultiBlockMasks((14, 14))
    first, again, other = _five_batches(masks, 7), _five_batches(masks, 7), _five_batches(masks, 8)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a["context_ids"], b["context_ids"]) and torch.equal(a["target_ids"], b["target_ids"])
    differs = [not torch.equal(a["target_ids"], c["target_ids"]) for a, c in zip(first, other, strict=True)]
    assert all(differs)


def test_allow_overlap_keeps_whole_context_blocks():
    masks = MultiBlockMasks((14, 14), allow_overlap=True)
    rng, num_overlapping = random.Random(4), 0
    for _ in range(50):
        blocks = masks.draw_blocks(4, rng)
        out = blocks.ids()
        height, width = blocks.context_size
        assert out["context_ids"].shape == (4, height * width)  # nothing taken out, nothing trimmed
        for row, context, targets in zip(out["context_ids"], blocks.contexts, out["target_ids"], strict=True):
            assert _bounding_box(row, 14) == context
            num_overlapping += bool(set(row.tolist()) & set(targets.flatten().tolist()))
    assert num_overlapping > 150  # a 13 x 13 or 14 x 14 context almost always holds a target token


def test_ijepa_edges_never_reach_the_last_row_or_column():
    grid = (14, 14)
    last = {13 * 14 + col for col in range(14)} | {row * 14 + 13 for row in range(14)}
    ijepa, ours = MultiBlockMasks(grid, ijepa_edges=True), MultiBlockMasks(grid)
    rng, reached = random.Random(5), 0
    for _ in range(100):
        blocks = ijepa.draw_blocks(4, rng)
        assert blocks.contexts == [(0, 0, 13, 13)] * 4  # I-JEPA's context on 14 x 14: always the top-left 13 x 13
        out = ijepa.draw(4, rng)
        assert not set(out["context_ids"].flatten().tolist()) & last
        assert not set(out["target_ids"].flatten().tolist()) & last
        reached += bool(set(ours.draw(4, rng)["target_ids"].flatten().tolist()) & last)
    assert reached > 50


def test_add_to_batch_draws_for_every_image():
    masks = MultiBlockMasks((14, 14))
    batch = masks.add_to_batch({"image": torch.zeros(6, 3, 224, 224, dtype=torch.uint8)}, random.Random(0))
    assert batch["context_ids"].shape[0] == 6 and batch["target_ids"].shape[:2] == (6, 4)
    assert torch.equal(batch["target_ids"], masks.draw(6, random.Random(0))["target_ids"])
    crops = DeviceCrops(
        pixels=torch.zeros(2, 3, 224, 224, dtype=torch.uint8),
        jpeg=torch.zeros(10, dtype=torch.uint8),
        ends=torch.tensor([4, 10]),
        crops=torch.zeros(2, 5, dtype=torch.int64),
        on_device=torch.tensor([True, False, False, True]),
    )
    batch = masks.add_to_batch({"image": crops}, random.Random(0))
    assert batch["context_ids"].shape[0] == 4 and batch["target_ids"].shape[0] == 4  # not the namedtuple's 5 fields


def test_a_context_that_can_just_keep_min_keep_is_accepted_and_one_more_is_rejected():
    # 10 x 10 context and 6 x 6 targets on 14 x 14: at best all targets sit in the far corner, overlapping 2 x 2
    kwargs = {"context_scale": (0.5, 0.5), "target_scale": (0.2, 0.2), "target_aspect": (1.0, 1.0)}
    with pytest.raises(ValueError, match=r"min_keep=96 cannot be met: a 10x10 context block .* keeps at most 96"):
        MultiBlockMasks((14, 14), min_keep=96, **kwargs)
    masks = MultiBlockMasks((14, 14), min_keep=95, **kwargs)  # possible, but about 4e-9 per placement
    with pytest.raises(RuntimeError, match="no 10x10 context block kept more than min_keep=95 tokens"):
        masks.draw(1, random.Random(0))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"grid": (0, 14)}, r"grid must be \(height, width\) with both >= 1"),
        ({"grid": (1, 14), "ijepa_edges": True}, "grid must be .* both >= 2"),
        ({"target_scale": (0.0, 0.2)}, r"target_scale must be \(low, high\) with 0 < low <= high <= 1"),
        ({"target_scale": (0.2, 0.15)}, "target_scale must be"),
        ({"context_scale": (0.85, 1.1)}, "context_scale must be"),
        ({"target_aspect": (0.0, 1.5)}, "target_aspect must be"),
        ({"context_aspect": (1.5, 1.0)}, "context_aspect must be"),
        ({"num_targets": 0}, "num_targets must be >= 1, got 0"),
        ({"min_keep": -1}, "min_keep must be >= 0, got -1"),
        ({"tries": 0}, "tries must be >= 1, got 0"),
        ({"grid": (4, 4), "target_scale": (0.01, 0.02)}, r"target_scale=\(0.01, 0.02\) .* gives a 0x0 block on"),
        ({"target_aspect": (200.0, 200.0)}, r"target_scale=.* with target_aspect=\(200.0, 200.0\) gives a 14x0 block"),
        ({"context_scale": (0.001, 0.002)}, "context_scale=.* gives a 0x0 block"),
        ({"min_keep": 170}, "min_keep=170 cannot be met: a 13x13 context block"),
        ({"grid": (7, 7)}, None),  # I-JEPA's min_keep 10 still fits a 7 x 7 grid
    ],
)
def test_arguments_are_checked(kwargs, message):
    kwargs = {"grid": (14, 14), **kwargs}
    if message is None:
        MultiBlockMasks(**kwargs)
        return
    with pytest.raises(ValueError, match=message):
        MultiBlockMasks(**kwargs)


def test_batch_size_is_checked():
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        MultiBlockMasks((14, 14)).draw(0, random.Random(0))
