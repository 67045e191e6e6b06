"""Pretraining entry point (launched by torchrun through launch.sh, or directly for one process).

python -m pretrain RECIPE [section.key=value ...]
python -m pretrain export RUN_DIR [--step N]

The stage is pretrain/stage.py, run by core/entry/stage.py (which first starts the data workers' fork server).
"""

import sys

from core.entry.stage import run

if __name__ == "__main__":
    sys.exit(run("pretrain"))
