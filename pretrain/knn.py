"""The kNN monitor: is the pretraining run learning anything right now?

Every `eval.knn.every_steps` the encoder (eval mode, no gradients, the run's precision) embeds a labelled bank and a
labelled query set; each query is classified by a weighted vote of its k most similar bank features, as in DINO
(`eval_knn.py`): cosine similarity of L2-normalised features, each neighbour voting for its class with weight
exp(similarity / temperature) (core/report/knn.py `KNNBank`). Logged: `knn/top1`, `knn/top5`, `knn/seconds` and the
two set sizes. With `eval.knn.fewshot`, the same features also give the ViT paper's few-shot linear accuracy
(`fewshot/top1_{n}shot`, `fewshot/seconds`).

Distributed: each rank embeds its own shards of both sets (`make_eval_loader`: every sample on exactly one rank), the
bank features are gathered on every rank, each rank classifies its own queries and the correct counts are summed,
so every query is counted once. Ranks embed in lock-step (one small all-reduce per batch says whether anyone still
has data): under ZeRO-3 every forward is collective, so a rank that has run out forwards a batch of zeros it ignores.
The same all-reduce says whether any rank received SIGTERM: then every rank stops the pass (`preempt.StopAgreed`)
and the loop saves the step.

Training is untouched: the monitor draws no random numbers (and restores the torch, numpy and python RNGs anyway),
does not read the training stream, and puts the module back into training mode.

Shapes: B batch, T tokens (prefix + patches), D feature width, N bank samples, Q queries, C classes.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from core.engine import preempt
from core.engine.distributed import DistInfo, all_gather_rows, all_reduce
from core.engine.precision import autocast_context, to_device
from core.recipe.sections import KNNConfig
from core.report.fewshot import fewshot_correct
from core.report.knn import KNNBank
from data.pipeline import make_eval_loader
from data.specs import resolve_shards
from data.transforms import eval_transform
from pretrain.export import exported_module


def pooled_features(encoder: nn.Module, images: torch.Tensor, pooling: str) -> torch.Tensor:
    """(B, C, H, W) images -> (B, D) features of a timm VisionTransformer, after its final norm.

    Args:
        encoder: The objective's timm ViT (all patches visible, no masking).
        images: Normalised images.
        pooling: "cls": the class token; "mean": the mean of the patch tokens (prefix tokens left out).
    """
    tokens = encoder.forward_features(images)  # (B, T, D)
    if pooling == "cls":
        return tokens[:, 0]
    if pooling == "mean":
        return tokens[:, encoder.num_prefix_tokens :].mean(dim=1)
    raise ValueError(f"pooling must be 'cls' or 'mean', got {pooling!r}")


@torch.no_grad()
def embed(
    encoder: nn.Module,
    batches: Iterable[dict],
    *,
    dist: DistInfo,
    precision: str,
    pooling: str,
    image_shape: tuple[int, int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of a labelled set as L2-normalised features; collective: every rank must call it.

    Args:
        encoder: As for `pooled_features`.
        batches: This rank's batches, "image" (B, 3, H, W) and "label" (B,) (none for unlabelled images); possibly
            none.
        dist: This process's place in the group.
        precision: "fp32", "bf16" (autocast) or "fp16" (half inputs), as for training.
        pooling: "cls" or "mean".
        image_shape: (3, H, W) of the images: the shape of the zero batch a rank that has run out forwards.

    Returns:
        (n, D) float32 features on `dist.device` and their (n,) int64 labels (empty for unlabelled batches).

    Raises:
        preempt.StopAgreed: On every rank, when some rank received SIGTERM during the pass.
    """
    features, labels = [], []
    iterator: Iterator[dict] = iter(batches)
    stand_in = {"image": torch.zeros(1, *image_shape)}  # (1, 3, H, W)
    while True:
        batch = preempt.next_unless_stopping(iterator)
        flags = torch.tensor([float(batch is not None), float(preempt.stop_requested())], device=dist.device)
        anyone, stop = all_reduce(flags, op="max").tolist()
        if stop:
            raise preempt.StopAgreed("kNN pass stopped early: a rank received SIGTERM")
        if not anyone:
            break
        inputs = to_device(batch if batch is not None else stand_in, dist.device, precision)
        with autocast_context(precision, dist.device):
            pooled = pooled_features(encoder, inputs["image"], pooling).float()  # (B, D)
        if batch is not None:  # a stand-in is forwarded only to keep ZeRO-3 in step
            features.append(F.normalize(pooled, dim=-1))
            labels.append(
                inputs["label"] if "label" in inputs else torch.zeros(0, dtype=torch.int64, device=dist.device)
            )
    if not features:
        width = encoder.embed_dim
        return torch.zeros(0, width, device=dist.device), torch.zeros(0, dtype=torch.int64, device=dist.device)
    return torch.cat(features), torch.cat(labels)


@contextlib.contextmanager
def training_untouched(module: nn.Module, device: torch.device):
    """Eval mode inside, the module's mode restored after; the torch (CPU and CUDA), numpy and python RNG states
    restored too, so that a run's next losses do not depend on whether anything ran in between."""
    was_training = module.training
    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            module.eval()
            yield
    finally:
        module.train(was_training)
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def monitor_loader(run, key: str, spec, max_samples: int | None, batch_size: int, *, labels: bool = True):
    """This rank's share of a monitor's set: `spec`'s shards (a resolved list too) whole at the model's size, as the
    evaluation transform shows them, the first `max_samples` spread over the shards.

    Raises:
        ValueError: Naming `key`: no such shards, fewer shards than ranks.
    """
    cfg, dist = run.cfg, run.dist
    transform = eval_transform(cfg.model.img_size, cfg.data.mean, cfg.data.std, crop_pct=cfg.data.eval_crop_pct)
    try:
        return make_eval_loader(
            resolve_shards(spec), transform=transform, batch_size=batch_size, rank=dist.rank,
            world_size=dist.world_size, num_workers=cfg.data.num_workers, labels=labels,
            label_field=cfg.data.label_field, max_samples=max_samples, read_policy=cfg.data.read_policy(),
            timeout_s=cfg.data.loader_timeout_s,
        )  # fmt: skip
    except ValueError as err:  # no such shards, fewer shards than ranks
        raise ValueError(f"{key}: {err}") from err


def knn_monitor(run, engine) -> Callable[[int], dict[str, float]] | None:
    """The `evaluate(step)` of a pretraining run with `eval.knn.enabled` (None without it).

    The shard specs are resolved and the loaders built now, so that a bad spec fails at start. Every rank must call
    the returned function (its forwards and reductions are collective); only rank 0 writes the console line.

    Args:
        run: The StageRun (config, process group, logger).
        engine: The DeepSpeed engine whose module has the timm ViT as `encoder` (MAE, BEiT-style objectives).
    """
    cfg, dist = run.cfg, run.dist
    knn: KNNConfig = cfg.eval.knn
    if not knn.enabled:
        return None
    b, q, size = knn.bank, knn.query, knn.batch_size_per_device
    bank_loader = monitor_loader(run, "eval.knn.bank.shards", b.shards or cfg.data.train, b.max_samples, size)
    query_loader = monitor_loader(run, "eval.knn.query.shards", q.shards or cfg.data.val, q.max_samples, size)
    height, width = cfg.model.image_hw
    encoder = exported_module(cfg, engine.module)  # the student, or the EMA teacher where that is exported

    def evaluate(step: int, on_bank: Callable[[torch.Tensor], None] | None = None) -> dict[str, float]:
        """The metrics at `step`; `on_bank` receives the gathered (N, D) bank features (the label-free monitor's
        reuse, pretrain/feature_monitor.py `monitors`)."""
        start = time.perf_counter()
        kwargs = {"dist": dist, "precision": cfg.engine.precision, "pooling": knn.pooling}
        with training_untouched(engine.module, dist.device):
            queries, query_labels = embed(encoder, query_loader, **kwargs, image_shape=(3, height, width))
            bank, bank_labels = embed(encoder, bank_loader, **kwargs, image_shape=(3, height, width))
        bank, bank_labels = all_gather_rows(bank), all_gather_rows(bank_labels)  # (N, D), (N,) on every rank
        if on_bank is not None:
            on_bank(bank)
        top_label = torch.cat([bank_labels, query_labels, bank_labels.new_zeros(1)]).max().reshape(1)
        num_classes = int(all_reduce(top_label, op="max").item()) + 1
        correct = KNNBank(bank, bank_labels, knn.k, knn.temperature, num_classes).correct(queries, query_labels)
        # few-shot: every rank fits the same support sets of the (gathered) bank and scores its own queries
        fewshot_start = time.perf_counter()
        shots = [
            fewshot_correct(bank, bank_labels, queries, query_labels, shots=n, num_classes=num_classes).mean()
            for n in knn.fewshot
        ]
        fewshot_seconds = time.perf_counter() - fewshot_start
        counts = torch.cat([correct, correct.new_tensor([len(queries), *[float(c) for c in shots]])])
        top1, top5, num_queries, *fewshot = all_reduce(counts).tolist()  # summed over ranks
        metrics = {
            "knn/top1": top1 / max(num_queries, 1),
            "knn/top5": top5 / max(num_queries, 1),
            "knn/bank_samples": float(len(bank)),
            "knn/query_samples": float(num_queries),
            "knn/seconds": time.perf_counter() - start,
        }
        if knn.fewshot:
            shot_counts = zip(knn.fewshot, fewshot, strict=True)
            metrics |= {f"fewshot/top1_{n}shot": c / max(num_queries, 1) for n, c in shot_counts}
            metrics["fewshot/seconds"] = fewshot_seconds
        run.logger.console(
            f"[mimpipe] step {step} knn: top1 {metrics['knn/top1']:.4f}  top5 {metrics['knn/top5']:.4f}  "
            f"({len(bank)} bank, {num_queries} queries, k {knn.k}, {knn.pooling} pooling, "
            f"{metrics['knn/seconds']:.1f} s)"
        )
        return metrics

    return evaluate
