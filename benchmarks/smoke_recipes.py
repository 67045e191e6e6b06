"""Every published recipe at its real size: each pretraining recipe in recipes/ runs 2 steps at its own model,
resolution, patch size, ZeRO stage and precision, exports, and the fine-tuning / linear-probe / distillation recipe
that follows it runs 2 steps from that export (`make smoke-recipes`).

    .venv/bin/python -m benchmarks.smoke_recipes                      # every chain -> results/smoke_recipes.md
    .venv/bin/python -m benchmarks.smoke_recipes --chains mae_vitb    # some chains (names: CHAINS below)

Each stage runs through `./launch.sh RECIPE overrides...` exactly as a user runs it (one process), on 224 px JPEG
shards of ImageNet-like sizes written here, overriding only the run folder, the data paths, the batch (2), the
length (2 steps, 1 warmup), the data workers and logging every step, plus the hand-off keys that chain the stages
(`model.init`, `objective.target.path`, `distill.teacher`) and the settings a recipe's own comment asks for at its
hand-off (BEiT's LayerScale). Per stage it reports the parameters (from the export), the time of the last step
(without the pictures the loop draws after the step before), the rank's peak resident memory and whether the
export loads strictly into plain timm with the recipe's shapes (benchmarks/smoke_measure.py measures them).
benchmarks/tests/test_recipes_at_size.py runs `CI_CHAINS` the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import math
import os
import platform
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import numpy as np
import psutil
from PIL import Image, ImageDraw

from benchmarks.smoke_measure import check_export, estimated_peak_gib, last_step_seconds, launch, read_metrics
from core.models.vit import VIT_SIZES
from core.recipe.config import Config, load_config
from data.segmentation import IGNORE_INDEX, SegInfo
from data.sources import Sample
from data.write import write_shards

REPO = Path(__file__).resolve().parents[1]

RECIPES = REPO / "recipes"
RESULTS = REPO / "benchmarks" / "results" / "smoke_recipes.md"
# (width, height) of the generated JPEGs: ImageNet's most common sizes, landscape and portrait, and a large one.
IMAGE_SIZES = ((500, 375), (375, 500), (500, 333), (333, 500), (640, 480), (500, 500), (800, 600))
NUM_CLASSES = 1000  # ImageNet-1k's head, so the fine-tuned parameter counts are the published ones
# (width, height) of the segmentation JPEGs: ADE20K's typical shapes (short side 512 and less), and its 150 classes.
SEG_IMAGE_SIZES = ((683, 512), (512, 683), (640, 427), (512, 512))
SEG_NUM_CLASSES = 150


@dataclass(frozen=True)
class Stage:
    """One `./launch.sh` run of a chain."""

    recipe: str
    """Stem of a file in recipes/, also the stage's name within its chain."""
    takes: tuple[tuple[str, str], ...] = ()
    """(override key, stem of an earlier stage of the chain): the key gets that stage's export folder."""
    settings: tuple[str, ...] = ()
    """Overrides the recipe's own comment asks for at this hand-off (e.g. BEiT's LayerScale)."""


CHAINS: dict[str, tuple[Stage, ...]] = {
    "mae_vitb": (
        Stage("mae_vitb"),
        Stage("finetune_vitb", takes=(("model.init", "mae_vitb"),)),
        Stage("finetune_deit_distill", takes=(("model.init", "mae_vitb"), ("distill.teacher", "finetune_vitb"))),
        Stage("seg_upernet_vitb_ade20k", takes=(("model.init", "mae_vitb"),)),
        Stage("seg_linear_vitb_ade20k", takes=(("model.init", "mae_vitb"),)),
    ),
    "beit_vitb": (
        Stage("tokenizer_in1k"),
        Stage("beit_vitb", takes=(("objective.target.path", "tokenizer_in1k"),)),
        Stage("finetune_vitb", takes=(("model.init", "beit_vitb"),), settings=("model.layer_scale_init=0.1",)),
    ),
    "vit_mpp_vitb": (
        Stage("vit_mpp_vitb"),
        Stage("finetune_vitb", takes=(("model.init", "vit_mpp_vitb"),)),
    ),
    "mae_vitl": (
        Stage("mae_vitl"),
        Stage("finetune_vitl", takes=(("model.init", "mae_vitl"),)),
        Stage("linprobe_vitl", takes=(("model.init", "mae_vitl"),)),
    ),
    "mae_vith": (
        Stage("mae_vith"),
        Stage("finetune_vith", takes=(("model.init", "mae_vith"),)),
    ),
    "data2vec2_vitb": (
        Stage("data2vec2_vitb"),
        Stage("finetune_vitb", takes=(("model.init", "data2vec2_vitb"),)),
    ),
    "data2vec2_vitl": (
        Stage("data2vec2_vitl"),
        Stage("finetune_vitl", takes=(("model.init", "data2vec2_vitl"),)),
    ),
    "ijepa_vith14": (
        Stage("ijepa_vith14"),
        Stage(
            "finetune_vith",
            takes=(("model.init", "ijepa_vith14"),),
            settings=("model.class_token=false", "model.global_pool=avg"),
        ),
    ),
    "ijepa_vitb16": (
        Stage("ijepa_vitb16"),
        Stage(
            "finetune_vitb",
            takes=(("model.init", "ijepa_vitb16"),),
            settings=("model.class_token=false", "model.global_pool=avg"),
        ),
    ),
    "t2t_vit14": (Stage("t2t_vit14"),),  # trained from scratch: no pretraining stage to hand over
    "vt_resnet18": (Stage("vt_resnet18"),),  # VT is fine-tuned only (docs/encoders.md)
    # The recipe starts from an ImageNet ResNet-50 the user saves; no chain makes one, so this runs from timm's init.
    "seg_vtfpn_r50": (Stage("seg_vtfpn_r50_ade20k", settings=("model.init=null",)),),
}
REDUCED: dict[str, tuple[str, ...]] = {"mae_vith": ("model.depth=8",), "ijepa_vith14": ("model.depth=8",)}
"""Chains run a second time with these overrides when a stage did not fit in memory: ViT-H/14 with 8 of its 32
blocks keeps the width, heads, patch 14, 16x16 grid, decoder and ZeRO-2 of the recipe at a quarter of the memory."""
CI_CHAINS: dict[str, tuple[Stage, ...]] = {"mae_vitb": CHAINS["mae_vitb"][:2]}
"""What CI runs (benchmarks/tests/test_recipes_at_size.py, marked long: `make test-long`): MAE ViT-B/16 into
fine-tuning. The BEiT chain's checks there are marked slow (`pytest -m slow`); every chain runs in
`make smoke-recipes`."""


@dataclass
class StageResult:
    """What one stage did; `error` is empty when it ran, exported and its export passed the checks."""

    chain: str
    stage: Stage
    cfg: Config
    run_dir: Path
    exit_code: int | None = None
    """None: not run (see `error`)."""
    wall_seconds: float = 0.0
    step_seconds: float | None = None
    peak_rss_gib: float | None = None
    """Peak resident memory of the run's largest process (the rank), the whole run long (export included)."""
    others_load: float | None = None
    """Share of the machine's CPU time other processes used while the stage ran (high: step times unreliable)."""
    num_params: int | None = None
    export: dict = field(default_factory=dict)
    """Facts read back from the export (shapes after a strict load into plain timm), see `check_export`."""
    error: str = ""
    left_out: bool = False
    """Not run because it would not fit in memory here (or its input was left out for that reason)."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.error


# ---------------------------------------------------------------- data


def _draw(rng: np.random.Generator, label: int, size: tuple[int, int]) -> bytes:
    """A JPEG of `size` (width, height): a colour gradient with a few class-coloured shapes and pixel noise."""
    width, height = size
    ramp = np.linspace(0, 1, width)[None, :, None] * rng.uniform(0, 255, 3) + rng.uniform(0, 80, 3)  # (1, W, 3)
    pixels = np.broadcast_to(ramp, (height, width, 3)).copy()
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    colour = tuple(int(c) for c in np.random.default_rng(label).integers(0, 256, 3))
    for _ in range(3):
        x0, y0 = rng.uniform(0, 0.7) * width, rng.uniform(0, 0.7) * height
        x1, y1 = x0 + rng.uniform(0.1, 0.3) * width, y0 + rng.uniform(0.1, 0.3) * height
        (draw.ellipse if label % 2 else draw.rectangle)((x0, y0, x1, y1), fill=colour)
    noisy = np.asarray(image, dtype=np.int16) + rng.integers(-10, 11, (height, width, 3))  # (H, W, 3)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def write_jpeg_shards(root: Path, *, num_train: int = 48, num_val: int = 16, shard_size: int = 16) -> dict[str, Path]:
    """Train and val shards of JPEGs (ImageNet-like sizes, `IMAGE_SIZES` in turn) labelled `.cls` out of
    `NUM_CLASSES` classes (spread over the whole range; the val labels are among the train labels).

    Returns:
        {"train": dir, "val": dir}. A split whose index.json is already there (written last, so its shards are
        complete) is kept as it is.
    """
    classes = [f"class_{k:04d}" for k in range(NUM_CLASSES)]
    out = {}
    for split, count, seed in (("train", num_train, 0), ("val", num_val, 1)):
        out[split] = root / split
        if (out[split] / "index.json").is_file():
            continue
        rng = np.random.default_rng(seed)

        def samples(count=count, rng=rng, split=split):
            for i in range(count):
                label = (i * 97) % NUM_CLASSES
                jpeg = _draw(rng, label, IMAGE_SIZES[i % len(IMAGE_SIZES)])
                yield f"{split}_{i:06d}", jpeg, label, {"label": label}

        write_shards(samples(), str(out[split]), shard_size=shard_size, split=split, classes=classes, source="smoke")
    return out | write_seg_shards(root)


def write_seg_shards(root: Path, *, num_train: int = 8, num_val: int = 2) -> dict[str, Path]:
    """Segmentation shards of ADE20K's kind: JPEGs of `SEG_IMAGE_SIZES` with masks of its 150 classes (shapes of a
    few classes on a class-0 ground, some pixels ignored), one shard per 2 samples.

    Returns:
        {"seg_train": dir, "seg_val": dir}; a split whose index.json is already there is kept.
    """
    out = {}
    for split, count, seed in (("train", num_train, 2), ("val", num_val, 3)):
        out[f"seg_{split}"] = directory = root / f"seg_{split}"
        if (directory / "index.json").is_file():
            continue
        rng = np.random.default_rng(seed)

        def samples(count=count, rng=rng, split=split):
            for i in range(count):
                size = SEG_IMAGE_SIZES[i % len(SEG_IMAGE_SIZES)]
                mask = Image.new("L", size, 0)
                draw = ImageDraw.Draw(mask)
                for _ in range(4):
                    x0, y0 = rng.uniform(0, 0.7) * size[0], rng.uniform(0, 0.7) * size[1]
                    box = (x0, y0, x0 + rng.uniform(0.1, 0.3) * size[0], y0 + rng.uniform(0.1, 0.3) * size[1])
                    draw.rectangle(box, fill=int(rng.integers(1, SEG_NUM_CLASSES)))
                draw.rectangle((0, 0, size[0] // 10, size[1] // 10), fill=IGNORE_INDEX)
                yield Sample(f"{split}_{i:06d}", _draw(rng, i, size), None, {}, mask)

        write_shards(
            samples(), str(directory), shard_size=2, split=split, classes=[], source="smoke",
            segmentation=SegInfo(SEG_NUM_CLASSES, True),
        )  # fmt: skip
    return out


# ---------------------------------------------------------------- one stage


def stage_overrides(
    stage: Stage, cfg: Config, run_dir: Path, shards: dict[str, Path], exports: dict[str, Path], *, batch: int
) -> list[str]:
    """The command-line overrides of one stage: run folder, data, tiny length and batch, and the hand-off keys."""
    overrides = [
        f"run_dir={run_dir}",
        f"data.train={shards['train']}",
        f"data.global_batch_size={batch}",
        "data.num_workers=1",
        "schedule.epochs=null",
        "schedule.steps=2",
        "schedule.warmup_epochs=null",
        "schedule.warmup_steps=1",
        "logging.every_steps=1",
    ]
    if cfg.objective.kind == "segmentation":
        overrides[1:2] = [f"data.train={shards['seg_train']}", f"data.val={shards['seg_val']}"]
    elif cfg.stage == "finetune":
        overrides.append(f"data.val={shards['val']}")
    overrides += [f"{key}={exports[name]}" for key, name in stage.takes]
    return overrides + list(stage.settings)


@dataclass(frozen=True)
class Options:
    """How every stage of a run of this script is launched."""

    batch: int = 2
    timeout: float = 3600
    """Seconds before a stage is killed."""
    memory_margin_gib: float = 4.0
    """Memory left to the other users of the machine: a stage whose estimated peak does not fit beside it is not run."""
    extra: tuple[str, ...] = ()
    """Overrides added to every stage (`REDUCED`)."""


def run_stage(chain: str, stage: Stage, root: Path, shards: dict, exports: dict, options: Options) -> StageResult:
    """Run one stage and read back what it did; `exports[stage.recipe]` becomes its export folder when it checks
    out, or None when the stage was left out for memory. A stage without its input, or whose estimated peak does not
    fit in the memory available now, is reported, not run."""
    recipe = RECIPES / f"{stage.recipe}.yaml"
    run_dir = root / chain / stage.recipe
    missing = [name for _, name in stage.takes if exports.get(name) is None]
    if missing:
        result = StageResult(chain, stage, load_config(recipe, list(options.extra)), run_dir)
        result.error = f"not run: no export of {', '.join(missing)}"
        result.left_out = all(name in exports for name in missing)  # they were left out too
        return result
    overrides = stage_overrides(stage, load_config(recipe), run_dir, shards, exports, batch=options.batch)
    overrides += options.extra
    cfg = load_config(recipe, overrides)
    need, available = estimated_peak_gib(cfg, NUM_CLASSES), psutil.virtual_memory().available / 2**30
    if need > available - options.memory_margin_gib:
        result = StageResult(chain, stage, cfg, run_dir, left_out=True)
        result.error = (
            f"not run: needs ~{need:.1f} GiB (estimate), {available:.1f} GiB available less "
            f"{options.memory_margin_gib:g} left to others"
        )
        exports[stage.recipe] = None
        return result
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"[smoke] {chain}: ./launch.sh recipes/{recipe.name} {' '.join(overrides)}", flush=True)
    run = launch(recipe, overrides, run_dir / "launch.log", timeout=options.timeout)
    result = StageResult(chain, stage, cfg, run_dir, exit_code=run["exit_code"], wall_seconds=run["wall_seconds"])
    result.peak_rss_gib, result.others_load = run["peak_rss_bytes"] / 2**30, run["others_load"]
    read_back(result)
    if result.ok:
        exports[stage.recipe] = run_dir / "export"
    print(f"[smoke] {stage.recipe}: {render_row(result)}", flush=True)
    return result


def read_back(result: StageResult) -> None:
    """Fill in what the run left: peak memory and step time from its metrics, the export's checks, or the error."""
    metrics = read_metrics(result.run_dir)
    result.step_seconds = last_step_seconds(result.run_dir)
    if result.exit_code != 0:
        killed = " (killed: timeout or out of memory)" if result.exit_code in (-9, 137) else ""
        result.error = f"exit code {result.exit_code}{killed}"
        tail = (result.run_dir / "launch.log").read_text().strip().splitlines()[-15:]
        print(f"[smoke] {result.stage.recipe} failed ({result.error}); log tail:\n  " + "\n  ".join(tail), flush=True)
        return
    losses = [m["train/loss"] for m in metrics if "train/loss" in m]
    if len(losses) != 2 or not all(math.isfinite(v) for v in losses):
        result.error = f"losses {losses}: expected 2 finite values"
    try:
        result.export = check_export(result.run_dir / "export", result.cfg, NUM_CLASSES)
    except Exception as err:  # the table says what failed; the log holds the rest
        result.export = {"problems": [f"{type(err).__name__}: {err}"]}
    result.num_params = result.export.get("num_params")
    if result.export["problems"]:
        result.error = result.error or "export: " + "; ".join(result.export["problems"])


def run_chain(
    name: str, root: Path, shards: dict[str, Path], options: Options = Options(), stages: tuple[Stage, ...] = ()
) -> list[StageResult]:
    """The stages of chain `name` (default: all of `CHAINS[name]`) in order, run under `root/name`."""
    exports: dict[str, Path | None] = {}
    return [run_stage(name, stage, root, shards, exports, options) for stage in stages or CHAINS[name]]


# ---------------------------------------------------------------- report


def _describe(cfg: Config) -> str:
    if cfg.stage == "tokenizer":
        o = cfg.objective
        return f"VQ-VAE {o.img_size} px / {o.downsample}, {o.codebook_size} codes"
    m = cfg.model
    if m.arch == "t2t_vit":
        return f"T2T-ViT{'_t' if m.t2t_variant.startswith('t_') else ''}-{m.t2t_variant[-2:]} at {m.img_size} px"
    if m.arch == "vt_resnet":
        return f"VT-ResNet-{m.vt_variant} at {m.img_size} px"
    if m.arch == "resnet":
        return f"ResNet-{m.resnet_variant} + {cfg.objective.head.upper().replace('_', '-')} at {m.img_size} px"
    depth = VIT_SIZES[m.size]["depth"]
    text = f"ViT-{m.size[0].upper()}/{m.patch_size} at {m.img_size} px"
    text += f", {m.depth} of {depth} blocks" if m.depth not in (None, depth) else ""
    return text + (f", LayerScale {m.layer_scale_init:g}" if m.layer_scale_init else "")


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render_row(r: StageResult) -> str:
    params = "-" if r.num_params is None else f"{r.num_params / 1e6:.1f}M"
    step = "-" if r.step_seconds is None else f"{r.step_seconds:.1f}"
    export = "ok" if r.ok else r.error
    engine = f"ZeRO-{r.cfg.engine.zero_stage} {r.cfg.engine.precision}"
    others = "-" if r.others_load is None else f"{r.others_load:.0%}"
    wall = "-" if r.exit_code is None else f"{r.wall_seconds:.0f}"
    return (
        f"| {r.chain} | {r.stage.recipe} | {_describe(r.cfg)} | {engine} | {params} | {step} | "
        f"{_gib(r.peak_rss_gib)} | {wall} | {others} | {export} |"
    )


def render(results: list[StageResult], argv: list[str]) -> str:
    import torch

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    lines = [
        "# Every published recipe at its real size, 2 steps each",
        "",
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- machine: {cpu}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.1f} GiB RAM (shared)",
        f"- torch {torch.__version__}, deepspeed {version('deepspeed')}, timm {version('timm')}, "
        f"python {platform.python_version()}",
        f"- command: `{' '.join(['python', '-m', 'benchmarks.smoke_recipes', *argv])}`",
        "- each stage: `./launch.sh RECIPE` with 1 process, global batch 2, 2 steps (1 warmup), 1 data worker, on "
        f"224 px JPEG shards ({NUM_CLASSES} classes; segmentation: ADE20K-shaped JPEGs with masks of "
        f"{SEG_NUM_CLASSES} classes); everything else as the recipe says",
        "- s/step: the second step, without the pictures drawn after the first; peak RSS: the largest process's, the "
        "rank's (the kernel's VmHWM, the whole run long, checkpoint and export included; its data worker is forked "
        "from it and shares its pages); wall: the whole launch; others' load: share of the machine's CPU time other "
        "processes used meanwhile (above ~20% the times mean little)",
        "- export ok: the run exited 0 with 2 finite losses, and its export loads into plain timm "
        "(`load_state_dict(strict=True)`; the tokenizer through `load_tokenizer`) with the recipe's pos_embed, "
        "patch kernel and head shapes",
        "",
        "| chain | recipe | model | engine | parameters | s/step | peak RSS GiB | wall s | others' load | export |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|",
        *(render_row(r) for r in results),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chains", default=",".join(CHAINS), help="comma-separated chain names (default: all)")
    p.add_argument("--batch", type=int, default=2, help="global batch of every stage (default: 2)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds before a stage is killed (default: 3600)")
    p.add_argument("--memory-margin-gib", type=float, default=4.0, help="memory left to others (default: 4)")
    p.add_argument("--work-dir", type=Path, default=None, help="keep shards and runs here (default: a temp dir)")
    p.add_argument("--out", type=Path, default=RESULTS, help="markdown result file (default: %(default)s)")
    args = p.parse_args(argv)
    names = [n for n in args.chains.split(",") if n]
    unknown = sorted(set(names) - set(CHAINS))
    if unknown:
        p.error(f"unknown chains {unknown}; known: {', '.join(CHAINS)}")

    root = args.work_dir or Path(tempfile.mkdtemp(prefix="smoke_recipes_"))
    shards = write_jpeg_shards(root / "shards")
    options = Options(batch=args.batch, timeout=args.timeout, memory_margin_gib=args.memory_margin_gib)
    results = []
    for name in names:
        results += run_chain(name, root, shards, options)
        if any(r.left_out for r in results[-len(CHAINS[name]) :]) and name in REDUCED:
            reduced = dataclasses.replace(options, extra=REDUCED[name])
            results += run_chain(name, root / "reduced", shards, reduced)
        if args.work_dir is None:  # the large models' checkpoints take ~10 GB: freed before the next chain
            shutil.rmtree(root / name, ignore_errors=True)
            shutil.rmtree(root / "reduced", ignore_errors=True)
    if args.work_dir is None:
        shutil.rmtree(root, ignore_errors=True)
    text = render(results, argv)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"[smoke] written to {args.out}")
    return 0 if all(r.ok or r.left_out for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
