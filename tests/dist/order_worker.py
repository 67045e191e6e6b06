"""Worker for test_order_dist.py (run under torchrun): the training stream a stage builds (`train_stream`) from a
recipe's data section, 4x4 images; writes the keys and labels of each batch it drew to OUT/rank{RANK}.json.

Usage: order_worker.py OUT NUM_BATCHES SKIP_BATCHES [section.key=value ...]
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from core.config import load_config
from core.engine.distributed import init_distributed, shutdown
from core.engine.stream import train_stream
from data.transforms import eval_transform


def main(out: Path, num_batches: int, skip_batches: int, overrides: list[str]) -> None:
    cfg = load_config(None, ["engine.device=cpu", *overrides])
    dist = init_distributed("cpu")
    transform = eval_transform(4, cfg.data.mean, cfg.data.std, crop_pct=1.0)
    batches = itertools.islice(train_stream(cfg, dist, transform, skip_batches=skip_batches, labels=True), num_batches)
    drawn = [{"key": b["key"], "label": b["label"].tolist()} for b in batches]
    (out / f"rank{dist.rank}.json").write_text(json.dumps(drawn))
    shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
