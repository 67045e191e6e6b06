"""What benchmarks/bench_quality.py reads back and writes: each finished arm's summary (from its metrics.jsonl or the
probe's JSON), then benchmarks/results/quality.md (accuracy and wall-time tables) and its plot.

An arm's summary is `ROOT/seed{S}/{encoder}/{arm}/bench_result.json`:
    {"arm", "wall_seconds", "others_load", "metrics": {...}}
with, per arm kind, `metrics` = {"top1"} (fine-tuning: val/top1 at the last step), {"cls", "mean"} (probe: test
top-1 per pooling), {"knn": [[step, top1], ...], "loss"} (pretraining), {} (tokenizer).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

ENCODERS = ("mae", "beit", "mpp", "simmim", "data2vec2", "ijepa", "scratch")
NAMES = {
    "mae": "MAE",
    "beit": "BEiT-style (tokenizer codes)",
    "mpp": "ViT-paper masked-patch prediction (3-bit mean colour)",
    "simmim": "SimMIM",
    "data2vec2": "data2vec 2.0 (EMA teacher's features)",
    "ijepa": "I-JEPA (EMA target encoder's features of blocks)",
    "scratch": "scratch (no pretraining)",
}
"""A variant of an objective is its own encoder, `{objective}_{label}` (recipes/bench/{objective}_{label}.yaml, based
on the objective's recipe): its row follows the objective's."""
FINETUNE_ARMS = {"ft_1pct": 0.01, "ft_10pct": 0.1, "ft_full": 1.0}
"""Fine-tuning arm -> fraction of the 60k training labels it sees."""
COLUMNS = (("ft_1pct", "top1"), ("ft_10pct", "top1"), ("ft_full", "top1"), ("probe", "cls"), ("probe", "mean"))
HEADERS = ("1% (60/class)", "10% (600/class)", "full (60k)", "probe cls", "probe mean")
REFERENCE = {"ft_1pct": 0.795, "ft_10pct": 0.809, "ft_full": 0.826, "probe mean": 0.864}
"""The official MAE code on the same protocol, as issue 14 reports it (mean-pooled L-BFGS probe); not run here."""
GOALS = "1% >= 0.84, 10% >= 0.87, full >= 0.88, linear probe >= 0.89; each objective >= +8 points over scratch at 1%"
RESULT_FILE = "bench_result.json"


def summarise_run(kind: str, run_dir: Path) -> dict:
    """The metrics an arm's table cell needs, read from what its run wrote.

    Args:
        kind: "pretrain", "tokenizer", "finetune" or "probe".
        run_dir: The arm's folder (metrics.jsonl of a launched run; probe.json of the probe).

    Raises:
        ValueError: If the run left no result to read (naming the file).
    """
    if kind == "probe":
        probe = json.loads((run_dir / "probe.json").read_text())
        return {name: probe[name]["top1"] for name in ("cls", "mean")} | {"train_samples": probe["train_samples"]}
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    if kind == "finetune":
        evals = [r for r in records if "val/top1" in r]
        if not evals:
            raise ValueError(f"{path} holds no val/top1")
        return {"top1": evals[-1]["val/top1"], "step": evals[-1]["step"]}
    if kind == "pretrain":
        losses = [r["train/loss"] for r in records if "train/loss" in r]
        return {
            "knn": [[r["step"], r["knn/top1"]] for r in records if "knn/top1" in r],
            "loss": losses[-1] if losses else None,
        }
    return {}


def collect(root: Path) -> dict[tuple[int, str, str], dict]:
    """Every finished arm under `root`: (seed, encoder, arm) -> its bench_result.json."""
    results = {}
    for path in sorted(root.glob(f"seed*/*/*/{RESULT_FILE}")):
        arm_dir = path.parent
        seed = int(arm_dir.parent.parent.name.removeprefix("seed"))
        results[(seed, arm_dir.parent.name, arm_dir.name)] = json.loads(path.read_text())
    return results


def objective_of(encoder: str) -> str:
    """The objective an encoder was pretrained with: `mae` for `mae` and for a variant such as `mae_crop08`."""
    head = encoder.split("_", 1)[0]
    return head if head in ENCODERS else encoder


def name_of(encoder: str) -> str:
    """The table's name for an encoder, a variant's with its recipe."""
    if encoder in NAMES:
        return NAMES[encoder]
    objective = objective_of(encoder)
    return f"{NAMES.get(objective, objective)}, variant `{encoder}`"


def encoders_in(results: dict) -> list[str]:
    """The encoders that have results, in table order: the objectives, each followed by its variants, then scratch."""
    found = {e for (_, e, _) in results}
    ordered = [v for e in ENCODERS for v in [e, *sorted(f for f in found if f.startswith(f"{e}_"))] if v in found]
    return ordered + sorted(found - set(ordered))


def _cell(values: list[float]) -> str:
    """A mean over seeds, with the seeds' own values when there are several."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ({', '.join(f'{v:.4f}' for v in values)})"


def _values(results: dict, encoder: str, arm: str, key: str) -> list[float]:
    return [r["metrics"][key] for (_, e, a), r in sorted(results.items()) if e == encoder and a == arm]


def _minutes(results: dict, encoder: str, arm: str) -> float | None:
    """Mean wall minutes of an arm over the seeds that ran it."""
    walls = [r["wall_seconds"] for (_, e, a), r in results.items() if e == encoder and a == arm]
    return statistics.mean(walls) / 60 if walls else None


def accuracy_table(results: dict) -> list[str]:
    """Test top-1 per encoder and arm, the reference row first."""
    lines = ["| encoder | " + " | ".join(HEADERS) + " | kNN top-1 (end of pretraining) |"]
    lines.append("|---" * (len(HEADERS) + 2) + "|")
    ref = [REFERENCE.get(a if a != "probe" else f"probe {k}") for a, k in COLUMNS]
    lines.append(
        "| official MAE code (the issue's reference, not run here) | "
        + " | ".join("-" if v is None else f"{v:.3f}" for v in ref)
        + " | - |"
    )
    for encoder in encoders_in(results):
        cells = [_cell(_values(results, encoder, arm, key)) for arm, key in COLUMNS]
        pretrained = [r["metrics"] for (_, e, a), r in sorted(results.items()) if (e, a) == (encoder, "pretrain")]
        knn = [m["knn"][-1][1] for m in pretrained if m.get("knn")]
        if any(c != "-" for c in cells) or knn:
            lines.append(f"| {name_of(encoder)} | " + " | ".join(cells) + f" | {_cell(knn)} |")
    return lines


def time_table(results: dict) -> list[str]:
    """Mean wall minutes per arm; the tokenizer's cost is in the BEiT row (its pretraining needs it)."""
    arms = ("tokenizer", "pretrain", "ft_1pct", "ft_10pct", "ft_full", "probe")
    lines = ["| encoder | " + " | ".join(arms) + " | total |", "|---" * (len(arms) + 2) + "|"]
    for encoder in encoders_in(results):
        minutes = [_minutes(results, encoder, arm) for arm in arms]
        if all(m is None for m in minutes):
            continue
        total = sum(m for m in minutes if m is not None)
        lines.append(
            f"| {name_of(encoder)} | "
            + " | ".join("-" if m is None else f"{m:.1f}" for m in minutes)
            + f" | {total:.1f} |"
        )
    return lines


def render(results: dict, *, header: list[str], plot_note: str) -> str:
    """The whole quality.md: header (command, machine), accuracy table, goals, wall times, plot."""
    loads = [r.get("others_load") or 0.0 for r in results.values()]
    busy = f"; other processes took up to {max(loads):.0%} of the CPU during an arm" if loads else ""
    return "\n".join(
        [
            "# Representation quality: label efficiency on Fashion-MNIST (`make bench-quality`)",
            "",
            *header,
            "",
            "## Test top-1 on the 10k test images",
            "",
            *accuracy_table(results),
            "",
            f"Goals (issue 14): {GOALS}.",
            "",
            "Fine-tuning arms report the last step (no choice on the test set); probes are L-BFGS logistic regression",
            "on frozen features, weight decay chosen on a held-out 10% of the training features; with several seeds a",
            "cell is the mean, the seeds' values in brackets.",
            "",
            f"## Wall time (minutes, mean over seeds{busy})",
            "",
            *time_table(results),
            "",
            "## Plot",
            "",
            plot_note,
            "",
        ]
    )


def plot(results: dict, path: Path) -> str:
    """Accuracy vs label fraction per encoder, and the kNN curves of pretraining, as one PNG.

    Returns:
        The markdown line for quality.md that shows the image.
    """
    import matplotlib  # a dev dependency, imported here so that reading results does not need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for encoder in encoders_in(results):
        points = [
            (f, statistics.mean(v)) for a, f in FINETUNE_ARMS.items() if (v := _values(results, encoder, a, "top1"))
        ]
        if points:
            left.plot(*zip(*points, strict=True), marker="o", label=name_of(encoder).split(" (")[0])
        curves = {s: r["metrics"]["knn"] for (s, e, a), r in sorted(results.items()) if (e, a) == (encoder, "pretrain")}
        for seed, curve in curves.items():
            if curve:
                label = f"{encoder} seed {seed}" if len(curves) > 1 else encoder
                right.plot(*zip(*curve, strict=True), marker=".", label=label)
    reference = [(FINETUNE_ARMS[a], REFERENCE[a]) for a in FINETUNE_ARMS]
    left.plot(*zip(*reference, strict=True), "k--", marker="x", label="official MAE (issue's reference)")
    left.set(xscale="log", xlabel="fraction of training labels", ylabel="test top-1", title="fine-tuning")
    right.set(xlabel="pretraining step", ylabel="kNN top-1", title="kNN monitor during pretraining")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"![accuracy vs labels, kNN during pretraining]({path.name})"
