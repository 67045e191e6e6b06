"""The FPN / VT-FPN cost table counts what the architectures compute: both per-level parts against hand-counted
multiply-accumulates on ResNet-18 at 64 px (maps of 16, 8, 4 and 2 a side, FPN width 256)."""

from __future__ import annotations

from benchmarks.seg_costs import head_costs
from finetune.fpn_heads import VT_TOKEN_DIM, VT_TOKENS

C, L, T = 256, VT_TOKENS, VT_TOKEN_DIM
PIXELS = [16 * 16, 8 * 8, 4 * 4, 2 * 2]


def test_fpn_per_level_part_is_four_3x3_convolutions():
    params, macs = head_costs(18, "fpn", 64, 11)["per-level"]
    assert macs == sum(9 * C * C * n for n in PIXELS)
    assert params == 4 * (9 * C * C + C)


def test_vt_fpn_per_level_part_is_tokenizers_one_transformer_and_projectors():
    _, macs = head_costs(18, "vt_fpn", 64, 11)["per-level"]
    per_level = [
        n * C * L
        + L * n * C
        + L * C * T  # tokenizer: attention logits, weighted sum of pixels, value to T wide
        + L * T * C
        + L * C * C
        + L * T * C  # projector: keys, W_Q folded into them, values back to C wide
        + n * L * C
        + n * L * C  # projector: each pixel's attention over the tokens, and what it reads
        for n in PIXELS
    ]
    tokens = 4 * L
    transformer = 2 * tokens * T * T // 2 + tokens * tokens * T // 2 + tokens * tokens * T + 2 * tokens * T * T
    assert macs == sum(per_level) + transformer
