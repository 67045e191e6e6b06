"""The EMA teacher of the latent-target objectives (data2vec 2.0, and I-JEPA on the same part): a second encoder of
the student's architecture, frozen, whose weights follow an exponential moving average of the student's.

The teacher is a module of the objective, built beside the student by the same builder, so DeepSpeed treats it as
it treats the student's weights: under ZeRO-3 it is partitioned by `deepspeed.zero.Init` and its forward gathers it
block by block as the student's does; in every checkpoint (frozen weights: DeepSpeed's module state at ZeRO-0/1, its
frozen fragments at ZeRO-2/3). It has no gradient and no optimizer state. What moves it is outside this module:
core/engine/teacher.py lerps it towards the student after each applied optimizer step, on each rank's own partition
under ZeRO-3, with the decay `decay_at(step)` gives. Nothing here imports DeepSpeed.

Its blocks are timm's pre-norm blocks (the export loads in plain timm); data2vec 2.0's own are post-LN. Each also
returns its FFN output before the last residual add (`TargetBlock`), data2vec 2.0's per-block target.

Shape legend:
    B: images    C: image channels    H, W: image height, width    L: patch tokens    D: encoder width
    T: prefix tokens (the class token, then the register tokens)
"""

from __future__ import annotations

import torch
from timm.models.vision_transformer import Block, VisionTransformer
from torch import nn

from core.recipe.teacher_sections import EMASchedule
from pretrain.encoder import patch_positions, prefix_tokens


class TargetBlock(Block):
    """timm's pre-norm transformer block that also returns its FFN output before the last residual add (the same
    parameters as `Block`; a teacher's blocks are switched to it in place)."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T + L, D) -> (the block's output (B, T + L, D), its FFN branch (B, T + L, D) before the residual)."""
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        ffn = self.ls2(self.mlp(self.norm2(x)))
        return x + self.drop_path2(ffn), ffn


class EMATeacher(nn.Module):
    """A frozen encoder of the student's architecture, averaged from the student's weights from outside.

    Args:
        encoder: A freshly built encoder of the student's exact architecture (its values are replaced by the
            student's before the first step: core/engine/teacher.py `follow_student` with weight 1).
        schedule: The decay schedule (`objective.ema`).
    """

    def __init__(self, encoder: VisionTransformer, schedule: EMASchedule):
        super().__init__()
        for block in encoder.blocks:
            block.__class__ = TargetBlock  # same parameters and submodules; forward also returns the FFN branch
        self.encoder = encoder.requires_grad_(False).eval()
        self.schedule = schedule
        # The decay of the last update, for logging; not saved (the step gives it again).
        self.register_buffer("decay", torch.tensor(schedule.start), persistent=False)

    def train(self, mode: bool = True) -> EMATeacher:
        super().train(mode)
        self.encoder.eval()  # the teacher never drops paths or tokens
        return self

    def decay_at(self, step: int) -> float:
        """The decay of optimizer step `step`'s update (`objective.ema`)."""
        return self.schedule.decay_at(step)

    def pairs(self, student: nn.Module) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(teacher parameter, student parameter) of the same name, every parameter of both.

        Raises:
            ValueError: The student's parameters are not the teacher's (another architecture).
        """
        mine, theirs = dict(self.encoder.named_parameters()), dict(student.named_parameters())
        if mine.keys() != theirs.keys():
            diff = sorted(mine.keys() ^ theirs.keys())[:5]
            raise ValueError(f"the teacher's parameters are not the student's (differ: {', '.join(diff)})")
        return [(mine[name], theirs[name]) for name in mine]

    @property
    def num_prefix_tokens(self) -> int:
        return self.encoder.num_prefix_tokens

    @property
    def embed_dim(self) -> int:
        return self.encoder.embed_dim

    def forward_features(self, imgs: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, T + L, D) the final norm's output, as timm's `forward_features` (the monitors embed
        with it when the teacher is the exported encoder)."""
        return self.forward_blocks(imgs, 0)[1]

    @torch.no_grad()
    def forward_blocks(self, imgs: torch.Tensor, num_blocks: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The teacher on the whole image.

        Args:
            imgs: (B, C, H, W) normalised images.
            num_blocks: How many of the last blocks' FFN outputs to return.

        Returns:
            (the last `num_blocks` blocks' FFN outputs, each (B, L, D), patch tokens only, oldest first, none for 0;
            the final norm's output (B, T + L, D)).
        """
        enc = self.encoder
        x = enc.patch_embed(imgs) + patch_positions(enc)  # (B, L, D)
        x = torch.cat([prefix_tokens(enc).expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)  # (B, T + L, D)
        x = enc.norm_pre(enc.pos_drop(x))
        outputs = []
        first = len(enc.blocks) - num_blocks
        for i, block in enumerate(enc.blocks):
            x, ffn = block(x)
            if i >= first:
                outputs.append(ffn[:, enc.num_prefix_tokens :])  # (B, L, D)
        return outputs, enc.norm(x)
