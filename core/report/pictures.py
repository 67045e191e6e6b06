"""Pictures for TensorBoard, drawn with torch and Pillow (no plotting library): nearest-neighbour upscaling, grids
of image panels under column titles, a labelled matrix with counts and a colour scale, and a bar chart.

Every function takes and returns float tensors in [0, 1], images as (3, H, W) or batches as (N, 3, H, W), which
`MetricsLogger.image` writes as they are. Text uses Pillow's default font (a small TrueType face when Pillow has
FreeType, else its bitmap font), so nothing is read from the system.

Shape legend: N images, H/W height/width, f integer upscale factor, R/C matrix rows/columns.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torchvision
from PIL import Image, ImageDraw, ImageFont

MIN_SIDE = 112
"""Small images are upscaled by the smallest integer factor that makes their shorter side at least this (28 px: x4)."""

PADDING = 2  # white pixels between and around the panels of a grid
FONT_SIZE = 12
MAX_LABEL_CHARS = 16  # longer names are cut to this many characters, the last one an ellipsis
_MARGIN = 4  # pixels between text and what it labels
_BLACK, _WHITE = (0, 0, 0), (255, 255, 255)


@functools.cache
def font(size: int = FONT_SIZE) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


def line_height() -> int:
    face = font()
    if isinstance(face, ImageFont.FreeTypeFont):
        ascent, descent = face.getmetrics()
        return ascent + descent
    return face.getbbox("Ag")[3]  # Pillow without FreeType: the bitmap font


def text_width(text: str) -> int:
    return math.ceil(font().getlength(text))


def abbreviate(text: str, max_chars: int = MAX_LABEL_CHARS) -> str:
    """`text` if it has at most `max_chars` characters, else its first `max_chars - 1` and an ellipsis."""
    return text if len(text) <= max_chars else text[: max_chars - 1] + "\u2026"


def from_pil(image: Image.Image) -> torch.Tensor:
    """RGB Pillow image -> (3, H, W) float in [0, 1]."""
    return torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()


def upscale_factor(height: int, width: int, min_side: int = MIN_SIDE) -> int:
    return max(1, math.ceil(min_side / min(height, width)))


def upscale_nearest(images: torch.Tensor, min_side: int = MIN_SIDE) -> torch.Tensor:
    """(N, 3, H, W) -> (N, 3, f H, f W): each pixel becomes an f x f block, f = `upscale_factor`."""
    f = upscale_factor(images.shape[-2], images.shape[-1], min_side)
    return images.repeat_interleave(f, dim=-2).repeat_interleave(f, dim=-1) if f > 1 else images


def title_height() -> int:
    """Height of the strip of column titles above a grid."""
    return line_height() + 2 * _MARGIN


def image_grid(
    columns: Sequence[torch.Tensor], titles: Sequence[str] | None = None, *, min_side: int = MIN_SIDE
) -> torch.Tensor:
    """Panels in rows (one per sample) and titled columns (one per view), small images upscaled (nearest).

    Args:
        columns: Each (N, 3, H, W) in [0, 1], all the same shape; row i shows sample i of every column.
        titles: One per column, written above it (shortened to fit the panel); None for no title strip.
        min_side: Panels are upscaled by an integer factor until their shorter side is at least this.

    Returns:
        (3, T + N (fH + p) + p, len(columns) (fW + p) + p), T = `title_height()` with titles (else 0), p = PADDING;
        panel (i, j) starts at row T + p + i (fH + p), column p + j (fW + p).
    """
    panels = torch.stack([upscale_nearest(c.detach().float().cpu(), min_side) for c in columns], dim=1)  # (N, J, ...)
    grid = torchvision.utils.make_grid(panels.flatten(0, 1), nrow=len(columns), padding=PADDING, pad_value=1.0)
    if titles is None:
        return grid
    if len(titles) != len(columns):
        raise ValueError(f"{len(titles)} titles for {len(columns)} columns")
    tile = panels.shape[-1] + PADDING
    strip = Image.new("RGB", (grid.shape[-1], title_height()), _WHITE)
    draw = ImageDraw.Draw(strip)
    for j, title in enumerate(titles):
        text = _fit(title, panels.shape[-1])
        left = PADDING + j * tile + (panels.shape[-1] - text_width(text)) // 2
        draw.text((left, _MARGIN), text, fill=_BLACK, font=font())
    return torch.cat([from_pil(strip), grid], dim=1)


def _fit(text: str, width: int) -> str:
    """`text`, cut (ending in an ellipsis) until it is at most `width` pixels wide."""
    while len(text) > 1 and text_width(text) > width:
        text = abbreviate(text, len(text) - 1)
    return text


@dataclass(frozen=True)
class MatrixLayout:
    """Where `labelled_matrix` puts things; boxes are (left, top, right, bottom) pixel bounds, right/bottom excluded.

    From left to right: the rotated row-axis title, row labels, the R x C cells, the colour scale with its tick
    labels. From top to bottom: the picture title, the cells (the scale and the row-axis title beside them may
    reach lower), the rotated column labels, the column-axis title.
    """

    rows: int
    cols: int
    cell: int  # side of a square cell in pixels
    left: int  # x of the cells' left edge
    top: int  # y of the cells' top edge
    body: int  # height of the band holding the cells, the colour scale and the row-axis title
    label_width: int  # row labels' width (= column labels' height once rotated)
    width: int  # the picture is wider when its title needs it; nothing else moves
    height: int

    def cell_box(self, row: int, col: int) -> tuple[int, int, int, int]:
        x, y = self.left + col * self.cell, self.top + row * self.cell
        return x, y, x + self.cell, y + self.cell

    def row_label_box(self, row: int) -> tuple[int, int, int, int]:
        y = self.top + row * self.cell
        return self.left - _MARGIN - self.label_width, y, self.left - _MARGIN, y + self.cell

    def col_label_box(self, col: int) -> tuple[int, int, int, int]:
        x, y = self.left + col * self.cell, self.top + self.rows * self.cell + _MARGIN
        return x, y, x + self.cell, y + self.label_width

    def scale_box(self) -> tuple[int, int, int, int]:
        """The colour bar: its top row is the colour of 1, its bottom row the colour of 0."""
        x = self.left + self.cols * self.cell + 3 * _MARGIN
        return x, self.top, x + _SCALE_WIDTH, self.top + self.body


_SCALE_WIDTH = 12
_SCALE_TICKS = (1.0, 0.5, 0.0)
_SCALE_MIN_HEIGHT = 80  # room for the three tick labels when the matrix is small


def matrix_layout(
    cell_text: Sequence[Sequence[str]],
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    *,
    row_title: str,
) -> MatrixLayout:
    """The geometry `labelled_matrix` draws with these texts (cells square and wide enough for every text)."""
    rows, cols = len(row_labels), len(col_labels)
    widest_cell = max((text_width(t) for line in cell_text for t in line), default=0)
    cell = max(line_height() + 2 * _MARGIN, widest_cell + 2 * _MARGIN)
    body = max(rows * cell, _SCALE_MIN_HEIGHT, text_width(row_title))
    label_width = max(text_width(abbreviate(name)) for name in [*row_labels, *col_labels])
    left = line_height() + 2 * _MARGIN + label_width + _MARGIN
    top = title_height()
    scale_right = left + cols * cell + 3 * _MARGIN + _SCALE_WIDTH + _MARGIN + text_width("0.5") + _MARGIN
    height = top + max(body, rows * cell + _MARGIN + label_width) + title_height()
    return MatrixLayout(rows, cols, cell, left, top, body, label_width, scale_right, height)


def labelled_matrix(
    colors: torch.Tensor,
    cell_text: Sequence[Sequence[str]],
    *,
    row_labels: Sequence[str],
    col_labels: Sequence[str],
    row_title: str,
    col_title: str,
    title: str,
    scale: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """A heat map with a text in every cell, named rows and columns, axis titles and a colour scale from 0 to 1.

    Args:
        colors: (R, C, 3) cell colours in [0, 1].
        cell_text: R lists of C strings, centred in their cells (black on light cells, white on dark ones).
        row_labels, col_labels: R and C names, shortened by `abbreviate`; column labels are rotated to read upwards.
        row_title, col_title: Axis titles (left, rotated; bottom).
        title: One line above the matrix.
        scale: (colour of 0, colour of 1), each (3,): the colour bar right of the matrix runs linearly between them.

    Returns:
        (3, H, W) float in [0, 1], laid out as `matrix_layout` says (W larger when the title needs it).
    """
    layout = matrix_layout(cell_text, row_labels, col_labels, row_title=row_title)
    width = max(layout.width, text_width(title) + 2 * _MARGIN)
    picture = Image.new("RGB", (width, layout.height), _WHITE)
    draw = ImageDraw.Draw(picture)
    draw.text((_MARGIN, _MARGIN), title, fill=_BLACK, font=font())
    rgb = (colors.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8).tolist()  # (R, C, 3) as lists
    for r in range(layout.rows):
        for c in range(layout.cols):
            box = layout.cell_box(r, c)
            fill = tuple(rgb[r][c])
            draw.rectangle((box[0], box[1], box[2] - 1, box[3] - 1), fill=fill)
            ink = _WHITE if _luminance(fill) < 128 else _BLACK
            _centred_text(draw, cell_text[r][c], box, ink)
    for r, name in enumerate(row_labels):
        x0, y0, x1, y1 = layout.row_label_box(r)
        text = abbreviate(name)
        draw.text((x1 - text_width(text), (y0 + y1 - line_height()) // 2), text, fill=_BLACK, font=font())
    for c, name in enumerate(col_labels):
        x0, y0, x1, _ = layout.col_label_box(c)
        label = _rotated(abbreviate(name))
        picture.paste(label, ((x0 + x1 - label.width) // 2, y0))
    row_axis = _rotated(row_title)
    picture.paste(row_axis, (_MARGIN, layout.top + (layout.body - row_axis.height) // 2))
    bottom = layout.height - title_height() + _MARGIN
    middle = layout.left + (layout.cols * layout.cell - text_width(col_title)) // 2
    draw.text((max(_MARGIN, middle), bottom), col_title, fill=_BLACK, font=font())
    _colour_scale(draw, layout.scale_box(), *scale)
    return from_pil(picture)


def _luminance(rgb: tuple[int, int, int]) -> float:
    return 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]


def _centred_text(draw: ImageDraw.ImageDraw, text: str, box: tuple[int, int, int, int], ink) -> None:
    if text:
        x = (box[0] + box[2] - text_width(text)) // 2
        y = (box[1] + box[3] - line_height()) // 2
        draw.text((x, y), text, fill=ink, font=font())


def _rotated(text: str) -> Image.Image:
    """`text` drawn black on white and turned 90 degrees anticlockwise (it reads upwards)."""
    strip = Image.new("RGB", (max(1, text_width(text)), line_height()), _WHITE)
    ImageDraw.Draw(strip).text((0, 0), text, fill=_BLACK, font=font())
    return strip.transpose(Image.Transpose.ROTATE_90)


def _colour_scale(draw: ImageDraw.ImageDraw, box, low: torch.Tensor, high: torch.Tensor) -> None:
    """A vertical bar from `high` (top) to `low` (bottom) with ticks at 1, 0.5 and 0."""
    x0, y0, x1, y1 = box
    span = max(1, y1 - y0 - 1)
    for y in range(y0, y1):
        value = 1.0 - (y - y0) / span
        color = ((low + (high - low) * value).clamp(0, 1) * 255).round().to(torch.uint8).tolist()
        draw.line((x0, y, x1 - 1, y), fill=tuple(color))
    draw.rectangle((x0 - 1, y0 - 1, x1, y1), outline=_BLACK)
    for value in _SCALE_TICKS:
        y = y0 + round((1.0 - value) * span)
        draw.line((x1, y, x1 + 2, y), fill=_BLACK)
        draw.text((x1 + _MARGIN, y - line_height() // 2), f"{value:g}", fill=_BLACK, font=font())


def bar_chart(values: torch.Tensor, *, title: str, x_label: str, width: int = 512, height: int = 128) -> torch.Tensor:
    """Bars of `values` in the given order, the tallest reaching the top; a title above, an axis label below.

    Bars are `width // len(values)` pixels wide (at least 1); with more values than `width` pixels, pixel column x
    shows value `x * len(values) // width`.

    Args:
        values: (K,) non-negative numbers.
        title: Line above the chart; the maximum value is written at the top of the y axis.
        x_label: Line below the chart.

    Returns:
        (3, H', W') float in [0, 1]; the bars are dark grey, the plot area starts `bar_chart_origin()` pixels in.
    """
    values = values.detach().double().cpu()
    num = len(values)
    bar = max(1, width // num)
    shown = values if num <= width else values[torch.arange(width) * num // width]
    plot_width = bar * len(shown)
    x0, y0 = bar_chart_origin()
    peak = max(float(values.max()), 1e-12) if num else 1.0
    picture = Image.new("RGB", (x0 + plot_width + _MARGIN, y0 + height + title_height()), _WHITE)
    draw = ImageDraw.Draw(picture)
    draw.text((_MARGIN, _MARGIN), title, fill=_BLACK, font=font())
    draw.text((_MARGIN, y0), _short_number(peak), fill=_BLACK, font=font())
    draw.text((_MARGIN, y0 + height - line_height()), "0", fill=_BLACK, font=font())
    for i, value in enumerate(shown.tolist()):
        top = y0 + height - round(height * value / peak)
        if top < y0 + height:
            draw.rectangle((x0 + i * bar, top, x0 + (i + 1) * bar - 1, y0 + height - 1), fill=_BAR)
    draw.line((x0 - 1, y0, x0 - 1, y0 + height), fill=_BLACK)
    draw.line((x0 - 1, y0 + height, x0 + plot_width, y0 + height), fill=_BLACK)
    draw.text((x0, y0 + height + _MARGIN), x_label, fill=_BLACK, font=font())
    return from_pil(picture)


_BAR = (60, 60, 60)
_Y_LABEL_WIDTH = 40


def bar_chart_origin() -> tuple[int, int]:
    """(x, y) of the plot area's top-left pixel in a `bar_chart` picture."""
    return _Y_LABEL_WIDTH, title_height()


def _short_number(value: float) -> str:
    return f"{value:.3g}" if value < 10 or value >= 1e6 else f"{value:.0f}"


def class_colours(num_classes: int) -> torch.Tensor:
    """(K + 1, 3) uint8: Pascal VOC's colour map, the usual one of segmentation masks (bit 3 j + c of the id becomes
    bit 7 - j of channel c: 0 black, 1 dark red, 2 dark green, 3 olive, ...), distinct for ids below 256 (larger ids
    repeat id mod 256); the last row, white, which no id gets, is for ignored pixels."""
    ids = np.arange(num_classes) % 256
    rgb = np.zeros((num_classes, 3), dtype=np.uint8)
    for j in range(3):  # an id below 256 has 8 bits: j = 0, 1, 2 takes them all
        for channel in range(3):
            rgb[:, channel] |= (((ids >> (3 * j + channel)) & 1) << (7 - j)).astype(np.uint8)
    return torch.from_numpy(np.concatenate([rgb, np.full((1, 3), 255, dtype=np.uint8)]))


def id_colours(ids: Sequence[int]) -> torch.Tensor:
    """(len(ids) + 1, 3) uint8: row k the `class_colours` colour of `ids[k]` (training class k's id in the dataset's
    own masks, `data.segmentation.dataset_ids`), so that a class has the colour of the id it is written as; the last
    row white, for ignored pixels."""
    voc = class_colours(max(ids, default=0) + 1)
    return torch.cat([voc[list(ids)], voc[-1:]])


def legend(entries: Sequence[tuple[str, Sequence[int]]], width: int) -> torch.Tensor:
    """Colour swatches with their labels, in rows wrapped to `width` pixels: (3, H, width) float in [0, 1].

    Args:
        entries: (label, RGB colour) pairs, in order.
        width: The strip's width (the picture's above it).
    """
    side, gap = line_height(), 3 * _MARGIN
    rows, row, used = [], [], _MARGIN
    for label, colour in entries:
        need = side + _MARGIN + text_width(label) + gap
        if row and used + need > width:
            rows.append(row)
            row, used = [], _MARGIN
        row.append((label, tuple(int(c) for c in colour)))
        used += need
    rows += [row] if row else []
    strip = Image.new("RGB", (width, _MARGIN + len(rows) * (side + _MARGIN)), _WHITE)
    draw = ImageDraw.Draw(strip)
    for i, entries_of_row in enumerate(rows):
        top, left = _MARGIN + i * (side + _MARGIN), _MARGIN
        for label, colour in entries_of_row:
            draw.rectangle((left, top, left + side - 1, top + side - 1), fill=colour, outline=_BLACK)
            draw.text((left + side + _MARGIN, top), label, fill=_BLACK, font=font())
            left += side + _MARGIN + text_width(label) + gap
    return from_pil(strip)


def colour_mask(ids: torch.Tensor, colours: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """(H, W) class ids -> (3, H, W) uint8 by `class_colours`; `ignore_index` (and any id out of range) is white."""
    ids = ids.long().cpu()
    ids = torch.where((ids < 0) | (ids >= len(colours) - 1) | (ids == ignore_index), len(colours) - 1, ids)
    return colours[ids].permute(2, 0, 1)
