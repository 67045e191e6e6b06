"""`python -m pretrain export RUN_DIR [--step N] [--out DIR] [--encoder student|teacher] [--push-to-hub ORG/NAME
[--private]]`: export a checkpoint's encoder (an EMA teacher objective's student or teacher), consolidated from any
ZeRO stage, in timm's Hugging Face layout (config.json + model.safetensors + mimpipe.json + the README.md model card),
and upload it to a Hub repo. The push is checked (network, token) before anything is read."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

from torch import nn

from core.engine.checkpoint import resumable_tag
from core.engine.gather import consolidated_state_dict
from core.export.folder import export_state_dict
from core.export.push import check_push, push_export
from core.recipe.config import Config, load_config


def exported_prefix(cfg: Config) -> str:
    """Where the exported encoder sits in the objective's state dict: the student (`encoder.`), or the EMA teacher
    (`teacher.encoder.`) where the recipe exports it (`objective.export: teacher`)."""
    return "teacher.encoder." if getattr(cfg.objective, "export", "student") == "teacher" else "encoder."


def exported_module(cfg: Config, objective: nn.Module) -> nn.Module:
    """The objective's module the export holds, which the monitors measure: its student (`encoder`), or its EMA
    teacher where the recipe exports that."""
    return objective.teacher if exported_prefix(cfg).startswith("teacher") else objective.encoder


def choose_encoder(cfg: Config, encoder: str | None) -> None:
    """`--encoder student|teacher` over the checkpoint's `objective.export`, in place.

    Raises:
        ValueError: `--encoder` for an objective without an EMA teacher.
    """
    if encoder is None:
        return
    if not hasattr(cfg.objective, "export"):
        raise ValueError(f"--encoder {encoder}: objective {cfg.objective.kind} has one encoder and no EMA teacher")
    cfg.objective.export = encoder


def exported_encoder(cfg: Config, state: dict) -> dict:
    """The exported encoder's tensors, by timm's names, out of the objective's state dict."""
    prefix = exported_prefix(cfg)
    return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}


def pretrain_manifest(cfg: Config, *, step: int, source: str, objective_keys: Iterable[str]) -> dict:
    """What `mimpipe.json` says about a pretrained encoder (fine-tuning reads `pooling_hint` and reports
    `not_exported`: the objective's own tensors, e.g. MAE's decoder or BEiT's mask token and head). `encoder` says
    which of an objective's encoders it is: the student, or the EMA teacher."""
    prefix = exported_prefix(cfg)
    return {
        "not_exported": sorted(k for k in objective_keys if not k.startswith(prefix)),
        **(
            {"encoder": "teacher" if prefix.startswith("teacher") else "student"}
            if hasattr(cfg.objective, "export")
            else {}
        ),
        "method": cfg.objective.kind,
        "step": step,
        "source": source,
        "data": cfg.data.model_dump(mode="json")["train"],  # a mixture as plain mappings
        "config": cfg.model_dump(mode="json"),
        "pooling_hint": "avg",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain export", description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: RUN_DIR/export)")
    parser.add_argument("--push-to-hub", metavar="ORG/NAME", help="upload the export to this Hugging Face Hub repo")
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    parser.add_argument(
        "--encoder", choices=("student", "teacher"), help="an objective with an EMA teacher: which encoder to export "
        "(default: the recipe's objective.export)"
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.private and not args.push_to_hub:
        parser.error("--private needs --push-to-hub ORG/NAME")
    try:
        target = check_push(args.push_to_hub) if args.push_to_hub else None  # before any work
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")

    ckpt_dir = args.run_dir / "checkpoints"
    if args.step is not None:
        tag = f"step_{args.step:08d}"
    else:
        tag = resumable_tag(ckpt_dir)  # what a relaunch would resume from, read back whole
        if tag is None:
            raise SystemExit(f"no complete checkpoint in {ckpt_dir}")
    if not (ckpt_dir / tag).is_dir():
        raise SystemExit(f"no checkpoint {ckpt_dir / tag}")
    cfg = load_config(ckpt_dir / tag / "config.yaml")
    try:
        choose_encoder(cfg, args.encoder)
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    state = consolidated_state_dict(ckpt_dir, tag, cfg.engine.zero_stage)
    encoder = exported_encoder(cfg, state)
    manifest = pretrain_manifest(
        cfg, step=int(tag.removeprefix("step_")), source=str(ckpt_dir / tag), objective_keys=state
    )
    out = export_state_dict(
        cfg, encoder, args.out or args.run_dir / "export", num_classes=0, manifest=manifest, run_dir=args.run_dir
    )
    print(f"exported {len(encoder)} encoder tensors from {ckpt_dir / tag} to {out}")
    if target is not None:
        try:
            url = push_export(out, target, private=args.private, message=f"mimpipe export: {cfg.objective.kind}, {tag}")
        except ValueError as e:
            parser.exit(2, f"{parser.prog}: error: {e}\n")
        print(f"pushed {out} to {url} as {target.user}: timm.create_model('hf-hub:{target.repo_id}', pretrained=True)")
    return 0
