"""Run the pretraining entry point (`python tests/gpu/block_dtypes_worker.py OUT RECIPE [key=value ...]`, under
torchrun) and record the dtype of every activation the `nn.Linear` layers inside timm transformer `Block`s produce
(attention qkv and projection, MLP): the encoder's and the MAE decoder's, in the training forwards inside
`engine(...)` and in the forwards outside it (the FLOP count, the pictures). A block's own output is no witness: its
residual stream adds the bf16 branch to an fp32 input, which type promotion makes fp32 under autocast too.

Process-wide module hooks see every call however precision is applied (the loop's autocast, DeepSpeed's
`torch_autocast` section or its bf16 mode), so the test reads what ran, not how it was set up. Rank 0 writes
{"grad": {dtype: count}, "no_grad": {dtype: count}} to OUT as JSON: forwards with autograd recording (training
steps, the FLOP count) and without (pictures).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
from timm.models.vision_transformer import Block
from torch import nn

COUNTS = {"grad": Counter(), "no_grad": Counter()}
open_blocks = 0  # blocks whose forward has started and not ended: a Linear seen meanwhile is inside one


def enter(module: nn.Module, args) -> None:
    global open_blocks
    open_blocks += isinstance(module, Block)


def leave(module: nn.Module, args, output) -> None:
    global open_blocks
    if isinstance(module, Block):
        open_blocks -= 1
    elif isinstance(module, nn.Linear) and open_blocks:
        COUNTS["grad" if torch.is_grad_enabled() else "no_grad"][str(output.dtype).removeprefix("torch.")] += 1


if __name__ == "__main__":
    out, *argv = sys.argv[1:]
    torch.nn.modules.module.register_module_forward_pre_hook(enter)
    torch.nn.modules.module.register_module_forward_hook(leave)
    from pretrain.stage import main

    code = main(argv)
    if os.environ.get("RANK", "0") == "0":
        Path(out).write_text(json.dumps(COUNTS))
    sys.exit(code)
