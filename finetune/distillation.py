"""DeiT distillation: a distillation token and head on the student, trained against a frozen teacher's outputs.

The student is timm's `VisionTransformerDistilled`: in training it returns the class-token and distillation-token
logits separately; in eval it returns their average (DeiT's inference). The loss is
    (1 - alpha) * CE(class logits, labels) + alpha * teacher loss
with DeiT's teacher losses: soft = KL(softmax(teacher / tau) || softmax(dist / tau)) * tau^2 (summed, divided by the
number of logits, as DeiT does), hard = CE(dist logits, teacher argmax). alpha = 1/2 is DeiT's weighting.
Cost: every training step also runs the teacher's forward pass (no backward), under the same autocast (bf16); with
`engine.precision: fp16` the teacher stays fp32 and gets the half images back in fp32.

Shapes: B batch, K classes, D width, L patches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from timm.models import VisionTransformer
from torch import nn

from finetune.classification import Classification


class Distillation(Classification):
    """Classification of a distilled student with a teacher held outside the module tree (frozen, not ours to save).

    Args:
        student: timm VisionTransformerDistilled with a K-class head.
        teacher: Any frozen classifier mapping images to (B, K) logits.
        kind: "soft" or "hard".
        tau: Softmax temperature of the soft loss.
        alpha: Weight of the teacher loss.
        label_smoothing: Of the class-token cross-entropy.
    """

    def __init__(self, student, teacher: nn.Module, *, kind: str, tau: float = 3.0, alpha: float = 0.5, **kwargs):
        super().__init__(student, **kwargs)
        if kind not in ("soft", "hard"):
            raise ValueError(f"distill.kind must be 'soft' or 'hard', got {kind!r}")
        if not hasattr(student, "set_distilled_training"):
            raise ValueError("distillation needs a student with a distillation token (VisionTransformerDistilled)")
        student.set_distilled_training(True)
        self.kind, self.tau, self.alpha = kind, tau, alpha
        self.__dict__["teacher"] = teacher.eval().requires_grad_(False)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.training:
            return super().forward(batch)  # the student averages its two heads in eval mode
        images, labels = batch["image"], batch["label"]
        logits, dist_logits = (x.float() for x in self.model(images))  # (B, K) each
        base = F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        with torch.no_grad():
            # In the teacher's own dtype: under fp16 the batch arrives in half, and the teacher, outside the module
            # tree DeepSpeed casts, stays fp32. load_teacher put it on the device.
            teacher_images = images.to(next((p.dtype for p in self.teacher.parameters()), images.dtype))
            teacher_logits = self.teacher(teacher_images).float()  # (B, K)
        teacher_loss = distillation_loss(dist_logits, teacher_logits, kind=self.kind, tau=self.tau)
        hard_labels = labels.argmax(dim=-1) if labels.ndim == 2 else labels
        mean_logits = (logits + dist_logits) / 2
        return {
            "loss": (1 - self.alpha) * base + self.alpha * teacher_loss,
            "loss_base": base.detach(),
            "loss_teacher": teacher_loss.detach(),
            "acc1": (mean_logits.argmax(-1) == hard_labels).float().mean(),
            "logits": mean_logits,
        }


def distillation_loss(dist_logits: torch.Tensor, teacher_logits: torch.Tensor, *, kind: str, tau: float):
    """DeiT's teacher loss on (B, K) logits: soft KL at temperature tau (x tau^2) or CE on the teacher's argmax."""
    if kind == "hard":
        return F.cross_entropy(dist_logits, teacher_logits.argmax(dim=-1))
    kl = F.kl_div(
        F.log_softmax(dist_logits / tau, dim=-1),
        F.log_softmax(teacher_logits / tau, dim=-1),
        reduction="sum",
        log_target=True,
    )
    return kl * tau * tau / dist_logits.numel()


@torch.no_grad()
def to_distilled(plain: VisionTransformer, student: nn.Module) -> list[str]:
    """Copy a plain ViT's weights (after the hand-off) into a distilled student of the same shape.

    The distillation token starts as a copy of the class token and its position embedding as the class position's
    (DeiT initialises them randomly; a copy keeps the pretrained statistics); the distillation head starts at zero
    like the class head. Returns the student keys that did not come from `plain`.
    """
    source = plain.state_dict()
    target = student.state_dict()
    new = []
    for key in target:
        if key == "pos_embed":
            pos = source["pos_embed"]  # (1, 1 + L, D) -> (1, 2 + L, D)
            target[key].copy_(torch.cat([pos[:, :1], pos[:, :1], pos[:, 1:]], dim=1))
        elif key == "dist_token":
            target[key].copy_(source["cls_token"])
            new.append(key)
        elif key.startswith("head_dist."):
            target[key].zero_()
            new.append(key)
        else:
            target[key].copy_(source[key])
    student.load_state_dict(target)
    return new
