"""What `mimpipe evaluate` writes (finetune/report_card.py makes the report): report.json as it is, report.md (the
table, one row per checkpoint and one column per measure, then the protocol and each row's settings) and one
TensorBoard run per checkpoint under tb/, its numbers under the pretraining monitors' tags (knn/top1,
fewshot/top1_10shot, features/effective_rank; linear/top1_cls, linear/top1_mean, seg/miou) at the step its weights
are from. With `--card`, each row measured on an export folder of ours also becomes that export's model card
Evaluation section (`write_card_sections`); other checkpoints have no card to write into and are left alone.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from core.export.card import update_card_evaluation
from core.export.manifest import MANIFEST_NAME
from core.export.read import read_json
from core.report.fewshot import DRAWS
from finetune.evaluate import markdown_table
from finetune.lbfgs_probe import WEIGHT_DECAYS


def write_report(out: Path, report: dict) -> str:
    """report.json, report.md and the TensorBoard scalars under `out`; returns report.md's text."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown_report(report)
    (out / "report.md").write_text(text + "\n")
    _write_tensorboard(out / "tb", report)
    return text


def markdown_report(report: dict) -> str:
    """The table (one row per checkpoint, one column per measure) and, under it, the protocol and each row's
    settings."""
    rows = report["rows"]
    columns = {
        "knn/top1": "kNN top-1",
        "linear/top1_cls": "linear cls",
        "linear/top1_mean": "linear mean",
        **{f"fewshot/top1_{n}shot": f"{n}-shot" for n in report["protocol"]["shots"]},
        "features/effective_rank": "rank",
        "seg/miou": "seg mIoU",
    }
    tags = [tag for tag in columns if any(tag in row["metrics"] for row in rows)]
    table = [["checkpoint", *(columns[tag] for tag in tags)]]
    for row in rows:
        values = [row["metrics"].get(tag) for tag in tags]
        table.append([_name(row), *(_cell(tag, value) for tag, value in zip(tags, values, strict=True))])
    settings = [["checkpoint", "format", "architecture", "image", "crop", "pooling", "mean / std", "from"]]
    for row in rows:
        s = row["settings"]
        by_source: dict[str, list[str]] = {}
        for name, source in s["sources"].items():
            by_source.setdefault(source, []).append(name)
        sources = "; ".join(f"{source}: {', '.join(names)}" for source, names in by_source.items())
        size, mean_std = "x".join(map(str, s["img_size"])), f"{_floats(s['mean'])} / {_floats(s['std'])}"
        settings.append([_name(row), s["checkpoint_format"], s["architecture"], size, f"{s['crop_pct']:g}",
                         s["pooling"], mean_std, sources])  # fmt: skip
    lines = ["# mimpipe evaluate", "", *markdown_table(table), "", *protocol_lines(report), "", "Settings:", ""]
    return "\n".join([*lines, *markdown_table(settings)])


def protocol_lines(report: dict, settings: str = "Settings") -> list[str]:
    """The protocol, one bullet per part, as report.md writes it under the table (`settings`: where the rows' image
    sizes and crops are listed)."""
    p = report["protocol"]
    suite = p["suite"]
    first = "the first {} of the shards, spread over them"
    train = first.format(p["max_train"]) if p["max_train"] else "all"
    val = first.format(p["max_val"]) if p["max_val"] else "all"
    lines = [
        "Protocol:",
        "",
        f"- images: train `{p['train']}` ({report['train_samples']}: {train}), val `{p['val']}` "
        f"({report['val_samples']}: {val}), {report['num_classes']} classes; ordered by sample key",
        f"- features: frozen encoder in eval mode, {p['precision']}, after the final norm: the class token (cls) and "
        f"the mean of the patch tokens (mean); images resized to img/crop_pct and centre-cropped to img ({settings})",
    ]
    if "knn" in suite:
        lines.append(
            f"- kNN: k {p['k']}, temperature {p['temperature']}, DINO's weighted vote of cosine similarities of "
            "L2-normalised features at the row's pooling; bank: train, queries: val (core/report/knn.py)"
        )
    if "linear" in suite:
        decays = ", ".join(f"{wd:g}" for wd in WEIGHT_DECAYS)
        lines.append(
            f"- linear: L-BFGS logistic regression on standardised features, weight decay from {decays} chosen on a "
            "seeded 10% of train, refitted on all of train; top-1 on val (finetune/lbfgs_probe.py)"
        )
    if "fewshot" in suite:
        shots = ", ".join(map(str, p["shots"]))
        lines.append(
            f"- few-shot: {shots} train images per class, {DRAWS} seeded draws, ridge regression to {{-1, 1}} "
            "targets (regularisation by leave-one-out) on the kNN's features; top-1 on val, mean of the draws "
            "(core/report/fewshot.py)"
        )
    if "rank" in suite:
        lines.append(
            "- rank: RankMe's effective rank of the L2-normalised train features at the row's pooling, at most "
            "min(N, D) (core/report/collapse.py)"
        )
    if "seg" in suite:
        s = p["seg_schedule"]
        crop = f"{p['seg_img_size']} px" if p["seg_img_size"] else "the image size"
        lines.append(
            f"- seg: linear head (BatchNorm + 1x1 conv on the last block's patch tokens) on the frozen encoder, "
            f"trained on `{p['seg_train']}` for {s['steps']} steps of {s['batch_size']} crops of {crop} "
            f"(AdamW lr {s['lr']:g}, weight decay {s['weight_decay']:g}, {s['warmup_steps']} warmup steps, cosine); "
            f"mIoU on `{p['seg_val']}` (finetune/seg_probe.py)"
        )
    return lines


def card_section(report: dict, row: dict) -> str:
    """One row of the report as its export's card section: every number of the row (report.md's precision), the
    protocol, and how this encoder was shown its images."""
    values = [f"| {tag} | {value:,} |" if isinstance(value, int) else f"| {tag} | {_cell(tag, value)} |"
              for tag, value in row["metrics"].items()]  # fmt: skip
    s = row["settings"]
    shown = (
        f"- this encoder: {'x'.join(map(str, s['img_size']))} px, crop {s['crop_pct']:g}, {s['pooling']} pooling, "
        f"mean / std {_floats(s['mean'])} / {_floats(s['std'])}"
    )
    protocol = protocol_lines(report, settings="this encoder, below")
    return "\n".join(["| measure | value |", "|---|---|", *values, "", *protocol, shown])


def write_card_sections(report: dict) -> tuple[list[str], int]:
    """Each row's numbers written into its export's README.md as the Evaluation section (replaced whole, the file
    renamed into place); a row whose checkpoint is not an export folder of ours here, or whose export was replaced
    since it was measured, is left alone. Returns one line per row saying which, and how many writes failed."""
    lines, failed = [], 0
    for row in report["rows"]:
        s, name = row["settings"], row["checkpoint"]
        path = Path(s["path"])
        now = read_json(path / MANIFEST_NAME).get("step") if (path / MANIFEST_NAME).is_file() else None
        if s["checkpoint_format"] != "mimpipe-export":
            reason = f"a {s['checkpoint_format']} checkpoint, not an export folder of ours (no card)"
        elif name.startswith("hf-hub:"):
            reason = "a Hub repo: update the card of the export it was pushed from, then push again"
        elif not (path / MANIFEST_NAME).is_file() or not (path / "config.json").is_file():
            reason = f"measured from a temporary export ({path}) of its latest checkpoint: export the run first"
        elif now != s["step"]:
            reason = f"{path} was replaced since it was measured (step {s['step']}, now {now}): evaluate it again"
        else:
            try:
                card = update_card_evaluation(path, card_section(report, row))
            except (OSError, ValueError) as e:
                lines.append(f"[mimpipe] card: could not write the Evaluation section of {name}: {e}")
                failed += 1
            else:
                lines.append(f"[mimpipe] card: wrote the Evaluation section of {card}")
            continue
        lines.append(f"[mimpipe] card: left {name} alone: {reason}")
    return lines, failed


def _name(row: dict) -> str:
    """The row's checkpoint as a table cell (a `|` in a path would end the cell)."""
    return row["checkpoint"].replace("|", "\\|")


def _cell(tag: str, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if tag == "features/effective_rank" else f"{value:.4f}"


def _floats(values) -> str:
    return ",".join(f"{v:.3g}" for v in values)


def _write_tensorboard(tb_dir: Path, report: dict) -> None:
    """One TensorBoard run per checkpoint (DIR/tb/<name>), its numbers at the step its weights are from (else 0)."""
    from torch.utils.tensorboard import SummaryWriter  # imported here: tensorboard's import takes seconds

    used: set[str] = set()
    for row in report["rows"]:
        name = re.sub(r"[^\w.-]+", "_", row["checkpoint"]).strip("_") or "checkpoint"
        while name in used:
            name += "_"
        used.add(name)
        writer = SummaryWriter(log_dir=str(tb_dir / name))
        step = row["settings"]["step"] or 0
        for tag, value in row["metrics"].items():
            writer.add_scalar(tag, value, step)
        writer.add_text("evaluate/report", markdown_report({**report, "rows": [row]}), step)
        writer.close()
