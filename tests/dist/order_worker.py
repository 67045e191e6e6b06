"""Worker for test_order_dist.py (run under torchrun): the training loader a stage builds (`train_loader`) from a
recipe's data section, 4x4 images; writes the keys and labels of each batch it drew to OUT/rank{RANK}.json and the
data position after the first SAVE_AFTER batches (what a checkpoint saves) to OUT/position{RANK}.json. With
RESUME_FROM (a folder of such positions), it continues from them: this rank's own with the world size and workers that
wrote them, all of them otherwise (an elastic resume).

Usage: order_worker.py OUT NUM_BATCHES SAVE_AFTER RESUME_FROM|- [section.key=value ...]
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from core.engine.distributed import init_distributed, shutdown
from core.engine.stream import train_loader
from core.recipe.config import load_config
from data.transforms import eval_transform
from data.worker_process import start_fork_server
from tests.launching import position_after


def main(out: Path, num_batches: int, save_after: int, resume_from: str, overrides: list[str]) -> None:
    cfg = load_config(None, ["engine.device=cpu", *overrides])
    dist = init_distributed("cpu")
    transform = eval_transform(4, cfg.data.mean, cfg.data.std, crop_pct=1.0)
    positions = None
    if resume_from != "-":
        files = sorted(Path(resume_from).glob("position*.json"))
        positions = [json.loads(f.read_text()) for f in files]
    loader = train_loader(cfg, dist, transform, labels=True, positions=positions)
    batches = list(itertools.islice(iter(loader), num_batches))
    drawn = [{"key": b["key"], "label": b["label"].tolist()} for b in batches]
    (out / f"rank{dist.rank}.json").write_text(json.dumps(drawn))
    (out / f"position{dist.rank}.json").write_text(json.dumps(position_after(batches, save_after)))
    shutdown()


if __name__ == "__main__":
    start_fork_server(forked=True)  # as a stage starts it (core/entry/stage.py): the workers fork from these imports
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:])
