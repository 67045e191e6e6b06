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
from core.recipe.teacher_sections import Data2Vec2Objective

Objective = Annotated[
    MAEObjective
    | BEiTObjective
    | SimMIMObjective
    | Data2Vec2Objective
    | VQVAEObjective
    | ClassificationObjective
    | SegmentationObjective,
    Field(discriminator="kind"),
]
OBJECTIVES_BY_STAGE = {
    "pretrain": ("mae", "beit", "simmim", "data2vec2"),
    "finetune": ("classification", "segmentation"),
    "tokenizer": ("vqvae",),
}
