"""What TensorBoard shows: upscaled grids, the BEiT-style masked-patch picture, the tokenizer's code usage, and the
hparams summary, each checked pixel by pixel or read back from the written event file."""

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

from core.recipe.config import Config
from core.report.logging import MetricsLogger, flat_hparams
from core.report.pictures import PADDING, bar_chart, bar_chart_origin, image_grid, title_height, upscale_nearest
from pretrain.beit import MaskedPatchPrediction
from pretrain.pictures import MASKED_GREY, OUTLINE, code_usage, code_usage_picture, masked_patch_grid
from pretrain.targets import Color3Bit4x4, MeanColor3Bit, PixelsL2, class_colors, quantize_color
from tests.helpers.models import tiny_vit

NORM = dict(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))


def _tile(grid, row, col, side, titled=True):
    """Panel (row, col) of an `image_grid` whose panels are `side` pixels square."""
    top = (title_height() if titled else 0) + PADDING + row * (side + PADDING)
    left = PADDING + col * (side + PADDING)
    return grid[:, top : top + side, left : left + side]


def test_upscale_nearest_repeats_each_pixel_into_a_block():
    images = torch.rand(2, 3, 28, 20)
    up = upscale_nearest(images)  # shorter side 20 -> factor ceil(112 / 20) = 6
    assert up.shape == (2, 3, 168, 120)
    for dy, dx in [(0, 0), (5, 5), (2, 4)]:  # every pixel of each 6 x 6 block is its source pixel
        assert torch.equal(up[..., dy::6, dx::6], images)
    large = torch.rand(1, 3, 224, 224)
    assert upscale_nearest(large) is large


def test_image_grid_lays_out_titled_columns_of_upscaled_panels():
    first, second = torch.rand(3, 3, 28, 28), torch.rand(3, 3, 28, 28)
    grid = image_grid([first, second], ["first", "second"])
    side = 112
    assert grid.shape == (3, title_height() + 3 * (side + PADDING) + PADDING, 2 * (side + PADDING) + PADDING)
    for row in range(3):
        assert torch.equal(_tile(grid, row, 0, side)[:, ::4, ::4], first[row])
        assert torch.equal(_tile(grid, row, 1, side)[:, 1::4, 3::4], second[row])
    strip = grid[:, : title_height()]
    assert (strip < 0.5).any()  # the titles' dark text
    assert image_grid([first], None).shape == (3, 3 * (side + PADDING) + PADDING, side + 2 * PADDING)
    with pytest.raises(ValueError, match="1 titles for 2 columns"):
        image_grid([first, second], ["one"])


def test_class_colors_are_the_bin_centres_quantize_color_maps_back():
    classes = torch.arange(512)
    colors = class_colors(classes)  # (512, 3)
    assert torch.equal(quantize_color(colors), classes)
    assert class_colors(torch.tensor(4 * 64 + 2 * 8 + 7)).tolist() == [4.5 / 8, 2.5 / 8, 7.5 / 8]


def _beit(target):
    return MaskedPatchPrediction(tiny_vit(seed=0), target, num_masked=4)


def _masked_batch():
    torch.manual_seed(1)
    mask = torch.zeros(3, 4, 4, dtype=torch.bool)
    mask[0, 1:3, 1:3] = True  # a 2 x 2 block
    mask[1, 0, :] = True  # the top row
    mask[2, 3, 3] = mask[2, 0, 0] = mask[2, 0, 3] = mask[2, 3, 0] = True  # the four corner patches
    return {"image": torch.randn(3, 3, 16, 16), "mask": mask}


@pytest.mark.parametrize("target_kind", ["mean_color_3bit", "color_3bit_4x4"])
def test_beit_picture_marks_exactly_the_masked_patches_and_paints_the_colours(target_kind):
    target = MeanColor3Bit((4, 4), **NORM) if target_kind == "mean_color_3bit" else Color3Bit4x4((4, 4), **NORM)
    batch = _masked_batch()
    with torch.no_grad():
        out = _beit(target)(batch)
    grid = masked_patch_grid(
        batch["image"], out["mask"], out["pred"], out["target"], target_kind=target_kind, patch_size=(4, 4), **NORM
    )
    side, patch = 112, 28  # 16 px upscaled x7; 4 px patches become 28 px
    assert grid.shape == (3, title_height() + 3 * (side + PADDING) + PADDING, 4 * (side + PADDING) + PADDING)
    original = (batch["image"] * 0.25 + 0.5).clamp(0, 1)
    cells = 1 if target_kind == "mean_color_3bit" else 16
    predicted = out["pred"].view(-1, cells, 512).argmax(-1)  # (N, cells) in row-major (image, patch) order
    colours = {"target": class_colors(out["target"].view(-1, cells)), "predicted": class_colors(predicted)}
    masked_index = 0
    for row in range(3):
        assert torch.equal(_tile(grid, row, 0, side)[:, ::7, ::7], original[row])  # the input, untouched
        for gy in range(4):
            for gx in range(4):
                y, x = gy * patch, gx * patch
                panels = [_tile(grid, row, col, side)[:, y : y + patch, x : x + patch] for col in range(1, 4)]
                source = upscale_nearest(original[row : row + 1])[0, :, y : y + patch, x : x + patch]
                if not batch["mask"][row, gy, gx]:
                    assert all(torch.equal(panel, source) for panel in panels), (row, gy, gx)  # visible: as input
                    continue
                masked, target_panel, pred_panel = panels
                inner = (slice(None), slice(2, patch - 2), slice(2, patch - 2))  # inside the outline
                assert torch.equal(masked[inner], torch.full_like(masked[inner], MASKED_GREY))
                for panel, name in ((target_panel, "target"), (pred_panel, "predicted")):
                    colour = colours[name][masked_index]  # (cells, 3)
                    for cell in range(cells):  # the centre of each of the patch's 1 or 4 x 4 cells
                        cy, cx = divmod(cell, 4) if cells == 16 else (1.5, 1.5)
                        pixel = panel[:, int((cy + 0.5) * 7), int((cx + 0.5) * 7)]
                        torch.testing.assert_close(pixel, colour[cell], atol=0, rtol=0)
                masked_index += 1
    assert masked_index == out["mask"].sum()


def test_beit_picture_outlines_the_border_of_the_masked_region_only():
    batch = _masked_batch()
    with torch.no_grad():
        out = _beit(MeanColor3Bit((4, 4), **NORM))(batch)
    grid = masked_patch_grid(
        batch["image"], out["mask"], out["pred"], out["target"], target_kind="tokenizer", patch_size=(4, 4), **NORM
    )
    assert grid.shape[-1] == 2 * (112 + PADDING) + PADDING  # codes are not pictures: input and mask only
    masked = _tile(grid, 0, 1, 112)  # the 2 x 2 block at patches (1..2, 1..2), 28 px each
    orange = (masked - torch.tensor(OUTLINE).view(3, 1, 1)).abs().amax(dim=0) == 0  # (112, 112)
    ys, xs = orange.nonzero(as_tuple=True)
    assert (ys.min(), ys.max(), xs.min(), xs.max()) == (28, 83, 28, 83)  # the block's outer border
    assert orange[28, 28:84].all() and orange[83, 28:84].all() and orange[28:84, 28].all()
    assert not orange[55, 29:83].any()  # no line between the block's own patches


def test_beit_picture_of_a_perfect_pixel_prediction_is_the_input():
    batch = _masked_batch()
    with torch.no_grad():
        out = _beit(PixelsL2((4, 4), norm_pix=True))(batch)
    kwargs = dict(target_kind="pixels_l2", patch_size=(4, 4), norm_pix=True, **NORM)
    grid = masked_patch_grid(batch["image"], out["mask"], out["target"], out["target"], **kwargs)
    assert grid.shape[-1] == 3 * (112 + PADDING) + PADDING  # input, masked, predicted: the target is the input
    for row in range(3):
        predicted, original = _tile(grid, row, 2, 112), _tile(grid, row, 0, 112)
        inside = ~(predicted == torch.tensor(OUTLINE).view(3, 1, 1)).all(dim=0)  # (112, 112) off the outline
        torch.testing.assert_close(predicted[:, inside], original[:, inside], atol=1e-5, rtol=0)


def test_code_usage_histogram_holds_the_code_counts(tmp_path):
    codes = torch.tensor([[[3, 3, 0], [5, 3, 0]], [[3, 7, 7], [0, 3, 5]]])  # (B, h, w) of a codebook of 8
    counts = code_usage(codes, 8)
    assert counts.tolist() == [3, 0, 0, 5, 0, 2, 0, 2]
    logger = MetricsLogger(tmp_path, enabled=True)
    logger.histogram_counts("train/code_usage", 4, counts)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    (event,) = events.Histograms("train/code_usage")
    histogram = event.histogram_value
    assert event.step == 4 and histogram.bucket_limit == [0.5 + i for i in range(8)]
    assert histogram.bucket == counts.tolist() and histogram.num == 12
    assert (histogram.min, histogram.max, histogram.sum) == (0, 7, float((torch.arange(8) * counts).sum()))


def test_code_usage_picture_draws_one_bar_per_code_most_used_first():
    counts = torch.tensor([3, 0, 12, 6])
    picture = code_usage_picture(counts)
    x0, y0 = bar_chart_origin()
    bar, height = 512 // 4, 128
    heights = []
    for i in range(4):
        column = picture[0, y0 : y0 + height, x0 + i * bar + bar // 2]  # (height,) red channel of the bar's middle
        heights.append(int((column < 0.5).sum()))
    assert heights == [128, 64, 32, 0]  # 12, 6, 3, 0 sorted from the top, the tallest filling the plot
    plain = bar_chart(torch.tensor([1.0, 2.0]), title="t", x_label="x", width=10)
    assert plain.shape[-1] == x0 + 10 + 4


def test_flat_hparams_gives_dotted_keys_of_plain_values():
    flat = flat_hparams({"optim": {"base_lr": 1e-3, "betas": [0.9, 0.95]}, "seed": 0, "x": None, "flag": True})
    assert flat == {"optim.base_lr": 1e-3, "optim.betas": "[0.9, 0.95]", "seed": 0, "x": "none", "flag": "true"}
    resolved = flat_hparams(Config().model_dump(mode="json"))
    assert resolved["objective.kind"] == "mae" and resolved["objective.mask_ratio"] == 0.75
    assert all(isinstance(v, int | float | str) for v in resolved.values())


def test_hparams_summary_is_in_the_event_file_without_an_experiment(tmp_path):
    config = Config().model_dump(mode="json")
    logger = MetricsLogger(tmp_path, enabled=True)
    logger.hparams(config)
    logger.scalars(1, {"train/loss": 2.5})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    content = events.PluginTagToContent(hparams_metadata.PLUGIN_NAME)
    start = HParamsPluginData.FromString(content[hparams_metadata.SESSION_START_INFO_TAG]).session_start_info
    assert set(start.hparams) == set(flat_hparams(config))
    assert start.hparams["optim.base_lr"].number_value == config["optim"]["base_lr"]
    assert start.hparams["objective.kind"].string_value == "mae"
    # No experiment summary: TensorBoard builds it from every run's settings and takes the metrics from the scalars.
    assert hparams_metadata.EXPERIMENT_TAG not in content
    assert [s.value for s in events.Scalars("train/loss")] == [2.5]
    MetricsLogger(tmp_path / "other", enabled=False).hparams(config)
    assert not (tmp_path / "other").exists()
