"""`mimpipe evaluate` (`python -m finetune evaluate`): one report card for any number of encoders, each measured by
the code the pipeline already has, on the same images in the same order, so that their rows compare.

    python -m finetune evaluate CHECKPOINT [CHECKPOINT ...] --train SHARDS --val SHARDS --out DIR
        [--suite knn,linear,fewshot,rank] [--max-train N] [--max-val N] [--seg-train SHARDS --seg-val SHARDS]
        [--img-size N] [--mean M M M] [--std S S S] [--crop-pct F] [--pooling cls|mean] [--arch NAME] [--num-heads N]
        [--card]
    torchrun --nproc_per_node 8 -m finetune evaluate ...     (each rank embeds its shards; rank 0 measures, writes)

A CHECKPOINT is anything the hand-off accepts, or a run_dir (finetune/report_encoders.py says how each is read and
where its image size, normalisation and pooling come from). Every checkpoint is resolved and checked before any
image is embedded. Then, one checkpoint after another, the encoder embeds the first `--max-train` training and
`--max-val` validation images (spread over the shards as the kNN monitor's sets are), in eval mode without
gradients, as finetune/lbfgs_probe.py `extract_features` does: the class token and the mean of the patch tokens after
the final norm. The features of every rank are gathered and put in the order of their sample keys, the same for
any number of ranks. Measures (`--suite`):

    knn       DINO's weighted kNN top-1 (core/report/knn.py; the pretraining monitor's k 20 and temperature 0.07):
              the training features are the bank, the validation features the queries, L2-normalised, at the row's
              pooling
    linear    the L-BFGS logistic-regression probe (finetune/lbfgs_probe.py `probe`) on the class token and on the
              mean of the patch tokens
    fewshot   the ViT paper's few-shot ridge fit (core/report/fewshot.py) on the kNN's features: 1, 5, 10, 25 images
              per class, 3 draws
    rank      RankMe's effective rank (core/report/collapse.py) of the kNN's training features (and std x sqrt(D),
              in report.json)
    seg       with --seg-train and --seg-val: the linear segmentation probe on the frozen encoder
              (finetune/seg_probe.py), mIoU

Writes DIR/report.json (every number, each row's settings and where they came from, the protocol), DIR/report.md (one
row per checkpoint, one column per measure, the protocol under the table) and DIR/tb/<row>/ (the same numbers as
TensorBoard scalars under the pretraining monitors' tags: knn/top1, fewshot/top1_10shot, features/effective_rank).
With --card, each checkpoint that is an export folder of ours (or a run_dir's export) gets its row, the protocol and
its settings as its README.md model card's Evaluation section (finetune/report_files.py `write_card_sections`); one
line says so for each checkpoint, or why it was left alone.

Shapes: N training images, M validation images, D feature width.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from core.engine.distributed import DistInfo, all_gather_rows, all_reduce, init_distributed
from core.engine.precision import device_machine
from core.launch.precision import choose_precision
from core.recipe.sections import KNNConfig
from core.report.collapse import effective_rank, normalised_std
from core.report.fewshot import fewshot_correct
from core.report.knn import KNNBank
from data.pipeline import make_eval_loader
from data.progress import Progress
from data.specs import dataset_classes, dataset_size, resolve_shards, split_index
from data.transforms import eval_transform
from finetune.lbfgs_probe import POOLINGS, extract_features, probe
from finetune.report_encoders import Encoder, EncoderFlags, resolve_encoders
from finetune.report_files import write_card_sections, write_report
from finetune.seg_probe import SegSchedule, seg_probe

SUITE = ("knn", "linear", "fewshot", "rank", "seg")
DEFAULT_SUITE = "knn,linear,fewshot,rank"
DEFAULT_SHOTS = (1, 5, 10, 25)
KNN = KNNConfig()  # the pretraining monitor's defaults: k, temperature, batch size


@dataclass(frozen=True)
class Protocol:
    """What every row is measured with (report.json's "protocol")."""

    train: str
    val: str
    suite: tuple[str, ...]
    max_train: int | None = None
    max_val: int | None = None
    k: int = KNN.k
    temperature: float = KNN.temperature
    shots: tuple[int, ...] = DEFAULT_SHOTS
    batch_size: int = KNN.batch_size_per_device
    precision: str = "fp32"
    label_field: str | None = None
    seg_train: str | None = None
    seg_val: str | None = None
    seg_img_size: int | None = None
    seg_schedule: SegSchedule = SegSchedule()


@dataclass
class Split:
    """One set's gathered features, in the order of their sample keys."""

    features: dict[str, torch.Tensor]
    """"cls" and "mean": (N, D) float32 on the CPU, as `extract_features` gives them (not normalised)."""
    labels: torch.Tensor
    keys: list[str]


def main(argv: list[str] | None = None) -> int:
    """Command line: `argv` is what follows `python -m finetune evaluate`. Returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        protocol = _protocol(args)
    except ValueError as e:
        parser.error(str(e))
    flags = EncoderFlags(
        arch=args.arch, num_heads=args.num_heads, img_size=args.img_size, mean=args.mean, std=args.std,
        crop_pct=args.crop_pct, pooling=args.pooling, trust_checkpoint=args.trust_checkpoint,
    )  # fmt: skip
    dist = init_distributed(args.device)
    choice = choose_precision(args.precision, device_machine(dist.device))
    if choice.problem is not None:  # bf16 asked for on a GPU without it
        parser.error(f"--precision: {choice.problem}")
    protocol = dataclasses.replace(protocol, precision="bf16" if choice.precision == "bf16" else "fp32")
    try:
        report = evaluate(args.checkpoints, protocol, flags, dist, num_workers=args.num_workers)
    except ValueError as e:
        if dist.is_main:
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    if report is not None:
        table = write_report(Path(args.out), report)
        print(f"{table}\n[mimpipe] wrote {args.out}/report.md, report.json and tb/")
        if args.card:
            lines, failed = write_card_sections(report)
            print("\n".join(lines))
            return 1 if failed else 0
    return 0


def evaluate(
    specs: list[str], protocol: Protocol, flags: EncoderFlags, dist: DistInfo, *, num_workers: int = 2
) -> dict | None:
    """The report of every checkpoint of `specs` (report.json's contents) on rank 0, None on the others; collective.

    Raises:
        ValueError: A checkpoint that does not resolve (before any image is embedded), unreadable shards.
    """
    with tempfile.TemporaryDirectory(prefix="mimpipe-evaluate-") as scratch:
        shards_size = split_index(protocol.train)[1].get("image_size")
        # every checkpoint checked before any image is embedded, the architecture flags across them
        encoders = resolve_encoders(specs, flags, scratch=Path(scratch), dist=dist, shards_img_size=shards_size)
        embedded = [_embed(encoder, protocol, dist, num_workers) for encoder in encoders]
    if not dist.is_main:
        return None
    classes = dataset_classes(protocol.train)
    labels = torch.cat([embedded[0][0].labels, embedded[0][1].labels, torch.zeros(1, dtype=torch.int64)])
    num_classes = max(len(classes), int(labels.max()) + 1)
    rows = []
    # The fits are small matmuls: at one thread they do not wait on a second one (finetune/lbfgs_probe.py measured
    # 1.1 s against 11 s; a 200-image probe here: 0.45 s against 7 s on a busy 2-core machine).
    torch.set_num_threads(1)
    for encoder, (train, val, seg, seconds) in zip(encoders, embedded, strict=True):
        start = time.perf_counter()
        metrics, details = measure(train, val, encoder, protocol, num_classes)
        metrics |= seg or {}
        seconds["measure"] = time.perf_counter() - start
        rows.append(
            {"checkpoint": encoder.name, "metrics": metrics, "details": details, "settings": encoder.describe(),
             "seconds": seconds}
        )  # fmt: skip
    sizes = {"train_samples": len(embedded[0][0].labels), "val_samples": len(embedded[0][1].labels)}
    return {"protocol": dataclasses.asdict(protocol), "num_classes": num_classes, **sizes, "rows": rows}


def measure(
    train: Split, val: Split, encoder: Encoder, protocol: Protocol, num_classes: int
) -> tuple[dict[str, float], dict]:
    """The suite's numbers for one encoder's features (rank 0); and the probe's details (weight decay chosen)."""
    metrics, details = {}, {}
    bank, queries = (F.normalize(split.features[encoder.pooling], dim=-1) for split in (train, val))  # (N|M, D)
    num_queries = max(len(val.labels), 1)
    if "knn" in protocol.suite:
        knn = KNNBank(bank, train.labels, protocol.k, protocol.temperature, num_classes)
        top1, top5 = knn.correct(queries, val.labels).tolist()
        metrics |= {"knn/top1": top1 / num_queries, "knn/top5": top5 / num_queries}
    if "linear" in protocol.suite:
        for pooling in POOLINGS if encoder.has_class_token else ("mean",):
            result = probe(
                (train.features[pooling], train.labels), (val.features[pooling], val.labels), num_classes=num_classes
            )
            metrics[f"linear/top1_{pooling}"] = result["top1"]
            details[f"linear_{pooling}"] = result
    if "fewshot" in protocol.suite:
        for shots in protocol.shots:
            correct = fewshot_correct(bank, train.labels, queries, val.labels, shots=shots, num_classes=num_classes)
            metrics[f"fewshot/top1_{shots}shot"] = float(correct.mean()) / num_queries
    if "rank" in protocol.suite:
        metrics |= {"features/effective_rank": effective_rank(bank), "features/std": normalised_std(bank)}
    return metrics, details


def _embed(
    encoder: Encoder, protocol: Protocol, dist: DistInfo, num_workers: int
) -> tuple[Split, Split, dict | None, dict]:
    """Both sets' gathered features and, with "seg", the segmentation probe's metrics; collective."""
    start = time.perf_counter()
    model, report = encoder.build()
    model.to(dist.device)
    if dist.is_main:
        h, w = encoder.img_size
        print(f"[mimpipe] evaluate {encoder.name}: {encoder.architecture} at {h}x{w}, {encoder.pooling} pooling")
        print(report.format(), flush=True)
    transform = eval_transform(encoder.img_size, encoder.mean, encoder.std, crop_pct=encoder.crop_pct)
    sets = ((protocol.train, protocol.max_train), (protocol.val, protocol.max_val))
    sizes = [dataset_size(spec) for spec, _ in sets]
    total = None if None in sizes else sum(min(n, limit or n) for n, (_, limit) in zip(sizes, sets, strict=True))
    progress = Progress(total, "images", label=f"evaluate {encoder.name}") if dist.is_main else None
    splits = []
    for spec, limit in sets:
        loader = make_eval_loader(
            resolve_shards(spec), transform=transform, batch_size=protocol.batch_size, rank=dist.rank,
            world_size=dist.world_size, num_workers=num_workers, label_field=protocol.label_field,
            max_samples=limit,
        )  # fmt: skip
        splits.append(_embed_split(model, loader, dist, protocol.precision, progress))
    if progress is not None:
        progress.finish()
    seconds = {"embed": time.perf_counter() - start}
    seg = None
    if "seg" in protocol.suite:
        start = time.perf_counter()
        crop = encoder.img_size if protocol.seg_img_size is None else (protocol.seg_img_size,) * 2
        seg_encoder, _ = encoder.build(crop)
        seg = seg_probe(
            seg_encoder, train=protocol.seg_train, val=protocol.seg_val, crop=crop, mean=encoder.mean,
            std=encoder.std, dist=dist, precision=protocol.precision, num_workers=num_workers,
            schedule=protocol.seg_schedule, label=f"evaluate {encoder.name} seg probe",
        )  # fmt: skip
        seconds["seg"] = time.perf_counter() - start
    return splits[0], splits[1], seg, seconds


def _embed_split(model, loader, dist: DistInfo, precision: str, progress: Progress | None) -> Split:
    """This rank's share embedded, every rank's gathered and sorted by sample key; collective."""
    keys: list[str] = []

    def counted():
        for batch in loader:
            keys.extend(batch["key"])
            if progress is not None:  # rank 0's pace stands for every rank's
                progress.advance(len(batch["key"]) * dist.world_size)
            yield batch

    features, labels = extract_features(model, counted(), precision, dist.device)
    features = {name: all_gather_rows(f).cpu() for name, f in features.items()}  # (N, D) each, rank order
    labels = all_gather_rows(labels.to(dist.device)).cpu()
    keys = _gather_keys(keys, dist)
    order = sorted(range(len(keys)), key=keys.__getitem__)  # the same for any number of ranks or workers
    index = torch.tensor(order, dtype=torch.int64)
    return Split({name: f[index] for name, f in features.items()}, labels[index], [keys[i] for i in order])


def _gather_keys(keys: list[str], dist: DistInfo) -> list[str]:
    """Every rank's sample keys, in rank order (as `all_gather_rows` orders rows): UTF-8 bytes padded with zeros."""
    encoded = [key.encode() for key in keys]
    width = torch.tensor([max(map(len, encoded), default=0)], device=dist.device)
    width = int(all_reduce(width, op="max").item())
    rows = torch.zeros(len(encoded), width, dtype=torch.uint8)  # (n, L)
    for i, data in enumerate(encoded):
        rows[i, : len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    gathered = all_gather_rows(rows.to(dist.device)).cpu()
    return [bytes(row).rstrip(b"\0").decode() for row in gathered.tolist()]


def _protocol(args: argparse.Namespace) -> Protocol:
    """The protocol the flags ask for (precision made concrete later, on the device).

    Raises:
        ValueError: An unknown measure, seg without both segmentation sets or one of them without seg.
    """
    suite = tuple(name for name in args.suite.split(",") if name)
    unknown = [name for name in suite if name not in SUITE]
    if unknown or not suite:
        raise ValueError(f"--suite {args.suite}: choose from {','.join(SUITE)}")
    segmentation = (args.seg_train, args.seg_val)
    if any(segmentation) and not all(segmentation):
        raise ValueError("--seg-train and --seg-val go together")
    if all(segmentation) and "seg" not in suite:
        suite += ("seg",)
    if "seg" in suite and not all(segmentation):
        raise ValueError("--suite seg needs --seg-train and --seg-val")
    schedule = SegSchedule(steps=args.seg_steps)
    return Protocol(
        train=args.train, val=args.val, suite=suite, max_train=args.max_train, max_val=args.max_val, k=args.k,
        temperature=args.temperature, shots=tuple(args.shots), batch_size=args.batch_size,
        label_field=args.label_field, seg_train=args.seg_train, seg_val=args.seg_val, seg_img_size=args.seg_img_size,
        seg_schedule=schedule,
    )  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m finetune evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="export folders, run_dirs, or any checkpoint the hand-off reads")
    parser.add_argument("--train", required=True, help="labelled shards: the kNN bank, the probes' training set")
    parser.add_argument("--val", required=True, help="labelled shards the measures score")
    parser.add_argument("--out", required=True, help="folder for report.json, report.md and tb/")
    parser.add_argument("--suite", default=DEFAULT_SUITE, help=f"measures, from {','.join(SUITE)}")
    parser.add_argument("--max-train", type=int, help="training images (default: all)")
    parser.add_argument("--max-val", type=int, help="validation images (default: all)")
    parser.add_argument("--shots", type=_ints, default=DEFAULT_SHOTS, help="few-shot images per class, e.g. 1,5,10,25")
    parser.add_argument("--k", type=int, default=KNN.k, help=f"kNN neighbours (default {KNN.k})")
    parser.add_argument("--temperature", type=float, default=KNN.temperature, help="kNN vote temperature")
    parser.add_argument("--batch-size", type=int, default=KNN.batch_size_per_device, help="images per forward")
    parser.add_argument("--num-workers", type=int, default=2, help="data workers per rank (default 2, as recipes)")
    parser.add_argument("--label-field", help="integer field of each sample's .json holding the label (default .cls)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"), help="auto: bf16 where native")
    parser.add_argument(
        "--card", action="store_true", help="write each export's numbers into its README.md model card (Evaluation)"
    )
    encoder = parser.add_argument_group("encoders (default: each checkpoint's manifest, config.json or weights)")
    encoder.add_argument("--img-size", type=int, help="image side (position embeddings resized to it)")
    encoder.add_argument("--mean", type=float, nargs=3, help="normalisation mean (3 values)")
    encoder.add_argument("--std", type=float, nargs=3, help="normalisation std (3 values)")
    encoder.add_argument("--crop-pct", type=float, help="centre crop's share of the resized image")
    encoder.add_argument("--pooling", choices=("cls", "mean"), help="pooling of the kNN, few-shot and rank features")
    encoder.add_argument("--arch", help="timm architecture to build a weights file as (its num_heads)")
    encoder.add_argument("--num-heads", type=int, help="attention heads (widths other than timm's standard ones)")
    encoder.add_argument("--trust-checkpoint", action="store_true", help="unpickle non-tensor objects (runs code)")
    seg = parser.add_argument_group("segmentation probe")
    seg.add_argument("--seg-train", help="segmentation shards the linear head trains on")
    seg.add_argument("--seg-val", help="segmentation shards scored (mIoU)")
    seg.add_argument("--seg-img-size", type=int, help="the probe's crop (default: the encoder's image size)")
    seg.add_argument("--seg-steps", type=int, default=SegSchedule.steps, help="the head's training steps")
    return parser


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in text.split(",") if n)
