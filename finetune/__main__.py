"""Fine-tuning entry point: hand-off from any accepted checkpoint, classification training (full fine-tuning, linear
probe, or DeiT distillation), exactly-once evaluation, export of the best checkpoint.

    python -m finetune RECIPE [section.key=value ...]
    python -m finetune convert SRC DST [--arch TIMM_NAME] [--trust-checkpoint]

The stage is finetune/stage.py, run by core/entry/stage.py (which first starts the data workers' fork server).
"""

import sys

from core.entry.stage import run

if __name__ == "__main__":
    sys.exit(run("finetune"))
