"""Fine-tuning entry point: hand-off from any accepted checkpoint, classification training (full fine-tuning, linear
probe, or DeiT distillation), exactly-once evaluation, export of the best checkpoint.

    python -m finetune RECIPE [section.key=value ...]
    python -m finetune convert SRC DST [--arch TIMM_NAME] [--trust-checkpoint]
    python -m finetune predict EXPORT --images DIR_OR_SHARDS --out DIR       (segmentation masks; finetune/predict.py)
    python -m finetune inspect EXPORT --images DIR_OR_SHARDS --out DIR       (the ViT paper's pictures; inspect_vit.py)
    python -m finetune evaluate CHECKPOINT ... --train SHARDS --val SHARDS --out DIR   (kNN, probes; report_card.py)

The stage is finetune/stage.py, run by core/entry/stage.py (which first starts the data workers' fork server).
"""

import sys

from core.entry.stage import run

if __name__ == "__main__":
    sys.exit(run("finetune"))
