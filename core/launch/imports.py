"""Heavy imports (torch, DeepSpeed, timm) without the cyclic garbage collector.

Importing torch, DeepSpeed and timm creates millions of objects that live as long as the process. Every few
thousand of them the collector walks the young ones and, every so often, all of them: about a quarter of the CPU
these imports cost (1.3 s of 5.4 s per rank on this 2-core machine). With the collector off while they run, and what
they made frozen afterwards (moved out of every generation the collector walks; a fork, such as the data workers'
fork server, shares it copy-on-write undisturbed), the collections skip it for the rest of the process.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def imports_without_collection() -> Iterator[None]:
    """Collector off inside; on leaving, every object alive is frozen and the collector is on again (if it was)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
