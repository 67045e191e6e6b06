"""BEiT-style targets on hand-computed values."""

import pytest
import torch

from pretrain.mae import patchify
from pretrain.targets import Color3Bit4x4, MeanColor3Bit, PixelsL2, TokenizerCodes, quantize_color

IDENTITY = dict(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))


def test_quantize_color_bins():
    rgb = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.5, 0.25, 0.99], [0.124, 0.126, 0.875]])
    # bins: floor(8c) clamped to 7 -> (0,0,0), (7,7,7), (4,2,7), (0,1,7); class = 64 r + 8 g + b
    assert quantize_color(rgb).tolist() == [0, 511, 4 * 64 + 2 * 8 + 7, 0 + 8 + 7]


def _four_patches() -> torch.Tensor:
    """(1, 3, 8, 8) image in [0, 1] with four 4x4 patches of known mean colour."""
    image = torch.zeros(1, 3, 8, 8)
    image[0, 0, :4, :4] = 1.0  # patch 0: red 1.0 -> bins (7, 0, 0) = 448
    image[0, 1, :2, 4:] = 1.0  # patch 1: half its pixels green -> mean g 0.5 -> bin 4 -> 32
    image[0, 2, 4:, :4] = 0.3  # patch 2: blue 0.3 -> bin floor(2.4) = 2
    return image  # patch 3 black -> 0


def test_mean_color_3bit_hand_values():
    target = MeanColor3Bit((4, 4), **IDENTITY)
    assert target({"image": _four_patches()}).tolist() == [[448, 32, 2, 0]]
    assert target.num_classes == 512 and target.num_outputs == 1


def test_mean_color_3bit_undoes_normalisation():
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)
    image = _four_patches()
    normalised = (image - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    assert MeanColor3Bit((4, 4), mean, std)({"image": normalised}).tolist() == [[448, 32, 2, 0]]


def test_color_3bit_4x4_cells():
    image = torch.zeros(1, 3, 8, 16)  # two 8x8 patches, each cell of the 4x4 downsizing is 2x2 pixels
    image[0, :, :2, :2] = 1.0  # patch 0, cell 0: white -> 511
    image[0, 2, 2:4, 10:12] = 1.0  # patch 1, cell (1, 1) = 5: blue -> 7
    image[0, 0, 6:8, 6] = 1.0  # patch 0, cell (3, 3) = 15: half its pixels red -> bin 4 -> 256
    out = Color3Bit4x4((8, 8), **IDENTITY)({"image": image})
    assert out.shape == (1, 2, 16)
    expected = torch.zeros(1, 2, 16, dtype=torch.long)
    expected[0, 0, 0], expected[0, 1, 5], expected[0, 0, 15] = 511, 7, 256
    assert torch.equal(out, expected)


def test_color_3bit_4x4_needs_4px_patches():
    with pytest.raises(ValueError, match="at least 4x4"):
        Color3Bit4x4((2, 2), **IDENTITY)


def test_pixels_l2_is_patchify_and_norm_pix_standardises():
    image = torch.randn(2, 3, 8, 12)
    assert torch.equal(PixelsL2((4, 4))({"image": image}), patchify(image, (4, 4)))
    normed = PixelsL2((4, 4), norm_pix=True)({"image": image})
    assert normed.shape == (2, 6, 48) and PixelsL2((4, 4)).num_outputs == 48
    torch.testing.assert_close(normed.mean(-1), torch.zeros(2, 6), atol=1e-5, rtol=0)
    torch.testing.assert_close(normed.var(-1), torch.ones(2, 6), atol=1e-3, rtol=0)  # unbiased, as MAE


class _FakeTokenizer(torch.nn.Module):
    grid = (2, 3)
    config = {"img_size": [4, 6], "downsample": 2, "codebook_size": 10}

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        return torch.arange(6).view(1, 2, 3).expand(images.shape[0], -1, -1)


def test_tokenizer_codes_flatten_row_major_and_stay_out_of_the_state_dict():
    target = TokenizerCodes(_FakeTokenizer(), (2, 3))
    codes = target({"tokenizer_image": torch.zeros(2, 3, 4, 6)})
    assert codes.tolist() == [[0, 1, 2, 3, 4, 5]] * 2 and target.num_classes == 10
    assert not list(target.parameters()) and not target.state_dict()


def test_tokenizer_grid_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"tokenizer grid \(2, 3\).*encoder's patch grid \(7, 7\)"):
        TokenizerCodes(_FakeTokenizer(), (7, 7))
