"""Compiled steps (`engine.compile`): the objective's repeated blocks run through torch.compile (inductor).

Each block of an encoder's `blocks` and a decoder's `decoder_blocks` is compiled on its own, not the whole objective:
torch inlines nn.Module instances into the graph with their parameters as inputs, so the repeated `Block` of one
width compiles once for all of its blocks, and what lies between the blocks (MAE's random token dropping, BEiT's
mask tokens, the losses) stays eager Python. The parameter names do not change (no `_orig_mod.` prefix), so
checkpoints and exports are those of an eager run.

Shapes are static (`dynamic=False`), and a block runs compiled only at the batch sizes the run declares: the training
micro-batch and the evaluation batches (fine-tuning's `data.eval_batch_size_per_device`, the kNN monitor's
`eval.knn.batch_size_per_device`). Any other batch, the last partial one of an evaluation pass, a rank's stand-in,
the fixed batch of the reconstruction pictures, runs the same block eagerly instead of compiling again. So a run
compiles each block shape once: training (forward and backward), and evaluation (no grad, eval mode); MAE drops the
same number of tokens from every image, so its training shapes never change.

A stochastic-depth schedule gives every block its own drop-path rate, a Python float that dynamo compiles in as a
constant: one graph per block, each compiled on its own (forward and backward: minutes of inductor for a deep ViT),
and a torch that counts them against its recompile limit (8) would run the blocks past it eagerly (torch 2.14 counts
per module instance). The compiled blocks' `DropPath`s therefore hold their rate in a buffer (`DropPathRate`), a
graph input, so all blocks of one shape share a graph (plus one for a first block of rate 0, which timm builds
without a drop path).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from timm.layers import DropPath
from torch import nn

from core.recipe.config import Config

BLOCK_CONTAINERS = ("blocks", "decoder_blocks")
"""Attributes holding an objective's repeated blocks: timm's and T2T-ViT's encoder `blocks`, MAE's decoder."""


class DropPathRate(nn.Module):
    """timm's `DropPath` (per-sample stochastic depth on a residual branch) with the rate in a buffer, not an attribute.

    It draws its mask with a tensor probability, so its random numbers differ from timm's (as inductor's do anyway).
    The buffer is not persistent: checkpoints and exports stay those of an eager run.

    Args:
        drop_prob: Probability of dropping the branch for a sample.
        scale_by_keep: Divide the kept branches by the keep probability (timm's default).
    """

    def __init__(self, drop_prob: float, scale_by_keep: bool = True):
        super().__init__()
        self.drop_prob = drop_prob  # for the repr only: forward reads the buffer
        self.scale_by_keep = scale_by_keep and drop_prob < 1.0
        self.register_buffer("keep_prob", torch.tensor(1.0 - drop_prob), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(self.keep_prob)  # (B, 1, ...), 1 = kept
        return x * (keep / self.keep_prob if self.scale_by_keep else keep)

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:.3f}"


def _drop_rate_in_buffers(block: nn.Module) -> None:
    """Replace every timm `DropPath` inside `block` by a `DropPathRate` of the same rate, in place, on the block's
    device (the objective is already there)."""
    for name, sub in list(block.named_modules()):
        if type(sub) is DropPath:
            parent, _, leaf = name.rpartition(".")
            replacement = DropPathRate(sub.drop_prob, sub.scale_by_keep).train(sub.training)
            setattr(block.get_submodule(parent), leaf, replacement.to(next(block.parameters()).device))


class BlockCall:
    """A block's call (`nn.Module._compiled_call_impl`): compiled at the declared batch sizes, eager at any other.

    Deep copies of the block (the FLOP counter's twin, an EMA of the weights) get no compiled call and run eagerly:
    a copied compiled function would still run the original block.
    """

    def __init__(self, block: nn.Module, batch_sizes: frozenset[int], backend: str | Callable = "inductor"):
        self.eager: Callable = block._call_impl
        self.compiled: Callable = torch.compile(block._call_impl, dynamic=False, backend=backend)
        self.batch_sizes = batch_sizes

    def __call__(self, x: torch.Tensor, *args, **kwargs):
        run = self.compiled if x.shape[0] in self.batch_sizes else self.eager
        return run(x, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> None:
        return None


def compile_blocks(objective: nn.Module, batch_sizes: Iterable[int], backend: str | Callable = "inductor") -> int:
    """Compile every block of `objective`'s block containers in place for inputs of `batch_sizes` rows.

    Args:
        objective: The objective (MAE, BEiT-style, SimMIM, classification), before DeepSpeed wraps it.
        batch_sizes: The leading sizes of the block inputs to compile for (training micro-batch, eval batches).
        backend: torch.compile's backend (the tests count graphs through their own).

    Returns:
        The number of blocks compiled: 0 when the objective has none (VT-ResNet's stages are not transformer blocks).
    """
    sizes = frozenset(batch_sizes)
    count = 0
    for name, module in objective.named_modules():
        if name.rsplit(".", 1)[-1] not in BLOCK_CONTAINERS or not isinstance(module, nn.Sequential | nn.ModuleList):
            continue
        for block in module:
            _drop_rate_in_buffers(block)
            block._compiled_call_impl = BlockCall(block, sizes, backend)
        count += len(module)
    return count


def compile_batch_sizes(cfg: Config, world_size: int) -> set[int]:
    """The block input batch sizes a run compiles for: its training micro-batch, and the evaluation batch of its
    stage (fine-tuning's held-out set, the kNN monitor's bank and queries)."""
    sizes = {cfg.batch_size_per_device(world_size)}
    if cfg.stage == "finetune":
        sizes.add(cfg.data.eval_batch_size_per_device)
    if cfg.eval.knn.enabled:
        sizes.add(cfg.eval.knn.batch_size_per_device)
    return sizes


def describe_compiled(module: nn.Module) -> str | None:
    """'encoder.blocks (4), decoder_blocks (2) at batches 64, 256' for a module with compiled blocks, else None."""
    containers, sizes = [], set()
    for name, sub in module.named_modules():
        calls = [b._compiled_call_impl for b in sub.children() if isinstance(b._compiled_call_impl, BlockCall)]
        if calls and name.rsplit(".", 1)[-1] in BLOCK_CONTAINERS:
            containers.append(f"{name} ({len(calls)})")
            sizes |= calls[0].batch_sizes
    if not containers:
        return None
    return f"{', '.join(containers)} at batches {', '.join(map(str, sorted(sizes)))}"


def compile_seconds() -> float:
    """Wall seconds this process has spent compiling so far (dynamo, AOT autograd and inductor, backward included)."""
    from torch._dynamo.utils import calculate_time_spent

    return calculate_time_spent().get("total_wall_time", 0.0)
