"""Run the pretraining entry point (`python tests/gpu/block_dtypes_worker.py OUT RECIPE [key=value ...]`, under
torchrun) and record the dtype of every timm transformer `Block`'s output: the encoder's and the MAE decoder's, in
the training forwards inside `engine(...)` and in the forwards outside it (the FLOP count, the pictures).

A process-wide forward hook sees every block call however precision is applied (the loop's autocast, DeepSpeed's
`torch_autocast` section or its bf16 mode), so the test reads what ran, not how it was set up. Rank 0 writes
{"grad": {dtype: count}, "no_grad": {dtype: count}} to OUT as JSON: forwards with autograd recording (training
steps, the FLOP count) and without (pictures, kNN features).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
from timm.models.vision_transformer import Block

COUNTS = {"grad": Counter(), "no_grad": Counter()}


def record(module: torch.nn.Module, args, output) -> None:
    if isinstance(module, Block):
        COUNTS["grad" if torch.is_grad_enabled() else "no_grad"][str(output.dtype).removeprefix("torch.")] += 1


if __name__ == "__main__":
    out, *argv = sys.argv[1:]
    torch.nn.modules.module.register_module_forward_hook(record)
    from pretrain.__main__ import main

    code = main(argv)
    if os.environ.get("RANK", "0") == "0":
        Path(out).write_text(json.dumps(COUNTS))
    sys.exit(code)
