"""Pretraining entry point (launched by torchrun through launch.sh, or directly for one process).

python -m pretrain RECIPE [section.key=value ...]
python -m pretrain export RUN_DIR [--step N]

The stage itself is pretrain/stage.py, imported after `prestart` has started the data workers' fork server, so that
the server's imports run beside the stage's (core/engine/prestart.py).
"""

from __future__ import annotations

import sys

from core.engine.failure import run_guarded
from core.engine.prestart import prestart


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    prestart(argv)
    from pretrain.stage import main as stage_main  # after prestart: seconds of imports, beside the fork server's

    return stage_main(argv)


if __name__ == "__main__":
    sys.exit(run_guarded(main))
