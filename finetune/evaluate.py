"""Held-out evaluation, each sample counted exactly once across ranks, and the per-class views of its result.

Every rank streams its own disjoint shards (`make_eval_loader`), sums loss / top-1 / top-5 / count (and, on request,
a confusion matrix), and the sums are all-reduced once at the end. Ranks step in lock-step (one tiny all-reduce per
batch says whether anyone still has data) and a rank that has run out forwards a zero-weight stand-in batch (a copy
of its last real batch), because under ZeRO-3 every forward is collective. The same all-reduce carries whether any
rank received SIGTERM: then every rank stops the pass at once (`preempt.StopAgreed`) and the loop saves the step.

Shapes: B batch, K classes.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from core.engine import preempt
from core.engine.distributed import DistInfo, all_reduce
from core.engine.precision import to_device
from core.report.metrics import topk_correct
from core.report.pictures import labelled_matrix

# Colour map of `confusion_image`: a row-normalised fraction of 0 is white, 1 is dark blue (matplotlib "Blues" ends).
_WHITE = (1.0, 1.0, 1.0)
_DARK_BLUE = (8 / 255, 48 / 255, 107 / 255)
_NO_SAMPLES_GREY = 0.85  # rows of classes without samples, told apart from "never predicted"
ROW_TITLE = "true class"  # the confusion picture's row axis


@torch.no_grad()
def evaluate(
    engine, batches, *, dist: DistInfo, precision: str, confusion: torch.Tensor | None = None
) -> dict[str, float]:
    """Evaluate on every rank's share of the held-out set; collective: every rank must call it.

    Args:
        engine: Called as `engine(batch)` and returns a dict with "logits" (B, K); has `eval()` and `train()`.
        batches: This rank's batches, "image" and "label" (B,) class indices. A rank may run out before the
            others, but must have at least one batch if any rank has one (see Raises).
        dist: This process's place in the group.
        precision: "fp32", "bf16" or "fp16", as for training.
        confusion: Optional (K, K) int64 tensor, on any device, overwritten with the confusion matrix summed over all
            ranks: rows are true classes, columns predicted (top-1) classes.

    Returns:
        {"val/loss", "val/top1", "val/top5", "val/samples"} over the whole held-out set (loss and accuracies are 0
        when it is empty).

    Raises:
        ValueError: On every rank at the first batch, if some rank has no batch at all while others have some: it
            cannot forward a stand-in (ZeRO-3 forwards are collective) without a batch to copy. `make_eval_loader`
            gives each rank at least one shard, so this means a shard without samples.
        preempt.StopAgreed: On every rank, when some rank received SIGTERM during the pass (the module is back in
            training mode).
    """
    if confusion is not None and confusion.dtype != torch.int64:
        raise ValueError(f"evaluate: confusion must be int64, got {confusion.dtype}")
    sums = torch.zeros(4, dtype=torch.float64, device=dist.device)  # loss, top1, top5, count
    counts = None  # (K, K) on this rank's device, whatever the caller's tensor is on
    if confusion is not None:
        _check_square(confusion, None)
        counts = torch.zeros(confusion.shape, dtype=torch.int64, device=dist.device)
    engine.eval()
    try:
        for batch, real in lockstep(batches, dist):
            batch = to_device(batch, dist.device, precision)
            logits = engine(batch)["logits"].float()  # (B, K); bf16: under the engine's own autocast
            if real:  # a stand-in is forwarded only to keep ZeRO-3 in step: weight 0, it is not added
                _accumulate(logits, batch["label"], sums, counts)
    finally:
        engine.train()
    loss, top1, top5, count = all_reduce(sums).tolist()
    if confusion is not None:
        confusion.copy_(all_reduce(counts))
    n = max(count, 1.0)
    return {"val/loss": loss / n, "val/top1": top1 / n, "val/top5": top5 / n, "val/samples": count}


def lockstep(batches, dist: DistInfo, every: int = 1) -> Iterator[tuple[dict, bool]]:
    """This rank's batches, each with True, in lock-step with every other rank's; once this rank has run out and
    others have not, copies of its last batch, each with False (a stand-in to forward and not to count); collective:
    every rank must iterate it to its end.

    The ranks agree (one all-reduce and one host read) once per `every` batches: each reads up to `every` of its
    batches ahead, and all forward as many as the rank that has most. A pass of one image per batch (segmentation's)
    agrees every few dozen images instead of at every image, which would wait for the GPU each time.

    Raises:
        ValueError: On every rank, if some rank has no batch at all while others have some (see `evaluate`).
        preempt.StopAgreed: On every rank, when some rank received SIGTERM.
    """
    iterator = iter(batches)
    stand_in = None
    while True:
        ahead = []
        while len(ahead) < every and (batch := preempt.next_unless_stopping(iterator)) is not None:
            ahead.append(batch)
        most = _most_batches(len(ahead), stand_in is not None, dist)
        if most == 0:
            return
        stand_in = ahead[-1] if ahead else stand_in
        for i in range(most):
            yield (ahead[i], True) if i < len(ahead) else (stand_in, False)


def _most_batches(num_batches: int, has_stand_in: bool, dist: DistInfo) -> int:
    """The lock-step all-reduce: the most batches any rank read ahead; raises if some rank has none at all while
    others have some, or `preempt.StopAgreed` if some rank received SIGTERM."""
    empty_rank = 0.0 if num_batches or has_stand_in else dist.rank + 1.0  # max-reduced: names one such rank
    flags = torch.tensor([float(num_batches), empty_rank, float(preempt.stop_requested())], device=dist.device)
    most, empty_rank, stop = all_reduce(flags, op="max").tolist()
    if stop:
        raise preempt.StopAgreed("evaluation stopped early: a rank received SIGTERM")
    if most and empty_rank:  # same values on every rank, so they all raise here instead of hanging in a forward
        raise ValueError(
            f"evaluate: rank {int(empty_rank) - 1} got no samples from its eval shards while other ranks did. Every "
            "rank must forward a batch at each eval step (ZeRO-3 forwards are collective) and a rank that runs out "
            "forwards a copy of its last batch, so it needs at least one. make_eval_loader gives each rank >= 1 "
            "shard, so one of them holds no samples: rewrite the eval shards without empty ones or use fewer ranks."
        )
    return int(most)


def _accumulate(logits: torch.Tensor, labels: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor | None) -> None:
    """Adds one real batch to the running sums (loss, top1, top5, count) and the (K, K) confusion counts."""
    loss = F.cross_entropy(logits, labels, reduction="sum")
    correct = topk_correct(logits, labels, ks=(1, 5)).to(sums)  # (2,)
    sums += torch.stack([loss.double(), correct[0], correct[1], sums.new_tensor(len(labels))])
    if counts is not None:
        num_classes = logits.shape[-1]
        if num_classes != counts.shape[0]:
            raise ValueError(f"evaluate: the model has {num_classes} classes, confusion is {tuple(counts.shape)}")
        cells = labels.long() * num_classes + logits.argmax(dim=-1)  # (B,) row-major index of (true, predicted)
        counts.view(-1).index_add_(0, cells, torch.ones_like(cells))  # no host sync, unlike bincount


def per_class_table(confusion: torch.Tensor, class_names: list[str]) -> str:
    """Per-class accuracy as a markdown table (class | samples | correct | accuracy) and a mean per-class line.

    Args:
        confusion: (K, K) counts, rows true classes, columns predicted classes (as filled by `evaluate`).
        class_names: K names, in class-index order.

    Returns:
        The table with columns padded to line up in a monospaced font (console, TensorBoard text), a blank line,
        then "mean per-class accuracy: 0.xxxx (n of K classes have samples)". A class without samples shows "-" as its
        accuracy and is left out of the mean.
    """
    num_classes = _check_square(confusion, class_names)
    samples = confusion.sum(dim=1).tolist()  # (K,)
    correct = confusion.diagonal().tolist()  # (K,)
    rows = [["class", "samples", "correct", "accuracy"]]
    accuracies = []
    for name, num_samples, num_correct in zip(class_names, samples, correct, strict=True):
        accuracy = num_correct / num_samples if num_samples else None
        accuracies += [] if accuracy is None else [accuracy]
        rows.append([name.replace("|", "\\|"), str(num_samples), str(num_correct), _fraction(accuracy)])
    lines = markdown_table(rows)
    mean = sum(accuracies) / len(accuracies) if accuracies else None
    lines.append("")  # ends the markdown table
    lines.append(
        f"mean per-class accuracy: {_fraction(mean)} ({len(accuracies)} of {num_classes} classes have samples)"
    )
    return "\n".join(lines)


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def markdown_table(rows: list[list[str]]) -> list[str]:
    """Lines of a markdown table (first row the header), padded to line up; first column left-aligned, rest right."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]

    def line(cells: list[str]) -> str:
        padded = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "| " + " | ".join(padded) + " |"

    rule = [":" + "-" * (width - 1) if i == 0 else "-" * (width - 1) + ":" for i, width in enumerate(widths)]
    return [line(rows[0]), line(rule), *map(line, rows[1:])]


def _check_square(confusion: torch.Tensor, class_names: list[str] | None) -> int:
    """K, after checking that confusion is (K, K) and that there are K class names (if given)."""
    if confusion.ndim != 2 or confusion.shape[0] != confusion.shape[1]:
        raise ValueError(f"confusion must be a (K, K) matrix, got shape {tuple(confusion.shape)}")
    num_classes = confusion.shape[0]
    if class_names is not None and len(class_names) != num_classes:
        raise ValueError(f"{len(class_names)} class names for a {num_classes}-class confusion matrix")
    return num_classes


def confusion_image(
    confusion: torch.Tensor, class_names: list[str] | None = None, max_classes: int = 100
) -> torch.Tensor:
    """A picture of the confusion matrix for TensorBoard (`MetricsLogger.image`): counts in the cells, coloured by
    the row-normalised fraction.

    Rows are true classes (top to bottom), columns predicted classes (left to right), both named on their axis
    (names longer than 16 characters are shortened, column names rotated). Each cell shows its count (blank for 0)
    on a colour from white (fraction 0 of the true class's samples) to dark blue (fraction 1), with the colour scale
    on the right: a good classifier shows a dark diagonal. Rows of classes without samples are light grey.

    Args:
        confusion: (K, K) counts, rows true classes, columns predicted classes.
        class_names: K names in class-index order; None numbers the classes 0 .. K-1.
        max_classes: If K is larger, only the first `max_classes` rows and columns are drawn (still normalised by
            the whole row, so a row's drawn cells may sum to less than 1).

    Returns:
        (3, H, W) float in [0, 1], laid out as `core.report.pictures.matrix_layout` says for the shown part's
        `confusion_cell_text`, the (shown) class names and ROW_TITLE.
    """
    if max_classes < 1:
        raise ValueError(f"max_classes must be >= 1, got {max_classes}")
    num_classes = _check_square(confusion, class_names)
    names = list(class_names) if class_names is not None else [str(k) for k in range(num_classes)]
    counts = confusion.detach().to("cpu", torch.int64)  # (K, K)
    row_sums = counts.sum(dim=1, keepdim=True)  # (K, 1)
    shown = min(num_classes, max_classes)
    fractions = (counts.double() / row_sums.clamp(min=1))[:shown, :shown].float()  # (k, k), k = shown
    white, blue = torch.tensor(_WHITE), torch.tensor(_DARK_BLUE)  # (3,)
    colors = white + (blue - white) * fractions[..., None]  # (k, k, 3)
    colors[row_sums[:shown, 0] == 0] = _NO_SAMPLES_GREY
    empty_rows = bool((row_sums[:shown] == 0).any())
    part = (f" (first {shown} of {num_classes} classes)" if shown < num_classes else "") + (
        "; grey rows: no samples" if empty_rows else ""
    )
    return labelled_matrix(
        colors,
        confusion_cell_text(counts[:shown, :shown]),
        row_labels=names[:shown],
        col_labels=names[:shown],
        row_title=ROW_TITLE,
        col_title="predicted class",
        title=f"counts; colour = fraction of the true class{part}",
        scale=(white, blue),
    )


def confusion_cell_text(counts: torch.Tensor) -> list[list[str]]:
    """The text of each cell of `confusion_image`: the count, or nothing for 0."""
    return [[str(count) if count else "" for count in row] for row in counts.tolist()]
