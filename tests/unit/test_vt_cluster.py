"""VT's clustering tokenizer: the initial centres from the downsampled map, the Lloyd steps against a hand-computed
case and a per-image reference, batching, determinism and where gradients flow."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F

from core.models import vt as _vt  # noqa: F401  (registers vt_resnet* with timm)
from core.models.vt_cluster import ClusterTokenizer, centre_grid, kmeans_centres


def test_the_centre_grid_is_the_squarest_factorisation():
    assert [centre_grid(n) for n in (16, 8, 12, 7, 1)] == [(4, 4), (2, 4), (3, 4), (1, 7), (1, 1)]


@pytest.mark.parametrize("num_tokens, grid", [(16, (4, 4)), (8, (2, 4))])
def test_without_lloyd_steps_the_centres_are_the_downsampled_map(num_tokens, grid):
    """An 8x8 map made of constant blocks, one per grid cell: each centre is its block's vector, normalised."""
    torch.manual_seed(0)
    rows, cols = grid
    vectors = torch.randn(rows * cols, 5)  # (L, C), row-major over the grid
    cells = vectors.view(rows, cols, 5).repeat_interleave(8 // rows, 0).repeat_interleave(8 // cols, 1)  # (8, 8, C)
    x = cells.reshape(1, 64, 5)
    centres = kmeans_centres(x, (8, 8), num_tokens, iterations=0)
    torch.testing.assert_close(centres[0], F.normalize(vectors, dim=-1))


def test_one_lloyd_step_splits_two_obvious_clusters_by_hand():
    """Two pixel directions, e1-ish and e2-ish, laid out so that the 1x2 initial grid mixes them; one step gives each
    centre its cluster's normalised mean."""
    a, b = torch.tensor([1.0, 0.1]), torch.tensor([0.1, 1.0])
    # a 2x2 map: left column (a, a), right column (a, b) -> initial centres: mean(a, a) = a, mean(a, b)
    x = torch.stack([a, a, a, b]).view(1, 4, 2)  # row-major pixels of [[a, a], [a, b]]
    start = kmeans_centres(x, (2, 2), 2, iterations=0)[0]
    torch.testing.assert_close(start, F.normalize(torch.stack([a, (a + b) / 2]), dim=-1))
    step = kmeans_centres(x, (2, 2), 2, iterations=1)[0]
    # b is nearer the mixed centre, the three a's nearer a: centres a and b
    torch.testing.assert_close(step, F.normalize(torch.stack([a, b]), dim=-1))


def _reference(x: torch.Tensor, grid, num_tokens: int, iterations: int) -> torch.Tensor:
    """Per image, per pixel, per centre: the same k-means written as loops."""
    rows, cols = centre_grid(num_tokens)
    out = []
    for image in x:
        h, w = grid
        fmap = image.T.reshape(-1, h, w)
        centres = [
            F.normalize(fmap[:, r * h // rows : (r + 1) * h // rows, c * w // cols : (c + 1) * w // cols].mean((1, 2)),
                        dim=0)
            for r in range(rows) for c in range(cols)
        ]  # fmt: skip
        unit = F.normalize(image, dim=-1)
        for _ in range(iterations):
            groups = [[] for _ in centres]
            for pixel in unit:
                groups[int(torch.stack([pixel @ c for c in centres]).argmax())].append(pixel)
            centres = [
                F.normalize(torch.stack(g).sum(0), dim=0) if g else c for g, c in zip(groups, centres, strict=True)
            ]
        out.append(torch.stack(centres))
    return torch.stack(out)


@pytest.mark.parametrize("iterations", [0, 1, 2, 3])
def test_each_lloyd_step_matches_a_per_image_loop_and_images_are_clustered_independently(iterations):
    torch.manual_seed(1)
    x = torch.randn(3, 8 * 8, 6) + torch.randn(3, 1, 6)  # each image its own offset
    centres = kmeans_centres(x, (8, 8), 16, iterations)
    torch.testing.assert_close(centres, _reference(x, (8, 8), 16, iterations), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kmeans_centres(x[1:2], (8, 8), 16, iterations), centres[1:2])  # batch-independent
    assert torch.equal(kmeans_centres(x, (8, 8), 16, iterations), centres)  # deterministic
    if iterations:
        assert not torch.allclose(centres, kmeans_centres(x, (8, 8), 16, iterations - 1))  # every step moves them


def test_gradients_flow_through_the_pixels_not_the_centres():
    torch.manual_seed(0)
    x = torch.randn(2, 16, 8, requires_grad=True)
    assert not kmeans_centres(x, (4, 4), 4, 3).requires_grad
    tokens = ClusterTokenizer(8, 12, 4)(x, (4, 4))
    assert tokens.shape == (2, 4, 12)
    tokens.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_vt_resnet_takes_the_clustering_tokenizer_in_its_first_module():
    model = timm.create_model("vt_resnet18", tokenizer="cluster", num_classes=3, token_dim=64)
    assert isinstance(model.layer4[0].tokenizer, ClusterTokenizer)
    assert not isinstance(model.layer4[1].tokenizer, ClusterTokenizer)  # recurrent after the first
    assert not any("filters" in name for name, _ in model.named_parameters())
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 3)
