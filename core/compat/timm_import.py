"""timm, imported without the wandb that `timm.utils.summary` imports when timm is imported (half a second of every
process, for a function mimpipe never calls): importing this module imports timm with `import wandb` failing, as if
wandb were not installed, then lets wandb be imported again (`logging.wandb` imports it when a run asks for it).

It must come before anything else imports timm, so it is imported first where that is known: by a stage's entry
point before its other imports (core/entry/stage.py) and by the data workers' fork server (data/worker_process.py
`PRELOAD`). Anywhere else timm is imported as usual. Torch is imported with timm.
"""

from __future__ import annotations

import sys


def import_timm() -> None:
    """Import timm with wandb hidden, unless timm or wandb is imported already (then there is nothing to save)."""
    if "timm" in sys.modules or "wandb" in sys.modules:
        return
    sys.modules["wandb"] = None  # `import wandb` raises ImportError, which timm.utils.summary catches
    try:
        import timm  # noqa: F401
    finally:
        del sys.modules["wandb"]


import_timm()
