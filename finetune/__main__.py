"""Fine-tuning entry point: hand-off from any accepted checkpoint, classification training (full fine-tuning, linear
probe, or DeiT distillation), exactly-once evaluation, export of the best checkpoint.

    python -m finetune RECIPE [section.key=value ...]
    python -m finetune convert SRC DST [--arch TIMM_NAME] [--trust-checkpoint]

The stage itself is finetune/stage.py, imported after `prestart` has started the data workers' fork server, so that
the server's imports run beside the stage's (core/engine/prestart.py).
"""

from __future__ import annotations

import sys

from core.engine.failure import run_guarded
from core.engine.prestart import prestart


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    prestart(argv)
    from finetune.stage import main as stage_main  # after prestart: seconds of imports, beside the fork server's

    return stage_main(argv)


if __name__ == "__main__":
    sys.exit(run_guarded(main))
