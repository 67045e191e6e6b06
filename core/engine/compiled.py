"""Compiled steps (`engine.compile`): the objective's training step, and its repeated blocks, through torch.compile
(inductor).

Two scopes (`engine.compile_scope`):
- `objective` (the default): the objective's whole `forward` at the training micro-batch is one graph: MAE's random
  masking, the encoder, the decoder and the loss (MAE keeps the same number of visible tokens in every image,
  BEiT-style and SimMIM a fixed number of masked positions, so the shapes never change), so inductor fuses the
  elementwise work between the matmuls (LayerNorm, GELU, the residual adds, the norm-pix target, the loss, the casts)
  across the whole step. The `forward` is replaced on the instance (`CompiledForward`), so DeepSpeed's module hooks
  run eagerly around the graph, as they must; `tests/unit/test_compiled_objective.py` counts one graph and no break
  for MAE, BEiT-style, SimMIM and classification.
- `blocks`: each block of an encoder's `blocks` and a decoder's `decoder_blocks` compiled on its own, what lies
  between them eager. Under either scope the blocks are compiled like this at the evaluation batch sizes (the kNN
  monitor, fine-tuning's held-out set), whose passes run the encoder, not the objective.

Block compilation: torch inlines nn.Module instances into the graph with their parameters as inputs, so the repeated
`Block` of one width compiles once for all of its blocks. The parameter names do not change under either scope (no
`_orig_mod.` prefix), so checkpoints and exports are those of an eager run.

Shapes are static (`dynamic=False`), and a compiled call runs only at the batch sizes the run declares: the objective
at the training micro-batch (in training mode, with gradients), the blocks at the training micro-batch and the
evaluation batches (fine-tuning's `data.eval_batch_size_per_device`, the kNN monitor's
`eval.knn.batch_size_per_device`). Any other batch, the last partial one of an evaluation pass, a rank's stand-in,
the fixed batch of the reconstruction pictures, runs eagerly instead of compiling again. So a run compiles each
shape once: the training step (forward and backward), and evaluation (no grad, eval mode).

A stochastic-depth schedule gives every block its own drop-path rate, a Python float that dynamo compiles in as a
constant: one graph per block, each compiled on its own (forward and backward: minutes of inductor for a deep ViT),
and a torch that counts them against its recompile limit (8) would run the blocks past it eagerly (torch 2.14 counts
per module instance). The compiled blocks' `DropPath`s therefore hold their rate in a buffer (`DropPathRate`), a
graph input, so all blocks of one shape share a graph (plus one for a first block of rate 0, which timm builds
without a drop path).

Inductor keeps what it compiled in a cache on disk, read by the next launch with the same graphs (seconds instead of
minutes): `compile_cache_dir()`, under the user's cache folder rather than torch's default in /tmp, which cluster
nodes clear between jobs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

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


def _compiled(fn: Callable, backend: str | Callable, mode: str) -> Callable:
    """torch.compile of `fn` with static shapes; `mode` (engine.compile_mode) is inductor's."""
    if backend == "inductor":
        return torch.compile(fn, dynamic=False, backend=backend, mode=None if mode == "default" else mode)
    return torch.compile(fn, dynamic=False, backend=backend)


class BlockCall:
    """A block's call (`nn.Module._compiled_call_impl`): compiled at the declared batch sizes, eager at any other.

    Deep copies of the block (the FLOP counter's twin, an EMA of the weights) get no compiled call and run eagerly:
    a copied compiled function would still run the original block.
    """

    def __init__(
        self, block: nn.Module, batch_sizes: frozenset[int], backend: str | Callable = "inductor", mode: str = "default"
    ):
        self.eager: Callable = block._call_impl
        self.compiled: Callable = _compiled(block._call_impl, backend, mode)
        self.batch_sizes = batch_sizes

    def __call__(self, x: torch.Tensor, *args, **kwargs):
        run = self.compiled if x.shape[0] in self.batch_sizes else self.eager
        return run(x, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> None:
        return None


def compile_blocks(
    objective: nn.Module, batch_sizes: Iterable[int], backend: str | Callable = "inductor", mode: str = "default"
) -> int:
    """Compile every block of `objective`'s block containers in place for inputs of `batch_sizes` rows.

    Args:
        objective: The objective (MAE, BEiT-style, SimMIM, classification), before DeepSpeed wraps it.
        batch_sizes: The leading sizes of the block inputs to compile for (training micro-batch, eval batches).
        backend: torch.compile's backend (the tests count graphs through their own).
        mode: inductor's mode (`engine.compile_mode`).

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
            block._compiled_call_impl = BlockCall(block, sizes, backend, mode)
        count += len(module)
    return count


class CompiledForward:
    """An objective's `forward`, set on the instance by `compile_objective`: the whole training step's forward (and,
    through AOT autograd, its backward) compiled at the training micro-batch, in training mode with gradients; eager
    at any other batch size, in evaluation or without gradients (the pictures' fixed batch, the FLOP count).

    The compiled call sees only the batch's tensors (its counters and positions are Python values that would
    specialise the graph). A deep copy of the objective (the FLOP counter's twin, an EMA) gets its class's own eager
    `forward`: a copied compiled function would still run the original.
    """

    def __init__(self, objective: nn.Module, batch_size: int, backend: str | Callable, mode: str):
        self.eager: Callable = objective.forward
        self.compiled: Callable = _compiled(self.eager, backend, mode)
        self.batch_size = batch_size

    def __call__(self, batch: dict):
        objective = self.eager.__self__
        image = batch.get("image")
        if image is None or image.shape[0] != self.batch_size or not (objective.training and torch.is_grad_enabled()):
            return self.eager(batch)
        return self.compiled({key: value for key, value in batch.items() if isinstance(value, torch.Tensor)})

    def __deepcopy__(self, memo: dict) -> Callable:
        twin = memo[id(self.eager.__self__)]  # deepcopy registers the new object before copying its attributes
        return type(twin).forward.__get__(twin)


def compile_objective(
    objective: nn.Module, batch_size: int, backend: str | Callable = "inductor", mode: str = "default"
) -> None:
    """Compile `objective`'s whole forward in place for its training micro-batch of `batch_size` (`CompiledForward`);
    its module hooks (DeepSpeed's) stay outside the graph."""
    objective.forward = CompiledForward(objective, batch_size, backend, mode)


def compiles(cfg: Config, device: torch.device) -> bool:
    """Whether the run compiles (`engine.compile`): `auto` on CUDA but at ZeRO-3 (whose hooks break every graph), where
    inductor's fused kernels and fewer launches pay; not on a CPU, where the quickstart models' steps gained at most
    9% and the compile cost more than it saved (docs/speed.md)."""
    setting = cfg.engine.compile
    return setting is True or (setting == "auto" and device.type == "cuda" and cfg.engine.zero_stage != 3)


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
    """ "the objective's step at batch 256; encoder.blocks (4), decoder_blocks (2) at batches 64, 256" for a module with
    compiled parts, else None."""
    containers, sizes = [], set()
    for name, sub in module.named_modules():
        calls = [b._compiled_call_impl for b in sub.children() if isinstance(b._compiled_call_impl, BlockCall)]
        if calls and name.rsplit(".", 1)[-1] in BLOCK_CONTAINERS:
            containers.append(f"{name} ({len(calls)})")
            sizes |= calls[0].batch_sizes
    forward = module.__dict__.get("forward")
    parts = [f"the objective's step at batch {forward.batch_size}"] if isinstance(forward, CompiledForward) else []
    if containers:
        parts.append(f"{', '.join(containers)} at batches {', '.join(map(str, sorted(sizes)))}")
    return "; ".join(parts) or None


def compile_seconds() -> float:
    """Wall seconds this process has spent compiling so far (dynamo, AOT autograd and inductor, backward included)."""
    from torch._dynamo.utils import calculate_time_spent

    return calculate_time_spent().get("total_wall_time", 0.0)


def cache_root() -> Path:
    """mimpipe's folder of things worth keeping between launches on a machine: $MIMPIPE_CACHE_DIR, else
    $XDG_CACHE_HOME/mimpipe, else ~/.cache/mimpipe."""
    if os.environ.get("MIMPIPE_CACHE_DIR"):
        return Path(os.environ["MIMPIPE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mimpipe"


def use_compile_cache() -> str:
    """Point inductor's on-disk cache at `cache_root()/inductor` unless the user's TORCHINDUCTOR_CACHE_DIR says where;
    returns the folder. torch writes its /tmp default into the variable the first time anything asks for the folder
    (`torch.compile` itself does), so that value counts as unset; inductor reads the variable at every lookup."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def compile_cache_report() -> str:
    """How the compiles of this process so far used the on-disk cache: 'inductor cache DIR: 2 hits, 0 misses'."""
    from torch._dynamo.utils import counters

    hits, misses = (counters["inductor"][f"fxgraph_cache_{what}"] for what in ("hit", "miss"))
    return f"inductor cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'default')}: {hits} hits, {misses} misses"
