"""What a stage's entry point does before its own imports, which take seconds (torch, torchvision, timm, DeepSpeed):
when the recipe has data workers, it starts their fork server, whose imports of the same modules then run on another
core beside the rank's instead of after them, when the first loader starts (data/worker_process.py); then it imports
timm without timm's wandb import (core/compat/timm_import.py).

Torch-free until that last import. A recipe that does not load is left alone here: the stage loads it again and
reports the error as it reports every other (core/engine/failure.py).
"""

from __future__ import annotations

from core.recipe.config import ConfigError, load_config
from data.worker_process import start_fork_server


def prestart(argv: list[str]) -> None:
    """Start the fork server if the recipe in `argv` (`RECIPE [section.key=value ...] [--flags]`) has data workers,
    then import timm. A subcommand's arguments (`export RUN_DIR`, `convert SRC DST`) are no recipe: nothing starts."""
    words = [arg for arg in argv if not arg.startswith("-")]
    if words and words[0].endswith((".yaml", ".yml")):
        try:
            cfg = load_config(words[0], words[1:])
        except (ConfigError, OSError, ValueError):
            cfg = None
        if cfg is not None and cfg.data.num_workers:
            start_fork_server()
    import core.compat.timm_import  # noqa: F401  (timm without wandb, before anything else imports timm)
