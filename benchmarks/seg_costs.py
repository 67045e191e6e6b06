"""Parameters and multiply-accumulates of panoptic FPN against VT-FPN on the same ResNet, as the VT paper compares them
(`make bench-seg` writes the table into benchmarks/results/segmentation.md).

    .venv/bin/python -m benchmarks.seg_costs                  # ResNet-50 at 512 px, 150 classes (ADE20K)

MACs are torch's FlopCounterMode FLOPs of one image's forward pass / 2: convolutions, linear layers, matmuls and
attention (the CPU attention kernel counted as the GPU ones); additions, normalisations, softmax and resampling are
not counted, as in the papers' FLOP counts. Parts (each run alone on what it receives in the model):
    per-level   FPN: the four 3x3 output convolutions; VT-FPN: tokenizers, the transformer, projectors
    FPN module  the laterals and the per-level part (what VT-FPN changes, with what it keeps around it)
    head        the FPN module, the semantic branch and the classifier
    model       the ResNet and the head
"""

from __future__ import annotations

import argparse

import timm
import torch
from torch.utils.flop_counter import FlopCounterMode

from core.engine.utilisation import CPU_ATTENTION_FLOPS
from finetune.seg_model import SegmentationModel

PARTS = ("per-level", "FPN module", "head", "model")


def head_costs(variant: int, head: str, size: int, num_classes: int) -> dict[str, tuple[int, int]]:
    """Part -> (parameters, MACs) of ResNet-`variant` under `head` ("fpn" or "vt_fpn") on one size x size image;
    each part's MACs counted by running that part alone on the inputs it gets in the model."""
    torch.manual_seed(0)
    model = SegmentationModel(timm.create_model(f"resnet{variant}", num_classes=0), head, num_classes).eval()
    fpn = model.head
    image = torch.zeros(1, 3, size, size)
    with torch.no_grad():
        stages = model.encoder.forward_intermediates(image, indices=model.blocks, intermediates_only=True)
        laterals = [lateral(x) for lateral, x in zip(fpn.lateral, stages, strict=True)]
        per_level = fpn.tokens or (lambda maps: [conv(m) for conv, m in zip(fpn.output, maps, strict=True)])
        level_module = fpn.tokens or fpn.output
        runs = {
            "per-level": (lambda: per_level(laterals), [level_module]),
            "FPN module": (lambda: fpn.forward_fpn(stages), [fpn.lateral, level_module]),
            "head": (lambda: fpn(stages), [fpn]),
            "model": (lambda: model(image), [model]),
        }
        return {part: (_params(modules), _macs(run)) for part, (run, modules) in runs.items()}


def _params(modules: list[torch.nn.Module]) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def _macs(run) -> int:
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        run()
    return counter.get_total_flops() // 2


def render(variant: int, size: int, num_classes: int) -> list[str]:
    """The markdown table of both heads' parts, with VT-FPN's share of FPN's."""
    costs = {head: head_costs(variant, head, size, num_classes) for head in ("fpn", "vt_fpn")}
    lines = [
        f"ResNet-{variant}, one {size}x{size} image, {num_classes} classes (benchmarks/seg_costs.py; MACs: "
        "FlopCounterMode FLOPs / 2, forward):",
        "",
        "| part | panoptic FPN params | VT-FPN params | panoptic FPN GMACs | VT-FPN GMACs | VT-FPN / FPN GMACs |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for part in PARTS:
        (p_fpn, m_fpn), (p_vt, m_vt) = costs["fpn"][part], costs["vt_fpn"][part]
        lines.append(
            f"| {part} | {p_fpn / 1e6:.2f}M | {p_vt / 1e6:.2f}M | {m_fpn / 1e9:.2f} | {m_vt / 1e9:.2f} | "
            f"{m_vt / m_fpn:.3f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", type=int, default=50, choices=(18, 34, 50, 101))
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--num-classes", type=int, default=150)
    args = p.parse_args(argv)
    print("\n".join(render(args.variant, args.size, args.num_classes)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
