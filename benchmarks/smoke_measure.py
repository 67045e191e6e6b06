"""What one launched recipe run cost and left behind, for benchmarks/smoke_recipes.py: its processes' peak memory
and the CPU other processes took meanwhile, the time of its last step, whether its export loads strictly into plain
timm with the recipe's shapes, and its memory estimated beforehand."""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from core.models.t2t_vit import VARIANTS as T2T_VARIANTS
from core.models.vit import VIT_SIZES
from core.recipe.config import Config

REPO = Path(__file__).resolve().parents[1]
POLL_SECONDS = 0.5


def _peak_rss(pid: int) -> int:
    """The process's peak resident set size so far (the kernel's VmHWM, bytes); 0 once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    line = next((line for line in status.splitlines() if line.startswith("VmHWM:")), "VmHWM: 0 kB")
    return int(line.split()[1]) * 1024


def _poll_peaks(root: psutil.Process, peaks: dict[int, int]) -> None:
    """Update `peaks` (pid -> peak RSS) for `root` and every descendant alive now."""
    try:
        pids = [root.pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return
    for pid in pids:
        peaks[pid] = max(peaks.get(pid, 0), _peak_rss(pid))


def _yield_to_others() -> None:
    """In the launched tree: be the out-of-memory killer's first choice, not another user's process."""
    Path("/proc/self/oom_score_adj").write_text("1000")


def _busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all cores, every process; guest time is already
    counted in user time), as bench_engine.py counts it."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


def launch(recipe: Path, overrides: list[str], log_path: Path, *, timeout: float) -> dict:
    """`./launch.sh recipe overrides` with one process, output to `log_path`, polling each process's peak memory.

    Peaks are the kernel's per-process high-water marks (VmHWM), read every `POLL_SECONDS`: cheap to read, and no
    short peak between two polls is missed (only what a process adds in its last fraction of a second). The run's
    peak is its largest process's, the rank's: its data workers are forked from it and share its pages, which a sum
    of resident sets would count once per worker (summed PSS would not, but reading it costs a core at this rate).

    Returns:
        {"exit_code", "wall_seconds", "peak_rss_bytes" (the largest process's peak), "others_load" (share of the
        machine's CPU time used by other processes meanwhile)}. A run past `timeout` is killed (its whole process
        group): exit code -9.
    """
    env = {**os.environ, "PYTHON": sys.executable, "NPROC_PER_NODE": "1", "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    command = [str(REPO / "launch.sh"), str(recipe), *overrides]
    start, busy, own = time.monotonic(), _busy_cpu_seconds(), resource.getrusage(resource.RUSAGE_CHILDREN)
    peaks: dict[int, int] = {}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=_yield_to_others,
        )  # fmt: skip
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            _poll_peaks(root, peaks)
            if time.monotonic() - start > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            time.sleep(POLL_SECONDS)
    wall = time.monotonic() - start
    used = resource.getrusage(resource.RUSAGE_CHILDREN)  # the whole tree: each level waits for its children
    own_seconds = used.ru_utime + used.ru_stime - own.ru_utime - own.ru_stime
    others = max(0.0, _busy_cpu_seconds() - busy - own_seconds) / (wall * psutil.cpu_count())
    return {
        "exit_code": proc.returncode,
        "wall_seconds": wall,
        "peak_rss_bytes": max(peaks.values(), default=0),
        "others_load": others,
    }


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _event_times(tb_dir: Path, step: int) -> list[float]:
    """Wall times of every TensorBoard event logged at `step` (scalars, pictures, text)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    times = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        times += [e.wall_time for e in EventFileLoader(str(path)).Load() if e.step == step]
    return times


def last_step_seconds(run_dir: Path) -> float | None:
    """Seconds of the last training step: from the last thing logged at the step before (its scalars, and the
    pictures the loop draws after them) to the last step's own scalars. None with fewer than 2 logged steps."""
    logged = [m for m in read_metrics(run_dir) if "train/loss" in m]
    if len(logged) < 2:
        return None
    before, last = logged[-2], logged[-1]
    start = max([before["time"], *_event_times(run_dir / "tb", before["step"])])
    return last["time"] - start


def _expected_shapes(cfg: Config, num_classes: int) -> dict[str, list[int]]:
    """The export's key tensors as the recipe's model has them (T2T-ViT stores no position table: it is fixed)."""
    m = cfg.model
    if m.arch == "t2t_vit":
        width = m.embed_dim or T2T_VARIANTS[f"t2t_vit_{m.t2t_variant}"]["embed_dim"]
        shapes = {"tokens_to_token.project.weight": [width, 64 * 3 * 3]}  # from the last 3x3 soft split of width 64
        return {**shapes, "head.weight": [num_classes, width]} if num_classes else shapes
    if m.arch == "vt_resnet":
        width, channels = m.embed_dim or 1024, 256 if m.vt_variant in (18, 34) else 1024
        shapes = {"layer4.0.tokenizer.filters.weight": [16, channels]}  # 16 visual tokens from the stride-16 map
        return {**shapes, "fc.weight": [num_classes, width]} if num_classes else shapes
    if m.arch == "resnet":  # the last stage's first convolution: 3x3 (BasicBlock, ResNet-18/34) or 1x1 (Bottleneck)
        return {"layer4.0.conv1.weight": [512, 256, 3, 3] if m.resnet_variant in (18, 34) else [512, 1024, 1, 1]}
    width = m.embed_dim or VIT_SIZES[m.size]["embed_dim"]
    prefix = 2 if cfg.stage == "finetune" and cfg.distill.kind != "none" else 1  # DeiT: class + distillation token
    shapes = {"pos_embed": [1, prefix + math.prod(m.grid), width]}
    if m.arch == "vit":  # the hybrid's patch embedding is a 1x1 conv over its backbone's channels
        shapes["patch_embed.proj.weight"] = [width, 3, m.patch_size, m.patch_size]
    if num_classes:
        shapes["head.weight"] = [num_classes, width]
    return shapes


def check_export(export_dir: Path, cfg: Config, num_classes: int) -> dict:
    """Load the export the way its user does and compare its shapes with the recipe's (a fine-tuned model's head
    with `num_classes`).

    A ViT export is built from its config.json by plain timm and loaded with `load_state_dict(strict=True)`; a
    tokenizer export is rebuilt by `load_tokenizer`, which loads strictly too.

    Returns:
        {"loader", "num_params", "shapes": {key: shape} of the checked tensors, "problems": [...]}.
    """
    import safetensors.torch
    import timm

    if cfg.stage == "tokenizer":
        from pretrain.tokenizer import load_tokenizer

        model = load_tokenizer(export_dir)
        grid, want = list(model.grid), [cfg.objective.img_size // cfg.objective.downsample] * 2
        problems = [] if grid == want else [f"code grid {grid}, recipe {want}"]
        num_params = sum(p.numel() for p in model.parameters())
        return {"loader": "load_tokenizer", "num_params": num_params, "shapes": {"grid": grid}, "problems": problems}
    model = timm.create_model(f"local-dir:{export_dir}", pretrained=False)
    model.load_state_dict(safetensors.torch.load_file(export_dir / "model.safetensors"), strict=True)
    state = model.state_dict()
    classifier = cfg.stage == "finetune" and cfg.objective.kind == "classification"
    want = _expected_shapes(cfg, num_classes if classifier else 0)  # a segmentation export's encoder has no head
    shapes = {key: list(state[key].shape) if key in state else None for key in want}
    problems = [f"{key}: export {shapes[key]}, recipe {shape}" for key, shape in want.items() if shapes[key] != shape]
    if cfg.objective.kind == "segmentation":
        head = export_dir / "seg_head.safetensors"
        problems += [] if head.is_file() else [f"no {head.name} beside the encoder"]
    num_params = sum(p.numel() for p in model.parameters())
    loader = f"timm.create_model('local-dir:...') + load_state_dict(strict=True): {type(model).__name__}"
    return {"loader": loader, "num_params": num_params, "shapes": shapes, "problems": problems}


def parameter_counts(cfg: Config, num_classes: int) -> tuple[int, int]:
    """(all, trained) parameters of what the stage's process trains (a fine-tuned model with a `num_classes` head, a
    segmentation model with `num_classes` outputs), counted on the meta device."""
    import torch

    if cfg.stage == "tokenizer":
        from pretrain.train_tokenizer import build_tokenizer

        build = lambda: build_tokenizer(cfg)  # noqa: E731
    elif cfg.stage == "pretrain":
        from pretrain.objectives import objective_builder

        build = objective_builder(cfg)  # a tokenizer target is loaded here, outside the meta device
    elif cfg.objective.kind == "segmentation":
        from core.models.build import build_model
        from finetune.seg_model import Segmentation, SegmentationModel
        from finetune.segment import encoder_config

        def build():
            o, encoder = cfg.objective, build_model(encoder_config(cfg), plain=True)
            model = SegmentationModel(encoder, o.head, num_classes, channels=o.channels, aux=o.aux_weight > 0)
            return Segmentation(model, freeze_encoder=o.freeze_encoder)
    else:
        from core.models.build import build_model
        from finetune.probe_ema import make_linear_probe

        def build():
            model = build_model(cfg, num_classes=num_classes, plain=True)
            return make_linear_probe(model) if cfg.objective.mode == "linear_probe" else model

    with torch.device("meta"):
        module = build()
    params = list(module.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def estimated_peak_gib(cfg: Config, num_classes: int) -> float:
    """A stage's peak memory on one process, estimated before it starts: 4 bytes per parameter for the weights, 20
    per trained parameter (gradient, AdamW's two moments, DeepSpeed's fp32 partition and gradient partition, all
    fp32 at world size 1), the weights of a distillation teacher of the same size, and 2.5 GiB for libraries,
    batch-2 activations and buffers.

    results/smoke_recipes.md sets the measured peaks beside it: the estimate misses by up to about 1.7 GiB either way
    (more for a linear probe, whose export copies the frozen weights twice); `Options.memory_margin_gib` covers that."""
    total, trained = parameter_counts(cfg, num_classes)
    teacher = total if cfg.stage == "finetune" and cfg.distill.kind != "none" else 0
    return (4 * (total + teacher) + 20 * trained) / 2**30 + 2.5
