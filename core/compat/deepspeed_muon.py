"""DeepSpeed's Muon optimizer, imported while an engine is built, without compiling its kernels.

Every ZeRO optimizer of DeepSpeed 0.19 (and its bf16 optimizer at ZeRO-0) imports
`deepspeed.runtime.zero.muon.muon_optimizer` as it is set up, to add Muon to the optimizers it supports; that module
wraps its kernels in `torch.compile` as it is imported, and wrapping resolves inductor's configuration, which imports
inductor's compiler (`torch._inductor.compile_fx`): about 0.7 CPU-seconds per rank at every launch (2-core AMD EPYC,
side by side), for kernels no recipe runs (`optim` builds AdamW, SGD or LARS). torch's `TORCHDYNAMO_DISABLE=1` makes a
`torch.compile` wrapping the function itself; set only while the engine is built, it leaves every other compile
alone: the recipe's own (`engine.compile`, done before the engine is built) and any after. Were the import to move
out of the engine's construction, or Muon's kernels to stop compiling at import, this would simply save nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

DISABLE_VARIABLE = "TORCHDYNAMO_DISABLE"
"""torch reads it at each `torch.compile` (and into `torch._dynamo.config.disable` when dynamo is first imported)."""


@contextmanager
def muon_kernels_uncompiled() -> Iterator[None]:
    """Inside, `torch.compile` wraps nothing (see the module's doc); the variable is put back as it was on leaving."""
    import torch._dynamo  # noqa: F401  (its config reads the variable once, at import: before it is set here)

    previous = os.environ.get(DISABLE_VARIABLE)
    os.environ[DISABLE_VARIABLE] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[DISABLE_VARIABLE]
        else:
            os.environ[DISABLE_VARIABLE] = previous
