"""The `objective` section of a recipe: one of every objective's sections, told apart by `kind`, and which kinds
each `stage` trains."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from core.recipe.sections import (
    BEiTObjective,
    ClassificationObjective,
    MAEObjective,
    SegmentationObjective,
    SimMIMObjective,
    VQVAEObjective,
)
from core.recipe.teacher_sections import Data2Vec2Objective, IJEPAObjective

Objective = Annotated[
    MAEObjective
    | BEiTObjective
    | SimMIMObjective
    | Data2Vec2Objective
    | IJEPAObjective
    | VQVAEObjective
    | ClassificationObjective
    | SegmentationObjective,
    Field(discriminator="kind"),
]
OBJECTIVES_BY_STAGE = {
    "pretrain": ("mae", "beit", "simmim", "data2vec2", "ijepa"),
    "finetune": ("classification", "segmentation"),
    "tokenizer": ("vqvae",),
}


def copies_note(objective, per_device: int) -> str:
    """ ", each image seen 16 times: the student's batch is 4096 per device" for an objective that masks each image
    several times (data2vec 2.0's `num_masks`), for the plan lines; "" for the others."""
    copies = getattr(objective, "num_masks", 1)
    if copies == 1:
        return ""
    return f", each image seen {copies} times: the student's batch is {per_device * copies} per device"
