"""torchrun worker: the kNN monitor's passes and fine-tuning's evaluation, many times over, without training.

    eval_stress_worker.py TRAIN_SHARDS VAL_SHARDS NUM_ROUNDS

Each round makes fresh evaluation loaders (2 workers each, from the fork server, as every evaluation does) in a rank
that runs threads (gloo's, the previous loaders' queue feeders), embeds a kNN bank and queries and evaluates a
classifier on them: 2 evaluations per round. Every round must give the same figures; rank 0 prints them once and
`rounds N` at the end."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from core.engine.distributed import DistInfo, all_gather_rows, all_reduce
from core.models.vit import build_vit
from data.pipeline import make_eval_loader
from data.specs import resolve_shards
from data.transforms import eval_transform
from data.worker_process import start_fork_server
from finetune.classification import Classification
from finetune.evaluate import evaluate
from pretrain.knn import KNNBank, embed

TIMEOUT_S = 60  # a round that hangs fails with the workers' one-line error instead of the test's timeout


def main() -> None:
    train, val, num_rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    info = DistInfo(dist.get_rank(), int(os.environ["LOCAL_RANK"]), dist.get_world_size(), torch.device("cpu"))
    torch.manual_seed(0)
    vit = build_vit("tiny", img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=2, num_classes=4).eval()
    classifier = Classification(vit)
    transform = eval_transform(16, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), crop_pct=1.0)

    def loader(spec: str, max_samples: int | None = None):
        return make_eval_loader(
            resolve_shards(spec), transform=transform, batch_size=16, rank=info.rank, world_size=info.world_size,
            num_workers=2, max_samples=max_samples, timeout_s=TIMEOUT_S,
        )  # fmt: skip

    first = None
    for _ in range(num_rounds):
        figures = _knn(vit, loader(train, 128), loader(val), info)
        figures += tuple(evaluate(classifier, loader(val), dist=info, precision="fp32").values())
        if first is None:
            first = figures
            if info.rank == 0:
                print(f"figures {figures}", flush=True)
        assert figures == first, (figures, first)
    if info.rank == 0:
        print(f"rounds {num_rounds}", flush=True)
    dist.destroy_process_group()


def _knn(vit, bank_batches, query_batches, info: DistInfo) -> tuple[float, ...]:
    """(top-1 correct, top-5 correct, queries), summed over the ranks."""
    kwargs = {"dist": info, "precision": "fp32", "pooling": "cls", "image_shape": (3, 16, 16)}
    queries, query_labels = embed(vit, query_batches, **kwargs)
    bank, bank_labels = embed(vit, bank_batches, **kwargs)
    bank, bank_labels = all_gather_rows(bank), all_gather_rows(bank_labels)
    correct = KNNBank(bank, bank_labels, k=20, temperature=0.07, num_classes=4).correct(queries, query_labels)
    return tuple(all_reduce(torch.cat([correct, correct.new_tensor([len(queries)])])).tolist())


if __name__ == "__main__":
    start_fork_server(forked=True)  # as a stage starts it (core/entry/stage.py): the workers fork from these imports
    main()
