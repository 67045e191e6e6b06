"""launch.sh's pre-launch check (`python -m core.entry.launch_check RECIPE ...`, core/launch/check.py `check_launch`)
with each recipe `stage`'s own checks: imported only for the stage launched, since fine-tuning's pull in the hand-off
and timm's models."""

from __future__ import annotations

import sys

from core.launch.check import check_launch
from core.launch.preflight import StageChecks


def pretrain_checks() -> StageChecks:
    from pretrain import preflight

    return StageChecks(preflight.check, preflight.resolve)


def finetune_checks() -> StageChecks:
    from finetune import preflight

    return StageChecks(preflight.check, preflight.resolve)


STAGES = {"pretrain": pretrain_checks, "tokenizer": pretrain_checks, "finetune": finetune_checks}


def main(argv: list[str] | None = None) -> int:
    return check_launch(argv, STAGES)


if __name__ == "__main__":
    sys.exit(main())
