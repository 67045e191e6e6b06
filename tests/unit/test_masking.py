"""Mask generators: exact counts, block geometry, top-up adjacency, statistics, seeding, argument checks."""

import random

import pytest
import torch

from data.masking import BlockwiseMaskGenerator, RandomMaskGenerator

# (grid, num_masked, min_patches)
BLOCKWISE_CASES = [
    ((14, 14), 75, 16),  # BEiT's setting for 224 px, patch 16
    ((7, 7), 20, 4),
    ((3, 5), 6, 16),  # min_patches > num_masked: no block fits, all from the top-up
    ((8, 12), 40, 16),  # non-square
    ((12, 8), 40, 4),
    ((14, 14), 196, 16),  # everything
    ((14, 14), 0, 16),  # nothing
]


def _touches(mask: torch.Tensor, top: int, left: int) -> bool:
    """Whether patch (top, left) has a masked 4-neighbour in `mask` (h, w)."""
    height, width = mask.shape
    neighbours = [(top - 1, left), (top + 1, left), (top, left - 1), (top, left + 1)]
    return any(0 <= r < height and 0 <= c < width and bool(mask[r, c]) for r, c in neighbours)


@pytest.mark.parametrize(("grid", "num_masked", "min_patches"), BLOCKWISE_CASES)
def test_blockwise_count_is_exact(grid, num_masked, min_patches):
    generator = BlockwiseMaskGenerator(grid, num_masked, min_patches=min_patches)
    rng = random.Random(0)
    for _ in range(200):
        mask = generator(rng)
        assert mask.shape == grid and mask.dtype == torch.bool
        assert int(mask.sum()) == num_masked


@pytest.mark.parametrize(("grid", "num_masked", "min_patches"), BLOCKWISE_CASES)
def test_blocks_are_rectangles_in_grid_whose_union_is_the_mask(grid, num_masked, min_patches):
    generator = BlockwiseMaskGenerator(grid, num_masked, min_patches=min_patches)
    rng = random.Random(1)
    for _ in range(200):
        mask, blocks = generator.sample_blocks(rng)
        union = torch.zeros(grid, dtype=torch.bool)
        seen_top_up = False
        for top, left, height, width in blocks:
            assert height >= 1 and width >= 1
            assert top >= 0 and left >= 0 and top + height <= grid[0] and left + width <= grid[1]
            if height * width == 1:  # a top-up patch: comes after all blocks, grows the mask
                seen_top_up = True
                assert not union[top, left]
                assert _touches(union, top, left) or not union.any()
            else:
                assert not seen_top_up, "a block after the top-up"
                assert height * width >= min_patches
                assert not union[top : top + height, left : left + width].all(), "block masked nothing new"
            union[top : top + height, left : left + width] = True
        assert torch.equal(union, mask)


def test_blocks_respect_max_patches():
    generator = BlockwiseMaskGenerator((14, 14), 75, min_patches=9, max_patches=20)
    rng = random.Random(2)
    areas = [h * w for _ in range(300) for _, _, h, w in generator.sample_blocks(rng)[1] if h * w > 1]
    assert areas and all(9 <= area <= 20 for area in areas)


def test_min_patches_above_budget_gives_one_connected_region():
    generator = BlockwiseMaskGenerator((3, 5), 6, min_patches=16)
    rng = random.Random(3)
    for _ in range(100):
        mask, blocks = generator.sample_blocks(rng)
        assert len(blocks) == 6 and all(h == w == 1 for _, _, h, w in blocks)
        # flood fill from the first patch reaches all six
        todo, reached = [blocks[0][:2]], set()
        while todo:
            r, c = todo.pop()
            if (r, c) in reached or not (0 <= r < 3 and 0 <= c < 5) or not mask[r, c]:
                continue
            reached.add((r, c))
            todo += [(r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)]
        assert len(reached) == 6


def test_blockwise_masks_differ_across_draws():
    generator = BlockwiseMaskGenerator((14, 14), 75)
    rng = random.Random(4)
    masks = {tuple(generator(rng).flatten().tolist()) for _ in range(100)}
    assert len(masks) >= 95


def test_blockwise_statistics():
    grid, num_masked, num_draws = (14, 14), 75, 2000
    generator = BlockwiseMaskGenerator(grid, num_masked)
    rng = random.Random(5)
    counts = torch.zeros(grid)
    aspects = []
    for _ in range(num_draws):
        mask, blocks = generator.sample_blocks(rng)
        counts += mask
        aspects += [h / w for _, _, h, w in blocks if h * w > 1]
    frequency = counts / num_draws  # (h, w), fraction of draws masking each patch
    assert frequency.mean().item() == pytest.approx(num_masked / 196)
    assert frequency.min() > 0.02, "some patch is (almost) never masked"
    assert frequency.max() < 0.8, "some patch is (almost) always masked"
    # blocks sit anywhere, so the centre is masked more often than a corner
    assert frequency[6:8, 6:8].mean() > frequency[0, 0] + 0.1
    assert min(aspects) <= 0.5 and max(aspects) >= 2.0, "blocks should be both wide and tall"
    assert 0.2 < sum(a > 1 for a in aspects) / len(aspects) < 0.8


def _adjacent_pairs(mask: torch.Tensor) -> int:
    """Number of horizontally or vertically adjacent masked pairs in (h, w)."""
    return int((mask[1:] & mask[:-1]).sum() + (mask[:, 1:] & mask[:, :-1]).sum())


def test_blockwise_is_more_clustered_than_random():
    blockwise = BlockwiseMaskGenerator((14, 14), 98)
    uniform = RandomMaskGenerator((14, 14), 0.5)
    rng = random.Random(6)
    block_pairs = sum(_adjacent_pairs(blockwise(rng)) for _ in range(100))
    random_pairs = sum(_adjacent_pairs(uniform(rng)) for _ in range(100))
    assert block_pairs > 1.5 * random_pairs


@pytest.mark.parametrize(
    ("grid", "ratio", "num_masked"), [((14, 14), 0.5, 98), ((14, 14), 0.75, 147), ((3, 5), 0.4, 6)]
)
def test_random_count_is_exact(grid, ratio, num_masked):
    generator = RandomMaskGenerator(grid, ratio)
    rng = random.Random(7)
    for _ in range(200):
        mask = generator(rng)
        assert mask.shape == grid and mask.dtype == torch.bool
        assert int(mask.sum()) == num_masked


def test_random_statistics():
    generator = RandomMaskGenerator((14, 14), 0.5)
    rng = random.Random(8)
    masks = torch.stack([generator(rng) for _ in range(2000)]).float()  # (2000, 14, 14)
    assert (masks.mean(dim=(1, 2)) == 0.5).all()
    frequency = masks.mean(dim=0)  # (14, 14); binomial sd over 2000 draws is about 0.011
    assert (frequency - 0.5).abs().max() < 0.06
    assert len({tuple(m.flatten().tolist()) for m in masks[:100]}) == 100


@pytest.mark.parametrize(
    "generator",
    [
        BlockwiseMaskGenerator((14, 14), 75),
        BlockwiseMaskGenerator((7, 7), 20, min_patches=4),
        RandomMaskGenerator((14, 14), 0.5),
    ],
)
def test_same_seed_same_mask(generator):
    first = generator(random.Random(11))
    assert torch.equal(first, generator(random.Random(11)))
    # the global RNG (seeded per sample by the pipeline) gives the same stream as an explicit one
    state = random.getstate()
    try:
        random.seed(11)
        assert torch.equal(first, generator())
        random.seed(11)
        assert torch.equal(first, generator())
    finally:
        random.setstate(state)  # leave the global RNG as other tests found it
    assert any(not torch.equal(first, generator(random.Random(seed))) for seed in range(12, 15))


def test_blocks_reproduce_with_seed():
    generator = BlockwiseMaskGenerator((8, 12), 40)
    assert generator.sample_blocks(random.Random(3))[1] == generator.sample_blocks(random.Random(3))[1]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"grid": (14, 14), "num_masked": 197}, "num_masked"),
        ({"grid": (14, 14), "num_masked": -1}, "num_masked"),
        ({"grid": (14, 14), "num_masked": 75, "min_patches": 0}, "min_patches"),
        ({"grid": (14, 14), "num_masked": 75, "min_patches": 16, "max_patches": 8}, "max_patches"),
        ({"grid": (14, 14), "num_masked": 75, "aspect_ratio": (0.0, 2.0)}, "aspect_ratio"),
        ({"grid": (14, 14), "num_masked": 75, "aspect_ratio": (3.0, 0.3)}, "aspect_ratio"),
        ({"grid": (14, 14), "num_masked": 75, "tries": 0}, "tries"),
        ({"grid": (0, 14), "num_masked": 0}, "grid"),
    ],
)
def test_blockwise_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        BlockwiseMaskGenerator(**kwargs)


@pytest.mark.parametrize(
    ("grid", "ratio", "name"), [((14, 14), 1.5, "ratio"), ((14, 14), -0.1, "ratio"), ((14, 0), 0.5, "grid")]
)
def test_random_bad_arguments(grid, ratio, name):
    with pytest.raises(ValueError, match=name):
        RandomMaskGenerator(grid, ratio)
