"""Pre-launch check used by launch.sh: validate the recipe and the batch split for the world size before any
process starts; print the module to run (stdout) and, with --dry-run, the resolved config (stderr)."""

from __future__ import annotations

import argparse
import sys

from core.config import ConfigError, dump_config, load_config

# The module launch.sh runs for each `stage` (the tokenizer is trained by the pretraining entry point).
STAGE_MODULES = {"pretrain": "pretrain", "tokenizer": "pretrain", "finetune": "finetune"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core.launch")
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.recipe, args.overrides)
        per_device = cfg.batch_size_per_device(args.world_size)
    except ConfigError as err:
        print(f"launch.sh: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(dump_config(cfg), file=sys.stderr)
    print(
        f"[mimpipe] plan: {args.world_size} processes, global batch {cfg.data.global_batch_size} = {per_device} per "
        f"device x {cfg.engine.grad_accum_steps} accumulation, lr {cfg.peak_lr:.4g}, ZeRO-{cfg.engine.zero_stage}, "
        f"{cfg.engine.precision}",
        file=sys.stderr,
    )
    print(STAGE_MODULES[cfg.stage])
    return 0


if __name__ == "__main__":
    sys.exit(main())
