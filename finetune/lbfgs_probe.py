"""Linear probe by L-BFGS: multinomial logistic regression on frozen features, fitted full batch.

    python -m finetune.lbfgs_probe RECIPE [section.key=value ...] --out probe.json [--max-train N] [--fewshot 1,5,10,25]

The encoder a fine-tuning recipe describes (`model.init` loaded by the same hand-off as fine-tuning, or a random
init without one) embeds `data.train` and `data.val` once, in eval mode, without augmentation (`eval_transform`).
Two features per image, both after the final norm: the class token (`cls`) and the mean of the patch tokens
(`mean`). Per pooling, the features are standardised with the training set's statistics, the weight decay is chosen
on a held-out part of the training set (a seeded 10%), the probe is refitted on the whole training set at that
decay, and its top-1 on `data.val` is reported. This is the protocol of the issue's reference (scikit-learn's
L-BFGS logistic regression on mean-pooled features); fitted full batch, it has no learning rate or schedule to tune,
unlike the SGD/LARS probe of `objective.mode: linear_probe`.

`--fewshot` adds the ViT paper's few-shot linear evaluation on the same features (core/report/fewshot.py): for each
number of images per class, a closed-form least-squares fit to {-1, 1} targets on 3 drawn support sets of the
training features, regularisation chosen by leave-one-out, top-1 on data.val averaged over the draws.

Shapes: N samples, D feature width, C classes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from core.engine.precision import autocast_context, resolve_precision
from core.export.handoff import load_encoder
from core.models.build import build_model
from core.recipe.config import load_config
from core.report.fewshot import fewshot_correct
from data.device import batch_to_device
from data.pipeline import make_eval_loader
from data.specs import dataset_classes, resolve_shards
from data.transforms import eval_transform
from finetune.handoff import resolve_init

WEIGHT_DECAYS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2)
"""The L2 penalties tried (on the mean cross-entropy, weights only): from almost none to strong."""
POOLINGS = ("cls", "mean")
CPU = torch.device("cpu")


def fit_logistic_regression(
    features: torch.Tensor, labels: torch.Tensor, *, num_classes: int, weight_decay: float, max_iter: int = 500
) -> torch.nn.Linear:
    """Minimises mean cross-entropy + weight_decay / 2 x ||W||^2 over all samples at once with L-BFGS.

    Args:
        features: (N, D) float features (standardised: L-BFGS converges fastest on well-scaled inputs).
        labels: (N,) int64 classes in [0, num_classes).
        num_classes: C.
        weight_decay: L2 penalty on the weights (the bias is not penalised).
        max_iter: L-BFGS iterations at most (the fit stops earlier once the gradient is below 1e-6).

    Returns:
        The fitted (D -> C) linear classifier, float32, without gradients.
    """
    features = features.double()
    linear = torch.nn.Linear(features.shape[1], num_classes, dtype=torch.float64)
    torch.nn.init.zeros_(linear.weight)  # a convex problem: start at the uniform prediction, no seed needed
    torch.nn.init.zeros_(linear.bias)
    optimizer = torch.optim.LBFGS(
        linear.parameters(), lr=1.0, max_iter=max_iter, history_size=20, tolerance_grad=1e-6,
        tolerance_change=1e-10, line_search_fn="strong_wolfe",
    )  # fmt: skip

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(linear(features), labels) + 0.5 * weight_decay * linear.weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return linear.float().requires_grad_(False)


def accuracy(linear: torch.nn.Linear, features: torch.Tensor, labels: torch.Tensor) -> float:
    """Top-1 of the classifier on (N, D) features."""
    return (linear(features.float()).argmax(dim=1) == labels).float().mean().item()


def probe(
    train: tuple[torch.Tensor, torch.Tensor],
    test: tuple[torch.Tensor, torch.Tensor],
    *,
    num_classes: int,
    weight_decays: tuple[float, ...] = WEIGHT_DECAYS,
    held_out_fraction: float = 0.1,
    seed: int = 0,
) -> dict:
    """Chooses the weight decay on a held-out part of `train`, refits on all of it, scores on `test`.

    Args:
        train: (N, D) features and (N,) labels.
        test: (M, D) features and (M,) labels.
        num_classes: C.
        weight_decays: The penalties tried; ties go to the larger (the simpler classifier).
        held_out_fraction: Share of `train` held out to choose the penalty (a seeded random part).
        seed: Seed of that split.

    Returns:
        {"top1" on test, "weight_decay" chosen, "held_out_top1": {penalty: held-out top-1}, "train_top1"}.
    """
    features, labels = train
    mean, std = features.mean(dim=0), features.std(dim=0).clamp_min(1e-6)  # (D,) each, from the training set only
    features = (features - mean) / std
    order = torch.randperm(len(features), generator=torch.Generator().manual_seed(seed))
    num_held_out = max(1, round(held_out_fraction * len(features)))
    held, fit = order[:num_held_out], order[num_held_out:]
    scores = {}
    for wd in weight_decays:
        linear = fit_logistic_regression(features[fit], labels[fit], num_classes=num_classes, weight_decay=wd)
        scores[wd] = accuracy(linear, features[held], labels[held])
    best = max(sorted(weight_decays, reverse=True), key=lambda wd: scores[wd])
    linear = fit_logistic_regression(features, labels, num_classes=num_classes, weight_decay=best)
    return {
        "top1": accuracy(linear, (test[0] - mean) / std, test[1]),
        "weight_decay": best,
        "held_out_top1": {str(wd): score for wd, score in scores.items()},
        "train_top1": accuracy(linear, features, labels),
    }


@torch.no_grad()
def extract_features(
    model, loader, precision: str, device: torch.device = CPU
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Frozen features of a timm ViT built with `global_pool: token` (its final norm applied to every token).

    Args:
        model: The encoder, on `device`.
        loader: Batches of "image" (B, 3, H, W) and "label" (B,); possibly none (a rank's empty share).
        precision: "bf16" (autocast) or "fp32".
        device: Where the model runs.

    Returns:
        {"cls": (N, D), "mean": (N, D)} float32 features on `device` and (N,) int64 labels on the CPU.
    """
    model.eval()
    pooled: dict[str, list[torch.Tensor]] = {name: [] for name in POOLINGS}
    labels = [torch.zeros(0, dtype=torch.int64)]
    for batch in loader:
        with autocast_context(precision, device):
            images = batch_to_device(batch, device)["image"]  # (B, 3, H, W) normalised
            tokens = model.forward_features(images).float()  # (B, T, D)
        pooled["cls"].append(tokens[:, 0])
        prefix = getattr(model, "num_prefix_tokens", 0)  # VT-ResNet's visual tokens have no prefix (nor a cls)
        pooled["mean"].append(tokens[:, prefix:].mean(dim=1))
        labels.append(batch["label"])
    empty = torch.zeros(0, model.num_features, device=device)  # (0, D): what an empty share gives
    return {name: torch.cat([empty, *parts]) for name, parts in pooled.items()}, torch.cat(labels)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # The encoder as fine-tuning would start from it; token pooling keeps the final norm on every token.
    cfg = load_config(args.recipe, [*args.overrides, "model.global_pool=token"])
    resolve_init(cfg)  # model.init's architecture and normalisation where the recipe leaves them out
    resolve_precision(cfg, torch.device("cpu"))  # the features are extracted on the CPU
    torch.manual_seed(cfg.seed)  # the random init of a probe without model.init
    classes = dataset_classes(cfg.data.train)
    model = build_model(cfg, num_classes=len(classes), plain=True)
    if cfg.model.init:
        load_encoder(model, cfg.model.init, trust_checkpoint=cfg.model.trust_checkpoint)
    transform = eval_transform(cfg.model.img_size, cfg.data.mean, cfg.data.std, crop_pct=cfg.data.eval_crop_pct)

    def features(spec, max_samples):
        loader = make_eval_loader(
            resolve_shards(spec), transform=transform, batch_size=cfg.data.eval_batch_size_per_device, rank=0,
            world_size=1, num_workers=cfg.data.num_workers, label_field=cfg.data.label_field, max_samples=max_samples,
            read_policy=cfg.data.read_policy(),
            timeout_s=cfg.data.loader_timeout_s,
        )  # fmt: skip
        return extract_features(model, loader, cfg.engine.precision)

    start = time.perf_counter()
    (train, train_labels), (test, test_labels) = features(cfg.data.train, args.max_train), features(cfg.data.val, None)
    result = {"init": cfg.model.init, "train_samples": len(train_labels), "test_samples": len(test_labels)}
    result["extract_seconds"] = time.perf_counter() - start
    # The fits are small (N x D x C matmuls): with a second thread every op waits on it, which on a shared machine
    # made a 1,800-sample fit take 11 s instead of 1.1 s at one thread (54k samples: 10 s against 6 s).
    torch.set_num_threads(1)
    for name in POOLINGS:
        start = time.perf_counter()
        result[name] = probe((train[name], train_labels), (test[name], test_labels), num_classes=len(classes))
        result[name]["fit_seconds"] = time.perf_counter() - start
        print(f"[mimpipe] lbfgs probe {name}: test top1 {result[name]['top1']:.4f} (wd {result[name]['weight_decay']})")
        for shots in args.fewshot:
            correct = fewshot_correct(
                train[name], train_labels, test[name], test_labels, shots=shots, num_classes=len(classes)
            )
            top1 = float(correct.mean()) / len(test_labels)
            result[name].setdefault("fewshot_top1", {})[str(shots)] = top1
            print(f"[mimpipe] few-shot {name}: {shots} per class, test top1 {top1:.4f} (mean of {len(correct)} draws)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m finetune.lbfgs_probe", description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="a fine-tuning recipe: model, data.train (fit), data.val (test)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. model.init=runs/x/export")
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--max-train", type=int, help="fit on at most this many training samples (default: all)")
    parser.add_argument(
        "--fewshot", type=lambda text: [int(n) for n in text.split(",") if n], default=[],
        help="also few-shot linear evaluation with these images per class, e.g. 1,5,10,25 (the ViT paper's)",
    )  # fmt: skip
    return parser


if __name__ == "__main__":
    sys.exit(main())
